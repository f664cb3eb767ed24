"""The partition's baselines: whole units to ranks by token count or by tree cost.

    greedy_least_loaded   heaviest unit first to the least-loaded rank (AReaL / verl)
    karmarkar_karp        K-way largest differencing on unit weights
    greedy_tree           largest tree cost first to the rank whose tree grows least

``dtarl.parallel.partition`` runs them as methods of their own and, by default,
beside its balanced cuts. Units are index arrays of sequences; the DFS order
(``order``, ``lcps``, ``rank_in_order``) is the batch's lexicographic one.

Letters: N = sequences, K = ranks. Host-side numpy only; no JAX.
"""

from __future__ import annotations

import array
import bisect
import heapq

import numpy as np

from dtarl.tree.cost import CostModel

__all__ = ["greedy_least_loaded", "greedy_tree", "karmarkar_karp"]


class _SparseMin:
    """Range-min over lcps: lcp(order[a], order[b]) = min(lcps[a+1..b]) for a < b."""

    def __init__(self, x: np.ndarray):
        levels = [np.asarray(x, np.int64)]
        w = 1
        while 2 * w <= x.shape[0]:
            prev = levels[-1]
            levels.append(np.minimum(prev[:-w], prev[w:]))
            w *= 2
        # Python int arrays: indexing them is several times cheaper than numpy scalars.
        self.levels = [array.array("q", lvl.tobytes()) for lvl in levels]

    def min(self, lo: int, hi: int) -> int:
        """min x[lo:hi], hi > lo."""
        j = (hi - lo).bit_length() - 1
        lvl = self.levels[j]
        a, b = lvl[lo], lvl[hi - (1 << j)]
        return a if a < b else b


class _RankTree:
    """A rank's prefix tree as the sorted DFS positions of its sequences.

    Inserting s adds the tokens at positions [m, len(s)), m = the longest lcp of
    s with any sequence already there, which is attained at a sorted neighbour.
    """

    def __init__(self, rmq: _SparseMin):
        self.rmq = rmq
        self.pos: list[int] = []

    def shared(self, q: int) -> int:
        i = bisect.bisect_left(self.pos, q)
        m = 0
        if i > 0:
            m = self.rmq.min(self.pos[i - 1] + 1, q + 1)
        if i < len(self.pos):
            m = max(m, self.rmq.min(q + 1, self.pos[i] + 1))
        return m

    def insert(self, q: int) -> None:
        bisect.insort(self.pos, q)


def greedy_least_loaded(weights: np.ndarray, k: int) -> list[list[int]]:
    """Heaviest first to the least-loaded rank (ties: lowest rank). Unit lists per rank."""
    w = np.asarray(weights).tolist()
    order = sorted(range(len(w)), key=lambda u: (-w[u], u))
    heap = [(0, j) for j in range(k)]
    out: list[list[int]] = [[] for _ in range(k)]
    for u in order:
        load, j = heapq.heappop(heap)
        out[j].append(u)
        heapq.heappush(heap, (load + w[u], j))
    return out


def karmarkar_karp(weights: np.ndarray, k: int) -> list[list[int]]:
    """K-way largest differencing method (Karmarkar & Karp 1982; Korf's K-way form).

    Each unit starts as a K-tuple (w, 0, ..., 0). Repeatedly merge the two tuples
    with the largest spread (max - min): pair the largest subset of one with the
    smallest of the other, then normalise by the minimum.
    """
    # A subset is a merge tree: None (empty), a unit id, or a pair of subsets; merging
    # is O(1) and the subsets are flattened once at the end.
    w = [int(x) for x in weights.tolist()]
    zeros, empty = [0] * (k - 1), [None] * (k - 1)
    heap = [(-w[u], u, [w[u], *zeros], [u, *empty]) for u in range(len(w))]
    heapq.heapify(heap)
    tie = len(w)
    while len(heap) > 1:
        _, _, s1, t1 = heapq.heappop(heap)
        _, _, s2, t2 = heapq.heappop(heap)
        a = sorted(range(k), key=s1.__getitem__, reverse=True)  # stable, like key=-s1[j]
        b = sorted(range(k), key=s2.__getitem__)
        sums = [s1[i] + s2[j] for i, j in zip(a, b, strict=True)]
        sets = [
            y if x is None else x if y is None else (x, y)
            for x, y in ((t1[i], t2[j]) for i, j in zip(a, b, strict=True))
        ]
        m = min(sums)
        sums = [s - m for s in sums]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, sums, sets))
        tie += 1
    return [_merge_leaves(t) for t in heap[0][3]]


def _merge_leaves(node) -> list[int]:
    """The unit ids of a merge tree of ``karmarkar_karp``, ascending."""
    out, stack = [], [node]
    while stack:
        x = stack.pop()
        if isinstance(x, tuple):
            stack.extend(x)
        elif x is not None:
            out.append(x)
    return sorted(out)


def greedy_tree(units, lengths, order, lcps, rank_in_order, cost: CostModel, k: int):
    """Largest standalone tree cost first, to the rank whose tree cost after adding it is least.

    The marginal cost of a unit on a rank counts the prefixes it shares with the
    sequences already there and among its own members (exact, via sorted neighbours).
    Ties: the less loaded rank, then the lowest rank. The cost is additive over
    positions, so c(len, lcp) = F[len] - F[lcp] with F[n] = c(n, 0), tabulated once.
    """
    if not getattr(cost, "shares_prefix", True):  # every sequence priced whole
        full = cost.append_cost(lengths, np.zeros_like(lengths))
        weights = np.array([full[u].sum() for u in units])
        return greedy_least_loaded(weights, k)
    rmq = _SparseMin(lcps)
    max_len = int(lengths.max())
    f = cost.append_cost(np.arange(max_len + 1), np.zeros(max_len + 1, np.int64)).tolist()
    len_sorted = lengths[order].tolist()
    unit_pos = [sorted(int(q) for q in rank_in_order[u]) for u in units]

    # A member's longest shared prefix with the earlier (smaller) members of its unit
    # is its lcp with the previous one.
    intra = [
        [0] + [rmq.min(a + 1, b + 1) for a, b in zip(pos[:-1], pos[1:], strict=True)]
        for pos in unit_pos
    ]
    standalone = [
        sum(f[len_sorted[q]] - f[m] for q, m in zip(pos, sh, strict=True))
        for pos, sh in zip(unit_pos, intra, strict=True)
    ]
    trees = [_RankTree(rmq) for _ in range(k)]
    loads = [0] * k
    out: list[list[int]] = [[] for _ in range(k)]
    for u in sorted(range(len(units)), key=lambda u: (-standalone[u], u)):
        members = [(q, f[len_sorted[q]], m) for q, m in zip(unit_pos[u], intra[u], strict=True)]
        # Cost on rank j: each member shares the longer of its prefix with rank j's tree
        # and with the unit's earlier members.
        extra = [sum(fl - f[max(t.shared(q), m)] for q, fl, m in members) for t in trees]
        j = min(range(k), key=lambda j: (loads[j] + extra[j], loads[j], j))
        for q, _, _ in members:
            trees[j].insert(q)
        loads[j] += extra[j]
        out[j].append(u)
    return out
