"""``Trainer`` on a mesh of the 8 simulated CPU devices: the same run as on one device.

A run is ``Trainer(cfg, reward_fn=...).run()`` (what ``dtarl train`` does, with a
reward that varies within a group so that GRPO's advantages are not all zero): tiny
model, 2 GRPO steps with an entropy bonus and a KL term (the reference scorer runs
on the mesh too), the fixed ``dfs`` engine, fp32. The single-device run is shared by
the module.

What is compared, and why the optimiser's epsilon is large here: AdamW's update
lr m / (sqrt(v) + eps) turns an absolute gradient error d on an element whose |g| is
near eps into an update error of up to lr d / eps. The sharded gradient is a psum over
ranks, summed in another order than the single device's, so d ~ 1e-7 x max|g| on some
elements; with eps = 1e-8 that is O(lr) on those elements whatever the mesh code does
(measured: 1.6e-3 max-relative on the final embedding after 3 steps at dp=8, with the
per-step gradient norms equal to 1e-7). With ``optim.eps=1`` (>> every |g| here) the
update is linear in the gradients, so the updates compare at the gradients' own
precision: per tensor max|upd_mesh - upd_1| <= 1e-5 max|upd_1| (+ 2 ulp of the
params, the resolution of an update read as a difference of fp32 params), and the
final parameters to 1e-5 relative. The per-step loss and gradient norm are compared at 1e-5 too.
"""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dtarl.parallel.mesh import param_shardings
from dtarl.parallel.sharded import allgather_objects
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import ConfigError, MeshSection, load_config
from dtarl.rl.episodes import encode_prompt, process_rollout, process_share, rollout
from dtarl.rl.metrics import read_metrics
from dtarl.rl.state import HostRecord
from dtarl.rl.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=0",
    "steps=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=2",
    "algo.engine=dfs",
    "algo.entropy_coef=0.01",
    "algo.kl_coef=0.05",
    "optim.lr=0.5",
    "optim.eps=1.0",
    "eval.num_problems=0",
    "console=false",
    "resume=false",
]


def mesh_reward(problem, completion: str) -> float:
    """Deterministic in the completion and spread over {0, 0.5, 1}."""
    return (sum(completion.encode()) % 3) / 2


def _run(out_dir, *mesh, max_steps=None):
    cfg = load_config(None, [*RUN, f"out_dir={out_dir}", *mesh])
    trainer = Trainer(cfg, reward_fn=mesh_reward)
    start = jax.tree.map(np.asarray, trainer.params)
    res = trainer.run(max_steps=max_steps)
    return trainer, start, res


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), "mesh.dp=1")


def _leaves(tree):
    return jax.tree.leaves(jax.tree.map(np.asarray, tree))


@pytest.mark.parametrize("dp, tp", [(8, 1), (4, 2)])
def test_mesh_run_equals_single_device(single, tmp_path, dp, tp):
    one, start, ref = single
    assert one.mesh is None and "dp" not in ref.history[-1]
    tr, start_m, res = _run(tmp_path, f"mesh.dp={dp}", f"mesh.tp={tp}")
    # The same rollouts (rewards, lengths) and the same per-step loss / gradient norm.
    for a, b in zip(ref.history, res.history, strict=True):
        assert a["advantage_abs_mean"] > 0  # a real policy gradient
        for key in ("reward_mean", "response_len_mean"):
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm", "kl"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-9, err_msg=key)
        assert b["engine"] == "sharded[dfs]" and (b["dp"], b["tp"]) == (dp, tp)
        assert b["partition_method"] == "balanced"
        assert b["partition_cost_model"] == "dfs"  # priced by the engine that runs
        assert b["partition_winner"].startswith("balanced/")
        assert b["work_balance"] >= 1.0  # the ranks' padded work as dfs counts it
        assert b["load_balance"] >= 1.0 and b["rank_load_max"] >= b["rank_load_mean"] > 0
    # The updates, and so the final parameters, per tensor.
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(start)]
    for name, s0, s1, a, b in zip(
        names,
        _leaves(start),
        _leaves(start_m),
        _leaves(ref.params),
        _leaves(res.params),
        strict=True,
    ):
        np.testing.assert_array_equal(s0, s1)
        upd_a, upd_b = a - s0, b - s0
        assert np.abs(upd_a).max() > 0, f"{name}: not updated; the check would be vacuous"
        # An update is read as a difference of fp32 params: +- 1 ulp of the params.
        ulp = np.spacing(np.abs(a).max())
        assert np.abs(upd_b - upd_a).max() <= 1e-5 * np.abs(upd_a).max() + 2 * ulp, name
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max(), name
    # Params, reference and Adam's moments keep the rule table's shardings.
    want = jax.tree.leaves(param_shardings(tr.params, tr.mesh))
    got = jax.tree.leaves(res.params)
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(got, want, strict=True))
    assert all(
        x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(jax.tree.leaves(tr.ref_params), want, strict=True)
    )
    adam = tr.opt_state[1][0]
    for moments in (adam.mu, adam.nu):
        leaves = jax.tree.leaves(moments)
        assert all(
            x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, want, strict=True)
        )
    if tp > 1:  # something is split over tp (query heads at least)
        assert any("tp" in str(s.spec) for s in want if isinstance(s, NamedSharding))


