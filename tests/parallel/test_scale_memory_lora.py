"""``dtarl bench scale --lora``: a LoRA row compiles the trainer's LoRA step (merge,
sharded step, adapter gradients, AdamW over the adapters) at the tiny model on a
2-device fsdp mesh. Its optimiser state is the adapters' Adam moments (replicated),
far below the full row's; the KL reference is a param-sized copy for full
fine-tuning and nothing for LoRA (the base is the reference); the step program is
the full row's (reused, and equal when compiled again). ``merged`` copies only the
adapted weights."""

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.bench import scale_memory as sm
from dtarl.errors import ConfigError
from dtarl.lora import LoraConfig, init_adapters, merge, merged, num_adapter_params, path_key
from dtarl.lora.memory import adapted_params
from dtarl.model import init_model

SHAPE = dict(group=2, prompt=4, response=4)
RANK = 2


@pytest.fixture(scope="module")
def rows():
    mesh = sm.parse_mesh("dp=1,fsdp=2,tp=1")
    full = sm.measure("tiny", mesh, "dense", **SHAPE)
    lora = sm.measure_lora("tiny", mesh, "dense", RANK, full=full, **SHAPE)
    # Compiles its own step, and the fused program.
    own = sm.measure_lora("tiny", mesh, "dense", RANK, fused=True, **SHAPE)
    return full, lora, own


def test_lora_row_holds_the_adapters_adam_state_and_no_reference(rows):
    full, lora, _ = rows
    cfg = sm.model_config("tiny")
    base = nnx.split(nnx.eval_shape(lambda: init_model(cfg, seed=0)), nnx.Param)[1]
    lcfg = LoraConfig(rank=RANK, alpha=2.0 * RANK)
    adapters = jax.eval_shape(lambda b: init_adapters(b, lcfg, jax.random.key(0)), base)
    adapter_b = 4 * num_adapter_params(adapters)  # fp32, replicated: 1 shard
    assert lora["lora_rank"] == RANK and full["lora_rank"] == 0
    assert lora["adapter_bytes"] == adapter_b > 0
    assert 0 <= lora["opt_bytes"] - 2 * adapter_b < 64  # mu, nu + step counts
    assert lora["opt_bytes"] * 5 < full["opt_bytes"]
    assert full["ref_bytes"] == full["param_bytes"] > 0 and lora["ref_bytes"] == 0
    # The frozen base is the params' fp32 shards; the engine still outputs dL/dW'.
    assert lora["param_bytes"] == full["param_bytes"] + adapter_b
    assert lora["grad_bytes"] == full["grad_bytes"] == full["param_bytes"]
    assert lora["merged_bytes"] * 2 == 4 * adapted_params(cfg, lcfg)  # split over fsdp=2
    held = lora["merged_bytes"] + adapter_b + lora["opt_bytes"]
    assert lora["peak_bytes"] >= lora["step_peak_bytes"] + held
    assert lora["peak_phase"] in ("merge", "step", "grads", "update")


def test_the_step_program_is_the_full_rows(rows):
    full, lora, own = rows
    assert own["step_peak_bytes"] == lora["step_peak_bytes"] == full["step_peak_bytes"]
    for k in (*sm.KEYS, *sm.LORA_KEYS):
        if k.endswith("_bytes"):
            assert own[k] == lora[k], k
    # merge + step + (2) as one program: the base and adapters are its arguments.
    assert own["fused_peak_bytes"] >= own["param_bytes"] + own["opt_bytes"]
    assert "fused_peak_bytes" not in lora
    assert sm.json_rows([own])[0]["fused_peak_bytes"] == own["fused_peak_bytes"]


def test_json_and_table_mark_the_lora_rows(rows):
    full, lora, _ = rows
    j_full, j_lora = sm.json_rows([full, lora])
    assert tuple(j_full) == sm.KEYS and j_full["lora_rank"] == 0
    assert tuple(j_lora) == (*sm.KEYS, *sm.LORA_KEYS) and j_lora["ref_bytes"] == 0
    head, line_full, line_lora = sm.format_table([full, lora]).splitlines()
    col = head.index("lora")
    assert line_full[col : col + 4].strip() == "-"
    assert line_lora[col : col + 4].strip() == str(RANK)


