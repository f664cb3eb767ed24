"""Structural invariants of the engines: no retrace, bounded memory, bad input."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.engines import BatchError, DenseEngine, DFSEngine, RolloutBatch
from dtarl.engines.config import Capacity
from dtarl.losses import ClippedSurrogateLoss, MaskedNLLLoss
from dtarl.model import ModelConfig, init_model
from dtarl.model.config import Remat
from dtarl.testing import grpo_groups


@pytest.fixture(scope="module")
def model_params():
    model = init_model(ModelConfig.tiny(), seed=0)
    return model, nnx.split(model, nnx.Param)[1]


def test_dfs_no_retrace_within_bucket(model_params):
    model, params = model_params
    engine = DFSEngine(model, chunk_len=8, prefix_levels=1)
    loss = MaskedNLLLoss()
    first = grpo_groups(num_groups=2, group_size=4, prompt_len=12, response_len=(4, 10), seed=0)
    engine.value_and_grad(params, first, loss)
    assert engine.trace_count == 1
    # Different lengths, counts and tokens; same or smaller buckets.
    for seed in range(1, 4):
        batch = grpo_groups(
            num_groups=2, group_size=3, prompt_len=9 + seed, response_len=(2, 8), seed=seed
        )
        engine.value_and_grad(params, batch, loss)
    assert engine.trace_count == 1
    # A larger batch needs a larger bucket: exactly one more compilation, then reuse.
    big = grpo_groups(num_groups=4, group_size=8, prompt_len=40, response_len=(10, 30), seed=9)
    engine.value_and_grad(params, big, loss)
    engine.value_and_grad(params, first, loss)
    assert engine.trace_count == 2


def _program_size(engine, params, batch, loss):
    """The DFS program's (prefix buckets, switch branches, dot products), lowered."""
    prepared = engine.prepare(batch, loss)
    lowered = engine.jit.lower(loss, prepared.static, params, prepared.args)
    hlo = lowered.as_text(dialect="hlo")
    (branches,) = re.findall(r"branch_computations=\{([^}]*)\}", hlo)
    dots = lowered.as_text().count("stablehlo.dot_general")
    return len(prepared.static.prefix_sizes), len(branches.split(",")), dots


def test_dfs_program_does_not_grow_with_prefix_buckets(model_params):
    """One switch body per op (noop, push, pop, row pop, wide pop): 2 or 4 prefix
    buckets lower to the same program; per-bucket bodies (``bucket_bodies``) grow."""
    model, params = model_params
    loss = MaskedNLLLoss()
    batch = grpo_groups(num_groups=1, group_size=4, prompt_len=28, response_len=(2, 12), seed=0)

    def size(levels, bucket_bodies):
        engine = DFSEngine(
            model, chunk_len=8, prefix_levels=levels, leaf_rows=2, bucket_bodies=bucket_bodies
        )
        return _program_size(engine, params, batch, loss)

    few, many = size(1, False), size(3, False)
    assert (few[0], many[0]) == (2, 4)
    assert few[1:] == many[1:] and few[1] == 5  # noop + 4 ops, whatever the buckets
    few_b, many_b = size(1, True), size(3, True)
    assert (few_b[1], many_b[1]) == (1 + 4 * 2, 1 + 4 * 4)
    assert many_b[2] > few_b[2] > few[2]  # model copies grow with per-bucket bodies


def test_dense_no_retrace_within_bucket(model_params):
    model, params = model_params
    engine = DenseEngine(model, microbatch=4)
    loss = MaskedNLLLoss()
    # Max length <= 32 and <= 128 tokens: one length/token bucket throughout.
    for seed, prompt_len in enumerate([20, 14, 11]):
        batch = grpo_groups(
            num_groups=2, group_size=2, prompt_len=prompt_len, response_len=(2, 6), seed=seed
        )
        engine.value_and_grad(params, batch, loss)
    assert engine.trace_count == 1


