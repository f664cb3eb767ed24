"""The contract: every engine equals jax.grad of the dense per-sequence loss.

Two references, each differentiated with jax.grad one sequence at a time: the
library's own dense forward (``Decoder.__call__``), loss objects and
``RolloutBatch.sequence_weights`` (``reference``), and one written from the
equations with plain jnp that shares none of them (``reference_math``). Every
engine must match both.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_math
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtarl.engines import (
    AutoEngine,
    Capacity,
    DenseEngine,
    DFSEngine,
    PrefixReuseEngine,
    RolloutBatch,
    make_engine,
)
from dtarl.engines.cost import token_flops
from dtarl.losses import ClippedSurrogateLoss, MaskedNLLLoss, SequenceData, TokenData
from dtarl.model import ModelConfig, ModelFamily, init_model
from dtarl.testing import grpo_groups
from dtarl.tree import DFSOrder, build_tree, compile_plan

RTOL = 1e-5  # fp32, max over parameter tensors of ||a - b|| / ||b||

LOSSES = {
    "nll": MaskedNLLLoss(),
    "grpo_kl": ClippedSurrogateLoss.grpo(kl_coef=0.1),
    "dapo": ClippedSurrogateLoss.dapo(),
    "dr_grpo": ClippedSurrogateLoss.dr_grpo(max_len=16),
}


@functools.cache
def _model(family: ModelFamily, dtype: str = "float32"):
    model = init_model(ModelConfig.tiny(family, param_dtype=dtype, compute_dtype=dtype), seed=1)
    _, params = nnx.split(model, nnx.Param)
    return model, params


@functools.cache
def _engine(
    kind: str,
    family: ModelFamily,
    chunk: int = 8,
    order=DFSOrder.GREEDY,
    levels=1,
    rows=4,
    wide=4,
):
    model, _ = _model(family)
    # Pre-sized buckets: one compilation per loss for the whole module. One prefix
    # level keeps compile time down; test_dfs_prefix_buckets covers several.
    if kind == "dfs":
        engine = DFSEngine(
            model,
            chunk_len=chunk,
            order=order,
            prefix_levels=levels,
            leaf_rows=rows,
            wide_chunks=wide,
        )
        return engine.reserve(Capacity(sequences=64, length=64, group_size=8, groups=64))
    return DenseEngine(model, microbatch=4).reserve(Capacity(sequences=64, length=64))


REF_LEN = 64  # every test sequence is shorter


@functools.cache
@functools.cache  # one compiled reference per (model, loss, temperature), not per call
def _reference_fn(model, loss, temperature=1.0):
    """jax.grad of one sequence's loss; the sequence is padded at the end to REF_LEN,
    which cannot change its logprobs (causal attention) and is masked out of the loss.
    Logprobs of logits / ``temperature`` (the sampler's distribution at T)."""
    graphdef, _ = nnx.split(model, nnx.Param)

    def one(params, toks, mask, old, ref, tadv, adv, w, n):
        m = nnx.merge(graphdef, params)
        logits, _ = m(toks[None], jnp.arange(REF_LEN)[None])
        lp = jax.nn.log_softmax(logits[0, :-1] / temperature, axis=-1)
        lp = jnp.take_along_axis(lp, toks[1:, None], axis=-1)[:, 0]
        lp = jnp.concatenate([jnp.zeros(1), lp])
        valid = jnp.arange(REF_LEN) < n
        lp = jnp.where(valid, lp, 0.0)
        tok = TokenData(mask, jnp.where(valid, old, 0.0), jnp.where(valid, ref, 0.0), tadv)
        return loss(lp, tok, SequenceData(adv, w)), lp

    return jax.jit(jax.value_and_grad(one, has_aux=True))


def reference(model, params, batch: RolloutBatch, loss, temperature=1.0):
    """sum_i w_i loss_i and its jax.grad, one sequence at a time (logprobs at T)."""
    fn = _reference_fn(model, loss, temperature)
    w = batch.sequence_weights(loss.norm, loss.norm_constant)
    total, grads, logps = 0.0, None, []
    for i, toks in enumerate(batch.tokens):
        n = toks.shape[0]
        assert n <= REF_LEN

        def pad(x, n=n):
            return np.concatenate([x, np.zeros(REF_LEN - n, np.float32)]).astype(np.float32)

        nan = np.full(n, np.nan, np.float32)
        old = nan if batch.old_logprobs is None else batch.old_logprobs[i]
        ref = nan if batch.ref_logprobs is None else batch.ref_logprobs[i]
        tadv = nan if batch.token_advantages is None else batch.token_advantages[i]
        (val, lp), g = fn(
            params,
            np.concatenate([toks, np.zeros(REF_LEN - n, np.int32)]),
            pad(batch.loss_mask[i]),
            pad(old),
            pad(ref),
            np.concatenate([tadv, np.full(REF_LEN - n, np.nan, np.float32)]),
            batch.advantages[i],
            w[i],
            n,
        )
        total = total + val
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        logps.append(np.asarray(lp)[:n])
    return total, grads, logps


def rel_errors(got, want):
    """Per-tensor relative error; a tensor with an all-zero reference is compared absolutely."""
    errs = jax.tree.map(
        lambda a, b: float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)),
        got,
        want,
    )
    return jax.tree.leaves(errs)