def test_run_reuses_the_full_step_and_extrapolates_each_rank(monkeypatch):
    calls = []

    def fake_measure(name, mesh, engine, *, layers, **kw):
        calls.append(("full", layers))
        return dict(layers=layers, x_bytes=10 * layers, compile_s=1.0, lora_rank=0)

    def fake_lora(name, mesh, engine, rank, *, full, layers, **kw):
        calls.append((rank, layers, full["layers"]))
        return dict(layers=layers, x_bytes=3 * layers, compile_s=1.0, lora_rank=rank)

    monkeypatch.setattr(sm, "measure", fake_measure)
    monkeypatch.setattr(sm, "measure_lora", fake_lora)
    monkeypatch.setattr(sm, "format_table", lambda rows, header: "")
    monkeypatch.setattr(sm, "check_budget", lambda row, gib: None)
    out = sm.run(["qwen3_8b"], [{}], ["dense"], lora_ranks=(0, 16), extrapolate_from=(1, 2))
    assert calls == [("full", 1), (16, 1, 1), ("full", 2), (16, 2, 2)]
    assert [r["lora_rank"] for r in out] == [0, 16]
    assert [r["x_bytes"] for r in out] == [360, 108]  # linear in depth, at 36 layers
    assert all(r["extrapolated"] for r in out)


def test_bad_ranks_are_refused():
    for bad in ([-1], [16, 16], [], [1.5]):
        with pytest.raises(ConfigError, match=r"--lora .*integer >= 0 \(0: full fine-tuning"):
            sm.check_ranks(bad)


def test_merged_copies_only_the_adapted_weights():
    _, base = nnx.split(init_model(sm.ModelConfig.tiny(), seed=0), nnx.Param)
    cfg = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    adapters = init_adapters(base, cfg, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0: W' != W
    out, ref = merged(base, adapters, cfg), merge(base, adapters, cfg)
    leaves = (
        jax.tree_util.tree_flatten_with_path(base)[0],
        jax.tree.leaves(out),
        jax.tree.leaves(ref),
    )
    for (path, w), m, r in zip(*leaves, strict=True):
        if path_key(path) in adapters:
            assert m is not w and not np.array_equal(m, w)
            np.testing.assert_array_equal(m, r)
        else:
            assert m is w  # the base's own array


def test_fused_step_equals_the_lora_engine_on_a_mesh():
    from dtarl.engines import DenseEngine
    from dtarl.lora import LoraEngine, fused_step
    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.parallel import mesh as mesh_lib
    from dtarl.parallel.sharded import ShardedEngine
    from dtarl.testing import grpo_groups

    model = init_model(sm.ModelConfig.tiny(), seed=0)
    _, base = nnx.split(model, nnx.Param)
    mesh = mesh_lib.make_train_mesh(1, 2, 1, devices=jax.devices()[:2])
    sharded = ShardedEngine(DenseEngine(model), mesh)
    base = sharded.shard_params(base)
    cfg = LoraConfig(rank=2, alpha=4.0)
    adapters = init_adapters(base, cfg, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B != 0: dL/dA != 0
    batch = grpo_groups(num_groups=1, group_size=4, prompt_len=6, response_len=(3, 7), seed=0)
    loss = ClippedSurrogateLoss.grpo()
    want_loss, want, _ = LoraEngine(sharded, base, cfg).value_and_grad(adapters, batch, loss)
    prepared = sharded.prepare(batch, loss)
    fn = fused_step(sharded.get_fn(loss, prepared, base), cfg)
    got_loss, got, _ = fn(base, adapters, *sharded.device_args(prepared))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.abs(w).max() > 0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_a_bf16_base_halves_the_base_and_compiles_its_own_step(rows):
    full, lora, _ = rows
    mesh = sm.parse_mesh("dp=1,fsdp=2,tp=1")
    bf16 = sm.measure_lora("tiny", mesh, "dense", RANK, full=full, base_dtype="bfloat16", **SHAPE)
    assert bf16["base_dtype"] == "bfloat16" and lora["base_dtype"] == "float32"
    adapter_b = lora["adapter_bytes"]
    assert bf16["adapter_bytes"] == adapter_b and bf16["opt_bytes"] == lora["opt_bytes"]
    assert (bf16["param_bytes"] - adapter_b) * 2 == full["param_bytes"]
    assert bf16["merged_bytes"] * 2 == lora["merged_bytes"]
    assert bf16["grad_bytes"] == full["grad_bytes"]  # dL/dW' still fp32
    assert bf16["step_peak_bytes"] != full["step_peak_bytes"]  # not the fp32 step's
    with pytest.raises(ConfigError, match=r"--lora-base-dtype 'float16': accepted"):
        sm.measure_lora("tiny", mesh, "dense", RANK, base_dtype="float16", **SHAPE)
