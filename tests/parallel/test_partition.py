"""Tests for dtarl.parallel.partition: exact cases, a DP reference, and invariants; and
the engines' own partition costs (``engine.partition_cost``) as ``ShardedEngine`` uses them."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.engines import AutoEngine, DenseEngine, DFSEngine, PrefixReuseEngine
from dtarl.engines.cost import token_flops
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel.mesh import make_mesh
from dtarl.parallel.partition import (
    BalancedOrder,
    FlopCost,
    Partition,
    PartitionInvariantError,
    PartitionMethod,
    RowCost,
    TreeTokenCost,
    _fill_empty,
    dfs_order,
    partition,
    partition_batch,
    tree_cost,
    tree_tokens,
)
from dtarl.parallel.sharded import ShardedEngine
from dtarl.testing import grpo_groups

ALL_METHODS = list(PartitionMethod)


# ----------------------------------------------------------------------------- references


def brute_prefixes(seqs) -> set[tuple[int, ...]]:
    """Every non-empty prefix of every sequence = the nodes of the prefix trie."""
    return {tuple(int(x) for x in s[:p]) for s in seqs for p in range(1, len(s) + 1)}


def brute_cost(seqs, cost) -> float:
    nodes = brute_prefixes(seqs)
    if isinstance(cost, TreeTokenCost):
        return len(nodes)
    return sum(cost.a + cost.b * (len(n) - 1) for n in nodes)


def dp_optimum(seqs, k: int, cost) -> float:
    """min over contiguous cuts of the sorted order into <= k segments of the max brute cost."""
    srt = sorted(seqs, key=lambda s: tuple(int(x) for x in s))
    n = len(srt)

    @functools.cache
    def best(i: int, parts: int) -> float:
        if i == n:
            return 0.0
        if parts == 0:
            return float("inf")
        return min(max(brute_cost(srt[i:j], cost), best(j, parts - 1)) for j in range(i + 1, n + 1))

    return best(0, k)


def dp_optimum_in_order(srt, k: int, cost) -> float:
    """min over cuts of the given order into <= k contiguous segments of the max brute cost."""
    n = len(srt)

    @functools.cache
    def best(i: int, parts: int) -> float:
        if i == n:
            return 0.0
        if parts == 0:
            return float("inf")
        return min(max(brute_cost(srt[i:j], cost), best(j, parts - 1)) for j in range(i + 1, n + 1))

    return best(0, k)


def block_order_reference(seqs, k: int, cost):
    """BalancedOrder.BLOCKS, independently: (order, LPT bin loads).

    Blocks = the lexicographically sorted sequences grouped by their token at depth
    m0 (the prefix all of them share); a sequence equal to that prefix is a block of
    its own. Blocks go largest brute cost first to the least loaded bin (ties: lowest
    bin) and are laid out bin by bin, in sorted order within a bin.
    """
    srt = sorted(range(len(seqs)), key=lambda i: (tuple(int(x) for x in seqs[i]), i))
    m0 = min(len(s) for s in seqs)
    for i in range(m0):
        if len({int(s[i]) for s in seqs}) > 1:
            m0 = i
            break
    blocks, keys = [], []
    for i in srt:
        key = ("in", int(seqs[i][m0])) if len(seqs[i]) > m0 else ("leaf", i)
        if keys and keys[-1] == key:
            blocks[-1].append(i)
        else:
            blocks.append([i])
            keys.append(key)
    costs = [brute_cost([seqs[i] for i in b], cost) for b in blocks]
    loads, bins = [0.0] * k, [[] for _ in range(k)]
    for b in sorted(range(len(blocks)), key=lambda b: (-costs[b], b)):
        j = min(range(k), key=lambda j: (loads[j], j))
        bins[j].append(b)
        loads[j] += costs[b]
    return [i for g in bins for b in sorted(g) for i in blocks[b]], loads


def assert_assigned_once(p: Partition, n: int):
    flat = np.concatenate(p.indices)
    assert sorted(flat.tolist()) == list(range(n))


# ----------------------------------------------------------------------------- strategies

# A small alphabet and short lengths make shared prefixes (and duplicates) common.
seq_st = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(lambda x: np.array(x, np.int32))


@st.composite
def batch_st(draw, max_n=10, max_k=4):
    seqs = draw(st.lists(seq_st, min_size=1, max_size=max_n))
    k = draw(st.integers(1, min(max_k, len(seqs))))
    return seqs, k


@st.composite
def grouped_st(draw):
    """GRPO-like: groups of siblings sharing a prompt; prompts may collide across groups."""
    n_groups = draw(st.integers(1, 5))
    seqs, gids = [], []
    for g in range(n_groups):
        prompt = draw(st.lists(st.integers(0, 2), min_size=0, max_size=3))
        for _ in range(draw(st.integers(1, 3))):
            resp = draw(st.lists(st.integers(0, 2), min_size=1, max_size=3))
            seqs.append(np.array(prompt + resp, np.int32))
            gids.append(10 * g + 7)  # arbitrary, non-contiguous ids
    k = draw(st.integers(1, n_groups))
    return seqs, gids, k


cost_st = st.sampled_from([TreeTokenCost(), FlopCost(a=1.0, b=0.37), FlopCost(a=0.0, b=1.0)])
# Costs whose sums are exact in float64 at these sizes, so LPT ties break the same way.
exact_cost_st = st.sampled_from([TreeTokenCost(), FlopCost(a=1.0, b=0.5), FlopCost(a=0.0, b=1.0)])


# ----------------------------------------------------------------------------- exact cases


def test_hand_computed_tree_tokens_and_cuts():
    seqs = [np.array([7, 8]), np.array([1, 2, 3]), np.array([1, 5]), np.array([1, 2, 4])]
    order, lcps, lengths = dfs_order(seqs)
    assert order.tolist() == [1, 3, 2, 0]
    assert lcps.tolist() == [0, 2, 1, 0]
    assert lengths.tolist() == [2, 3, 2, 3]
    assert tree_tokens(seqs) == 7  # 1,2,3 + 4 + 5 + 7,8
    # K=2 cuts of [123, 124, 15, 78]: |3+1+1+2 -> (3,4) (4,3) (5,2): optimum 4.
    p = partition(seqs, 2)
    assert [ix.tolist() for ix in p.indices] == [[1, 3], [2, 0]]
    assert p.loads.tolist() == [4, 4]
    assert p.makespan == 4 and p.mean_load == 4 and p.imbalance == 1.0
    assert p.tree_tokens.tolist() == [4, 4]
    assert p.global_tree_tokens == 7 and p.total_tokens == 10 and p.max_len == 3
    assert p.duplicated_tokens == 1 and p.duplication_bound == 3
    assert p.rank_of().tolist() == [1, 0, 1, 0]


def test_hand_computed_flop_cost():
    # [1,2,3] + [1,2,4]: nodes at depths 0,1,2 and 2 -> 4a + b(0+1+2+2).
    c = FlopCost(a=2.0, b=0.5)
    assert tree_cost([np.array([1, 2, 3]), np.array([1, 2, 4])], c) == pytest.approx(
        4 * 2.0 + 0.5 * 5, abs=1e-12
    )
    np.testing.assert_allclose(c.append_cost(np.array([3, 5]), np.array([0, 2])), [7.5, 10.5])
    np.testing.assert_allclose(
        FlopCost.features([np.array([1, 2, 3]), np.array([1, 2, 4])]), [4.0, 5.0]
    )


def test_greedy_tokens_is_lpt():
    # Lengths 8,7,6,5,4 without shared prefixes: LPT gives {8,5,4}=17, {7,6}=13.
    seqs = [np.full(n, n) for n in (8, 7, 6, 5, 4)]
    p = partition(seqs, 2, method=PartitionMethod.GREEDY_TOKENS)
    assert sorted(sorted(ix.tolist()) for ix in p.indices) == [[0, 3, 4], [1, 2]]
    assert sorted(p.loads.tolist()) == [13, 17]


def test_karmarkar_karp_largest_differencing():
    # LDM on 8,7,6,5,4: 8-7 -> 1; 6-5 -> 1; 4-1 -> 3; 3-1 -> 2 => sums 16 / 14
    # (the optimum 15/15 is missed: LDM is a heuristic).
    seqs = [np.full(n, n) for n in (8, 7, 6, 5, 4)]
    p = partition(seqs, 2, method="karmarkar_karp")
    assert p.method is PartitionMethod.KARMARKAR_KARP
    assert sorted(p.loads.tolist()) == [14, 16]
    # Balanced on the sorted order [4,5,6,7,8] finds the contiguous optimum 4+5+6 | 7+8.
    assert partition(seqs, 2).makespan == 15


def test_greedy_tree_counts_shared_prefix():
    # x: 35 unrelated tokens; a1, a2: siblings of 21 tokens sharing a 20-token prompt; c: 10.
    # Token greedy: x | a1, then a2 -> the 21-token rank, c -> x's rank: loads 45 / 22.
    # Tree greedy: a2 costs 1 next to a1, so c fits there too: loads 35 / 32.
    a = np.arange(100, 120)
    seqs = [np.arange(35), np.append(a, 1), np.append(a, 2), np.arange(200, 210)]
    tok = partition(seqs, 2, method=PartitionMethod.GREEDY_TOKENS)
    assert [ix.tolist() for ix in tok.indices] == [[0, 3], [1, 2]]
    assert tok.loads.tolist() == [45, 22]
    tree = partition(seqs, 2, method=PartitionMethod.GREEDY_TREE)
    assert [ix.tolist() for ix in tree.indices] == [[0], [1, 2, 3]]
    assert tree.loads.tolist() == [35, 32] and tree.duplicated_tokens == 0


def test_blocks_order_beats_lexicographic_cut():
    # Lex order [0], [1,0], [2] costs 1, 2, 1: every 2-cut of it has a segment of 3.
    # Blocks (siblings under the root): LPT puts [1,0] alone and [0], [2] together: 2 | 2.
    seqs = [np.array([0]), np.array([1, 0]), np.array([2])]
    lex = partition(seqs, 2, order="lexicographic")
    assert lex.makespan == 3
    for order in (BalancedOrder.BLOCKS, BalancedOrder.BEST):
        p = partition(seqs, 2, order=order)
        assert [ix.tolist() for ix in p.indices] == [[1], [0, 2]]
        assert p.loads.tolist() == [2, 2] and p.duplicated_tokens == 0


def test_dfs_reuse_and_bad_order():
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 3, rng.integers(1, 8)) for _ in range(30)]
    dfs = dfs_order(seqs)
    for method in ALL_METHODS:
        a = partition(seqs, 3, method=method)
        b = partition(seqs, 3, method=method, dfs=dfs)
        assert [x.tolist() for x in a.indices] == [x.tolist() for x in b.indices]
        assert a.loads.tolist() == b.loads.tolist()
    with pytest.raises(ValueError, match=r"dfs: expected dfs_order\(sequences\)"):
        partition(seqs[:-1], 3, dfs=dfs)
    with pytest.raises(ValueError, match=r"order='dfs'.*lexicographic"):
        partition(seqs, 3, order="dfs")


def test_k_equals_n_and_k_one():
    seqs = [np.array([3, 1]), np.array([1]), np.array([2, 2, 2])]
    p = partition(seqs, 3)
    assert sorted(ix.shape[0] for ix in p.indices) == [1, 1, 1]
    assert p.makespan == 3
    p1 = partition(seqs, 1)
    assert p1.indices[0].tolist() == [1, 2, 0] and p1.duplicated_tokens == 0


def test_keep_groups_hand_case():
    # Group 0: prompt [1] + 4 responses of 3 tokens (tree 13); group 1: [2, 9] (tree 2).
    seqs = [np.array([1, r, r, r]) for r in (5, 6, 7, 8)] + [np.array([2, 9])]
    free = partition(seqs, 2)  # sorted inc costs 4,3,3,3,2: best cut 7 | 4+3+2 = 9
    assert free.loads.tolist() == [7, 9]
    grouped = partition(seqs, 2, group_ids=[0, 0, 0, 0, 1], keep_groups=True)
    assert [sorted(ix.tolist()) for ix in grouped.indices] == [[0, 1, 2, 3], [4]]
    assert grouped.loads.tolist() == [13, 2] and grouped.duplicated_tokens == 0


def test_partition_batch_uses_group_ids_and_splits():
    from dtarl.batch import RolloutBatch

    toks = [np.array([1, 2, 3]), np.array([1, 2, 4]), np.array([5, 6]), np.array([5, 7, 8])]
    batch = RolloutBatch.create(tokens=toks, group_ids=[0, 0, 1, 1])
    p = partition_batch(batch, 2, keep_groups=True)
    subs = p.split(batch)
    assert [s.num_sequences for s in subs] == [2, 2]
    assert sorted(int(g) for g in subs[0].group_ids) == [0, 0]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, seqs, k, match",
    [
        ({}, [np.array([1])], 0, r"k=0: must be in \[1, 1\]"),
        ({}, [np.array([1]), np.array([2])], 3, r"k=3: must be in \[1, 2\].*sequences"),
        ({}, [np.array([1]), np.array([], np.int32)], 1, r"sequences\[1\]: length 0"),
        ({}, [], 1, r"k=1: must be in \[1, 0\]"),
        ({}, [np.array([[1, 2]])], 1, r"sequences\[0\]: expected a 1-D"),
        ({}, [np.array([1.5])], 1, r"sequences\[0\]: expected integer"),
        ({"method": "round_robin"}, [np.array([1])], 1, r"method='round_robin'"),
        ({"keep_groups": True}, [np.array([1])], 1, r"group_ids: required"),
        ({"group_ids": [0, 1]}, [np.array([1])], 1, r"group_ids: expected 1 entries"),
        (
            {"group_ids": [0, 0, 1], "keep_groups": True},
            [np.array([1]), np.array([2]), np.array([3])],
            3,
            r"k=3: must be in \[1, 2\].*number of groups",
        ),
        ({}, [np.array([1])], 1.0, r"k=1.0: expected an int"),
    ],
)
def test_bad_input_names_field(kwargs, seqs, k, match):
    with pytest.raises(ValueError, match=match):
        partition(seqs, k, **kwargs)


def test_flop_cost_validation_and_fit():
    with pytest.raises(ValueError, match=r"FlopCost.b=-1"):
        FlopCost(a=1.0, b=-1.0)
    with pytest.raises(ValueError, match="both 0"):
        FlopCost(a=0.0, b=0.0)
    rng = np.random.default_rng(0)
    feats = np.stack(
        [
            FlopCost.features([rng.integers(0, 4, rng.integers(1, 40)) for _ in range(6)])
            for _ in range(12)
        ]
    )
    times = feats @ np.array([3e-3, 7e-6])
    fit = FlopCost.fit(feats, times)
    assert fit.a == pytest.approx(3e-3, rel=1e-9) and fit.b == pytest.approx(7e-6, rel=1e-6)
    # A negative unconstrained slope is clipped to the best one-term fit.
    nn = FlopCost.fit(np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]), np.array([1.0, 2.0, 3.0]))
    assert nn.b >= 0 and nn.a >= 0
    with pytest.raises(ValueError, match=r"features: expected shape \[M, 2\]"):
        FlopCost.fit(np.ones(3), np.ones(3))
    c = FlopCost.from_transformer(num_params=7.6e9, num_layers=28, hidden=3584)
    assert c.a == 1.0 and c.b == pytest.approx(2 * 28 * 3584 / 7.6e9)


# ----------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(batch_st(), cost_st)
def test_balanced_equals_dp_optimum(data, cost):
    seqs, k = data
    p = partition(seqs, k, cost=cost, order="lexicographic")
    opt = dp_optimum(seqs, k, cost)
    assert p.makespan == pytest.approx(opt, rel=1e-12, abs=1e-12)
    assert all(ix.shape[0] > 0 for ix in p.indices)
    # Balanced ranks are contiguous runs of the DFS order.
    order, _, _ = dfs_order(seqs)
    assert np.concatenate(p.indices).tolist() == order.tolist()


@settings(max_examples=200, deadline=None)
@given(batch_st(), exact_cost_st)
def test_blocks_and_best_equal_dp_optimum_of_their_orders(data, cost):
    seqs, k = data
    ref_order, lpt_loads = block_order_reference(seqs, k, cost)
    blocks_opt = dp_optimum_in_order([seqs[i] for i in ref_order], k, cost)
    blocks = partition(seqs, k, cost=cost, order="blocks")
    assert blocks.makespan == blocks_opt
    assert blocks_opt <= max(lpt_loads)  # the LPT bins are one of the cuts
    cuts = partition(seqs, k, cost=cost, order="cuts")
    assert cuts.makespan == min(blocks_opt, dp_optimum(seqs, k, cost))
    assert cuts.contiguous and cuts.method is PartitionMethod.BALANCED
    for p in (blocks, cuts):
        assert all(ix.shape[0] > 0 for ix in p.indices)
        assert p.duplicated_tokens <= (k - 1) * max(len(s) for s in seqs)
    assert partition(seqs, k, cost=cost).makespan <= cuts.makespan  # BalancedOrder.BEST


@settings(max_examples=150, deadline=None)
@given(batch_st(), cost_st, st.sampled_from(ALL_METHODS))
def test_every_sequence_once_and_loads_are_tree_costs(data, cost, method):
    seqs, k = data
    p = partition(seqs, k, method=method, cost=cost)
    assert p.k == k
    assert_assigned_once(p, len(seqs))
    for j, ix in enumerate(p.indices):
        sub = [seqs[i] for i in ix]
        assert p.tree_tokens[j] == len(brute_prefixes(sub))
        assert p.loads[j] == pytest.approx(brute_cost(sub, cost), rel=1e-12, abs=1e-12)
    assert p.global_tree_tokens == len(brute_prefixes(seqs))
    assert p.duplicated_tokens >= 0
    if p.contiguous:
        assert p.duplicated_tokens <= (k - 1) * max(len(s) for s in seqs)
    assert p.makespan == p.candidates[p.winner]


@settings(max_examples=150, deadline=None)
@given(st.lists(seq_st, min_size=0, max_size=12), cost_st)
def test_incremental_tree_cost_equals_brute_trie(seqs, cost):
    assert tree_tokens(seqs) == len(brute_prefixes(seqs))
    assert tree_cost(seqs, cost) == pytest.approx(brute_cost(seqs, cost), rel=1e-12, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(grouped_st(), cost_st, st.sampled_from(ALL_METHODS))
def test_keep_groups_never_splits_a_group(data, cost, method):
    seqs, gids, k = data
    p = partition(seqs, k, method=method, cost=cost, group_ids=gids, keep_groups=True)
    assert_assigned_once(p, len(seqs))
    rank = p.rank_of()
    for g in set(gids):
        assert len({int(rank[i]) for i, x in enumerate(gids) if x == g}) == 1
    for j, ix in enumerate(p.indices):
        assert p.loads[j] == pytest.approx(
            brute_cost([seqs[i] for i in ix], cost), rel=1e-12, abs=1e-12
        )


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_keep_groups_balanced_optimal_for_distinct_prompts(data):
    # Distinct prompts (first token = group) -> the group order is a DFS order; compare with
    # a DP over cuts at group boundaries.
    n_groups = data.draw(st.integers(1, 5))
    seqs, gids = [], []
    for g in range(n_groups):
        for _ in range(data.draw(st.integers(1, 3))):
            tail = data.draw(st.lists(st.integers(0, 2), min_size=0, max_size=3))
            seqs.append(np.array([g] + tail, np.int32))
            gids.append(g)
    k = data.draw(st.integers(1, n_groups))
    p = partition(seqs, k, group_ids=gids, keep_groups=True, order="lexicographic")
    groups = [[s for s, x in zip(seqs, gids, strict=True) if x == g] for g in range(n_groups)]

    @functools.cache
    def best(i, parts):
        if i == n_groups:
            return 0
        if parts == 0:
            return float("inf")
        return min(
            max(len(brute_prefixes([s for gr in groups[i:j] for s in gr])), best(j, parts - 1))
            for j in range(i + 1, n_groups + 1)
        )

    assert p.makespan == best(0, k)
    assert p.duplicated_tokens <= (k - 1) * max(len(s) for s in seqs)
    both = partition(seqs, k, group_ids=gids, keep_groups=True)  # BalancedOrder.BEST
    assert both.makespan <= p.makespan
    assert both.duplicated_tokens <= (k - 1) * max(len(s) for s in seqs)


def test_balanced_never_worse_than_any_contiguous_split_on_larger_input():
    # N=400 GRPO-like batch: the binary search result must match the best of all 1-cut
    # splits for K=2 (exhaustive), exactly, for both cost models.
    rng = np.random.default_rng(1)
    seqs = []
    for _ in range(50):
        prompt = rng.integers(0, 1000, rng.integers(5, 50))
        for j in range(8):
            seqs.append(
                np.concatenate([prompt, [1000 + j], rng.integers(0, 1000, rng.integers(0, 90))])
            )
    for cost in (TreeTokenCost(), FlopCost(a=1.0, b=1e-3)):
        p = partition(seqs, 2, cost=cost, order="lexicographic")
        order, lcps, lengths = dfs_order(seqs)
        inc = cost.append_cost(lengths[order], lcps)
        full = cost.append_cost(lengths[order], np.zeros_like(lcps))
        best = min(max(inc[:c].sum(), full[c] + inc[c + 1 :].sum()) for c in range(1, len(seqs)))
        assert p.makespan == pytest.approx(best, rel=1e-12)
        assert partition(seqs, 2, cost=cost).makespan <= p.makespan


# ----------------------------------------------------------------------------- never worse


BASELINES = [m for m in PartitionMethod if m is not PartitionMethod.BALANCED]


def grpo_batch(rng: np.random.Generator):
    """A GRPO-like batch: 1-8 groups of 1-8 members; each group shares a prompt (half the
    batches put one system prefix before every prompt); 30% of members fork from an earlier
    member's response at a random depth; response lengths are lognormal (median 20)."""
    system = rng.integers(0, 50, rng.integers(0, 20)) if rng.random() < 0.5 else np.zeros(0, int)
    seqs, gids = [], []
    for g in range(int(rng.integers(1, 9))):
        prompt = np.concatenate([system, rng.integers(0, 50, rng.integers(1, 40))])
        members = []
        for _ in range(int(rng.integers(1, 9))):
            resp = rng.integers(0, 50, max(1, int(rng.lognormal(3.0, 0.8))))
            if members and rng.random() < 0.3:
                base = members[int(rng.integers(0, len(members)))]
                resp = np.concatenate([base[: int(rng.integers(0, base.shape[0] + 1))], resp])
            members.append(resp)
            seqs.append(np.concatenate([prompt, resp]))
            gids.append(g)
    return seqs, gids