def check(
    engine_kind, family, batch, loss, chunk=8, order=DFSOrder.GREEDY, levels=1, rows=4, wide=4
):
    model, params = _model(family)
    engine = _engine(engine_kind, family, chunk, order, levels, rows, wide)
    reserved = engine.buckets
    aux = check_engine(engine, params, batch, loss, model=model)
    # The shared engine's buckets cover every batch of the module, so no test grows
    # them: each runs the same program whatever ran before it (order-independent).
    assert engine.buckets == reserved, f"batch outgrew the reserve: {engine.buckets}"
    return aux


def check_engine(engine, params, batch, loss, *, model, temperature=1.0):
    """``engine`` (built at ``temperature``) against both jax.grad references at it."""
    want_loss, want_grads, want_logp = reference(model, params, batch, loss, temperature)
    got_loss, got_grads, aux = engine.value_and_grad(params, batch, loss)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=RTOL, atol=1e-7)
    for got, want in zip(aux.logprobs, want_logp, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    worst = max(rel_errors(got_grads, want_grads))
    assert worst <= RTOL, f"{engine.name}: worst per-tensor relative grad error {worst:.2e}"
    reference_math.check(
        model.cfg,
        params,
        batch,
        loss,
        got_loss,
        got_grads,
        aux.logprobs,
        name=engine.name,
        temperature=temperature,
    )
    return aux


def with_logprob_data(batch: RolloutBatch, seed=0) -> RolloutBatch:
    rs = np.random.RandomState(seed)
    return RolloutBatch.create(
        tokens=batch.tokens,
        loss_mask=batch.loss_mask,
        advantages=batch.advantages,
        old_logprobs=[-(rs.rand(len(t)) * 3 + 3) for t in batch.tokens],
        ref_logprobs=[-(rs.rand(len(t)) * 3 + 3) for t in batch.tokens],
        group_ids=batch.group_ids,
    )


@st.composite
def tree_batches(draw):
    """Sequences with branching at several depths, prefixes of others, duplicates."""
    rng = np.random.RandomState(draw(st.integers(0, 2**31 - 1)))
    n_roots = draw(st.integers(1, 2))
    seqs = []
    for _ in range(n_roots):
        stem = list(rng.randint(3, 256, draw(st.integers(1, 12))))
        for _ in range(draw(st.integers(1, 4))):
            mid = stem + list(rng.randint(3, 256, draw(st.integers(0, 10))))
            for _ in range(draw(st.integers(1, 3))):
                seqs.append(mid + list(rng.randint(3, 256, draw(st.integers(0, 14)))))
    if draw(st.booleans()):
        seqs.append(list(seqs[0]))  # exact duplicate
    if draw(st.booleans()) and len(seqs[0]) > 3:
        seqs.append(seqs[0][: len(seqs[0]) // 2 + 1])  # a prefix of another sequence
    seqs = [s for s in seqs if len(s) >= 2] or [[5, 6]]
    masks = []
    for s in seqs:
        m = (rng.rand(len(s)) < 0.8).astype(np.float32)
        m[0] = 0
        masks.append(m)
    return RolloutBatch.create(tokens=seqs, loss_mask=masks, advantages=rng.randn(len(seqs)))


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=tree_batches(), loss_name=st.sampled_from(sorted(LOSSES)))
def test_dfs_matches_dense_grad_random_trees(batch, loss_name):
    loss = LOSSES[loss_name]
    if loss_name != "nll":
        batch = with_logprob_data(batch)
    check("dfs", ModelFamily.QWEN3, batch, loss)


@pytest.mark.parametrize(
    "family,loss_name",
    [(ModelFamily.QWEN3, name) for name in sorted(LOSSES)]
    + [(ModelFamily.LLAMA3, "dapo"), (ModelFamily.QWEN2, "grpo_kl")],
)
def test_dfs_and_dense_grpo_groups(family, loss_name):
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=3)
    batch = with_logprob_data(batch)
    check("dfs", family, batch, LOSSES[loss_name])
    check("dense", family, batch, LOSSES[loss_name])


@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([[7, 8, 9, 10, 11]], id="single-sequence"),
        pytest.param([[7, 8], [7, 9], [7, 10]], id="one-token-prompt-one-token-responses"),
        pytest.param([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]], id="all-duplicates"),
        pytest.param([[1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]], id="nested-prefixes"),
        pytest.param([[3, 4, 5], [9, 8, 7, 6]], id="no-shared-prefix"),
        pytest.param([list(range(3, 40)), list(range(3, 30)) + [99] * 20], id="longer-than-chunk"),
    ],
)
@pytest.mark.parametrize("order", list(DFSOrder))
def test_dfs_hand_made_trees(seqs, order):
    rs = np.random.RandomState(0)
    batch = RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs)))
    check("dfs", ModelFamily.QWEN3, batch, MaskedNLLLoss(), chunk=8, order=order)
    check("dfs", ModelFamily.QWEN3, batch, ClippedSurrogateLoss.grpo(), chunk=8, order=order)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_dfs_chunk_sizes(chunk):
    batch = grpo_groups(num_groups=1, group_size=4, prompt_len=9, response_len=(2, 12), seed=5)
    aux = check("dfs", ModelFamily.QWEN3, batch, MaskedNLLLoss(), chunk=chunk)
    # The prompt is run once (plus one fork token per child), not once per sequence.
    assert aux.stats["computed_tokens"] < aux.stats["num_tokens"]


