"""Sharded training on 8 fake CPU devices equals the single-device engine.

For dp x tp in {8x1, 4x2, 2x4} and every engine, the loss, the per-tensor
gradients (fp32, relative Frobenius error <= 1e-5) and the per-sequence
logprobs equal the same engine run on one device. tp=4 with kv_heads=2
exercises the rule table's fallback (k/v projections replicated).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
import reference_math
from flax import nnx
from jax.sharding import PartitionSpec as P

from dtarl import axes
from dtarl.engines import DenseEngine, DFSEngine, RolloutBatch
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel.mesh import MeshConfig, MeshError, logical_to_spec, make_mesh, param_specs
from dtarl.parallel.partition import PartitionMethod
from dtarl.parallel.sharded import ShardedEngine, ShardingError, Strategy
from dtarl.testing import grpo_groups

RTOL = 1e-5  # fp32, per parameter tensor: ||g - g_ref|| / ||g_ref||
MESHES = [(8, 1), (4, 2), (2, 4)]
LOSS = ClippedSurrogateLoss.dapo()  # token-level: weights must come from the global batch


def _tiny_cfg():
    return ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)


@functools.cache
def _problem():
    """Abstract model (engines need only graphdef + cfg), host params, a GRPO batch."""
    cfg = _tiny_cfg()
    model = nnx.eval_shape(lambda: init_model(cfg, seed=0))
    _, abstract = nnx.split(model, nnx.Param)
    rs = np.random.RandomState(0)
    params = jax.tree.map(
        lambda a: (rs.standard_normal(a.shape) / np.sqrt(a.shape[0])).astype(a.dtype), abstract
    )
    batch = grpo_groups(num_groups=4, group_size=4, prompt_len=6, response_len=(3, 9), seed=0)
    return model, params, batch


def _prefix_reuse_engine(model):
    from dtarl.engines.prefix_reuse import PrefixReuseEngine

    return PrefixReuseEngine(model)


def _engine(kind: str):
    model, _, _ = _problem()
    if kind == "dfs":
        return DFSEngine(model, chunk_len=8)
    if kind == "dense":
        return DenseEngine(model, microbatch=2)
    return _prefix_reuse_engine(model)


@functools.cache
def _reference(kind: str):
    """The engine on one device, itself checked against the equations (the engines'
    contract, tests/reference_math.py) on this model and batch."""
    model, params, batch = _problem()
    total, grads, aux = _engine(kind).value_and_grad(params, batch, LOSS)
    reference_math.check(model.cfg, params, batch, LOSS, total, grads, aux.logprobs, name=kind)
    return float(total), jax.tree.map(np.asarray, grads), aux.logprobs


def _max_rel(grads, ref) -> float:
    errs = []
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        errs.append(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
    return max(errs)


# prefix_reuse runs on one mesh only (each case is a ~6 s CPU compile).
CASES = [(k, dp, tp) for k in ("dfs", "dense") for dp, tp in MESHES] + [("prefix_reuse", 4, 2)]


@pytest.mark.parametrize("kind,dp,tp", CASES, ids=[f"{k}-dp{d}tp{t}" for k, d, t in CASES])
def test_sharded_equals_single_device(kind, dp, tp):
    _, params, batch = _problem()
    engine = _engine(kind)
    ref_loss, ref_grads, ref_logp = _reference(kind)
    sharded = ShardedEngine(engine, make_mesh(dp, tp))
    sp = sharded.shard_params(params)
    total, grads, aux = sharded.value_and_grad(sp, batch, LOSS)

    np.testing.assert_allclose(float(total), ref_loss, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert _max_rel(grads, ref_grads) <= RTOL
    assert len(aux.logprobs) == batch.num_sequences
    for lp, rlp in zip(aux.logprobs, ref_logp, strict=True):
        np.testing.assert_allclose(lp, rlp, atol=1e-5, rtol=0)
    # Gradients come back split like the parameters.
    # (Layer parameters are stacked [L, ...]: the layers axis is replicated.)
    attn = grads["layers"]["self_attn"]
    want_q = P(None, None, "tp", None) if tp > 1 else P(None, None, None, None)
    assert attn["q_proj"].sharding.spec == want_q
    kv = P(None, None, "tp", None) if tp == 2 else P(None, None, None, None)  # tp=4 replicates
    assert attn["k_proj"].sharding.spec == kv
    down = sp["layers"]["mlp"]["down_proj"].sharding.spec
    assert down == P(None, "tp" if tp > 1 else None, None)
    # Every rank got work; the same batch again does not retrace.
    assert len(aux.stats["rank_stats"]) == dp
    assert sharded.trace_count == 1
    sharded.value_and_grad(sp, batch, LOSS)
    assert sharded.trace_count == 1


def test_auto_runs_one_engine_on_every_rank(monkeypatch):
    """auto under ShardedEngine: one choice (asked once, on the rank with the most
    tokens), every rank prepared by that engine, its buckets agreed like the
    engine's own; the result equals that engine on one device."""
    from dtarl.engines import AutoEngine

    model, params, batch = _problem()
    engines = {k: _engine(k) for k in ("dense", "dfs", "prefix_reuse")}
    auto = AutoEngine(model, engines=engines)
    asked = []
    real = auto.shard_choice

    def spy(b, *a, **k):
        asked.append(b.num_tokens)
        return real(b, *a, **k)

    monkeypatch.setattr(auto, "shard_choice", spy)
    sharded = ShardedEngine(auto, make_mesh(4, 2))
    prep = sharded.prepare(batch, LOSS)
    kind = prep.static[0]
    most = max(int(batch.lengths[ix].sum()) for ix in prep.partition.indices)
    assert asked == [most] and most < batch.num_tokens
    assert {r.static for r in prep.ranks} == {prep.static}
    assert all(r.stats["chosen_engine"] == kind for r in prep.ranks)
    ref_loss, ref_grads, ref_logp = _reference(kind)
    total, grads, aux = sharded.value_and_grad(params, batch, LOSS)
    np.testing.assert_allclose(float(total), ref_loss, rtol=1e-6)
    assert _max_rel(grads, ref_grads) <= RTOL
    for lp, rlp in zip(aux.logprobs, ref_logp, strict=True):
        np.testing.assert_allclose(lp, rlp, atol=1e-5, rtol=0)