def _assert_same_run(start, ref, params):
    """Per tensor: the update from ``start`` and the final value as the other tests."""
    for s0, a, b in zip(_leaves(start), _leaves(ref), _leaves(params), strict=True):
        ulp = np.spacing(np.abs(a).max())
        assert np.abs(a - s0).max() > 0
        assert np.abs((b - s0) - (a - s0)).max() <= 1e-5 * np.abs(a - s0).max() + 2 * ulp
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max()


def test_resume_onto_another_mesh_equals_uninterrupted(single, tmp_path):
    """Step 1 at dp=4, tp=2 with a checkpoint (sharded over that mesh), then step 2
    resumed from it at dp=8 and on 1 device (``resume.enabled``; ``mesh`` may change
    on resume): both end with the uninterrupted single-device run's parameters, to
    1e-5 per tensor like ``test_mesh_run_equals_single_device``. The restored
    params, reference policy and Adam moments land on the new mesh's shardings; the
    rollout of step 2 (keys from the step, prompts from the data cursor) is the
    uninterrupted run's (same rewards and lengths)."""
    one, start, ref = single
    src = tmp_path / "src"
    # (No sampler warm-up: it compiles every decode window up front, the same samples.)
    cold = ["rollout.warmup=false", "checkpoint_every=1"]
    first, _, part = _run(src, "mesh.dp=4", "mesh.tp=2", *cold, max_steps=1)
    assert part.steps_done == 1 and (part.history[0]["dp"], part.history[0]["tp"]) == (4, 2)
    assert CheckpointManager(str(src / "checkpoints")).latest_step() == 1
    for name, mesh in (("dp8", ["mesh.dp=8"]), ("one", ["mesh.dp=1"])):
        shutil.copytree(src, tmp_path / name)
        tr, _, res = _run(tmp_path / name, *mesh, *cold, "resume=true")
        assert res.steps_done == 2 and [r["step"] for r in res.history] == [1]
        (b,) = res.history
        a = ref.history[1]
        for key in ("reward_mean", "response_len_mean"):
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm", "kl"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-9, err_msg=key)
        _assert_same_run(start, ref.params, res.params)
        for s0, r in zip(_leaves(start), _leaves(tr.ref_params), strict=True):
            np.testing.assert_array_equal(r, s0)  # the KL reference: the initial policy
        if tr.mesh is None:
            assert "dp" not in b and len(jax.tree.leaves(res.params)[0].devices()) == 1
            continue
        assert (b["dp"], b["tp"]) == (8, 1)
        want = jax.tree.leaves(param_shardings(tr.params, tr.mesh))
        adam = tr.opt_state[1][0]
        for tree in (res.params, tr.ref_params, adam.mu, adam.nu):
            pairs = zip(jax.tree.leaves(tree), want, strict=True)
            assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in pairs)


