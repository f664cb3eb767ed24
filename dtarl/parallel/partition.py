"""Load-balanced data-parallel partition of a rollout batch (AREAL-DTA §4).

N rollouts (token sequences) are split over K data-parallel ranks; every rank
builds the prefix tree T_j of its own sequences, so a rank's work is the cost
C(T_j) of that tree, and the step time is the makespan max_j C(T_j).

The balanced method sorts the sequences lexicographically (a DFS order of the
global prefix tree) and cuts that order into K contiguous segments minimising
the largest segment cost. For sequences s_i in sorted order with
lcp_i = lcp(s_i, s_{i-1}), the tree of the run s_i..s_{j-1} has the tokens

    tree(i, j) = {positions [lcp_t, len_t) of s_t : i <= t < j},  lcp_i := 0,

so a cost model that charges each tree token by its depth p gives the
incremental segment cost

    C(i, j) = c(len_i, 0) + sum_{t=i+1}^{j-1} c(len_t, lcp_t),
    c(len, lcp) = sum_{p=lcp}^{len-1} w(p)        (w >= 0: TreeTokenCost w = 1,
                                                    FlopCost w = a + b p).

C is monotone (a sub-run never costs more), so the greedy scan "extend the
segment while C <= tau" is an exact feasibility test for "K segments of cost
<= tau", and binary search over tau finds the optimal contiguous cut. The
search keeps its upper end on an achieved segment cost, so it is exact for
integer and floating costs alike (see ``_balanced_cuts``).

Contiguous cuts of a DFS order duplicate at most the shared prefix at each of
the K-1 cuts: sum_j tree_tokens(T_j) - tree_tokens(T) <= (K-1) max_len.

Which DFS order. The lexicographic order is one DFS order of many: the children
of any tree node may be visited in any order, and everything above holds for
each. ``BalancedOrder.BEST`` (the default) also tries the order whose top-level
subtrees (GRPO groups, when the prompts differ) are laid out as a longest-
processing-time assignment of whole subtrees to K bins, and keeps the lower of
the two optimal cuts. Without it the lexicographic cut can be worse than plain
LPT on whole groups when a batch has few, large groups (the order then forces
two big neighbours onto one rank); with it the balanced makespan is never above
that LPT (those bins are one of the cuts it considers).

Baselines: greedy to the least-loaded rank by token count (the paper's baseline;
AReaL / verl dispatch by token count), greedy by tree cost, and Karmarkar-Karp
(largest differencing) on token counts.

Never worse than a baseline. The optimal contiguous cut is not the optimal
assignment: a baseline may cut the tree where no DFS order can. On 450 seeded
GRPO-like batches (``grpo_batch`` in tests/parallel/test_partition.py: 1-8
groups of 1-8 members, prompts of 1-40 tokens behind an optional shared system
prefix, 30% of members forking from a sibling's response, lognormal response
lengths), K = 2-4, tree-token cost, the best cut had a higher makespan than
greedy by tokens on 10 batches (up to 1.19x) and than some baseline on 76 (up to
1/0.838 = 1.19x, mean 4.4% above it). So ``BalancedOrder.BEST`` (the default)
also runs the three baselines on the same units and returns the lowest makespan
under the same cost model, ties to the cut. Winners over those 450 batches:

    cost          lexicographic  blocks  greedy_tree  greedy_tokens  karmarkar_karp
    tree tokens   213            161     68           7              1
    FlopCost()    207            165     70           7              1

(K = 2-8, tree tokens: 266 / 121 / 56 / 7 / 0.) ``Partition.winner`` names it,
``Partition.method`` is its method and ``Partition.candidates`` holds every
candidate's makespan. The baselines cost host time: at K = 8 on one PolyTrace
step (CPU time, tree tokens, min of 5) math (N = 768) 2.1 ms for the cuts, 17 ms
with the baselines; search per turn (N = 5424) 11 ms and 145 ms (greedy by tree
cost is most of it). ``BalancedOrder.CUTS`` is the cut alone.

Invariants by winner. Every winner assigns every sequence exactly once, leaves
no rank empty (an empty rank of a baseline candidate is given the smallest unit
of the rank with most units first, which cannot raise the makespan) and, with
``keep_groups``, never splits a group. Only a cut winner (``contiguous``) has
ranks that are contiguous runs of a DFS order and the duplication bound above;
a baseline winner duplicates whatever prefixes it splits, and its lower makespan
is the only thing it is chosen for.

Letters: N = sequences, K = ranks, G = groups (units with ``keep_groups``).
Host-side numpy only; no JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from dtarl.parallel.baselines import greedy_least_loaded, greedy_tree, karmarkar_karp
from dtarl.tree.cost import (
    CostModel,
    FlopCost,
    RowCost,
    TreeTokenCost,
    check_sequences,
    dfs_order,
    lex_order,
    tree_cost,
    tree_tokens,
)
from dtarl.tree.trie import lcp

__all__ = [
    "BalancedOrder",
    "CostModel",
    "FlopCost",
    "Partition",
    "PartitionInvariantError",
    "PartitionMethod",
    "RowCost",
    "TreeTokenCost",
    "dfs_order",
    "partition",
    "partition_batch",
    "tree_cost",
    "tree_tokens",
]


class PartitionInvariantError(RuntimeError):
    """An internal guarantee of the partitioner was violated (a bug, please report)."""


class PartitionMethod(enum.Enum):
    """How sequences are assigned to ranks.

    BALANCED:       contiguous cuts of the DFS order, min-max tree cost (AREAL-DTA).
    GREEDY_TOKENS:  longest first to the rank with the fewest tokens (AReaL / verl).
    GREEDY_TREE:    largest tree cost first to the rank with the smallest tree cost
                    after adding it (marginal cost counts the prefixes it shares there).
    KARMARKAR_KARP: K-way largest differencing method on token counts.
    """

    BALANCED = "balanced"
    GREEDY_TOKENS = "greedy_tokens"
    GREEDY_TREE = "greedy_tree"
    KARMARKAR_KARP = "karmarkar_karp"


class BalancedOrder(enum.Enum):
    """Which DFS order the balanced method cuts into K contiguous segments.

    LEXICOGRAPHIC: the lexicographic order of the sequences (AREAL-DTA §4).
    BLOCKS:        the lexicographic order with its top-level blocks permuted. A block is
                   a sibling subtree under the prefix every sequence shares (one GRPO
                   group when the prompts differ); blocks are dealt to K bins largest
                   first, to the least loaded bin (LPT on C(block)), and laid out bin by
                   bin. Permuting siblings keeps a DFS order, so the duplication bound
                   holds, and the cut can still split a block where two bins meet.
    CUTS:          both; the one with the lower optimal makespan (ties: lexicographic).
                   Always a contiguous cut of a DFS order.
    BEST:          CUTS, and also the three baselines (greedy by tokens, greedy by tree
                   cost, Karmarkar-Karp on the same units); the lowest makespan under the
                   cost model wins (ties: the cut). Never worse than any baseline, but a
                   baseline winner is not contiguous (see the module docstring).
    """

    LEXICOGRAPHIC = "lexicographic"
    BLOCKS = "blocks"
    CUTS = "cuts"
    BEST = "best"


# ----------------------------------------------------------------------------- result


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Partition:
    """Assignment of N sequences to K ranks.

    Attributes:
      method: the method whose assignment this is. With ``BalancedOrder.BEST`` (the
        balanced default) it is the winner: ``BALANCED`` for a contiguous cut, or the
        baseline whose assignment had the lower makespan.
      cost: the cost model the loads are measured with.
      indices: K int64 arrays of indices into the original batch, each in DFS
        (lexicographic) order of its rank's sequences. Every index appears once.
      loads: [K] C(T_j) of each rank's own prefix tree under ``cost``.
      tree_tokens: [K] tree tokens of each rank's prefix tree.
      global_tree_tokens: tree tokens of the prefix tree of the whole batch.
      total_tokens: sum of sequence lengths (no prefix sharing at all).
      max_len: longest sequence length.
      candidates: makespan of every assignment the call considered, by name:
        "balanced/lexicographic", "balanced/blocks" (the optimal cut of each order),
        and with ``BalancedOrder.BEST`` "greedy_tokens", "greedy_tree",
        "karmarkar_karp" (a baseline's makespan after any empty rank was filled, never
        above that baseline's own). A baseline method alone: {its value: makespan}.
      winner: the key of ``candidates`` returned; ``makespan == candidates[winner]``.
    """

    method: PartitionMethod
    cost: CostModel
    indices: tuple[np.ndarray, ...]
    loads: np.ndarray
    tree_tokens: np.ndarray
    global_tree_tokens: int
    total_tokens: int
    max_len: int
    candidates: dict[str, float] = dataclasses.field(default_factory=dict)
    winner: str = ""

    @property
    def contiguous(self) -> bool:
        """True when a balanced cut won: ranks are contiguous runs of the order it cut (a DFS
        order, or with ``keep_groups`` the group order of ``partition``'s docstring)."""
        return self.winner.startswith("balanced/")

    @property
    def k(self) -> int:
        return len(self.indices)

    @property
    def makespan(self) -> float:
        """max_j C(T_j): the simulated step time under ``cost``."""
        return float(self.loads.max())

    @property
    def max_load(self) -> float:
        return float(self.loads.max())

    @property
    def mean_load(self) -> float:
        return float(self.loads.mean())

    @property
    def imbalance(self) -> float:
        """max / mean load (1.0 = perfect balance)."""
        m = self.mean_load
        return float(self.max_load / m) if m > 0 else 1.0

    @property
    def duplicated_tokens(self) -> int:
        """Tree tokens computed on more than one rank: sum_j |T_j| - |T|."""
        return int(self.tree_tokens.sum()) - self.global_tree_tokens

    @property
    def duplication_bound(self) -> int:
        """(K - 1) max_len, the bound for contiguous cuts of a DFS order."""
        return (self.k - 1) * self.max_len

    def rank_of(self) -> np.ndarray:
        """[N] the rank each sequence is assigned to."""
        n = sum(ix.shape[0] for ix in self.indices)
        out = np.full(n, -1, np.int64)
        for j, ix in enumerate(self.indices):
            out[ix] = j
        return out

    def split(self, batch) -> tuple:
        """Per-rank sub-batches of a ``RolloutBatch`` (``batch.select`` per rank)."""
        return tuple(batch.select(ix) for ix in self.indices)


# ----------------------------------------------------------------------------- balanced


def _segment_prefix(full: np.ndarray, inc: np.ndarray):
    """C(i, j) = base[i] + P[j] with P[j] = sum_{t<j} inc[t], base[i] = full[i] - inc[i] - P[i]."""
    p = np.concatenate([np.zeros(1, inc.dtype), np.cumsum(inc)])
    base = full - inc - p[:-1]
    return base, p


def _greedy_cuts(base, p, tau, k: int) -> list[int] | None:
    """Greedy scan: each segment extends while its cost <= tau. Start offsets or None."""
    n = base.shape[0]
    starts = []
    i = 0
    while i < n:
        if len(starts) == k:
            return None
        # costs of [i, j) for j = i+1..n are base[i] + p[i+1:], non-decreasing in j.
        reach = int(np.searchsorted(base[i] + p[i + 1 :], tau, side="right"))
        if reach == 0:
            return None
        starts.append(i)
        i += reach
    return starts


def _segment_costs(base, p, starts: list[int], n: int) -> np.ndarray:
    ends = starts[1:] + [n]
    return np.array([base[s] + p[e] for s, e in zip(starts, ends, strict=True)])


def _balanced_cuts(full: np.ndarray, inc: np.ndarray, k: int) -> list[int]:
    """Segment start offsets minimising max_j C(segment j) over <= k contiguous segments.

    Binary search over tau with invariants: tau = lo is infeasible and hi is an
    achieved segment cost of a feasible partition. A feasible probe moves hi
    down to the makespan the greedy achieved (a candidate cost <= probe), so on
    termination no representable value lies in (lo, hi) and hi is the optimum.
    Integer costs bisect over integers; float costs stop when the midpoint
    rounds onto an end.
    """
    base, p = _segment_prefix(full, inc)
    n = full.shape[0]
    integer = np.issubdtype(full.dtype, np.integer)
    lo = full.max()  # every segment holds a sequence, so OPT >= max_i C(i, i+1).
    starts = _greedy_cuts(base, p, lo, k)
    if starts is not None:
        return starts
    starts = [0]
    hi = base[0] + p[n]
    while True:
        mid = (lo + hi) // 2 if integer else lo + (hi - lo) / 2
        if not lo < mid < hi:
            break
        probe = _greedy_cuts(base, p, mid, k)
        if probe is None:
            lo = mid
        else:
            starts = probe
            hi = _segment_costs(base, p, probe, n).max()
    return starts


def _fill_to_k(starts: list[int], n_units: int, k: int) -> list[int]:
    """Halve the segment with most units until there are k (C is monotone: max cost can't rise)."""
    s = sorted(starts)
    while len(s) < k:
        sizes = np.diff(np.array(s + [n_units]))
        j = int(np.argmax(sizes))
        bisect.insort(s, s[j] + int(sizes[j]) // 2)
    return s


def _unit_costs(ln: np.ndarray, lc: np.ndarray, unit_len: np.ndarray, cost: CostModel):
    """Per unit of an order: full = C(unit alone), inc = cost it appends after the previous unit.

    ``ln`` / ``lc`` are the lengths and consecutive lcps of the sequences in that order.
    Returns (full_u, inc_u, bounds) with unit u = sequences bounds[u]:bounds[u+1].
    """
    inc_seq = cost.append_cost(ln, lc)
    full_seq = cost.append_cost(ln, np.zeros_like(lc))
    bounds = np.concatenate([[0], np.cumsum(unit_len)])
    csum = np.concatenate([np.zeros(1, inc_seq.dtype), np.cumsum(inc_seq)])
    inc_u = csum[bounds[1:]] - csum[bounds[:-1]]
    full_u = inc_u - inc_seq[bounds[:-1]] + full_seq[bounds[:-1]]
    return full_u, inc_u, bounds


@dataclasses.dataclass(frozen=True)
class _CutOrder:
    """One candidate order of the balanced method and its optimal cut."""

    seq_order: np.ndarray  # [N] sequence indices
    bounds: np.ndarray  # [U+1] unit u = seq_order[bounds[u]:bounds[u+1]]
    starts: list[int]  # first unit of each segment
    makespan: float  # max segment cost (the incremental sum)


def _cut(seq_order, lc, unit_len, lengths, cost: CostModel, k: int) -> _CutOrder:
    full_u, inc_u, bounds = _unit_costs(lengths[seq_order], lc, unit_len, cost)
    starts = _balanced_cuts(full_u, inc_u, k)
    base, p = _segment_prefix(full_u, inc_u)
    span = float(_segment_costs(base, p, starts, full_u.shape[0]).max())
    return _CutOrder(seq_order=seq_order, bounds=bounds, starts=starts, makespan=span)


def _block_order(seqs, seq_order, lc, unit_len, lengths, cost: CostModel, k: int):
    """The unit order with its top-level blocks dealt to k bins by LPT and laid out bin by bin.

    A block starts at every unit boundary whose lcp equals the batch's common prefix
    m0 = min(lc[1:]). Returns (seq_order, lc, unit_len) of the permuted order, or None
    when there are fewer than 2 blocks.
    """
    n_units = unit_len.shape[0]
    if n_units < 2:
        return None
    full_u, inc_u, bounds = _unit_costs(lengths[seq_order], lc, unit_len, cost)
    m0 = lc[1:].min()
    first = np.flatnonzero(lc[bounds[1:-1]] == m0) + 1  # units that start a block (besides 0)
    bstart = np.concatenate([[0], first])
    if bstart.shape[0] < 2:
        return None
    bend = np.concatenate([bstart[1:], [n_units]])
    csum = np.concatenate([np.zeros(1, inc_u.dtype), np.cumsum(inc_u)])
    bcost = full_u[bstart] + (csum[bend] - csum[bstart + 1])  # C(block alone)
    bins = greedy_least_loaded(bcost, k)  # LPT: largest block first, to the least loaded bin
    blocks = [b for g in bins for b in sorted(g)]
    units = np.concatenate([np.arange(bstart[b], bend[b]) for b in blocks])
    new_order = np.concatenate([seq_order[bounds[u] : bounds[u + 1]] for u in units])
    new_lc = np.concatenate([lc[bounds[u] : bounds[u + 1]] for u in units]).copy()
    # Only a block's first sequence gets a new predecessor.
    heads = np.cumsum(np.concatenate([[0], unit_len[units]]))[:-1]
    for h in heads[np.isin(units, bstart)]:
        new_lc[h] = 0 if h == 0 else lcp(seqs[new_order[h - 1]], seqs[new_order[h]])
    return new_order, new_lc, unit_len[units]


# ----------------------------------------------------------------------------- partition


def _units(n: int, group_ids, keep_groups: bool) -> list[np.ndarray]:
    if group_ids is None:
        if keep_groups:
            raise ValueError("group_ids: required with keep_groups=True (one id per sequence)")
        return [np.array([i], np.int64) for i in range(n)]
    g = np.asarray(group_ids).reshape(-1)
    if g.shape[0] != n:
        raise ValueError(f"group_ids: expected {n} entries (one per sequence), got {g.shape[0]}")
    if not keep_groups:
        return [np.array([i], np.int64) for i in range(n)]
    _, inv = np.unique(g, return_inverse=True)
    members = [[] for _ in range(int(inv.max()) + 1)]
    for i, u in enumerate(inv.tolist()):
        members[u].append(i)
    return [np.array(m, np.int64) for m in members]


def partition(
    sequences: Sequence,
    k: int,
    *,
    method: PartitionMethod | str = PartitionMethod.BALANCED,
    cost: CostModel | None = None,
    group_ids=None,
    keep_groups: bool = False,
    order: BalancedOrder | str = BalancedOrder.BEST,
    dfs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Partition:
    """Splits N sequences over K data-parallel ranks.

    Args:
      sequences: N 1-D integer token arrays, each of length >= 1.
      k: number of ranks, 1 <= k <= N (<= number of groups with ``keep_groups``).
      method: a ``PartitionMethod`` (or its value string).
      cost: the per-rank cost model C(T_j) (``TreeTokenCost()`` by default); the
        balanced and greedy-tree methods optimise it, and every method's loads
        are measured with it.
      group_ids: [N] group (prompt) ids; only used with ``keep_groups``.
      keep_groups: assign whole groups (units = groups); a group's sequences never
        split across ranks.
      order: the DFS order(s) the balanced method cuts, and with ``BEST`` (the
        default) the baselines it also tries (``BalancedOrder``); ignored by the
        baselines.
      dfs: ``dfs_order(sequences)`` of these very sequences, to reuse it across
        calls on one batch (it is the O(N log N) part); computed when None.

    Returns:
      A ``Partition``; with the balanced method every rank is non-empty, and
      ``winner`` / ``method`` say which candidate was returned (a baseline method
      called alone may leave a rank empty).

    With ``keep_groups`` the balanced method orders groups by their smallest
    member and each group's members lexicographically, and prices a segment by
    the incremental sum over that order. That equals the tree cost whenever the
    groups occupy disjoint lexicographic ranges (distinct prompts: the GRPO case)
    and is an upper bound otherwise; the duplication bound is checked only when
    the group order is a DFS order.
    """
    if isinstance(method, str):
        try:
            method = PartitionMethod(method)
        except ValueError:
            raise ValueError(
                f"method={method!r}: expected one of {[m.value for m in PartitionMethod]}"
            ) from None
    if not isinstance(method, PartitionMethod):
        raise ValueError(f"method={method!r}: expected a PartitionMethod")
    try:
        order_kind = BalancedOrder(order)
    except ValueError:
        raise ValueError(
            f"order={order!r}: expected one of {[o.value for o in BalancedOrder]}"
        ) from None
    cost = TreeTokenCost() if cost is None else cost
    seqs = check_sequences(sequences)
    n = len(seqs)
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise ValueError(f"k={k!r}: expected an int number of ranks")
    k = int(k)
    units = _units(n, group_ids, keep_groups)
    n_units = len(units)
    what = "number of groups" if keep_groups else "number of sequences"
    if not 1 <= k <= max(n_units, 1) or n == 0:
        raise ValueError(f"k={k}: must be in [1, {n_units}] (the {what}); got N={n} sequences")

    lengths = np.array([s.shape[0] for s in seqs], np.int64)
    if dfs is None:
        order_ix, lcps = lex_order(seqs)
    else:
        order_ix, lcps, dfs_len = (np.asarray(a, np.int64) for a in dfs)
        if order_ix.shape != (n,) or lcps.shape != (n,) or not np.array_equal(dfs_len, lengths):
            raise ValueError(
                f"dfs: expected dfs_order(sequences) of these {n} sequences (order, lcps, "
                f"lengths, each [{n}]); got shapes {order_ix.shape}, {lcps.shape}, "
                f"{dfs_len.shape} or different lengths"
            )
    rank_in_order = np.empty(n, np.int64)
    rank_in_order[order_ix] = np.arange(n)
    ctx = _Ctx(cost, lengths, order_ix, lcps, rank_in_order)

    # Candidates: (name, method, per-rank sequence indices, contiguous cut of a DFS order).
    cands: list[tuple[str, PartitionMethod, list[np.ndarray], bool]] = []
    if method is PartitionMethod.BALANCED:
        if keep_groups:
            # Units in DFS order of their smallest member; members in DFS order.
            members = [np.sort(rank_in_order[u]) for u in units]
            uorder = sorted(range(n_units), key=lambda u: members[u][0])
            seq_order = np.concatenate([order_ix[members[u]] for u in uorder])
            unit_len = np.array([members[u].shape[0] for u in uorder], np.int64)
            dfs_cut = bool(np.all(np.diff(rank_in_order[seq_order]) > 0))
            u_lcps = np.zeros(n, np.int64)
            for t in range(1, n):
                u_lcps[t] = lcp(seqs[seq_order[t - 1]], seqs[seq_order[t]])
        else:
            seq_order, unit_len, u_lcps, dfs_cut = order_ix, np.ones(n, np.int64), lcps, True
        orders = []
        if order_kind is not BalancedOrder.BLOCKS:
            orders.append(("balanced/lexicographic", (seq_order, u_lcps, unit_len)))
        if order_kind is not BalancedOrder.LEXICOGRAPHIC:
            blocks = _block_order(seqs, seq_order, u_lcps, unit_len, lengths, cost, k)
            if blocks is not None:
                orders.append(("balanced/blocks", blocks))
            elif not orders:
                orders.append(("balanced/lexicographic", (seq_order, u_lcps, unit_len)))
        for name, (o, lc, ul) in orders:
            cut = _cut(o, lc, ul, lengths, cost, k)
            starts = _fill_to_k(cut.starts, n_units, k)
            ends = starts[1:] + [n_units]
            b = cut.bounds
            ranks = [cut.seq_order[b[s] : b[e]] for s, e in zip(starts, ends, strict=True)]
            cands.append((name, method, ranks, dfs_cut))
        baselines = list(_BASELINES) if order_kind is BalancedOrder.BEST else []
    else:
        baselines = [method]
    for m in baselines:
        groups = _baseline(m, units, lengths, ctx, k)
        if method is PartitionMethod.BALANCED:
            _fill_empty(groups, units, lengths)  # balanced ranks are never empty
        ranks = [
            np.concatenate([units[u] for u in g]) if g else np.zeros(0, np.int64) for g in groups
        ]
        cands.append((m.value, m, ranks, False))

    measured = [ctx.measure(ranks) for _, _, ranks, _ in cands]
    makespans = {name: float(mz[1].max()) for (name, *_), mz in zip(cands, measured, strict=True)}
    # Lowest makespan; ties go to the earlier candidate (the cuts come first).
    best = min(range(len(cands)), key=lambda c: (makespans[cands[c][0]], c))
    name, won, _, check_bound = cands[best]
    indices, loads, ttok = measured[best]
    result = Partition(
        method=won,
        cost=cost,
        indices=tuple(indices),
        loads=loads,
        tree_tokens=ttok,
        global_tree_tokens=int((lengths[order_ix] - lcps).sum()),
        total_tokens=int(lengths.sum()),
        max_len=int(lengths.max()),
        candidates=makespans,
        winner=name,
    )
    if sorted(np.concatenate(indices).tolist()) != list(range(n)):
        raise PartitionInvariantError(f"{name}: not every sequence assigned exactly once")
    if method is PartitionMethod.BALANCED and any(ix.shape[0] == 0 for ix in indices):
        raise PartitionInvariantError(f"{name}: a balanced partition left a rank empty")
    if check_bound and result.duplicated_tokens > result.duplication_bound:
        raise PartitionInvariantError(
            f"{name}: duplicated tokens {result.duplicated_tokens} > (K-1)*max_len = "
            f"{result.duplication_bound}"
        )
    return result


_BASELINES = (
    PartitionMethod.GREEDY_TOKENS,
    PartitionMethod.GREEDY_TREE,
    PartitionMethod.KARMARKAR_KARP,
)


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """One batch's lengths and global DFS order, shared by the candidates of a call."""

    cost: CostModel
    lengths: np.ndarray  # [N]
    order: np.ndarray  # [N] the lexicographic order
    lcps: np.ndarray  # [N] consecutive lcps of that order
    rank_in_order: np.ndarray  # [N] position of each sequence in it

    def measure(self, ranks: list[np.ndarray]):
        """Every rank's tree under the cost model, in DFS order: (indices, loads, tree tokens).

        For positions q_a < q_b of the global order, lcp = min(lcps[q_a + 1 .. q_b]).
        """
        indices, loads, ttok = [], [], []
        for ix in ranks:
            pos = np.sort(self.rank_in_order[ix])
            ix = self.order[pos]
            lc = np.zeros(pos.shape[0], np.int64)
            if pos.shape[0] > 1:
                lc[1:] = np.minimum.reduceat(self.lcps[: pos[-1] + 1], pos[:-1] + 1)
            indices.append(ix.astype(np.int64))
            loads.append(self.cost.append_cost(self.lengths[ix], lc).sum())
            ttok.append(int((self.lengths[ix] - lc).sum()))
        return indices, np.array(loads), np.array(ttok, np.int64)


def _baseline(method: PartitionMethod, units, lengths, ctx: _Ctx, k: int) -> list[list[int]]:
    """Unit ids per rank of a baseline method."""
    if method is PartitionMethod.GREEDY_TREE:
        return greedy_tree(units, lengths, ctx.order, ctx.lcps, ctx.rank_in_order, ctx.cost, k)
    starts = np.cumsum([0] + [u.shape[0] for u in units[:-1]])
    unit_tokens = np.add.reduceat(lengths[np.concatenate(units)], starts).astype(np.int64)
    if method is PartitionMethod.GREEDY_TOKENS:
        return greedy_least_loaded(unit_tokens, k)
    return karmarkar_karp(unit_tokens, k)


def _fill_empty(groups: list[list[int]], units, lengths) -> None:
    """Gives every empty rank one unit, in place: the unit with the fewest tokens of the
    rank with the most units (ties: lowest rank, then lowest unit).

    The makespan cannot rise: removing a unit never raises its rank's tree cost (the
    cost is monotone), and a unit alone costs at most the load of the rank it was on.
    """
    for j in range(len(groups)):
        if groups[j]:
            continue
        donor = max(range(len(groups)), key=lambda r: (len(groups[r]), -r))
        if len(groups[donor]) < 2:
            raise PartitionInvariantError("no rank holds 2 units to fill an empty rank (K > units)")
        u = min(groups[donor], key=lambda u: (int(lengths[units[u]].sum()), u))
        groups[donor].remove(u)
        groups[j].append(u)


def partition_batch(batch, k: int, **kwargs) -> Partition:
    """``partition`` of a ``RolloutBatch``'s tokens, with its ``group_ids``."""
    kwargs.setdefault("group_ids", batch.group_ids)
    return partition(batch.tokens, k, **kwargs)
