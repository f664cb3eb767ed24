"""DFS pops from the layer outputs their push kept (``engine.dfs.keep_layer_outputs``).

The pop of a pushed chunk then runs only the backward pass
(``dtarl.model.reverse.vjp_from_layer_outputs``); a chunk never pushed (a leaf's
cut tail, packed sibling leaves, a merged run half pushed) runs the forward first
in the same loop step. Both must equal dense ``jax.grad`` as every engine does.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from test_equivalence import LOSSES, check_engine, tree_batches, with_logprob_data

from dtarl.engines import Capacity, DFSEngine, RolloutBatch
from dtarl.engines.dfs import Op
from dtarl.model import ModelConfig, ModelFamily, init_model
from dtarl.model.config import Remat
from dtarl.model.decoder import KVCache, token_logprobs
from dtarl.model.reverse import vjp_from_layer_outputs
from dtarl.testing import grpo_groups
from dtarl.tree import build_tree, compile_plan


@functools.cache
def _model(remat=Remat.FULL, family=ModelFamily.QWEN3, layers=2):
    cfg = ModelConfig.tiny(family, remat=remat, num_layers=layers)
    model = init_model(cfg, seed=1)
    return model, nnx.split(model, nnx.Param)[1]


@functools.cache
def _engine(remat=Remat.FULL, chunk=8, rows=1, wide=4, bucket_bodies=None, keep=None):
    model, _ = _model(remat)
    engine = DFSEngine(
        model,
        chunk_len=chunk,
        leaf_rows=rows,
        wide_chunks=wide,
        prefix_levels=2,
        bucket_bodies=bucket_bodies,
        keep_layer_outputs=keep,
    )
    return engine.reserve(Capacity(sequences=64, length=64, group_size=8, groups=64))


def check(batch, loss, **engine):
    model, params = _model(engine.get("remat", Remat.FULL))
    return check_engine(_engine(**engine), params, batch, loss, model=model)


def plain_check(batch, loss, family=ModelFamily.QWEN3, **engine_kw):
    """A fresh engine (its own buckets) on a model of ``family``, remat full."""
    model, params = _model(Remat.FULL, family)
    engine = DFSEngine(model, keep_layer_outputs=True, **engine_kw)
    return check_engine(engine, params, batch, loss, model=model)


def test_default_keeps_layer_outputs_only_under_full_remat():
    assert _engine(Remat.FULL).keeps_layer_outputs
    assert not _engine(Remat.NONE).keeps_layer_outputs
    assert not _engine(Remat.FULL, keep=False).keeps_layer_outputs
    assert _engine(Remat.NONE, keep=True).keeps_layer_outputs
    with pytest.raises(ValueError, match="engine.dfs.keep_layer_outputs='yes'"):
        DFSEngine(_model()[0], keep_layer_outputs="yes")


def test_vjp_from_layer_outputs_equals_vjp_of_the_forward():
    """The reverse pass alone against ``jax.vjp`` of the whole chunk forward (head and
    K/V outputs), over a prefix with masked rows, untied head, 3 layers."""
    model, _ = _model(Remat.FULL, ModelFamily.LLAMA3, layers=3)
    graphdef, params = nnx.split(model, nnx.Param)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    t, p = 6, 5
    tokens = jnp.asarray(rng.integers(0, 256, (1, t)))
    targets = jnp.asarray(rng.integers(0, 256, (1, t)))
    positions = jnp.arange(4, 4 + t)[None]  # one prefix row past the valid 4: masked
    kv_shape = (3, 1, p, cfg.num_kv_heads, cfg.head_dim)
    prefix = KVCache(*(jnp.asarray(rng.normal(size=kv_shape), jnp.float32) for _ in "kv"))
    plen = jnp.array([4])

    def head(m, h):
        return token_logprobs(m.lm_head_weight(), h, targets, entropy=True, chunk=4)

    def forward(prm, k, v):
        m = nnx.merge(graphdef, prm)
        hidden, kv = m(tokens, positions, KVCache(k, v), plen, return_hidden=True)
        return head(m, hidden), kv.k, kv.v

    out, vjp = jax.vjp(forward, params, prefix.k, prefix.v)
    d_head = tuple(jnp.asarray(rng.normal(size=(1, t)), jnp.float32) for _ in range(2))
    d_kv = KVCache(*(jnp.asarray(rng.normal(size=out[1].shape), jnp.float32) for _ in "kv"))
    want_params, want_k, want_v = vjp((d_head, d_kv.k, d_kv.v))
    m = nnx.merge(graphdef, params)
    *_, outs = m(tokens, positions, prefix, plen, return_hidden=True, layer_outputs=True)
    assert outs.shape == (3, 1, t, cfg.hidden_size)
    start = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, jnp.float32), params)
    got_params, got_prefix = vjp_from_layer_outputs(
        graphdef, params, tokens, positions, prefix, plen, outs, head, d_head, d_kv, start
    )
    got_params = jax.tree.map(lambda g: g - 0.5, got_params)  # added to the accumulator
    for got, want in zip(
        jax.tree.leaves(got_params) + [got_prefix.k, got_prefix.v],
        jax.tree.leaves(want_params) + [want_k, want_v],
        strict=True,
    ):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    assert float(jnp.abs(got_prefix.k[:, :, 4:]).max()) == 0.0  # the masked row
    with pytest.raises(ValueError, match=r"outs_LxBxTxE \(2, 1, 6, 64\) must be"):
        vjp_from_layer_outputs(
            graphdef, params, tokens, positions, prefix, plen, outs[:2], head, d_head, d_kv, start
        )


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=tree_batches())
def test_random_trees_match_dense_grad(batch):
    """Branching at several depths, prefixes of other sequences, duplicates: merged
    runs half pushed, internal nodes that end sequences, packed leaves. One loss
    (one program; the other losses: test_grpo_groups_every_family)."""
    check(with_logprob_data(batch), LOSSES["grpo_kl"])


@pytest.mark.parametrize(
    "family,loss_name",
    [(ModelFamily.LLAMA3, "dapo"), (ModelFamily.QWEN2, "dr_grpo")],
)
def test_grpo_groups_every_family(family, loss_name):
    """Untied head (Llama), attention bias (Qwen2), each layer's backward from its
    kept input; prompts longer than a chunk (several pushed chunks per node)."""
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=19, response_len=(1, 13), seed=3)
    aux = plain_check(with_logprob_data(batch), LOSSES[loss_name], family, chunk_len=8)
    assert aux.stats["pushed_tokens"] >= 2 * 16


@pytest.mark.parametrize("bucket_bodies", [None, True])
def test_rows_wide_pops_and_bucket_bodies(bucket_bodies):
    """Row pops and wide pops (leaf ops, their own switch after the backward one),
    several prefix buckets, each kind of program body."""
    rs = np.random.RandomState(8)
    stem = list(rs.randint(3, 256, 13))
    seqs = [stem + list(rs.randint(3, 256, rs.randint(5, 8))) for _ in range(5)]
    seqs += [stem[:5] + list(rs.randint(3, 256, n)) for n in (3, 3, 30)]  # packed, wide
    seqs += [list(rs.randint(3, 256, 40))]  # alone, longer than a chunk
    batch = with_logprob_data(RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs))))
    aux = check(batch, LOSSES["grpo_kl"], rows=2, bucket_bodies=bucket_bodies)
    assert aux.stats["row_steps"] >= 1 and aux.stats["wide_steps"] >= 1


def test_plan_marks_the_pops_of_pushed_chunks():
    """``saved``: the POPs whose every entry an earlier PUSH computed. A 20-token
    prompt in chunks of 8 pushes 3 chunks; so does the 12-token response but for its
    cut tail; the two short responses are packed into one pop, never pushed."""
    prompt = list(range(3, 23))
    seqs = [prompt + [30 + i] * n for i, n in enumerate((2, 3, 12))]
    plan = compile_plan(build_tree(seqs), chunk_len=8)
    op, saved = plan.op[: plan.num_steps], plan.saved[: plan.num_steps]
    assert not saved[op != Op.POP].any()
    pops = np.flatnonzero(op == Op.POP)
    # Every saved pop's positions are inside what the pushes before it covered.
    for t in pops[saved[pops]]:
        lo, hi = plan.entry_ptr[t], plan.entry_ptr[t + 1]
        pos = set(plan.entries["positions"][lo:hi].tolist())
        pushed = set()
        for u in np.flatnonzero(op[:t] == Op.PUSH):
            a, b = plan.entry_ptr[u], plan.entry_ptr[u + 1]
            pushed |= set(plan.entries["positions"][a:b].tolist())
        assert pos <= pushed
    # Pops in order: the two short leaves packed, the long one's cut tail (neither
    # pushed), then its pushed chunk and the prompt's three chunks.
    assert saved[pops].tolist() == [False, False, True, True, True, True]
    assert plan.seg[pops[0]].max() == 1  # the packed step holds two leaves


def test_sharded_dp_fsdp_tp_matches_dense():
    """On a dp=2 x fsdp=2 x tp=2 mesh (``ShardedEngine``: ranks run their own plans,
    parameters split over fsdp and tp): loss and every gradient tensor equal the
    single-device dense engine's at 1e-5."""
    from dtarl.engines import make_engine
    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.parallel import mesh as mesh_lib
    from dtarl.parallel.sharded import ShardedEngine

    model, params = _model()
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=10, response_len=(2, 7), seed=4)
    loss = ClippedSurrogateLoss.grpo()
    want_loss, want_grads, _ = make_engine("dense", model).value_and_grad(params, batch, loss)
    engine = DFSEngine(model, chunk_len=8)
    assert engine.keeps_layer_outputs
    sharded = ShardedEngine(engine, mesh_lib.make_train_mesh(2, 2, 2))
    got_loss, got_grads, _ = sharded.value_and_grad(params, batch, loss)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max(), a.shape


@pytest.mark.parametrize("keep", [True, False])
def test_logits_blocks_of_logits_rows_chunks(keep):
    """``logits_chunk`` 3 and ``logits_rows`` 2: the head builds 6 of a step's 8
    positions at a time (the last block padded), under the push, the kept-output pop
    and the ``jax.vjp`` pop alike. Kept outputs on a model without remat (not the
    default there: it saves nothing, but stays exact); the ``jax.vjp`` pop under
    full remat (``keep_layer_outputs: false``)."""
    cfg = ModelConfig.tiny(remat=Remat.NONE if keep else Remat.FULL, logits_chunk=3)
    model = init_model(cfg, seed=1)
    params = nnx.split(model, nnx.Param)[1]
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=3)
    engine = DFSEngine(model, chunk_len=8, prefix_levels=1, logits_rows=2, keep_layer_outputs=keep)
    check_engine(engine, params, with_logprob_data(batch), LOSSES["grpo_kl"], model=model)
    with pytest.raises(ValueError, match="engine.dfs.logits_rows=0"):
        DFSEngine(model, logits_rows=0)