def assert_never_worse(seqs, k, cost, **kw):
    """BEST is <= every baseline run alone; its invariants hold for its winner. Returns it."""
    p = partition(seqs, k, cost=cost, **kw)
    assert_assigned_once(p, len(seqs))
    assert all(ix.shape[0] > 0 for ix in p.indices)  # even when a baseline winner had an empty rank
    assert p.makespan == p.candidates[p.winner] == min(p.candidates.values())
    assert set(p.candidates) >= {m.value for m in BASELINES}
    for m in BASELINES:
        alone = partition(seqs, k, method=m, cost=cost, **kw)
        assert p.candidates[m.value] <= alone.makespan
        assert p.makespan <= alone.makespan
    cut = partition(seqs, k, cost=cost, order="cuts", **kw)
    assert p.makespan <= cut.makespan
    if p.contiguous:  # a cut won: the cut's guarantees (ties go to the cut)
        assert p.method is PartitionMethod.BALANCED and p.makespan == cut.makespan
        assert [x.tolist() for x in p.indices] == [x.tolist() for x in cut.indices]
    else:  # a baseline won: strictly lower than the best cut, and it is that baseline's
        assert p.makespan < cut.makespan and p.method.value == p.winner
    return p


@settings(max_examples=120, deadline=None)
@given(batch_st(max_n=12, max_k=8), cost_st)
def test_best_never_worse_than_any_baseline(data, cost):
    seqs, k = data
    assert_never_worse(seqs, k, cost)