@pytest.mark.parametrize("bucket_bodies", [False, True])
def test_dfs_prefix_buckets_and_packing(bucket_bodies):
    """Several static prefix lengths per program, packed sibling leaves, deep tree;
    one switch body per op (the prefix length as data) or per (op, prefix bucket)."""
    rs = np.random.RandomState(4)
    stem = list(rs.randint(3, 256, 30))
    seqs = [stem + list(rs.randint(3, 256, rs.randint(1, 6))) for _ in range(6)]
    seqs += [stem[:12] + list(rs.randint(3, 256, 20)) for _ in range(2)]
    seqs += [list(rs.randint(3, 256, 5)) for _ in range(3)]  # unrelated short roots
    batch = with_logprob_data(RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs))))
    if not bucket_bodies:  # the shared engines have the default, per-bucket bodies
        model, params = _model(ModelFamily.QWEN3)
        engine = DFSEngine(model, chunk_len=16, prefix_levels=3, bucket_bodies=False)
        aux = check_engine(engine, params, batch, LOSSES["dapo"], model=model)
    else:
        aux = check("dfs", ModelFamily.QWEN3, batch, LOSSES["dapo"], chunk=16, levels=3)
    assert aux.stats["packed_steps"] >= 2


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_dfs_leaf_rows(rows):
    """Sibling leaves popped as rows over one shared stack prefix (POP_ROWS).

    Responses of 5..7 tokens (+1 fork entry) in chunks of 8 cannot share a chunk,
    so a group of 7 needs about 7 chunks, which rows=2 pops in about 4 steps and
    rows=4 in about 2 (a partial step pads rows). Four 3-token leaves pack two
    per chunk, and the two chunks become one 2-row step.
    """
    rs = np.random.RandomState(6)
    stem = list(rs.randint(3, 256, 13))
    seqs = [stem + list(rs.randint(3, 256, rs.randint(5, 8))) for _ in range(7)]
    seqs += [stem[:5] + list(rs.randint(3, 256, 3)) for _ in range(4)]  # packable pairs
    batch = with_logprob_data(RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs))))
    aux = check("dfs", ModelFamily.QWEN3, batch, LOSSES["grpo_kl"], rows=rows)
    one_row = compile_plan(build_tree(batch.tokens), chunk_len=8, rows=1)
    assert aux.stats["packed_steps"] >= 1
    if rows == 1:
        assert aux.stats["row_steps"] == 0
        assert aux.stats["num_steps"] == one_row.num_steps
    else:
        assert aux.stats["row_steps"] >= 2
        two_rows = compile_plan(build_tree(batch.tokens), chunk_len=8, rows=2)
        assert aux.stats["num_steps"] <= two_rows.num_steps <= one_row.num_steps - 3
        assert aux.stats["computed_tokens"] == one_row.computed_tokens


