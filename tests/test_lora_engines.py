"""LoRA on every engine: the adapters' gradients equal jax.grad of the dense loss.

The reference differentiates, with plain ``jax.grad`` and one sequence at a time, the
dense per-sequence loss of the model whose adapted weights are W + (alpha/r) A@B
(``dtarl.lora.merge``) with respect to A and B; every engine (dense, dfs,
prefix_reuse, auto, and ``ShardedEngine`` over dp x tp) wrapped in ``LoraEngine``
must match it at fp32 1e-5 per tensor, on a GRPO batch and on a tree branching at
several depths (prefix K/V cotangents flow through the frozen base).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dtarl.engines import (
    AutoEngine,
    Capacity,
    DenseEngine,
    DFSEngine,
    PrefixReuseEngine,
    RolloutBatch,
)
from dtarl.lora import Adapter, LoraConfig, LoraEngine, init_adapters, merge
from dtarl.losses import ClippedSurrogateLoss, SequenceData, TokenData
from dtarl.model import ModelConfig, init_model
from dtarl.parallel.mesh import make_mesh
from dtarl.parallel.sharded import ShardedEngine
from dtarl.testing import grpo_groups

RTOL = 1e-5  # fp32, per adapter tensor: ||g - g_ref|| / ||g_ref||
LOSS = ClippedSurrogateLoss.grpo(kl_coef=0.1)
CFG = LoraConfig(rank=4, alpha=8.0)


@functools.cache
def _setup():
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
    model = init_model(cfg, seed=1)
    _, base = nnx.split(model, nnx.Param)
    ad = init_adapters(base, CFG, jax.random.key(0))
    # B = 0 at init would make dL/dA = 0: random B so both gradients are exercised.
    ad = {
        k: Adapter(a=v.a, b=0.1 * jax.random.normal(jax.random.key(i), v.b.shape))
        for i, (k, v) in enumerate(sorted(ad.items()))
    }
    return model, base, ad


def _with_logprobs(tokens, advantages, group_ids=None, seed=0):
    rs = np.random.RandomState(seed)
    masks = []
    for t in tokens:
        m = (rs.rand(len(t)) < 0.85).astype(np.float32)
        m[0] = 0
        masks.append(m)
    return RolloutBatch.create(
        tokens=tokens,
        loss_mask=masks,
        advantages=advantages,
        old_logprobs=[-(rs.rand(len(t)) * 3 + 3) for t in tokens],
        ref_logprobs=[-(rs.rand(len(t)) * 3 + 3) for t in tokens],
        group_ids=group_ids,
    )


def _grpo_batch():
    b = grpo_groups(num_groups=2, group_size=3, prompt_len=9, response_len=(2, 11), seed=3)
    return _with_logprobs(b.tokens, b.advantages, b.group_ids)


def _deep_batch():
    """Branching at depths 4, 9 and 15; a duplicate and a prefix of another sequence."""
    rs = np.random.RandomState(7)
    stem = list(rs.randint(3, 256, 4))
    mids = [stem + list(rs.randint(3, 256, 5)) for _ in range(2)]
    seqs = []
    for mid in mids:
        deeper = mid + list(rs.randint(3, 256, 6))
        seqs += [deeper + list(rs.randint(3, 256, n)) for n in (3, 7)]
        seqs.append(mid + list(rs.randint(3, 256, 4)))
    seqs += [list(seqs[0]), seqs[1][:12]]
    return _with_logprobs(seqs, rs.randn(len(seqs)), seed=1)


BATCHES = {"grpo": _grpo_batch, "deep": _deep_batch}
REF_LEN = 32


@functools.cache
def _reference_fn():
    model, base, _ = _setup()
    graphdef, _ = nnx.split(model, nnx.Param)

    def one(adapters, toks, mask, old, ref, adv, w, n):
        m = nnx.merge(graphdef, merge(base, adapters, CFG))
        logits, _ = m(toks[None], jnp.arange(REF_LEN)[None])
        lp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
        lp = jnp.take_along_axis(lp, toks[1:, None], axis=-1)[:, 0]
        lp = jnp.concatenate([jnp.zeros(1), lp])
        valid = jnp.arange(REF_LEN) < n
        lp = jnp.where(valid, lp, 0.0)
        nan = jnp.full(REF_LEN, jnp.nan)
        tok = TokenData(mask, jnp.where(valid, old, 0.0), jnp.where(valid, ref, 0.0), nan)
        return LOSS(lp, tok, SequenceData(adv, w))

    return jax.jit(jax.value_and_grad(one))


@functools.cache
def reference(name):
    """sum_i w_i loss_i and its jax.grad with respect to the adapters."""
    _, _, ad = _setup()
    batch = BATCHES[name]()
    w = batch.sequence_weights(LOSS.norm, LOSS.norm_constant)
    total, grads = 0.0, None
    for i, toks in enumerate(batch.tokens):
        n = len(toks)
        pad = REF_LEN - n

        def f32(x, pad=pad):
            return np.concatenate([x, np.zeros(pad)]).astype(np.float32)

        v, g = _reference_fn()(
            ad,
            np.concatenate([toks, np.zeros(pad, np.int32)]),
            f32(batch.loss_mask[i]),
            f32(batch.old_logprobs[i]),
            f32(batch.ref_logprobs[i]),
            batch.advantages[i],
            w[i],
            n,
        )
        total += float(v)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return total, grads


def worst_rel(got, want) -> float:
    errs = []
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        errs.append(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
    return max(errs)


@functools.cache
def _engine(kind):
    model, base, _ = _setup()
    cap = Capacity(sequences=16, length=REF_LEN, group_size=8, groups=8)
    if kind == "dense":
        return DenseEngine(model, microbatch=4)
    if kind == "dfs":
        return DFSEngine(model, chunk_len=8).reserve(cap)
    if kind == "prefix_reuse":
        return PrefixReuseEngine(model)
    if kind == "auto":
        return AutoEngine(model)
    if kind == "sharded":
        return ShardedEngine(DFSEngine(model, chunk_len=8), make_mesh(4, 2))
    raise AssertionError(kind)


ERRORS: dict[str, float] = {}


# Each engine on the batch that exercises it (a ~10 s CPU compile each): the tree
# engines and the sharded one on the deep tree, prefix_reuse and auto on GRPO groups.
CASES = [
    ("dense", "deep"),
    ("dfs", "deep"),
    ("sharded", "deep"),
    ("prefix_reuse", "grpo"),
    ("auto", "grpo"),
    ("dense", "grpo"),
]


@pytest.mark.parametrize("kind,batch_name", CASES)
def test_adapter_grads_equal_dense_jax_grad(kind, batch_name):
    _, base, ad = _setup()
    inner = _engine(kind)
    b = base
    if kind == "sharded":
        b = inner.shard_params(base)
        ad = jax.device_put(
            ad, jax.sharding.NamedSharding(inner.mesh, jax.sharding.PartitionSpec())
        )
    engine = LoraEngine(inner, b, CFG)
    value, grads, aux = engine.value_and_grad(ad, BATCHES[batch_name](), LOSS)
    want_value, want_grads = reference(batch_name)
    np.testing.assert_allclose(float(value), want_value, rtol=RTOL, atol=1e-7)
    err = worst_rel(grads, want_grads)
    ERRORS[f"{kind}/{batch_name}"] = err
    print(f"lora {kind} {batch_name}: worst per-tensor relative adapter-grad error {err:.2e}")
    assert err <= RTOL, f"{kind}: {err:.2e}"
    # Only the adapters come back: an optimiser over them holds nothing else.
    assert set(grads) == set(ad)


def test_optimizer_state_holds_only_adapters():
    _, base, ad = _setup()
    engine = LoraEngine(DenseEngine(_setup()[0], microbatch=4), base, CFG)
    tx = optax.adamw(1e-2)
    state = tx.init(ad)
    n_state = sum(np.size(x) for x in jax.tree.leaves(state))
    n_ad = sum(np.size(x) for x in jax.tree.leaves(ad))
    assert n_state == 2 * n_ad + 1  # mu, nu and the step count
    _, g, _ = engine.value_and_grad(ad, _grpo_batch(), LOSS)
    upd, state = tx.update(g, state, ad)
    new = optax.apply_updates(ad, upd)
    # The base is untouched; the merged policy moved.
    assert all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(engine.base), jax.tree.leaves(base), strict=True)
    )
    assert worst_rel(new, ad) > 0


def test_base_is_the_reference_with_adapters_off():
    """Adapters at init (B = 0) merge to the base itself, and the wrapped engine run on
    ``engine.base`` is the base policy: no second copy of the weights is made."""
    model, base, _ = _setup()
    fresh = init_adapters(base, CFG, jax.random.key(3))
    m = merge(base, fresh, CFG)
    for x, y in zip(jax.tree.leaves(m), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    engine = LoraEngine(DenseEngine(model, microbatch=4), base, CFG)
    assert engine.base is base
    _, _, aux_base = engine.engine.value_and_grad(engine.base, _grpo_batch(), LOSS)
    _, _, aux_off = engine.value_and_grad(fresh, _grpo_batch(), LOSS)
    for a, b in zip(aux_base.logprobs, aux_off.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_loss_fn_of_the_adapters_equals_the_reference():
    """``LoraEngine.loss_fn``: jax.grad through the custom-VJP tree loss and the merge."""
    _, _, ad = _setup()
    f = LoraEngine(_engine("dense"), _setup()[1], CFG).loss_fn(LOSS)
    prepared = f.prepare(_grpo_batch())
    value, grads = jax.value_and_grad(lambda a: f(a, prepared))(ad)
    want_value, want_grads = reference("grpo")
    np.testing.assert_allclose(float(value), want_value, rtol=RTOL, atol=1e-7)
    assert worst_rel(grads, want_grads) <= RTOL
