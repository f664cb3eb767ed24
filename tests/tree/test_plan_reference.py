"""``compile_plan`` (vectorised, compact storage) against its reference twin
``compile_plan_reference`` (the pure-Python compiler it replaced): every array of the
plan, padded as the device program takes it, and every count must be identical, on
hypothesis trees and on seeded random GRPO / multi-turn trees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.tree import DFSOrder, build_tree, compile_plan
from dtarl.tree.plan import ENTRY_FIELDS
from dtarl.tree.plan_reference import ReferencePlan, compile_plan_reference
from tests.tree.test_plan import PLAN_OPTIONS, trainable_sets


def assert_same_plan(tree, **options) -> None:
    want = compile_plan_reference(tree, **options)
    got = compile_plan(tree, **options)
    for name in ReferencePlan._fields:
        w, g = getattr(want, name), getattr(got, name)
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            assert g == w, (name, g, w)
    # The compact form holds exactly the real entries, in step and column order.
    real = want.seg >= 0
    assert got.num_entries == int(real.sum())
    steps, cols = np.nonzero(real)
    np.testing.assert_array_equal(got.entry_step, steps)
    np.testing.assert_array_equal(got.entry_col, cols)
    for name in ENTRY_FIELDS:
        np.testing.assert_array_equal(got.entries[name], getattr(want, name)[real], err_msg=name)


def _flops(keys: float) -> float:
    return 100.0 + keys


@settings(max_examples=200, deadline=None)
@given(
    seqs=trainable_sets(),
    options=PLAN_OPTIONS,
    flops=st.booleans(),
    mins=st.tuples(st.sampled_from([1, 40]), st.sampled_from([1, 64]), st.sampled_from([0, 3])),
)
def test_same_plan_as_the_reference_on_hypothesis_trees(seqs, options, flops, mins):
    min_steps, min_path, min_wide = mins
    assert_same_plan(
        build_tree(seqs),
        **options,
        token_flops=_flops if flops else None,
        min_steps=min_steps,
        min_path=min_path,
        min_wide=min_wide,
        min_slots=2,
    )


def _random_sequences(seed: int) -> list[np.ndarray]:
    """GRPO groups with long-tailed responses, plus multi-turn chains that share turns."""
    rs = np.random.default_rng(seed)
    out = []
    for _ in range(rs.integers(2, 5)):
        prompt = rs.integers(0, 50, rs.integers(2, 40), dtype=np.int32)
        for _ in range(rs.integers(1, 6)):
            n = int(np.clip(rs.lognormal(2.5, 1.0), 1, 200))
            out.append(np.concatenate([prompt, rs.integers(0, 50, n, dtype=np.int32)]))
    turns = [rs.integers(0, 50, rs.integers(1, 12), dtype=np.int32) for _ in range(6)]
    for k in range(2, 7):
        out.append(np.concatenate(turns[:k]))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "options",
    [
        dict(chunk_len=16, rows=2, wide=4, wide_slack=0.25),
        dict(chunk_len=8, rows=3, wide=0, order=DFSOrder.LEXICOGRAPHIC),
        dict(chunk_len=32, rows=1, wide=3, pack_leaves=False, merge_runs=False),
    ],
    ids=["default-like", "rows", "unpacked"],
)
def test_same_plan_as_the_reference_on_random_trees(seed, options):
    assert_same_plan(build_tree(_random_sequences(seed)), token_flops=_flops, **options)


def test_padded_arrays_are_read_only_and_built_once():
    plan = compile_plan(build_tree(_random_sequences(0)), chunk_len=8, rows=2)
    assert plan.seg is plan.seg and not plan.seg.flags.writeable
    assert plan.host_nbytes < sum(plan.padded(k).nbytes for k in ENTRY_FIELDS)
    with pytest.raises(ValueError, match="accepted names"):
        plan.padded("position")
