"""FSDP (``mesh.fsdp``): ``dtarl train`` on a ('dp', 'fsdp', 'tp') mesh of the 8
simulated CPU devices, and over 2 processes, is the single-device run.

The run is ``Trainer(cfg, reward_fn=...).run()`` (what ``dtarl train`` does): tiny
model, 2 GRPO steps with an entropy bonus and a KL term, the ``dfs`` engine, fp32,
``mesh.fsdp_gather`` step and layer (dfs runs step either way: see below),
``optim.eps=1`` so that AdamW's update is linear in the gradient (why:
``tests/rl/test_trainer_mesh.py``). Compared per step: loss, grad norm, KL (1e-5);
per tensor: the update and the final value (1e-5 relative, + 2 ulp on the update).
Checked structurally: params, the KL reference and both Adam moments stay split over
'fsdp' by the rule (``dtarl.parallel.mesh.FSDP_ORDER``), each a 1/fsdp slice per device.

Per-layer gather (``fsdp_gather=layer``, ``dtarl.parallel.fsdp``): every engine's loss
and gradients on dp=2 x fsdp=2 x tp=2 equal the single-device dense ``jax.grad`` at 1e-5
(dfs falls back to step mode: its gathers would sit under ``lax.switch``), and the
compiled step holds no gathered [L, ...] stack (all-gather shapes, temp bytes).
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dtarl import axes
from dtarl.engines import make_engine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.mesh import FsdpGather
from dtarl.parallel.sharded import ShardedEngine
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import ConfigError, MeshSection, load_config
from dtarl.rl.metrics import read_metrics
from dtarl.rl.state import HostRecord
from dtarl.rl.trainer import Trainer
from dtarl.testing import grpo_groups
from tests.rl.test_trainer_mesh import RUN, mesh_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# RUN and mesh_reward: the mesh tests' run, which FSDP must equal on one device too.


def _run(out_dir, *mesh):
    cfg = load_config(None, [*RUN, f"out_dir={out_dir}", *mesh])
    trainer = Trainer(cfg, reward_fn=mesh_reward)
    start = jax.tree.map(np.asarray, trainer.params)
    return trainer, start, trainer.run()


def _leaves(tree):
    return jax.tree.leaves(jax.tree.map(np.asarray, tree))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), "mesh.dp=1")


def _assert_same_history(ref, res, *, policy_gradient=True):
    for a, b in zip(ref, res, strict=True):
        assert a["advantage_abs_mean"] > 0 or not policy_gradient  # a real policy gradient
        for key in ("reward_mean", "response_len_mean"):
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm", "kl"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-9, err_msg=key)


def _assert_same_params(start, ref, params):
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(start)]
    for name, s0, a, b in zip(names, _leaves(start), _leaves(ref), _leaves(params), strict=True):
        upd_a, upd_b = a - s0, b - s0
        assert np.abs(upd_a).max() > 0, f"{name}: not updated; the check would be vacuous"
        ulp = np.spacing(np.abs(a).max())
        assert np.abs(upd_b - upd_a).max() <= 1e-5 * np.abs(upd_a).max() + 2 * ulp, name
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max(), name


@pytest.mark.parametrize(
    "dp, fsdp, tp, gather", [(1, 8, 1, "layer"), (1, 4, 2, "step"), (2, 2, 2, "layer")]
)
def test_fsdp_run_equals_single_device(single, tmp_path, dp, fsdp, tp, gather):
    one, start, ref = single
    assert one.mesh is None
    mesh = [f"mesh.dp={dp}", f"mesh.fsdp={fsdp}", f"mesh.tp={tp}", f"mesh.fsdp_gather={gather}"]
    tr, start_m, res = _run(tmp_path, *mesh)
    # dfs: per-layer gathers would sit under its lax.switch, so layer mode runs step.
    assert set(tr.engine.gather_used.values()) == {"step"}
    assert tr.engine.fsdp_gather is FsdpGather(gather)
    assert tuple(tr.mesh.axis_names) == mesh_lib.TRAIN_AXES
    assert dict(tr.mesh.shape) == {"dp": dp, "fsdp": fsdp, "tp": tp}
    for b in res.history:
        assert (b["dp"], b["fsdp"], b["tp"]) == (dp, fsdp, tp)
        assert b["engine"] == "sharded[dfs]" and b["partition_cost_model"] == "dfs"
    for s0, s1 in zip(_leaves(start), _leaves(start_m), strict=True):
        np.testing.assert_array_equal(s0, s1)
    _assert_same_history(ref.history, res.history)
    _assert_same_params(start, ref.params, res.params)
    # Params, KL reference and Adam's moments split over fsdp (ZeRO-3), per device
    # 1/fsdp (1/(fsdp x tp) where tp splits too) of every matrix.
    want = jax.tree.leaves(mesh_lib.param_shardings(tr.params, tr.mesh))
    adam = tr.opt_state[1][0]
    for tree in (res.params, tr.ref_params, adam.mu, adam.nu):
        leaves = jax.tree.leaves(tree)
        assert all(
            x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, want, strict=True)
        )
        for x in leaves:
            shard = x.addressable_shards[0].data.shape
            if x.ndim == 2:  # every matrix (embedding, projections) is split over fsdp
                assert np.prod(shard) * fsdp <= np.prod(x.shape), (x.shape, shard)
    assert all(mesh_lib.FSDP in str(s.spec) for s in want)  # nothing left replicated


def test_two_process_fsdp_equals_one_process(tmp_path):
    """``dtarl launch --nproc 2 --devices-per-proc 1 -- train ... mesh.fsdp=2``: the
    parameters are split over the two processes' devices (each holds half of every
    tensor) and the final checkpoint, gathered, is the one-process single-device run's
    to 1e-5; per-step loss, grad norm and KL on both processes too. The reward is the
    task's (``dtarl train``'s), all zero for the untrained model: the entropy and KL
    terms give the gradient."""
    sets = [*RUN, f"out_dir={tmp_path / 'two'}", "mesh.fsdp=2"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2"]
    cmd += ["--devices-per-proc", "1", "--init-timeout", "60", "--", "train"]
    proc = subprocess.run(
        cmd + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 1] done: 2 steps" in proc.stdout, proc.stdout[-3000:]

    one = Trainer(load_config(None, [*RUN, f"out_dir={tmp_path / 'one'}", "mesh.dp=1"]))
    start = jax.tree.map(np.asarray, one.params)
    ref = one.run()
    ckpt = CheckpointManager(str(tmp_path / "two" / "checkpoints"))
    assert ckpt.latest_step() == 2
    host = HostRecord.from_dict(ckpt.read_host(2), where=ckpt.path(2))
    state, _ = ckpt.restore_state(2, one.restore_target(2, host))
    logs = [tmp_path / "two" / "metrics.jsonl", tmp_path / "two" / "process_1" / "metrics.jsonl"]
    for log in logs:
        rl = [r for r in read_metrics(str(log), flat=True) if r.get("phase") == "rl"]
        assert [(r["dp"], r["fsdp"], r["tp"]) for r in rl] == [(1, 2, 1)] * 2
        _assert_same_history(ref.history, rl, policy_gradient=False)
    _assert_same_params(start, ref.params, state.params)


def _abstract_params():
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
    _, params = nnx.split(nnx.eval_shape(lambda: init_model(cfg, seed=0)), nnx.Param)
    return params


def test_fsdp_rule_is_by_logical_name_and_skips_the_layer_axis():
    mesh = mesh_lib.make_train_mesh(2, 2, 2)
    plan = mesh_lib.param_specs(_abstract_params(), mesh)
    specs = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_leaves_with_path(
            plan.specs, is_leaf=lambda x: isinstance(x, P)
        )
    }
    assert specs["['embed_tokens'].value"] == P(None, "fsdp")  # (vocab, embed): embed
    # The model's layers are stacked ([L, ...]): the layer axis is never split.
    assert any(v == P(None, "fsdp", "tp", None) for k, v in specs.items() if "q_proj" in k)
    assert any(v == P(None, "tp", "fsdp") for k, v in specs.items() if "down_proj" in k)
    assert plan.replicated == ()
    # A stacked parameter (the scan's leading layer axis): never split there.
    mesh8 = mesh_lib.make_train_mesh(1, 4, 2)
    stacked = nnx.State(
        {
            "w": nnx.Param(
                jax.ShapeDtypeStruct((4, 32, 64), np.float32),
                axes=(axes.LAYERS, axes.EMBED, axes.MLP),
            ),
            "n": nnx.Param(
                jax.ShapeDtypeStruct((4, 6), np.float32), axes=(axes.LAYERS, axes.HEAD_DIM)
            ),
        }
    )
    plan = mesh_lib.param_specs(stacked, mesh8)
    assert plan.specs["w"].get_value() == P(None, "fsdp", "tp")
    assert plan.specs["n"].get_value() == P(None, None)  # 6 % 4: replicated, and reported
    assert plan.replicated == (("n", "fsdp"),)


def test_bad_fsdp_meshes_name_the_axis_and_the_accepted_values():
    with pytest.raises(
        mesh_lib.MeshError, match=r"dp=1 x fsdp=3 x tp=1 = 3 devices.*\[1, 2, 4, 8\]"
    ):
        mesh_lib.make_train_mesh(1, 3, 1)
    with pytest.raises(mesh_lib.MeshError, match=r"fsdp=0: must be an int >= 1"):
        mesh_lib.make_train_mesh(1, 0, 8)
    assert MeshSection(fsdp=4).resolve3(8) == (2, 4, 1)
    assert MeshSection(fsdp=2, tp=2).resolve3(8) == (2, 2, 2)
    assert load_config(None, ["mesh.fsdp=8"]).mesh == MeshSection(fsdp=8)
    with pytest.raises(
        ConfigError,
        match=r"mesh.fsdp=3 x mesh.tp=1 = 3 does not divide the 8 devices.*"
        r"mesh.fsdp x mesh.tp in \[1, 2, 4, 8\]",
    ):
        MeshSection(fsdp=3).resolve3(8)
    with pytest.raises(
        ConfigError, match=r"mesh.dp=2 x mesh.fsdp=4 x mesh.tp=2 = 16 devices.*<= 8"
    ):
        MeshSection(dp=2, fsdp=4, tp=2).resolve3(8)
    with pytest.raises(ConfigError, match=r"mesh.fsdp"):
        load_config(None, ["mesh.fsdp=0"])


# ------------------------------------------------------ per-layer gather (fsdp_gather)

LAYER_CFG = dict(num_layers=3, hidden_size=32, intermediate_size=64, head_dim=8)


@pytest.fixture(scope="module")
def layer_setup():
    model = init_model(ModelConfig.tiny(**LAYER_CFG), seed=0)
    _, params = nnx.split(model, nnx.Param)
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=6, response_len=5, vocab_size=256)
    loss = ClippedSurrogateLoss.grpo()
    ref_loss, ref_grads, _ = make_engine("dense", model).value_and_grad(params, batch, loss)
    return model, params, batch, loss, float(ref_loss), _leaves(ref_grads)


@pytest.mark.parametrize("kind", ["dense", "dense_remat", "prefix_reuse", "dfs", "auto"])
def test_layer_gather_grads_are_dense_jax_grad(layer_setup, kind):
    """``fsdp_gather=layer`` on dp=2 x fsdp=2 x tp=2: loss and every gradient tensor are
    the single-device dense engine's (``jax.grad`` of the dense loss) at 1e-5. The dfs
    engine's per-layer gathers would sit under its rank-dependent ``lax.switch``: that
    program gathers per step instead, and says so."""
    model, params, batch, loss, ref_loss, ref_grads = layer_setup
    sharded = ShardedEngine(
        make_engine(kind, model), mesh_lib.make_train_mesh(2, 2, 2), fsdp_gather="layer"
    )
    total, grads, aux = sharded.value_and_grad(params, batch, loss)
    ran = aux.stats.get("chosen_engine", kind)
    assert aux.stats["fsdp_gather"] == ("step" if ran == "dfs" else "layer"), ran
    # GRPO's loss is ~0 at the sampling policy (zero-mean advantages): its noise is ~1e-8.
    np.testing.assert_allclose(float(total), ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_grads, _leaves(grads), strict=True):
        assert np.abs(a).max() > 0
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max(), (kind, a.shape)


def _compiled(mode: str, remat: str):
    """The dense step at fsdp=8 (3 layers, bf16 gathers), compiled; and the fp32 bytes
    of the whole stacked layer parameters (what a gather before the step holds)."""
    cfg = ModelConfig.tiny(**LAYER_CFG, remat=remat)
    model = init_model(cfg, seed=0)
    _, params = nnx.split(model, nnx.Param)
    batch = grpo_groups(num_groups=1, group_size=8, prompt_len=2, response_len=2, vocab_size=256)
    loss = ClippedSurrogateLoss.grpo()
    sharded = ShardedEngine(
        make_engine("dense", model),
        mesh_lib.make_train_mesh(1, 8, 1),
        fsdp_gather=mode,
        gather_dtype=jnp.bfloat16,
    )
    prepared = sharded.prepare(batch, loss)
    placed = sharded.place_params(params)
    step = sharded.get_fn(loss, prepared, params).lower(placed, *sharded.device_args(prepared))
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    assert sharded.gather_used[prepared.static] == mode
    return step.compile(), layer_bytes


def _gathers(hlo: str) -> list[str]:
    """The result shapes of the program's all-gathers."""
    return re.findall(r"= (\w+\[[\d,]*\])[^=]*? all-gather(?:-start)?\(", hlo)


