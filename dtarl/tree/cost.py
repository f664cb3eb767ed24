"""What a prefix tree costs: the DFS order of a set of sequences and cost models.

For sequences s_t in lexicographic order (a DFS order of their prefix tree) with
lcp_t = lcp(s_t, s_{t-1}) and lcp_0 = 0, the tree holds the tokens at positions
[lcp_t, len_t) of every s_t, so a cost model that charges a tree token by its
depth p prices the tree as

    C(T) = sum_t c(len_t, lcp_t),   c(len, lcp) = sum_{p=lcp}^{len-1} w(p),  w >= 0

(``TreeTokenCost`` w = 1, ``FlopCost`` w = a + b p; ``RowCost`` prices every
sequence whole). Engines price their work in these (``dtarl.engines.cost``) and
the data-parallel partition balances it (``dtarl.parallel.partition``).

Letters: N = sequences. Host-side numpy only; no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dtarl.tree.trie import lcp, sort_key

__all__ = [
    "CostModel",
    "FlopCost",
    "RowCost",
    "TreeTokenCost",
    "check_sequences",
    "dfs_order",
    "lex_order",
    "tree_cost",
    "tree_tokens",
]


# ----------------------------------------------------------------------------- cost models


class CostModel(Protocol):
    """Cost of tree tokens; ``append_cost`` must be >= 0 and additive over positions
    (a model whose ``shares_prefix`` attribute is False, e.g. ``RowCost``, instead
    prices every sequence whole, whatever prefix it shares)."""

    def append_cost(self, lengths: np.ndarray, lcps: np.ndarray) -> np.ndarray:
        """Cost of the tree tokens at positions [lcp, len) of each sequence."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeTokenCost:
    """The paper's cost: the number of tree tokens, c(len, lcp) = len - lcp (int64)."""

    def append_cost(self, lengths: np.ndarray, lcps: np.ndarray) -> np.ndarray:
        return np.asarray(lengths, np.int64) - np.asarray(lcps, np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowCost:
    """An engine that runs every sequence as its own padded row (dense): each sequence
    costs one row, c(len, lcp) = row, whatever prefix it shares with its neighbours.

    ``row`` is the work of one padded row (e.g. its training FLOPs at the engine's
    row length, ``DenseEngine.partition_cost``); the balanced method then balances
    the number of sequences per rank, which is what a rank's padded rows cost.
    """

    row: float
    shares_prefix = False  # class attribute: the partition's prefix-sharing switch

    def __post_init__(self):
        if not (np.isfinite(self.row) and self.row > 0):
            raise ValueError(f"RowCost.row={self.row}: must be finite and > 0")

    def append_cost(self, lengths: np.ndarray, lcps: np.ndarray) -> np.ndarray:
        del lcps
        return np.full(np.shape(lengths), self.row, np.float64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlopCost:
    """Linear + attention cost: a tree token at depth p (0-based position) costs a + b p.

    c(len, lcp) = a n + b n (lcp + len - 1) / 2,  n = len - lcp.

    ``a`` stands for the per-token matmul work and ``b`` for attention over the p
    earlier tokens. The default (a = 1, b = 2.6e-5) is a Qwen2.5-7B-sized decoder
    in units of one token's linear FLOPs (see ``from_transformer``).
    """

    a: float = 1.0
    b: float = 2.6e-5

    def __post_init__(self):
        if not (np.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"FlopCost.a={self.a}: must be finite and >= 0")
        if not (np.isfinite(self.b) and self.b >= 0):
            raise ValueError(f"FlopCost.b={self.b}: must be finite and >= 0")
        if self.a == 0 and self.b == 0:
            raise ValueError("FlopCost: a and b are both 0; at least one must be > 0")

    def append_cost(self, lengths: np.ndarray, lcps: np.ndarray) -> np.ndarray:
        ln = np.asarray(lengths, np.float64)
        lc = np.asarray(lcps, np.float64)
        n = ln - lc
        return self.a * n + self.b * n * (lc + ln - 1.0) * 0.5

    @classmethod
    def from_transformer(cls, *, num_params: float, num_layers: int, hidden: int) -> FlopCost:
        """Training FLOPs of a dense decoder, normalised to a = 1.

        Per token: 6 N (matmuls, fwd + bwd); attention at depth p: 12 L d p
        (QK^T and AV, fwd + bwd). So b / a = 2 L d / N.
        """
        if num_params <= 0 or num_layers <= 0 or hidden <= 0:
            raise ValueError(
                f"from_transformer: num_params={num_params}, num_layers={num_layers}, "
                f"hidden={hidden}; all must be > 0"
            )
        return cls(a=1.0, b=2.0 * num_layers * hidden / float(num_params))

    @staticmethod
    def features(sequences: Sequence) -> np.ndarray:
        """[2] = (tree tokens, sum of tree-token depths) of the prefix tree of ``sequences``.

        A measured time t ~ a * features[0] + b * features[1]; stack these rows to ``fit``.
        """
        order, lcps, lengths = dfs_order(sequences)
        ln = lengths[order].astype(np.float64)
        lc = lcps.astype(np.float64)
        n = ln - lc
        return np.array([n.sum(), (n * (lc + ln - 1.0) * 0.5).sum()])

    @classmethod
    def fit(cls, features, measured_times) -> FlopCost:
        """Non-negative least squares for t_m ~ a f_m0 + b f_m1.

        Args:
          features: [M, 2] rows from ``FlopCost.features`` (one per measured run).
          measured_times: [M] seconds (or any unit; a and b come out in that unit).
        """
        x = np.asarray(features, np.float64)
        y = np.asarray(measured_times, np.float64).reshape(-1)
        if x.ndim != 2 or x.shape[1] != 2:
            raise ValueError(f"features: expected shape [M, 2], got {x.shape}")
        if x.shape[0] != y.shape[0] or x.shape[0] < 1:
            raise ValueError(
                f"measured_times: expected {x.shape[0]} >= 1 entries matching features, "
                f"got {y.shape[0]}"
            )
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise ValueError("features / measured_times: must be finite")
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        if np.all(coef >= 0) and np.any(coef > 0):
            return cls(a=float(coef[0]), b=float(coef[1]))
        # 2-variable NNLS: the optimum has one coefficient at 0; try both.
        best = None
        for j in (0, 1):
            den = float(x[:, j] @ x[:, j])
            c = max(float(x[:, j] @ y) / den, 0.0) if den > 0 else 0.0
            r = float(np.sum((y - c * x[:, j]) ** 2))
            if c > 0 and (best is None or r < best[0]):
                best = (r, j, c)
        if best is None:
            raise ValueError("measured_times: no non-negative (a, b) fits these measurements")
        _, j, c = best
        return cls(a=c, b=0.0) if j == 0 else cls(a=0.0, b=c)


# ----------------------------------------------------------------------------- DFS order


def check_sequences(sequences: Sequence) -> list[np.ndarray]:
    """``sequences`` as 1-D integer arrays; a ValueError names the first bad one."""
    seqs = []
    for i, s in enumerate(sequences):
        a = np.asarray(s)
        if a.ndim != 1:
            raise ValueError(f"sequences[{i}]: expected a 1-D token array, got shape {a.shape}")
        if a.shape[0] == 0:
            raise ValueError(f"sequences[{i}]: length 0; every sequence needs >= 1 token")
        if a.dtype.kind not in "iub":
            raise ValueError(f"sequences[{i}]: expected integer token ids, got dtype {a.dtype}")
        seqs.append(a)
    return seqs


def lex_order(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcps) of ``dfs_order`` for sequences already through ``check_sequences``."""
    keys = [sort_key(s) for s in seqs]
    order = np.array(sorted(range(len(seqs)), key=keys.__getitem__), np.int64)
    lcps = np.zeros(len(seqs), np.int64)
    for t in range(1, len(order)):
        lcps[t] = lcp(seqs[order[t - 1]], seqs[order[t]])
    return order, lcps


def dfs_order(sequences: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lexicographic order of the sequences, a DFS order of their prefix tree.

    Returns:
      order: [N] indices into ``sequences``, lexicographically sorted (ties by index).
      lcps: [N] lcps[t] = lcp(s[order[t-1]], s[order[t]]), lcps[0] = 0.
      lengths: [N] lengths in the original order.
    """
    seqs = check_sequences(sequences)
    order, lcps = lex_order(seqs)
    return order, lcps, np.array([s.shape[0] for s in seqs], np.int64)


def tree_cost(sequences: Sequence, cost: CostModel | None = None):
    """C(T) of the prefix tree of ``sequences``: sum_t c(len_t, lcp_t) over the DFS order."""
    cost = TreeTokenCost() if cost is None else cost
    if len(sequences) == 0:
        return cost.append_cost(np.zeros(0, np.int64), np.zeros(0, np.int64)).sum()
    order, lcps, lengths = dfs_order(sequences)
    return cost.append_cost(lengths[order], lcps).sum()


def tree_tokens(sequences: Sequence) -> int:
    """Number of tokens (non-root nodes) of the prefix tree of ``sequences``."""
    return int(tree_cost(sequences, TreeTokenCost()))