def test_dfs_memory_bounded_by_longest_path(model_params):
    """XLA's temp memory for 4x more sequences (same longest path) barely grows:
    live state is the path's K/V stack, not per-token activations."""
    model, params = model_params
    cfg = model.cfg
    loss = MaskedNLLLoss()

    def temp_bytes(groups):
        engine = DFSEngine(model, chunk_len=16, prefix_levels=1)
        batch = grpo_groups(
            num_groups=groups, group_size=8, prompt_len=48, response_len=48, seed=groups
        )
        mem = engine.compiled_memory(params, batch, loss)
        return mem.temp_size_in_bytes, batch.num_tokens

    small, n_small = temp_bytes(1)
    large, n_large = temp_bytes(8)
    # What dense-style activation storage would add per extra token: at least the
    # K/V of every layer (fp32), far more with MLP activations.
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    growth = large - small
    assert growth < 0.25 * (n_large - n_small) * kv_bytes_per_token, (small, large)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tokens=[]), "empty"),
        (dict(tokens=[[5]]), "length 1 < 2"),
        (dict(tokens=[[5, 6, 7]], loss_mask=[[0, 1]]), r"loss_mask\[0\]: length 2 != tokens"),
        (dict(tokens=[[5, 6, 7]], advantages=[np.nan]), r"advantages\[0\]"),
        (
            dict(tokens=[[5, -6, 7]]),
            r"^tokens\[0\]\[1\] = -6 is not a token id \(0 <= id < 2\*\*31\)",
        ),
        # Checked before the int32 cast: no wrap-around, no truncation.
        (dict(tokens=[[5, 6], [5, 2**32 + 7]]), r"^tokens\[1\]\[1\] = 4294967303 is not a token"),
        (dict(tokens=[[5, 2**31]]), r"^tokens\[0\]\[1\] = 2147483648 is not a token id"),
        (dict(tokens=[np.array([5, 2**40], np.uint64)]), r"^tokens\[0\]\[1\] = 1099511627776"),
        (dict(tokens=[[5, 6], [5.7, 6.0]]), r"^tokens\[1\]: token ids must have an integer dtype"),
        (dict(tokens=[np.array([1, 0], bool)]), r"^tokens\[0\]: .* integer dtype, got bool"),
        (dict(tokens=[[5, 6, 7]], vocab_size=7), r"^tokens\[0\]\[2\] = 7 >= vocab_size 7"),
        (dict(tokens=[[5, 6]], group_ids=[0.5]), r"^group_ids: must have an integer dtype"),
        (
            dict(tokens=[[5, 6, 7]], loss_mask=[[0, 1, 1]], prompt_lens=[2]),
            r"^prompt_lens: given together with loss_mask",
        ),
        (dict(tokens=[[5, 6, 7]], prompt_lens=[1.5]), r"prompt_lens\[0\]=1.5 must be an integer"),
        (dict(tokens=[[5, 6, 7]], loss_mask=[[1, 1, 1]]), r"loss_mask\[0\]\[0\]"),
        (dict(tokens=[[5, 6]], old_logprobs=[[0.0, np.inf]]), "old_logprobs"),
        (dict(tokens=[[5, 6]], prompt_lens=[2]), r"prompt_lens\[0\]=2 outside"),
    ],
)
def test_batch_rejects_bad_input(kwargs, match):
    with pytest.raises(BatchError, match=match):
        RolloutBatch.create(**kwargs)


def test_engine_rejects_token_out_of_vocab_and_missing_ref(model_params):
    model, params = model_params
    engine = DFSEngine(model)
    with pytest.raises(BatchError, match="vocab_size 256"):
        engine.value_and_grad(params, RolloutBatch.create(tokens=[[1, 300]]), MaskedNLLLoss())
    with pytest.raises(BatchError, match="needs ref_logprobs"):
        engine.value_and_grad(
            params, RolloutBatch.create(tokens=[[1, 3]]), ClippedSurrogateLoss.grpo(kl_coef=0.1)
        )


def _switches(engine, params, batch, loss):
    """The lowered DFS program's prefix sizes, the branch count of every conditional
    and the number of MLP weight products (dots with the tiny model's F = 128)."""
    prepared = engine.prepare(batch, loss)
    lowered = engine.jit.lower(loss, prepared.static, params, prepared.args)
    hlo = lowered.as_text(dialect="hlo")
    counts = sorted(len(b.split(",")) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo))
    mlp_dots = [
        line
        for line in lowered.as_text().splitlines()
        if "stablehlo.dot_general" in line and re.search(r"[<x]128x", line)
    ]
    return prepared.static.prefix_sizes, counts, len(mlp_dots)


