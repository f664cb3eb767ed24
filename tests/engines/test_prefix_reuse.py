"""prefix_reuse engine: the equivalence contract, microbatch and activation-mode
invariance, an optimizer run against dense, no retrace, and phase-B memory.

Reuses the independent jax.grad reference and the random tree strategy of
test_equivalence.py (the DFS engine's matrix).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_math
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_equivalence import (
    LOSSES,
    RTOL,
    _model,
    reference,
    rel_errors,
    tree_batches,
    with_logprob_data,
)

from dtarl.bench.memory import memory_report
from dtarl.engines import (
    Capacity,
    DeepTrees,
    EngineKind,
    PrefixActivations,
    PrefixReuseEngine,
    RolloutBatch,
    make_engine,
)
from dtarl.engines.base import Buckets
from dtarl.engines.prefix_reuse import (
    deep_sequences,
    group_plan,
    offload_supported,
)
from dtarl.losses import MaskedNLLLoss
from dtarl.model import ModelFamily
from dtarl.testing import grpo_groups
from dtarl.tree import build_tree
from dtarl.tree.plan import fine_bucket

RESERVE = Capacity(
    sequences=32,
    length=64,
    tokens=1024,
    group_size=16,
    groups=8,  # random trees split into up to 8 groups below their shared first tokens
    prompt_len=40,
    response_len=40,
)


@functools.cache
def pr_engine(
    family=ModelFamily.QWEN3,
    microbatch=4,
    mode=PrefixActivations.OFFLOAD,
    deep=DeepTrees.DFS,
    split=False,
):
    """Pre-sized: one compilation per loss for the whole module. ``split``: the
    engine for batches with deep groups, in its two-program form from the start
    (the form only ever switches once, so a shared engine would otherwise run
    shallow batches in either form depending on which test ran first)."""
    model, _ = _model(family)
    engine = PrefixReuseEngine(
        model,
        microbatch=microbatch,
        prefix_activations=mode,
        deep_trees=deep,
        offload_on_cpu=True,  # the offload program itself, also on a CPU
    ).reserve(RESERVE)
    if split:
        engine.merge_buckets(Buckets.of(split=1))
    return engine


def check_pr(batch, loss, family=ModelFamily.QWEN3, split=None, **kw):
    """``split``: run the engine in its two-program form (``None``: when the batch
    has deep groups, the form a fresh engine would take for it)."""
    model, params = _model(family)
    if split is None:
        split = kw.get("deep", DeepTrees.DFS) is DeepTrees.DFS and bool(
            deep_sequences(build_tree(batch.tokens)).any()
        )
    engine = pr_engine(family, split=split, **kw)
    want_loss, want_grads, want_logp = reference(model, params, batch, loss)
    reserved = engine.buckets
    got_loss, got_grads, aux = engine.value_and_grad(params, batch, loss)
    # The shared engine's buckets cover every batch of the module, so no test grows
    # them: each runs the same program whatever ran before it (order-independent).
    assert engine.buckets == reserved, f"batch outgrew the reserve: {engine.buckets}"
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=RTOL, atol=1e-7)
    for got, want in zip(aux.logprobs, want_logp, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    worst = max(rel_errors(got_grads, want_grads))
    assert worst <= RTOL, f"prefix_reuse: worst per-tensor relative grad error {worst:.2e}"
    reference_math.check(
        model.cfg, params, batch, loss, got_loss, got_grads, aux.logprobs, name="prefix_reuse"
    )
    return got_grads, aux


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=tree_batches(), loss_name=st.sampled_from(sorted(LOSSES)))
def test_prefix_reuse_matches_dense_grad_random_trees(batch, loss_name):
    """Every example runs the two-program form (rows + DFS; a batch without deep
    groups gives the DFS side its zero-weight stand-in), so the examples share one
    compiled program per loss whatever hypothesis draws. The one-program form runs
    the hand-made trees and the GRPO groups below."""
    loss = LOSSES[loss_name]
    if loss_name != "nll":
        batch = with_logprob_data(batch)
    check_pr(batch, loss, split=True)


@pytest.mark.parametrize(
    "family,loss_name",
    [(ModelFamily.QWEN3, name) for name in sorted(LOSSES)],
)
def test_prefix_reuse_grpo_groups(family, loss_name):
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=3)
    _, aux = check_pr(with_logprob_data(batch), LOSSES[loss_name], family, deep=DeepTrees.ROWS)
    assert aux.stats["num_groups"] == 2 and aux.stats["suffix_rows"] == 6
    # Prompt once (minus its last token, which starts every suffix row), responses once each.
    assert aux.stats["prefix_tokens"] == 2 * 10
    assert aux.stats["computed_tokens"] == batch.num_tokens - 6 * 11 + 2 * 10


@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([[7, 8, 9, 10, 11]], id="single-sequence"),
        pytest.param([[7, 8], [7, 9], [7, 10]], id="one-token-prompt-one-token-responses"),
        pytest.param([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]], id="all-duplicates"),
        pytest.param([[1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]], id="nested-prefixes"),
        pytest.param([[3, 4, 5], [9, 8, 7, 6]], id="no-shared-prefix"),
        pytest.param([list(range(3, 40)), list(range(3, 30)) + [99] * 15], id="long-suffix"),
        pytest.param(
            [[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3], [5, 6, 7, 1, 2, 4], [5, 6, 7, 1], [5, 6, 2]],
            id="deep-below-the-top-fork",
        ),
    ],
)
def test_prefix_reuse_hand_made_trees(seqs):
    rs = np.random.RandomState(0)
    batch = RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs)))
    check_pr(batch, MaskedNLLLoss())
    check_pr(with_logprob_data(batch), LOSSES["grpo_kl"])
    if deep_sequences(build_tree(batch.tokens)).any():  # the one-program form too
        check_pr(with_logprob_data(batch), LOSSES["grpo_kl"], deep=DeepTrees.ROWS)


def test_deep_groups_go_to_dfs():
    """Groups that fork below their prefix run in the DFS program (every node once),
    shallow groups in the prefix-reuse schedule; exact either way, and a later batch
    without deep groups reuses the two-program form (zero-weight stand-in)."""
    rs = np.random.RandomState(3)
    seqs = [list(rs.randint(3, 256, 9))]
    for _ in range(2):  # two turns, branching 2 then 2 below the prompt
        seqs = [q + list(rs.randint(3, 256, 5)) for q in seqs for _ in range(2)]
    shallow = grpo_groups(num_groups=2, group_size=3, prompt_len=7, response_len=(2, 6), seed=4)
    batch = RolloutBatch.create(
        tokens=seqs + list(shallow.tokens), advantages=rs.randn(len(seqs) + 6)
    )
    deep = deep_sequences(build_tree(batch.tokens))
    assert deep.tolist() == [True] * 4 + [False] * 6
    model, params = _model(ModelFamily.QWEN3)
    # Reserved for multi-turn trees: the two-program form from the start (a reserved
    # single-turn engine runs the rare deep group as rows, without a new program).
    engine = PrefixReuseEngine(model, microbatch=2).reserve(dataclasses.replace(RESERVE, turns=2))
    for b, n_deep in ((batch, 4), (shallow, 0)):
        want_loss, want_grads, want_logp = reference(model, params, b, LOSSES["dapo"])
        got_loss, got_grads, aux = engine.value_and_grad(params, b, LOSSES["dapo"])
        assert aux.stats["deep_sequences"] == n_deep
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=RTOL, atol=1e-7)
        assert max(rel_errors(got_grads, want_grads)) <= RTOL
        for got, want in zip(aux.logprobs, want_logp, strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    # The rows form recomputes the shared turns once per leaf; dfs computes them once.
    rows = PrefixReuseEngine(model, microbatch=2, deep_trees=DeepTrees.ROWS)
    split, by_rows = engine.prepare(batch, LOSSES["dapo"]), rows.prepare(batch, LOSSES["dapo"])
    assert split.stats["computed_tokens"] < by_rows.stats["computed_tokens"]
    # The split program's work: its rows part plus the DFS program as a sub-program.
    work = engine.features(split)
    assert work.sub and work.sub[0] == engine.dfs.features(split.host.dfs)
    assert work.flops == engine.features(split.host.rows).flops + work.sub[0].flops


def test_group_plan_rows_and_slots():
    seqs = [
        [5, 6, 7, 8, 9],
        [5, 6, 7, 1, 2, 3],
        [5, 6, 7, 1, 2, 4],
        [5, 6, 7, 1],
        [5, 6, 7],
        [4, 4],
    ]
    tree = build_tree([np.asarray(s) for s in seqs])
    plan = group_plan(tree)
    assert len(plan.prefix_nodes) == 2  # [4, 4] and [5, 6, 7]
    g = int(plan.seq_group[0])
    assert plan.prefix_end[g] == 3 and plan.prefix_slots[g] == (4,)
    assert len(plan.row_leaf[g]) == 3  # one row per leaf below the fork
    # [5, 6, 7, 1] ends at an internal node: it rides on the first leaf below it.
    assert plan.seq_row[3] == plan.seq_row[1]
    assert plan.seq_row[4] == -1 and plan.seq_row[5] == -1


def test_fine_bucket():
    assert [fine_bucket(n) for n in (0, 1, 3, 8, 9, 11, 17, 255, 257, 300)] == [
        1, 1, 4, 8, 10, 12, 20, 256, 320, 320,
    ]  # fmt: skip
    assert fine_bucket(5, 40) == 40


def test_microbatch_sizes_and_prefix_modes_agree():
    """Suffix microbatch 1, G/2, G (with REMAT, KEEP, OFFLOAD prefix activations)
    all equal the reference and each other."""
    g = 4
    batch = grpo_groups(num_groups=2, group_size=g, prompt_len=13, response_len=(3, 11), seed=11)
    loss = LOSSES["nll"]
    grads = {}
    for mb, mode in ((1, PrefixActivations.REMAT), (g // 2, PrefixActivations.KEEP), (g, None)):
        kw = dict(microbatch=mb) if mode is None else dict(microbatch=mb, mode=mode)
        grads[mb], aux = check_pr(batch, loss, **kw)
        assert aux.stats["offloaded"] == (mode is None and offload_supported())
        assert aux.stats["microbatch"] == mb
        assert aux.stats["microbatches_per_group"] == -(-RESERVE.group_size // mb)
    # Not bitwise: fp32 sums over rows and microbatches run in different orders
    # (measured ~1e-6); the contract's fp32 tolerance.
    for mb in (1, g // 2):
        assert max(rel_errors(grads[mb], grads[g])) <= RTOL


def test_offload_is_keep_on_a_cpu():
    """On a CPU host memory is device memory: OFFLOAD runs as KEEP unless forced."""
    model, _ = _model(ModelFamily.QWEN3)
    on_cpu = jax.devices()[0].platform == "cpu"
    assert PrefixReuseEngine(model).offloads == (offload_supported() and not on_cpu)
    assert PrefixReuseEngine(model, offload_on_cpu=True).offloads == offload_supported()
    keep = PrefixReuseEngine(model, prefix_activations=PrefixActivations.KEEP, offload_on_cpu=True)
    assert not keep.offloads


def test_adamw_run_tracks_dense():
    """10 AdamW steps with prefix_reuse track a dense run (jax.grad of the dense
    per-sequence loss, the reference) within fp32 tolerance."""
    model, params = _model(ModelFamily.QWEN3)
    loss = LOSSES["nll"]
    opt = optax.adamw(1e-3, weight_decay=0.01)
    batches = [
        grpo_groups(num_groups=2, group_size=3, prompt_len=10, response_len=(2, 9), seed=step)
        for step in range(10)
    ]

    def grads_dense(p, batch):
        return reference(model, p, batch, loss)[1]

    def grads_pr(p, batch):
        return pr_engine().value_and_grad(p, batch, loss)[1]

    @jax.jit
    def apply(g, state, p):
        updates, state = opt.update(g, state, p)
        return optax.apply_updates(p, updates), state

    runs = {}
    for kind, grad_fn in (("dense", grads_dense), ("prefix_reuse", grads_pr)):
        p = jax.tree.map(jnp.array, params)
        state = opt.init(p)
        for batch in batches:
            p, state = apply(grad_fn(p, batch), state, p)
        runs[kind] = p
    assert max(rel_errors(runs["dense"], params)) > 1e-3  # the run really trains
    # A composite result (10 Adam steps amplify 1e-6 gradient differences where
    # gradients are small): the composite fp32 tolerance of STYLE.md, 1e-4.
    assert max(rel_errors(runs["prefix_reuse"], runs["dense"])) <= 1e-4


def test_no_retrace_within_bucket():
    _, params = _model(ModelFamily.QWEN3)
    engine = pr_engine(deep=DeepTrees.ROWS)
    loss = LOSSES["nll"]
    engine.value_and_grad(
        params,
        grpo_groups(num_groups=2, group_size=4, prompt_len=12, response_len=(4, 10), seed=0),
        loss,
    )
    before = engine.trace_count
    for seed in range(1, 4):
        batch = grpo_groups(
            num_groups=1 + seed % 2,
            group_size=2 + seed,
            prompt_len=9 + 5 * seed,
            response_len=(1, 20),
            seed=seed,
        )
        _, _, aux = engine.value_and_grad(params, batch, loss)
    assert engine.trace_count == before
    assert aux.stats["trace_count"] == before


def test_make_engine_kinds():
    model, _ = _model(ModelFamily.QWEN3)
    assert isinstance(make_engine("prefix_reuse", model, microbatch=2), PrefixReuseEngine)
    assert make_engine(EngineKind.AUTO, model).name == "auto"
    with pytest.raises(ValueError, match="prefix_reuse"):
        make_engine("nope", model)
    with pytest.raises(ValueError, match="microbatch=0"):
        PrefixReuseEngine(model, microbatch=0)


def test_suffix_phase_memory_below_dense():
    """Phase B holds the prefix K/V and one microbatch of suffix activations; dense
    holds activations of whole sequences. Long prompt, short responses."""
    model, params = _model(ModelFamily.QWEN3)
    batch = grpo_groups(num_groups=1, group_size=4, prompt_len=120, response_len=8, seed=0)
    rep = memory_report(model, params, batch, MaskedNLLLoss(), microbatch=4, whole=False)
    assert rep["suffix_phase"]["peak"] < rep["dense"]["peak"]
    assert rep["suffix_phase"]["temp"] < 0.5 * rep["dense"]["temp"], rep


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (scan, custom_vjp...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_suffix_rows_share_the_prefix_kv():
    """The B suffix rows of a microbatch read one copy of the prefix K/V (the
    decoder's shared prefix): no [L, B, P, K, D] copy is made in the program."""
    model, params = _model(ModelFamily.QWEN3)
    engine = PrefixReuseEngine(model, microbatch=4, deep_trees=DeepTrees.ROWS)
    loss = LOSSES["nll"]
    batch = grpo_groups(num_groups=1, group_size=4, prompt_len=24, response_len=6, seed=0)
    prep = engine.prepare(batch, loss)
    st, cfg = prep.static, model.cfg
    assert st.microbatch == 4
    fn = engine.device_fn(loss, st)
    jaxpr = jax.make_jaxpr(fn)(params, *prep.args).jaxpr
    copy = (cfg.num_layers, st.microbatch, st.prefix, cfg.num_kv_heads, cfg.head_dim)
    shapes = {tuple(v.aval.shape) for e in _eqns(jaxpr) for v in e.outvars}
    shared = (cfg.num_layers, 1, st.prefix, cfg.num_kv_heads, cfg.head_dim)
    assert shared in shapes  # the check looks at the right shapes
    assert copy not in shapes


def test_prefix_logits_chunk_is_a_microbatch_of_rows():
    """With ``logits_chunk`` the prefix's one row builds its logits B x logits_chunk
    positions at a time (the [tokens, V] block of a suffix microbatch's chunk), and
    the gradients stay those of dense ``jax.grad``."""
    from flax import nnx
    from test_equivalence import check_engine

    from dtarl.model import ModelConfig, init_model

    cfg = ModelConfig.tiny(ModelFamily.QWEN3, logits_chunk=5)
    model = init_model(cfg, seed=1)
    _, params = nnx.split(model, nnx.Param)
    batch = grpo_groups(num_groups=2, group_size=2, prompt_len=31, response_len=(1, 9), seed=3)
    batch = with_logprob_data(batch)
    loss = LOSSES["grpo_kl"]
    engine = PrefixReuseEngine(model, microbatch=2, deep_trees=DeepTrees.ROWS)
    prep = engine.prepare(batch, loss)
    assert prep.static.microbatch == 2 and prep.static.prefix >= 30
    jaxpr = jax.make_jaxpr(engine.device_fn(loss, prep.static))(params, *prep.args).jaxpr
    shapes = {tuple(v.aval.shape) for e in _eqns(jaxpr) for v in e.outvars}
    assert (1, 10, cfg.vocab_size) in shapes  # prefix logits: 2 x 5 positions of 1 row
    assert (1, 5, cfg.vocab_size) not in shapes
    check_engine(engine, params, batch, loss, model=model)