def test_mesh_section_resolves_and_names_the_field():
    assert MeshSection().resolve(8) == (8, 1)
    assert MeshSection(tp=2).resolve(8) == (4, 2)
    assert MeshSection(dp=2, tp=2).resolve(8) == (2, 2)  # one process: the first 4 devices
    assert load_config(None, ["mesh.dp=4", "mesh.tp=2"]).mesh == MeshSection(dp=4, tp=2)
    with pytest.raises(ConfigError, match=r"mesh.tp=3 does not divide the 8 devices.*\[1, 2"):
        MeshSection(tp=3).resolve(8)
    with pytest.raises(ConfigError, match=r"mesh.dp=4 x mesh.tp=4 = 16 devices.*<= 8"):
        MeshSection(dp=4, tp=4).resolve(8)
    with pytest.raises(ConfigError, match=r"multi-process run must use every device.*= 8"):
        MeshSection(dp=2, tp=2).resolve(8, num_processes=2)
    for bad in ("mesh.dp=0", "mesh.tp=-1"):
        with pytest.raises(ConfigError, match=bad):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="mesh.dp='two' must be an integer"):
        load_config(None, ["mesh.dp=two"])
    with pytest.raises(ConfigError, match=r"mesh: unknown keys \['pp'\]"):
        load_config(None, ["mesh.pp=2"])


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ["algo.kl_coef=0.1", "rollout.streaming.enabled=true"],
            r"rollout.streaming.enabled=true is not supported on a mesh \(mesh.dp=8",
        ),
        (["rollout.prompts_per_step=2"], r"gives 4 sequences per engine call, fewer than the 8"),
        (["rollout.engine=static"], r"rollout.engine=static has no mesh support"),
        (["sft.steps=1", "sft.batch_size=4"], r"sft.batch_size=4 is smaller than the 8 dp"),
    ],
)
def test_unsupported_mesh_combinations_are_refused(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(load_config(None, [*RUN, f"out_dir={tmp_path}", "mesh.dp=8", *extra]))


# The 2-process run's problems (and evaluation problems) split 1 + 2 over its processes.
UNEVEN = ["rollout.prompts_per_step=3", "eval.num_problems=3"]


def test_two_process_run_equals_one_process(tmp_path):
    """``dtarl launch --nproc 2 --devices-per-proc 2 -- train ...`` (gloo on localhost,
    dp = 4 over both processes' devices) ends with the parameters of the same run in
    one process on 4 devices: its final (sharded, multi-process) checkpoint restored
    here compares to 1e-5 per tensor, updates included. (One process on a mesh equals
    one device: ``test_mesh_run_equals_single_device``.) The reward is the task's,
    all zero for the untrained model; the entropy and KL terms give the gradient.
    Each process samples only its share of the step's 3 problems (1 and 2: an uneven
    split) and both train on the gathered batch (``process_rollout``)."""
    sets = [*RUN, *UNEVEN, f"out_dir={tmp_path / 'two'}"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2"]
    cmd += ["--devices-per-proc", "2", "--init-timeout", "60", "--", "train"]
    proc = subprocess.run(
        cmd + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 1] done: 2 steps" in proc.stdout, proc.stdout[-3000:]

    one = Trainer(load_config(None, [*RUN, *UNEVEN, f"out_dir={tmp_path / 'one'}", "mesh.dp=4"]))
    start = _leaves(one.params)
    ref = one.run()
    ckpt = CheckpointManager(str(tmp_path / "two" / "checkpoints"))
    assert ckpt.latest_step() == 2
    host = HostRecord.from_dict(ckpt.read_host(2), where=ckpt.path(2))
    state, _ = ckpt.restore_state(2, one.restore_target(2, host))
    logs = [tmp_path / "two" / "metrics.jsonl", tmp_path / "two" / "process_1" / "metrics.jsonl"]
    two = [read_metrics(str(f), flat=True) for f in logs]
    # The greedy evaluations (before and after training) too, on both processes.
    evals = [
        [r["eval_success_rate"] for r in recs if r.get("phase") == "eval"]
        for recs in (ref.history, *two)
    ]
    assert len(evals[0]) == 2 and evals[0] == evals[1] == evals[2], evals
    ref_rl, *two = [[r for r in recs if r.get("phase") == "rl"] for recs in (ref.history, *two)]
    for a, b, b1 in zip(ref_rl, *two, strict=True):
        assert "rollout_processes" not in a  # one process: the rollout is not sharded
        # Each process sampled its share of the 3 problems (1 and 2) on its 2 devices,
        # then both held all.
        for rec, share in ((b, 1), (b1, 2)):
            got = [
                rec[k] for k in ("rollout_processes", "rollout_local_prompts", "rollout_devices")
            ]
            assert got == [2, share, 2]
        assert (b["dp"], b["tp"]) == (4, 1) and a["response_len_mean"] == b["response_len_mean"]
        for key in ("grad_norm", "loss", "kl"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-9, err_msg=key)
            np.testing.assert_allclose(b1[key], a[key], rtol=1e-5, atol=1e-9, err_msg=key)
    for s0, a, b in zip(start, _leaves(ref.params), _leaves(state.params), strict=True):
        ulp = np.spacing(np.abs(a).max())
        assert np.abs(a - s0).max() > 0
        assert np.abs((b - s0) - (a - s0)).max() <= 1e-5 * np.abs(a - s0).max() + 2 * ulp
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max()


def test_rollout_share_with_index_offset_samples_as_the_whole_batch(single):
    """A process's share of a step's problems (``process_rollout``: a contiguous slice,
    whole groups, keyed by the global problem index through ``index_offset``) samples
    exactly the trajectories of those problems in the whole batch's rollout, at a
    smaller decode batch; uneven shares (2 + 3) included."""
    tr = single[0]
    problems = tr.task.generate(np.random.default_rng(7), 5)
    key = jax.random.PRNGKey(11)

    def run(probs, **kw):
        return rollout(
            tr.sampler, tr.params, tr.tokenizer, tr.task, probs, group_size=2, key=key, **kw
        )[0]

    whole = run(problems)
    shares = run(problems[:2]) + run(problems[2:], index_offset=2)
    assert len(shares) == len(whole) == 10
    for a, b in zip(whole, shares, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.old_logprobs, a.old_logprobs)
        assert a.response_len > 0
    # Without the offset the second share is keyed as problems 0, 1, 2: other samples.
    unkeyed = run(problems[2:])
    assert any(
        not np.array_equal(a.tokens, b.tokens) for a, b in zip(whole[4:], unkeyed, strict=True)
    )
    # ContinuousSampler.generate's index_offset: the same keying, one turn.
    prompts = [encode_prompt(tr.tokenizer, p.prompt) for p in problems]
    full = tr.sampler.generate(tr.params, prompts, num_samples=2, seed=key)
    tail = tr.sampler.generate(tr.params, prompts[2:], num_samples=2, seed=key, index_offset=2)
    for j in range(6):
        np.testing.assert_array_equal(tail.tokens[j], full.tokens[4 + j])
    # One process: process_rollout is the whole rollout, its share all the problems.
    one, stats = process_rollout(
        tr.sampler, tr.params, tr.tokenizer, tr.task, problems, group_size=2, key=key
    )
    assert [t.problem_index for t in one] == [t.problem_index for t in whole]
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(whole, one, strict=True))
    assert stats["rollout_processes"] == 1 and stats["rollout_local_prompts"] == 5
    with pytest.raises(ValueError, match=r"counts: 2 values for 5 problems"):
        process_rollout(
            tr.sampler, tr.params, tr.tokenizer, tr.task, problems, group_size=2, key=key,
            counts=[2, 2],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"problems: empty"):
        process_rollout(tr.sampler, tr.params, tr.tokenizer, tr.task, [], group_size=2, key=key)


def test_process_share_and_allgather_objects():
    assert [process_share(5, p, 2) for p in range(2)] == [(0, 2), (2, 5)]
    assert [process_share(2, p, 3) for p in range(3)] == [(0, 0), (0, 1), (1, 2)]
    assert [process_share(8, p, 4) for p in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match=r"process=2: need 0 <= process < processes=2"):
        process_share(4, 2, 2)
    assert allgather_objects({"a": np.arange(3)}, what="test")[0]["a"].tolist() == [0, 1, 2]