@settings(max_examples=60, deadline=None)
@given(grouped_st(), cost_st)
def test_best_never_worse_than_any_baseline_keep_groups(data, cost):
    seqs, gids, k = data
    p = assert_never_worse(seqs, k, cost, group_ids=gids, keep_groups=True)
    rank = p.rank_of()
    for g in set(gids):
        assert len({int(rank[i]) for i, x in enumerate(gids) if x == g}) == 1


def test_best_never_worse_on_450_grpo_batches():
    # Seeded GRPO-like batches, K = 2-8. The cut alone loses to a baseline on some of them
    # (this seed: 63 of 450, 56 to greedy by tree cost, 7 to greedy by tokens); BEST never does.
    rng = np.random.default_rng(0)
    wins = {}
    for _ in range(450):
        seqs, _ = grpo_batch(rng)
        k = min(int(rng.integers(2, 9)), len(seqs))
        p = assert_never_worse(seqs, k, TreeTokenCost())
        wins[p.winner] = wins.get(p.winner, 0) + 1
    assert sum(v for w, v in wins.items() if not w.startswith("balanced/")) > 0, wins
    assert wins["balanced/lexicographic"] + wins["balanced/blocks"] > 0.5 * 450, wins


def test_fill_empty_moves_the_smallest_unit_of_the_fullest_rank():
    # BEST gives a baseline candidate that left a rank empty one unit there before it is
    # compared (greedy by tokens / tree cost never do with K <= units; the guard is direct).
    units = [np.array([0]), np.array([1, 2]), np.array([3]), np.array([4])]
    lengths = np.array([5, 1, 1, 2, 9])
    groups = [[0, 1, 3], [], [2]]
    _fill_empty(groups, units, lengths)
    assert groups == [[0, 3], [1], [2]]  # unit 1 has 2 tokens, unit 0 has 5, unit 3 has 9
    with pytest.raises(PartitionInvariantError, match="2 units"):
        _fill_empty([[0], [], [1]], units, lengths)