def test_sharded_at_a_sampling_temperature():
    """An engine built at T = 0.7 trains on logits / T sharded too: equal to that engine
    on one device (tests/engines ties it to the jax.grad reference at T), and not to T = 1."""
    model, params, batch = _problem()
    engine = DenseEngine(model, microbatch=4, temperature=0.7)
    ref_loss, ref_grads, aux_ref = engine.value_and_grad(params, batch, LOSS)
    sharded = ShardedEngine(DenseEngine(model, microbatch=4, temperature=0.7), make_mesh(4, 2))
    total, grads, aux = sharded.value_and_grad(sharded.shard_params(params), batch, LOSS)
    np.testing.assert_allclose(float(total), float(ref_loss), rtol=1e-6)
    assert _max_rel(grads, ref_grads) <= RTOL
    for lp, rlp, one in zip(aux.logprobs, aux_ref.logprobs, _reference("dense")[2], strict=True):
        np.testing.assert_allclose(lp, rlp, atol=1e-5, rtol=0)
        assert np.abs(lp - one).max() > 1e-3


def test_jit_strategy_matches():
    """The NamedSharding + vmap alternative gives the same numbers (it is just slower)."""
    _, params, batch = _problem()
    ref_loss, ref_grads, _ = _reference("dense")
    sharded = ShardedEngine(_engine("dense"), make_mesh(4, 2), strategy=Strategy.JIT)
    total, grads, _ = sharded.value_and_grad(params, batch, LOSS)
    np.testing.assert_allclose(float(total), ref_loss, rtol=1e-6)
    assert _max_rel(grads, ref_grads) <= RTOL


def test_baseline_partition_prepares_equal_shapes():
    """Greedy-by-tokens ranks have different trees; the two-pass prepare still stacks them."""
    _, _, batch = _problem()
    sharded = ShardedEngine(_engine("dfs"), make_mesh(4, 2), method=PartitionMethod.GREEDY_TOKENS)
    prep = sharded.prepare(batch, LOSS)
    assert {r.static for r in prep.ranks} == {prep.static}
    for leaf in jax.tree.leaves(prep.args):
        assert leaf.shape[0] == 4
    got = np.sort(np.concatenate(prep.partition.indices))
    np.testing.assert_array_equal(got, np.arange(batch.num_sequences))
    # Per-rank weights are slices of the global ones (token-level normalisation).
    w = batch.sequence_weights(LOSS.norm)
    for r, ix in enumerate(prep.partition.indices):
        np.testing.assert_array_equal(prep.args[1].weight[r][: ix.shape[0]], w[ix])