@pytest.mark.parametrize("wide", [0, 2, 4])
def test_dfs_wide_pops(wide):
    """Leaves longer than a chunk popped as one row of up to ``wide`` chunks (POP_WIDE).

    Unrelated sequences of up to W*C + 1 tokens are then never pushed: each is
    computed once forward and once backward, like dense training. A leaf longer
    than W*C pushes only what does not fit its wide tail. wide=0 is the chunked plan.
    """
    rs = np.random.RandomState(8)
    # Distinct first tokens: nothing shared. Segments 32, 28, 16, 11.
    alone = [
        [first] + list(rs.randint(3, 256, n - 1))
        for first, n in zip((3, 4, 5, 6), (33, 29, 17, 12), strict=True)
    ]
    stem = list(rs.randint(3, 256, 6))
    group = [stem + list(rs.randint(3, 256, n)) for n in (20, 13, 9, 30)]
    long_leaf = [stem[:3] + list(rs.randint(3, 256, 47))]  # segment 47 below a fork
    seqs = alone + group + long_leaf
    batch = with_logprob_data(RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs))))
    aux = check("dfs", ModelFamily.QWEN3, batch, LOSSES["grpo_kl"], wide=wide)
    tree = build_tree(batch.tokens)
    chunked = compile_plan(tree, chunk_len=8, rows=4)
    assert aux.stats["computed_tokens"] == chunked.computed_tokens
    if wide == 0:
        assert aux.stats["wide_steps"] == 0
        assert aux.stats["pushed_tokens"] == chunked.pushed_tokens
        return
    assert aux.stats["wide_steps"] >= 1
    assert aux.stats["pushed_tokens"] < chunked.pushed_tokens
    # Unit token costs (no token_flops), W*C = 32: rows [32], [28], [16 + 11], each
    # fewer FLOPs wide (3 x 32) than chunked (8 per push + 24 per pop: 120, 120,
    # 56 + 56), all three in one 4-row step.
    unrelated = compile_plan(build_tree(alone), chunk_len=8, rows=4, wide=4)
    assert unrelated.pushed_tokens == 0 and unrelated.wide_steps == 1
    assert unrelated.num_steps == 1
    # The engine's FLOP count of that step (``features``): 4 rows of 32 entries,
    # each attending its prefix bucket and its whole 32-entry row (the program
    # computes the masked part too); pop = recompute + backward.
    engine = DFSEngine(_model(ModelFamily.QWEN3)[0], chunk_len=8, leaf_rows=4, wide_chunks=4)
    prepared = engine.prepare(RolloutBatch.create(tokens=alone), LOSSES["nll"])
    assert prepared.stats["num_steps"] == 1
    work = engine.features(prepared)
    p0 = prepared.static.prefix_sizes[int(prepared.args[0].pbucket[0])]
    f0, fa = token_flops(engine.cfg)
    assert work.lin_flops == pytest.approx(3 * 4 * 32 * f0, rel=1e-12)
    assert work.attn_flops == pytest.approx(3 * 4 * 32 * (p0 + 32) * fa, rel=1e-12)
    assert work.steps == prepared.args[0].op.shape[0]  # padded scan steps count
    # One 50-token sequence (49 entries): 3 chunks pushed, the last 25 entries pop
    # wide (96 against 120 chunked); chunked it pushes 6 chunks. With 4 rows the
    # tail's step would be 3/4 padding (384 > 120): no wide tail.
    one = compile_plan(build_tree(long_leaf), chunk_len=8, rows=1, wide=4)
    assert one.wide_steps == 1 and one.pushed_tokens == 24
    padded = compile_plan(build_tree(long_leaf), chunk_len=8, rows=4, wide=4)
    assert padded.wide_steps == 0 and padded.pushed_tokens == 48


