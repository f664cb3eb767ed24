"""Tests for dtarl.tree.plan on the host: no device program is compiled or run.

Hand-counted plans of small trees (a chain, a two-level fork, packed siblings,
leaf rows, wide rows, a multi-turn chain whose runs merge), the shape buckets,
and hypothesis properties of every plan: each predicted token is popped exactly
once with the right input/target/position, pushes follow the stack discipline,
every sequence is visited once with its whole path known, and every bucket
covers what the plan uses.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.tree import DFSOrder, Op, build_tree, compile_plan
from dtarl.tree.plan import bucket, fine_bucket, prefix_bucket_sizes

POPS = (Op.POP, Op.POP_ROWS, Op.POP_WIDE)


def plan_of(seqs, **kwargs):
    return compile_plan(build_tree([np.asarray(s, np.int32) for s in seqs]), **kwargs)


def steps(plan) -> list[tuple[str, int, list[tuple[int, int]], list[int]]]:
    """Each real step as (op, start, [(first, last + 1) input positions per segment
    in segment order], visited sequences)."""
    out = []
    for t in range(plan.num_steps):
        segs = []
        for j in sorted(set(plan.seg[t][plan.seg[t] >= 0].tolist())):
            pos = plan.positions[t][plan.seg[t] == j]
            segs.append((int(pos.min()), int(pos.max()) + 1))
        visits = [int(s) for s in plan.slots[t] if s >= 0]
        out.append((Op(plan.op[t]).name, int(plan.start[t]), segs, visits))
    return out


# ------------------------------------------------------------------ buckets


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000)] == [1, 1, 2, 4, 8, 8, 16, 1024]
    assert bucket(3, minimum=10) == 16 and bucket(20, minimum=10) == 32


def test_bucket_and_fine_bucket_properties():
    """Both cover n, are monotone, honour ``minimum``; fine_bucket is a quarter octave
    {4, 5, 6, 7} / 4 x 2^k above 8 (padding within 25%), never above bucket."""
    quarter = {(q << k) // 4 for k in range(2, 16) for q in (4, 5, 6, 7)}
    prev_b = prev_f = 0
    for n in range(0, 3000):
        b, f = bucket(n), fine_bucket(n)
        assert b >= max(n, 1) and b & (b - 1) == 0 and (n <= 1 or b < 2 * n)
        assert max(n, 1) <= f <= b
        if n > 8:
            assert f in quarter and f < 1.25 * n
        assert b >= prev_b and f >= prev_f
        prev_b, prev_f = b, f
        m = (n * 7) % 50
        assert bucket(n, m) == bucket(max(n, m)) and fine_bucket(n, m) == fine_bucket(max(n, m))


def test_prefix_bucket_sizes():
    """0, the path length, and halvings down to max(C / 2, 8), ``levels`` in all."""
    assert prefix_bucket_sizes(64, 8, 3) == (0, 16, 32, 64)
    assert prefix_bucket_sizes(64, 8, 1) == (0, 64)
    assert prefix_bucket_sizes(64, 64, 3) == (0, 32, 64)  # 16 < C / 2
    assert prefix_bucket_sizes(8, 4, 3) == (0, 8)  # 4 < 8


# ------------------------------------------------------- hand-counted plans


def test_chain_pushes_all_but_the_last_chunk():
    """One sequence of 10 tokens = 9 inputs [0, 9), C = 4: chunks [0,4) [4,8) [8,9).
    The last chunk is never pushed (cut tail); the sequence is visited at its pop."""
    plan = plan_of([range(1, 11)], chunk_len=4)
    assert steps(plan) == [
        ("PUSH", 0, [(0, 4)], []),
        ("PUSH", 4, [(4, 8)], []),
        ("POP", 8, [(8, 9)], [0]),
        ("POP", 4, [(4, 8)], []),
        ("POP", 0, [(0, 4)], []),
    ]
    assert (plan.pushed_tokens, plan.computed_tokens, plan.peak_path) == (8, 9, 9)
    assert plan.op.shape == (8,) and (plan.op[5:] == Op.NOOP).all()  # fine_bucket(5)
    assert plan.path_len == 16 and plan.positions.shape == (8, 4)
    # Inputs are tokens 1..9 at positions 0..8, targets the next token.
    np.testing.assert_array_equal(plan.inputs[2, :1], [9])
    np.testing.assert_array_equal(plan.targets[2, :1], [10])


@pytest.mark.parametrize("n", [2, 5, 9])
def test_a_sequence_within_one_chunk_is_one_pop(n):
    plan = plan_of([range(1, n + 1)], chunk_len=8)
    assert steps(plan) == [("POP", 0, [(0, n - 1)], [0])]
    assert plan.pushed_tokens == 0 and plan.op.shape == (1,)


def test_two_level_fork():
    """[1 2 3] forks into the leaf [4 5 6] and [7 8], which forks into the leaves
    [9 10 11] and [12]. Inputs: A [0,2), B [2,5), C [2,4), D [4,7), E [4,5); C = 4.
    A and C are pushed; B pops alone; D and E (3 + 1 entries) pack in one chunk;
    C's pop merges with A's ([0, 4) fits a chunk)."""
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9, 10, 11], [1, 2, 3, 7, 8, 12]]
    plan = plan_of(seqs, chunk_len=4)
    assert steps(plan) == [
        ("PUSH", 0, [(0, 2)], []),
        ("POP", 2, [(2, 5)], [0]),
        ("PUSH", 2, [(2, 4)], []),
        ("POP", 4, [(4, 7), (4, 5)], [1, 2]),
        ("POP", 0, [(0, 4)], []),
    ]
    assert plan.pushed_tokens == 2 + 2
    assert plan.computed_tokens == 2 + 3 + 2 + 3 + 1
    assert plan.packed_steps == 1 and plan.slots.shape[1] == 2
    # The fork entry: C's first input is A's last token (3) predicting 7.
    t, col = 2, 0
    assert (plan.positions[t, col], plan.inputs[t, col], plan.targets[t, col]) == (2, 3, 7)


def test_siblings_pack_into_one_step():
    """A GRPO group: prompt of 5, four responses of 2 (2 entries each with the fork
    token), C = 8: the four leaves share one POP as four segments."""
    seqs = [[1, 2, 3, 4, 5, 10 + g, 20 + g] for g in range(4)]
    plan = plan_of(seqs, chunk_len=8)
    assert steps(plan) == [
        ("PUSH", 0, [(0, 4)], []),
        ("POP", 4, [(4, 6)] * 4, [0, 1, 2, 3]),
        ("POP", 0, [(0, 4)], []),
    ]
    assert plan.packed_steps == 1
    np.testing.assert_array_equal(plan.slot_seg[1], [0, 1, 2, 3])
    # Every leaf's fork entry reads the prompt's last token at position 4.
    np.testing.assert_array_equal(plan.inputs[1, 0:8:2], [5] * 4)
    # Unpacked: one pop per leaf; the last one merges with the prompt's pop.
    unpacked = plan_of(seqs, chunk_len=8, pack_leaves=False)
    assert steps(unpacked) == [
        ("PUSH", 0, [(0, 4)], []),
        ("POP", 4, [(4, 6)], [0]),
        ("POP", 4, [(4, 6)], [1]),
        ("POP", 4, [(4, 6)], [2]),
        ("POP", 0, [(0, 6)], [3]),
    ]
    assert unpacked.packed_steps == 0 and unpacked.computed_tokens == plan.computed_tokens


@pytest.mark.parametrize(
    "rows,ops,visits",
    [
        (1, ["POP"] * 4, [[0], [1], [2], [3]]),
        (2, ["POP_ROWS"] * 2, [[0, 1], [2, 3]]),
        (3, ["POP_ROWS", "POP"], [[0, 1, 2], [3]]),
        (4, ["POP_ROWS"], [[0, 1, 2, 3]]),
    ],
)
def test_leaf_rows(rows, ops, visits):
    """Four leaves of 5 entries, C = 8: no two share a chunk, so they pop ``rows``
    chunks per step over the shared prompt; row r holds columns [8r, 8r + 5)."""
    seqs = [[1, 2, 3, 4, 5] + [10 + g] * 5 for g in range(4)]
    plan = plan_of(seqs, chunk_len=8, rows=rows)
    got = steps(plan)
    assert [s[0] for s in got] == ["PUSH"] + ops + ["POP"]
    assert [s[3] for s in got[1:-1]] == visits
    assert all(s[1] == 4 and set(s[2]) == {(4, 9)} for s in got[1:-1])
    assert plan.positions.shape[1] == rows * 8
    assert plan.row_steps == ops.count("POP_ROWS")
    for t in range(1, 1 + len(ops)):
        used = np.flatnonzero(plan.seg[t] >= 0)
        want = [8 * r + k for r in range(len(visits[t - 1])) for k in range(5)]
        np.testing.assert_array_equal(used, want)


def test_multi_turn_chain_merges_runs():
    """Turns of 3 tokens, each a sequence end: inputs [0,2) [2,5) [5,8) [8,11).
    C = 16: all pushes merge into one and all pops into one (2 steps, not 7).
    C = 6: merges stop where a run would exceed 6 entries."""
    t = list(range(1, 13))
    seqs = [t[:3], t[:6], t[:9], t[:12]]
    assert steps(plan_of(seqs, chunk_len=16)) == [
        ("PUSH", 0, [(0, 8)], []),
        ("POP", 0, [(0, 11)], [3, 2, 1, 0]),
    ]
    assert steps(plan_of(seqs, chunk_len=6)) == [
        ("PUSH", 0, [(0, 5)], []),
        ("PUSH", 5, [(5, 8)], []),
        ("POP", 5, [(5, 11)], [3, 2]),
        ("POP", 0, [(0, 5)], [1, 0]),
    ]
    unmerged = plan_of(seqs, chunk_len=16, merge_runs=False)
    assert [s[0] for s in steps(unmerged)] == ["PUSH"] * 3 + ["POP"] * 4
    assert unmerged.pushed_tokens == 8 and unmerged.computed_tokens == 11


# Two unrelated leaves of 16 and 12 inputs, C = 4, W = 4 (rows of 16 entries).
# Unit token costs: wide = 3 x 16 = 48 for either; chunked = 4 per pushed chunk +
# 3 x 4 per popped chunk (a partial chunk costs a whole one): 16 inputs -> 12 + 48
# = 60, 12 inputs -> 8 + 36 = 44.
WIDE_SEQS = [[1] + list(range(100, 116)), [2] + list(range(200, 212))]


def test_wide_row_only_where_it_costs_less():
    """wide_slack = 0: the 16-input leaf pops wide (48 <= 60), the 12-input leaf
    stays chunked (48 > 44) and pushes its first two chunks."""
    plan = plan_of(WIDE_SEQS, chunk_len=4, wide=4)
    assert plan.wide == 4 and plan.positions.shape[1] == 16
    assert steps(plan) == [
        ("POP_WIDE", 0, [(0, 16)], [0]),
        ("PUSH", 0, [(0, 4)], []),
        ("PUSH", 4, [(4, 8)], []),
        ("POP", 8, [(8, 12)], [1]),
        ("POP", 4, [(4, 8)], []),
        ("POP", 0, [(0, 4)], []),
    ]
    assert (plan.wide_steps, plan.pushed_tokens, plan.computed_tokens) == (1, 8, 28)
    chunked = plan_of(WIDE_SEQS, chunk_len=4, wide=0)
    assert (chunked.wide_steps, chunked.pushed_tokens, chunked.num_steps) == (0, 12 + 8, 12)


def test_wide_slack_and_rows():
    """wide_slack = 0.1 admits 48 <= 1.1 x 44: both leaves pop wide, nothing is
    pushed; with rows = 2 both rows share one step (row 1 at column 16)."""
    one_row = plan_of(WIDE_SEQS, chunk_len=4, wide=4, wide_slack=0.1)
    assert steps(one_row) == [("POP_WIDE", 0, [(0, 16)], [0]), ("POP_WIDE", 0, [(0, 12)], [1])]
    assert one_row.pushed_tokens == 0
    two_rows = plan_of(WIDE_SEQS, chunk_len=4, wide=4, wide_slack=0.1, rows=2)
    assert steps(two_rows) == [("POP_WIDE", 0, [(0, 16), (0, 12)], [0, 1])]
    assert two_rows.positions.shape[1] == 2 * 16
    np.testing.assert_array_equal(np.flatnonzero(two_rows.seg[0] == 1), np.arange(16, 28))
    # W is capped by the longest leaf (16 inputs = 4 chunks), not by ``wide``.
    assert plan_of(WIDE_SEQS, chunk_len=4, wide=8, wide_slack=0.1).wide == 4


def test_wide_tail_of_a_leaf_longer_than_a_wide_row():
    """31 tokens = 30 inputs, C = 4, W = 4: push [0, 16) in 4 chunks, pop the
    14-input tail [16, 30) as one POP_WIDE (48 <= 12 + 48 chunked), then pop the
    pushed chunks. With 4 rows the tail's step would be 3/4 padding (192 > 60):
    fully chunked, 7 pushes."""
    seq = [[1] + list(range(100, 130))]
    plan = plan_of(seq, chunk_len=4, wide=4)
    got = steps(plan)
    assert [s[0] for s in got] == ["PUSH"] * 4 + ["POP_WIDE"] + ["POP"] * 4
    assert got[4] == ("POP_WIDE", 16, [(16, 30)], [0])
    assert (plan.pushed_tokens, plan.wide_steps, plan.peak_path) == (16, 1, 30)
    padded = plan_of(seq, chunk_len=4, wide=4, rows=4)
    assert (padded.pushed_tokens, padded.wide_steps, padded.num_steps) == (28, 0, 15)


def test_minimums_reproduce_a_larger_plans_shapes():
    """min_steps / min_path / min_slots / min_wide make a small batch's plan take the
    shape of a larger one (so the compiled program is reused)."""
    big = plan_of(WIDE_SEQS + [[3, 4, 5]] * 3, chunk_len=4, wide=4, rows=2)
    small = plan_of(
        [[7, 8, 9]],
        chunk_len=4,
        rows=2,
        wide=4,
        min_steps=big.op.shape[0],
        min_path=big.path_len,
        min_slots=big.slots.shape[1],
        min_wide=big.wide,
    )
    assert small.num_steps == 1 and small.shape_key == big.shape_key


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_len=0), "chunk_len"),
        (dict(chunk_len=4, prefix_levels=0), "prefix_levels"),
        (dict(chunk_len=4, rows=0), "rows"),
        (dict(chunk_len=4, wide=-1), "wide"),
        (dict(chunk_len=4, wide_slack=-0.5), "wide_slack"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_of([[1, 2, 3]], **kwargs)


@pytest.mark.parametrize("seqs", [[[5]], [[5], [5, 6, 7]]], ids=["alone", "prefix-of-another"])
def test_one_token_sequence_is_not_trainable(seqs):
    with pytest.raises(ValueError, match="not trainable"):
        plan_of(seqs, chunk_len=4)


# --------------------------------------------------------------- properties


@st.composite
def trainable_sets(draw, max_n: int = 10):
    """Sequences of >= 2 tokens over a small alphabet: extensions, prefixes and
    duplicates of earlier ones, so trees fork at many depths."""
    tok = st.integers(0, draw(st.integers(1, 3)))
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_n))):
        kind = draw(st.sampled_from(["fresh", "extend", "extend", "prefix", "dup"]))
        if not seqs or kind == "fresh":
            s = draw(st.lists(tok, min_size=2, max_size=24))
        else:
            base = draw(st.sampled_from(seqs))
            if kind == "extend":
                cut = draw(st.integers(0, len(base)))
                s = base[:cut] + draw(st.lists(tok, min_size=max(2 - cut, 1), max_size=20))
            elif kind == "prefix":
                s = base[: draw(st.integers(2, len(base)))]
            else:
                s = list(base)
        seqs.append(s)
    return [np.array(s, np.int32) for s in seqs]


PLAN_OPTIONS = st.fixed_dictionaries(
    dict(
        chunk_len=st.sampled_from([1, 2, 3, 4, 8]),
        order=st.sampled_from(list(DFSOrder)),
        pack_leaves=st.booleans(),
        rows=st.sampled_from([1, 2, 3]),
        wide=st.sampled_from([0, 2, 3, 4]),
        wide_slack=st.sampled_from([0.0, 0.5, 5.0]),
        merge_runs=st.booleans(),
        prefix_levels=st.sampled_from([1, 3]),
    )
)


def _targets(tree, i: int) -> dict[int, tuple[int, int, int]]:
    """Sequence i's predicted tokens: tree flat index -> (input position, input, target)."""
    path = []
    x = int(tree.seq_node[i])
    while x > 0:
        path.append(x)
        x = int(tree.parent[x])
    toks = tree.path_tokens(int(tree.seq_node[i]))
    out = {}
    for x in path:
        for k in range(int(tree.length[x])):
            p = int(tree.start[x]) + k
            if p >= 1:
                out[int(tree.offset[x]) + k] = (p - 1, int(toks[p - 1]), int(toks[p]))
    return out