def test_empty_rank_runs_a_zero_weight_dummy(monkeypatch):
    """A baseline partition may leave a rank empty: it gets one sequence with weight 0."""
    import dtarl.parallel.sharded as sharded_mod

    _, _, batch = _problem()
    real = sharded_mod.partition

    def leave_rank_1_empty(*args, **kwargs):
        p = real(*args, **kwargs)
        ix = list(p.indices)
        ix[0] = np.concatenate([ix[0], ix[1]])
        ix[1] = np.zeros(0, np.int64)
        return dataclasses.replace(p, indices=tuple(ix))

    monkeypatch.setattr(sharded_mod, "partition", leave_rank_1_empty)
    prep = ShardedEngine(_engine("dfs"), make_mesh(4, 2)).prepare(batch, LOSS)
    assert prep.dummy == (False, True, False, False)
    assert not np.any(prep.args[1].weight[1])  # the dummy rank contributes nothing
    assert np.all(prep.args[1].weight[0][: prep.partition.indices[0].shape[0]] > 0)


# ------------------------------------------------------------------------ rule table


def test_rule_table_specs():
    mesh = make_mesh(2, 4)
    spec, fb = logical_to_spec((axes.EMBED, axes.HEADS, axes.HEAD_DIM), (32, 4, 8), mesh)
    assert spec == P(None, "tp", None) and fb == ()
    spec, fb = logical_to_spec((axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), (32, 2, 8), mesh)
    assert spec == P(None, None, None) and fb == (axes.KV_HEADS,)
    spec, _ = logical_to_spec((axes.MLP, axes.EMBED), (64, 32), mesh)
    assert spec == P("tp", None)
    spec, _ = logical_to_spec((axes.VOCAB, axes.EMBED), (256, 32), mesh)
    assert spec == P(None, None)
    # A mesh axis is used once per array; 'batch' -> dp is excluded for parameters.
    spec, fb = logical_to_spec((axes.HEADS, axes.MLP), (4, 64), mesh)
    assert spec == P("tp", None) and fb == (axes.MLP,)
    spec, _ = logical_to_spec((axes.BATCH, axes.EMBED), (8, 32), mesh)
    assert spec == P(None, None)
    with pytest.raises(MeshError, match="no rule"):
        logical_to_spec(("nonsense",), (4,), mesh)
    with pytest.raises(MeshError, match="do not match shape"):
        logical_to_spec((axes.EMBED,), (4, 4), mesh)


def test_param_specs_report_replicated_fallbacks():
    _, params, _ = _problem()
    plan = param_specs(params, make_mesh(2, 4))
    assert sorted({p.rsplit("/", 1)[1] for p, _ in plan.replicated}) == ["k_proj", "v_proj"]
    assert param_specs(params, make_mesh(4, 2)).replicated == ()


# ------------------------------------------------------------------------ bad input


def test_mesh_must_cover_the_devices():
    with pytest.raises(MeshError, match=r"dp=4 x tp=4 = 16 devices, but 8"):
        make_mesh(4, 4)
    with pytest.raises(MeshError, match=r"tp=3 does not divide the 8"):
        make_mesh(tp=3)
    with pytest.raises(MeshError, match="dp=0"):
        MeshConfig(dp=0)
    with pytest.raises(MeshError, match="tp=-1"):
        MeshConfig(tp=-1)
    assert dict(make_mesh(tp=2).shape) == {"dp": 4, "tp": 2}
    assert dict(make_mesh(2, 1, devices=jax.devices()[:2]).shape) == {"dp": 2, "tp": 1}


def test_more_ranks_than_sequences():
    model, _, _ = _problem()
    small = RolloutBatch.create(tokens=[np.arange(5) + 3 * i for i in range(4)])
    sharded = ShardedEngine(DFSEngine(model), make_mesh(8, 1))
    with pytest.raises(ShardingError, match=r"4 sequences but the mesh has dp=8"):
        sharded.prepare(small, LOSS)
    grouped = ShardedEngine(DFSEngine(model), make_mesh(8, 1), keep_groups=True)
    _, _, batch = _problem()
    with pytest.raises(ShardingError, match=r"4 groups but the mesh has dp=8"):
        grouped.prepare(batch, LOSS)


def test_bad_engine_and_weights():
    model, params, batch = _problem()
    with pytest.raises(ShardingError, match="no prepare"):
        ShardedEngine(object(), make_mesh(8, 1))
    with pytest.raises(ShardingError, match="missing"):
        ShardedEngine(DFSEngine(model), jax.make_mesh((8,), ("data",)))
    sharded = ShardedEngine(DFSEngine(model), make_mesh(8, 1))
    with pytest.raises(ShardingError, match=r"weights: shape \(3,\), expected"):
        sharded.value_and_grad(params, batch, LOSS, weights=np.ones(3))