def test_dfs_default_program_one_backward_body(model_params):
    """The default program (``bucket_bodies`` None, ``leaf_rows`` 1): the loop's switch
    has 3 branches (noop, push, pop: one forward and one backward model body), 4 when
    the plan pops leaves longer than a chunk as wide rows, whatever the prefix
    buckets; the bucket selects only the attention's prefix rows (one small switch
    per attention, a branch per prefix size). Per-(op, bucket) bodies grow."""
    model, params = model_params
    loss = MaskedNLLLoss()

    def program(levels, response_len, **kw):
        batch = grpo_groups(
            num_groups=1, group_size=4, prompt_len=28, response_len=response_len, seed=0
        )
        engine = DFSEngine(model, chunk_len=8, prefix_levels=levels, **kw)
        return _switches(engine, params, batch, loss)

    dots = {}
    for response_len, outer in (((2, 6), 3), ((2, 12), 4)):
        (few_sizes, few, few_dots), (many_sizes, many, many_dots) = (
            program(1, response_len),
            program(3, response_len),
        )
        assert (len(few_sizes), len(many_sizes)) == (2, 4)
        # One loop switch; every other conditional is an attention's, with one
        # branch per prefix size, and as many of them for 2 as for 4 buckets.
        assert len(few) == len(many) > 1
        assert few == sorted([outer] + [2] * (len(few) - 1))
        assert many == sorted([outer] + [4] * (len(many) - 1))
        assert few_dots == many_dots > 0  # the model's weight products do not grow
        dots[outer] = few_dots
    assert dots[4] > dots[3]  # the wide pop's body

    (_, few_b, few_b_dots), (_, many_b, many_b_dots) = (
        program(1, (2, 6), bucket_bodies=True),
        program(3, (2, 6), bucket_bodies=True),
    )
    assert (few_b, many_b) == ([1 + 2 * 2], [1 + 2 * 4])
    assert many_b_dots > few_b_dots > dots[3]


def test_dfs_chunk_is_capped_at_the_longest_sequence_bucket(model_params):
    """Short sequences do not pad every step to ``chunk_len``: the plan's chunk is the
    power-of-two bucket of the longest sequence seen when that is shorter, and it only
    grows (a shorter batch after a longer one keeps the compiled program)."""
    model, params = model_params
    loss = MaskedNLLLoss()
    engine = DFSEngine(model, chunk_len=64, prefix_levels=1)
    short = grpo_groups(num_groups=1, group_size=4, prompt_len=8, response_len=(2, 6), seed=0)
    assert short.prefix_tree().stats.longest_path <= 16
    assert engine.prepare(short, loss).static.chunk_len == 16
    longer = grpo_groups(num_groups=1, group_size=4, prompt_len=20, response_len=(8, 10), seed=1)
    assert engine.prepare(longer, loss).static.chunk_len == 32
    assert engine.prepare(short, loss).static.chunk_len == 32  # monotone
    long = grpo_groups(num_groups=1, group_size=2, prompt_len=90, response_len=(8, 10), seed=2)
    assert engine.prepare(long, loss).static.chunk_len == 64  # never past chunk_len
    # reserve() fixes it from the capacity's length, and the step bucket with it.
    reserved = DFSEngine(model, chunk_len=64, prefix_levels=1)
    reserved.reserve(Capacity(sequences=4, length=24, group_size=4))
    assert reserved.prepare(short, loss).static.chunk_len == 32
    # Exact with the capped chunk: the engine equals dense.
    d_loss, d_grads, _ = DenseEngine(model).value_and_grad(params, short, loss)
    t_loss, t_grads, _ = DFSEngine(model, chunk_len=64).value_and_grad(params, short, loss)
    np.testing.assert_allclose(t_loss, d_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(t_grads), jax.tree.leaves(d_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_dfs_pop_from_kept_outputs_runs_only_the_backward():
    """Under full remat a pop from kept outputs holds one layer recompute and its
    backward (3 + 6 MLP products) besides the push's forward (3): 12, against more
    when the pop runs the forward under ``jax.vjp`` and the remat recomputes it
    inside the backward. The loop is a forward switch, then a backward one."""
    model = init_model(ModelConfig.tiny(remat=Remat.FULL), seed=1)
    params = nnx.split(model, nnx.Param)[1]
    batch = grpo_groups(num_groups=1, group_size=4, prompt_len=20, response_len=(2, 6), seed=0)
    loss = MaskedNLLLoss()
    kept = _switches(DFSEngine(model, chunk_len=8, prefix_levels=1), params, batch, loss)[1:]
    vjp = _switches(
        DFSEngine(model, chunk_len=8, prefix_levels=1, keep_layer_outputs=False),
        params,
        batch,
        loss,
    )[1:]
    assert kept[1] == 12 < vjp[1]
    # Loop switches: forward and backward (2 branches each) against one of 3 (noop,
    # push, pop); every other conditional is an attention's prefix-bucket switch.
    assert 3 not in kept[0] and vjp[0].count(3) == 1