@pytest.mark.parametrize("remat", ["full"])
def test_layer_gather_holds_no_gathered_model(remat):
    """Structural: in layer mode no all-gather yields a stacked [L=3, ...] layer leaf
    (the gathers sit in the layer scan's body) and the step's temporaries stay below
    the whole gathered stack; in step mode both are there (the test would fail if the
    gather were hoisted out of the scan). With ``remat=none`` the layers' bf16 operands
    are residuals (``dtarl.parallel.fsdp``), still below the fp32 stack."""
    layer, layer_bytes = _compiled("layer", remat)
    step, _ = _compiled("step", remat)
    stacked = lambda shapes: [s for s in shapes if re.search(r"\[3,", s)]  # noqa: E731
    assert stacked(_gathers(step.as_text())), _gathers(step.as_text())
    assert _gathers(layer.as_text()) and not stacked(_gathers(layer.as_text()))
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(step) >= layer_bytes > temp(layer), (temp(step), layer_bytes, temp(layer))


def test_fsdp_gather_config_names_the_key_and_the_accepted_values():
    assert load_config(None, ["mesh.fsdp_gather=step"]).mesh.fsdp_gather is FsdpGather.STEP
    assert MeshSection().fsdp_gather is FsdpGather.LAYER
    with pytest.raises(
        ConfigError, match=r"mesh.fsdp_gather='rows'.*accepted: \['step', 'layer'\]"
    ):
        load_config(None, ["mesh.fsdp_gather=rows"])
    with pytest.raises(mesh_lib.MeshError, match=r"fsdp_gather='rows'; accepted"):
        ShardedEngine(
            make_engine("dense", init_model(ModelConfig.tiny())),
            mesh_lib.make_train_mesh(1, 8, 1),
            fsdp_gather="rows",
        )