# ----------------------------------------------------------------------------- RowCost


def test_row_cost_prices_every_sequence_whole():
    """A dense engine's cost: one row per sequence, shared prefixes or not. Every
    method's loads are rows x count, and the best cut balances the counts (7 -> 4 + 3)."""
    seqs = [np.array([1, 2, 3]), np.array([1, 2, 4]), np.array([1, 2]), np.array([5])]
    seqs += [np.array([5, 6, 7, 8, 9]), np.array([9]), np.array([1])]
    c = RowCost(row=2.5)
    np.testing.assert_array_equal(c.append_cost(np.array([3, 5]), np.array([2, 0])), [2.5, 2.5])
    assert tree_cost(seqs, c) == pytest.approx(2.5 * 7)
    for method in ALL_METHODS:
        p = partition(seqs, 2, cost=c, method=method)
        assert_assigned_once(p, len(seqs))
        counts = [ix.shape[0] for ix in p.indices]
        np.testing.assert_allclose(p.loads, [2.5 * n for n in counts])
        if method is PartitionMethod.BALANCED:
            assert sorted(counts) == [3, 4]
    with pytest.raises(ValueError, match=r"RowCost.row=0: must be finite and > 0"):
        RowCost(row=0)


@settings(max_examples=40, deadline=None)
@given(batch_st(max_n=12, max_k=8))
def test_row_cost_best_balances_counts_and_beats_baselines(data):
    """Under RowCost the best makespan is rows x ceil(N / K) (the count balance), and
    never above a baseline's (greedy by tree cost prices whole sequences too)."""
    seqs, k = data
    p = assert_never_worse(seqs, k, RowCost(row=3.0))
    assert p.makespan == 3.0 * -(-len(seqs) // k)


# ------------------------------------------------------------- engines' own partition cost


@functools.cache
def _abstract_model():
    """Engines' host side (prepare, features, partition_cost) needs only graphdef + cfg."""
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
    return nnx.eval_shape(lambda: init_model(cfg, seed=0))


def _sharded(engine, dp: int, **kw):
    return ShardedEngine(engine, make_mesh(dp, 1, devices=jax.devices()[:dp]), **kw)


def _trie_price(seqs, passes: float, context: float, f0: float, fa: float) -> float:
    """Independent count: passes x FLOPs of every trie node at depth p, context p + context."""
    return sum(passes * (f0 + fa * (len(n) - 1 + context)) for n in brute_prefixes(seqs))


def test_dense_partition_cost_is_its_counted_padded_work():
    """Dense: the cut's load of every rank equals the rank's padded work as the engine
    counts it (``features``) and as the prepared arrays show it (rows x row length x
    3 passes x (f0 + row length x fa)), 16 GRPO sequences over dp = 2 and 4."""
    model = _abstract_model()
    f0, fa = token_flops(model.cfg)
    batch = grpo_groups(num_groups=4, group_size=4, prompt_len=6, response_len=(3, 9), seed=0)
    for dp in (2, 4):
        sharded = _sharded(DenseEngine(model, microbatch=2), dp)
        prep = sharded.prepare(batch, ClippedSurrogateLoss.dapo())
        assert prep.cost_model == "dense"
        rows, t = np.asarray(prep.args[0]).shape[1:]  # [dp, rows, T] padded tokens
        assert rows == 16 // dp  # the rows fill their bucket: nothing priced is missing
        counted = 3.0 * rows * t * (f0 + t * fa)
        np.testing.assert_allclose(sharded.rank_work(prep), [counted] * dp, rtol=1e-12)
        np.testing.assert_allclose(prep.partition.loads, [counted] * dp, rtol=1e-12)


@pytest.mark.parametrize("kind", ["dfs", "prefix_reuse"])
def test_tree_engine_partition_cost_prices_tree_tokens(kind):
    """dfs / prefix_reuse: each rank's load is the engine's per-token rule over the
    rank's prefix trie, counted independently (dfs: 4 passes at context p + chunk;
    prefix_reuse: 3 at p + 1), and the stats name the engine's cost model. The
    engine's own padded count (``rank_work``) comes with it, >= the unpadded price
    only up to what padding adds (checked as a ratio in [0.5, 3] here)."""
    model = _abstract_model()
    f0, fa = token_flops(model.cfg)
    batch = grpo_groups(num_groups=4, group_size=4, prompt_len=6, response_len=(3, 9), seed=1)
    engine = DFSEngine(model, chunk_len=8) if kind == "dfs" else PrefixReuseEngine(model)
    passes, context = (4.0, 8.0) if kind == "dfs" else (3.0, 1.0)
    sharded = _sharded(engine, 4)
    prep = sharded.prepare(batch, ClippedSurrogateLoss.dapo())
    assert prep.cost_model == kind
    want = [
        _trie_price([batch.tokens[i] for i in ix], passes, context, f0, fa)
        for ix in prep.partition.indices
    ]
    np.testing.assert_allclose(prep.partition.loads, want, rtol=1e-12)
    ratio = np.asarray(sharded.rank_work(prep)) / np.asarray(want)
    assert np.all((ratio > 0.5) & (ratio < 3.0)), ratio


def test_sharded_cost_model_given_fallback_and_auto():
    """``cost`` wins and is named "given:..."; an engine without ``partition_cost``
    gets ``fallback_cost`` ("fallback:FlopCost"; tree tokens when None); auto's cut
    is priced by the engine it picks for the ranks."""
    model = _abstract_model()
    loss = ClippedSurrogateLoss.dapo()
    batch = grpo_groups(num_groups=4, group_size=2, prompt_len=5, response_len=(2, 6), seed=2)

    class NoCost:  # the engine API without the cost hook
        def __init__(self):
            self.inner = DFSEngine(model, chunk_len=8)
            self.name = "plain"

        def prepare(self, *a, **kw):
            return self.inner.prepare(*a, **kw)

        def device_fn(self, *a):
            return self.inner.device_fn(*a)

        def finish(self, *a):
            return self.inner.finish(*a)

    given = _sharded(DFSEngine(model, chunk_len=8), 2, cost=TreeTokenCost())
    prep = given.prepare(batch, loss)
    assert prep.cost_model == "given:TreeTokenCost"
    assert prep.partition.loads.sum() >= tree_tokens(batch.tokens)  # tree tokens, as given
    flop = FlopCost(a=1.0, b=0.5)
    fb = _sharded(NoCost(), 2, fallback_cost=flop)
    prep = fb.prepare(batch, loss)
    assert prep.cost_model == "fallback:FlopCost" and prep.partition.cost is flop
    assert fb.rank_work(prep) == []  # no features: nothing counted
    assert _sharded(NoCost(), 2).prepare(batch, loss).cost_model == "fallback:TreeTokenCost"
    auto = _sharded(AutoEngine(model, autotune=False), 2)
    for _ in range(2):  # the second batch starts from the first pick's cost
        prep = auto.prepare(batch, loss)
        chosen = prep.ranks[0].stats["chosen_engine"]
        assert prep.cost_model == chosen