def test_per_token_advantages_ppo():
    """PPO/GAE: per-token advantages replace the sequence advantage, in every engine."""
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=7, response_len=(2, 9), seed=11)
    rs = np.random.RandomState(2)
    base = with_logprob_data(batch)
    batch = RolloutBatch.create(
        tokens=base.tokens,
        loss_mask=base.loss_mask,
        advantages=np.zeros(base.num_sequences),
        old_logprobs=base.old_logprobs,
        ref_logprobs=base.ref_logprobs,
        token_advantages=[rs.randn(len(t)) for t in base.tokens],
    )
    loss = ClippedSurrogateLoss.ppo(kl_coef=0.05)
    check("dfs", ModelFamily.QWEN3, batch, loss)
    check("dense", ModelFamily.QWEN3, batch, loss)


T = 0.7  # a sampling temperature: every engine trains on logits / T


def _temperature_engine(kind: str, model):
    if kind == "dense":
        return DenseEngine(model, microbatch=4, temperature=T)
    if kind == "dfs":  # one prefix level, as _engine: the fewest branches to compile
        return DFSEngine(model, chunk_len=8, prefix_levels=1, temperature=T)
    if kind == "prefix_reuse":  # deep groups too: its inner DFS engine must get T
        return PrefixReuseEngine(model, microbatch=4, offload_on_cpu=True, temperature=T)
    return AutoEngine(model, candidates=("dfs",), autotune=False, temperature=T)


def test_auto_passes_the_temperature_to_its_candidates():
    """auto runs its candidates' own programs (each checked below at T): it must build
    them at its temperature."""
    model, _ = _model(ModelFamily.QWEN3)
    auto = AutoEngine(model, candidates=("dense", "dfs"), autotune=False, temperature=T)
    assert auto.temperature == T and all(e.temperature == T for e in auto.engines.values())


@pytest.mark.parametrize("kind", ["dense", "dfs", "prefix_reuse"])
def test_temperature_matches_dense_grad(kind):
    """At T = 0.7 every engine's loss, per-token logprobs and grads are those of
    log_softmax(logits / T) (fp32, 1e-5), the sampler's untruncated distribution."""
    model, params = _model(ModelFamily.QWEN3)
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=3)
    rs = np.random.RandomState(9)
    stem = list(batch.tokens[0][:11])
    deep = [stem + list(rs.randint(3, 256, 4)) + list(rs.randint(3, 256, k)) for k in (2, 5)]
    deep = [deep[0], deep[0][:15] + deep[1][15:]]  # two leaves below a node under the prompt
    batch = with_logprob_data(
        RolloutBatch.create(
            tokens=list(batch.tokens) + deep,
            advantages=np.concatenate([batch.advantages, [0.5, -0.5]]),
            group_ids=np.concatenate([batch.group_ids, [0, 0]]),
        )
    )
    loss = LOSSES["grpo_kl"]
    engine = _temperature_engine(kind, model)
    assert engine.temperature == T
    aux = check_engine(engine, params, batch, loss, model=model, temperature=T)
    if kind == "prefix_reuse":
        assert engine.dfs.temperature == T
    # The check can fail: at T = 1 the logprobs are far from these.
    _, _, at_one = reference(model, params, batch, loss)
    assert max(np.abs(a - b).max() for a, b in zip(aux.logprobs, at_one, strict=True)) > 1e-2


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "hot", True])
def test_bad_temperature_names_the_field(bad):
    model, _ = _model(ModelFamily.QWEN3)
    with pytest.raises(ValueError, match=r"temperature=.*finite number > 0"):
        DFSEngine(model, temperature=bad)
    with pytest.raises(ValueError, match=r"temperature="):
        make_engine("auto", model, temperature=bad)