@settings(max_examples=150, deadline=None)
@given(seqs=trainable_sets(), options=PLAN_OPTIONS)
def test_plan_invariants(seqs, options):
    tree = build_tree(seqs)
    plan = compile_plan(tree, **options)
    c, r, w = plan.chunk_len, plan.rows, plan.wide
    n_steps = plan.num_steps

    # Buckets cover what the plan uses.
    assert plan.op.shape[0] == fine_bucket(n_steps) >= n_steps
    assert (plan.op[:n_steps] != Op.NOOP).all() and (plan.op[n_steps:] == Op.NOOP).all()
    assert (plan.seg[n_steps:] == -1).all() and (plan.slots[n_steps:] == -1).all()
    most_slots = max(int((plan.slots[t] >= 0).sum()) for t in range(n_steps))
    assert plan.slots.shape[1] == bucket(most_slots)
    assert plan.path_len == bucket(tree.stats.longest_path)
    assert plan.positions.shape[1] == r * max(w, 1) * c
    assert w == 0 or 2 <= w <= options["wide"]
    real = plan.seg >= 0
    assert plan.peak_path == int(plan.positions[real].max()) + 1 <= plan.path_len
    sizes = plan.prefix_sizes
    for t in range(n_steps):
        b = int(plan.pbucket[t])
        assert sizes[b] >= plan.start[t] and (b == 0 or sizes[b - 1] < plan.start[t])

    # Row layout: PUSH/POP use row 0, POP_ROWS rows of C, POP_WIDE rows of W * C; each
    # segment is a run of consecutive positions starting at the step's shared prefix.
    for t in range(n_steps):
        op = Op(plan.op[t])
        cap = w * c if op is Op.POP_WIDE else c
        nrows = 1 if op in (Op.PUSH, Op.POP) else r
        cols = np.flatnonzero(real[t])
        assert cols.size and cols.max() < nrows * cap
        for j in np.unique(plan.seg[t][cols]):
            in_seg = np.flatnonzero(plan.seg[t] == j)
            rows_of = set((in_seg // cap).tolist())
            assert len(rows_of) == 1 and np.all(np.diff(in_seg) == 1)
            pos = plan.positions[t, in_seg]
            np.testing.assert_array_equal(pos, plan.start[t] + np.arange(pos.size))
        if op is Op.PUSH:
            assert set(plan.seg[t][cols].tolist()) == {0}

    # Every predicted token of the tree is popped exactly once, with its position,
    # input and target; pushes are a subset of them, at most once each.
    want = {}
    for i in range(tree.stats.num_sequences):
        want.update(_targets(tree, i))
    popped, pushed = {}, {}
    for t in range(n_steps):
        into = popped if Op(plan.op[t]) in POPS else pushed
        for col in np.flatnonzero(real[t]):
            key = int(plan.tree_idx[t, col])
            assert key not in into
            into[key] = (
                int(plan.positions[t, col]),
                int(plan.inputs[t, col]),
                int(plan.targets[t, col]),
            )
    assert popped == want
    assert all(want[k] == v for k, v in pushed.items())
    assert plan.computed_tokens == len(want) and plan.pushed_tokens == len(pushed)
    # Internal nodes' tokens are all pushed (their children read them on the stack).
    for x in range(1, tree.num_nodes):
        if tree.children[x]:
            own = range(int(tree.offset[x]), int(tree.offset[x] + tree.length[x]))
            assert all(k in pushed for k in own if k in want)

    # Stack discipline: a PUSH extends the stack at its top; a pop reads the stack
    # below ``start`` and recomputes (so drops) every pushed entry above it. Each
    # sequence is visited once, when all of its predicted tokens are on the stack
    # or in the visiting step, in the segment that holds its last token.
    stack: list[tuple[int, int]] = []  # (position, tree index)
    visited = []
    for t in range(n_steps):
        start, cols = int(plan.start[t]), np.flatnonzero(real[t])
        here = {int(k) for k in plan.tree_idx[t, cols]}
        if Op(plan.op[t]) is Op.PUSH:
            assert start == len(stack)
            stack += [(int(plan.positions[t, col]), int(plan.tree_idx[t, col])) for col in cols]
        else:
            assert start <= len(stack)
            assert {k for _, k in stack[start:]} <= here
        known = here | {k for _, k in stack}
        for sid, j in zip(plan.slots[t], plan.slot_seg[t], strict=True):
            if sid < 0:
                continue
            visited.append(int(sid))
            assert set(_targets(tree, int(sid))) <= known
            x = int(tree.seq_node[sid])
            last = int(tree.offset[x] + tree.length[x]) - 1
            assert last in {int(k) for k in plan.tree_idx[t][plan.seg[t] == j]}
        if Op(plan.op[t]) is not Op.PUSH:
            del stack[start:]
    assert stack == []
    assert sorted(visited) == list(range(tree.stats.num_sequences))


@settings(max_examples=60, deadline=None)
@given(seqs=trainable_sets(), chunk_len=st.sampled_from([1, 2, 4, 8]), wide=st.sampled_from([2, 4]))
def test_merges_and_wide_rows_only_save_work(seqs, chunk_len, wide):
    """Merging runs never adds a step and moves no token; wide rows compute the same
    tokens and never push more than the chunked plan."""
    tree = build_tree(seqs)
    base = compile_plan(tree, chunk_len=chunk_len, merge_runs=False)
    merged = compile_plan(tree, chunk_len=chunk_len)
    assert merged.num_steps <= base.num_steps
    assert (merged.computed_tokens, merged.pushed_tokens) == (
        base.computed_tokens,
        base.pushed_tokens,
    )
    wide_plan = compile_plan(tree, chunk_len=chunk_len, wide=wide, wide_slack=0.5)
    assert wide_plan.computed_tokens == merged.computed_tokens
    assert wide_plan.pushed_tokens <= merged.pushed_tokens