@pytest.mark.parametrize("kind", ["dfs", "prefix_reuse"])
def test_logits_chunk_matches_dense_grad(kind):
    """``ModelConfig.logits_chunk``: logprobs built 5 positions at a time under
    jax.checkpoint, the last piece padded. The values and gradients are those of the
    whole [T, V] logits (both references compute them at once). The tree engines call
    it on chunks, fork entries and suffix rows; dense (its whole rows) is left out to
    keep the suite's compile time down."""
    cfg = ModelConfig.tiny(ModelFamily.QWEN3, logits_chunk=5)
    model = init_model(cfg, seed=1)
    _, params = nnx.split(model, nnx.Param)
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=3)
    batch = with_logprob_data(batch)
    loss = LOSSES["grpo_kl"]
    engine = {
        "dfs": lambda: DFSEngine(model, chunk_len=8, prefix_levels=1),
        "prefix_reuse": lambda: PrefixReuseEngine(model, microbatch=4, offload_on_cpu=True),
    }[kind]()
    assert engine.cfg.logits_chunk == 5
    check_engine(engine, params, batch, loss, model=model)


def test_dfs_per_bucket_bodies_with_rows_and_wide_pops():
    """Per-(op, bucket) bodies (``bucket_bodies=True``, no longer the default) on a
    tree with rowed sibling leaves and wide leaves (the
    default, per-op bodies are what the shared engines above run)."""
    rs = np.random.RandomState(8)
    stem = list(rs.randint(3, 256, 12))
    seqs = [stem + list(rs.randint(3, 256, rs.randint(5, 8))) for _ in range(3)]
    seqs += [stem[:5] + list(rs.randint(3, 256, 18)) for _ in range(2)]  # wide leaves
    batch = with_logprob_data(RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs))))
    model, params = _model(ModelFamily.QWEN3)
    engine = DFSEngine(
        model, chunk_len=8, prefix_levels=1, leaf_rows=2, wide_chunks=4, bucket_bodies=True
    )
    aux = check_engine(engine, params, batch, LOSSES["grpo_kl"], model=model)
    assert aux.stats["row_steps"] >= 1 and aux.stats["wide_steps"] >= 1
    assert len(engine.prepare(batch, LOSSES["grpo_kl"]).static.prefix_sizes) == 2


def test_attention_over_the_prefix_bucket_equals_the_whole_prefix():
    """``attend_xla(prefix_sizes=...)`` (the default DFS program's attention) reads only
    the smallest bucket that holds every row's prefix: the same output and cotangents
    as attending all P rows, masked, for prefix lengths at, inside and past a size."""
    from dtarl.model.decoder import attend_xla

    rs = np.random.RandomState(3)
    q = jnp.asarray(rs.randn(2, 3, 4, 8), jnp.float32)
    kp, vp = (jnp.asarray(rs.randn(1, 12, 2, 8), jnp.float32) for _ in range(2))
    kn, vn = (jnp.asarray(rs.randn(2, 3, 2, 8), jnp.float32) for _ in range(2))
    seg = jnp.asarray([[0, 0, 1], [2, 2, 2]])

    @functools.partial(jax.jit, static_argnums=1)
    def f(lens, sizes):
        def out(q, kp, vp, kn, vn):
            o = attend_xla(q, kp, vp, lens, kn, vn, seg, prefix_sizes=sizes)
            return jnp.sum(o * jnp.cos(o))

        return jax.value_and_grad(out, argnums=(0, 1, 2, 3, 4))(q, kp, vp, kn, vn)

    for lens in ([0, 0], [3, 4], [4, 4], [5, 2], [12, 9]):
        lens = jnp.asarray(lens, jnp.int32)
        (want, want_g), (got, got_g) = f(lens, None), f(lens, (0, 4, 8, 12))
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for a, b in zip(got_g, want_g, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
