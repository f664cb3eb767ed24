"""FLOP counts of a batch under each engine, and the calibrated per-engine cost model.

Forward FLOPs of the token at path position t (0-based) attending t + 1 keys:
``cfg.flops_per_token(t + 1)`` (linear in the context), so a run of n tokens at
positions [a, a + n) costs ``n * flops_per_token(a + (n + 1) / 2)`` exactly.
A backward pass costs 2x its forward (``BACKWARD_FACTOR``), so fwd+bwd = 3x.

    dense_flops = 3 * sum_i  F(0, n_i)                  every sequence in full
    tree_flops  = 3 * sum_x  F(start_x, length_x)       every tree node once
    ideal_ratio = dense_flops / tree_flops              the best any tree engine can do

What each engine's program computes, padding included, is counted by the engine
itself (``engine.features(prepared)`` -> ``WorkFeatures``, one counter per engine,
in ``dtarl.engines.{dense,dfs,prefix_reuse}``).

Partition cost per engine (``dense_partition_cost``, ``tree_partition_cost``): the
dp partition (``dtarl.parallel.partition``) needs an additive per-sequence price,
and each engine gives its own (``engine.partition_cost(batch)``), in FLOPs, from
the same per-token rules as its ``features``:

    dense         RowCost(P * T * (f0 + T * fa))      a padded row of length T per
                                                      sequence, shared or not (P = 3,
                                                      4 with remat)
    dfs           FlopCost(a = 4 (f0 + C fa), b = 4 fa)   every tree token once, pushed
                                                      (1 pass) and popped (3), attending
                                                      its prefix and its chunk C
    prefix_reuse  FlopCost(a = 3 (f0 + fa), b = 3 fa)     every tree token once, fwd +
                                                      bwd, causal context

Dense is exact (a rank's padded rows x T, when the rank's rows fill their power-
of-two bucket); the tree engines count the unpadded tree tokens (chunk padding,
prefix buckets, a suffix row's full-row attention and prefix_reuse's deep-group
DFS are not in the per-token price). ``ShardedEngine`` partitions with the cost
of the engine that runs (auto's pick) and reports each rank's padded work from
``features`` beside it.

Cost model (``CostModel``): predicted seconds of engine e on a batch =
``seconds_per_flop[e] * flops_e + seconds_per_step[e] * steps_e`` over its
``WorkFeatures`` (FLOPs and sequential steps, sub-programs included); the per-step
term is the engine's overhead (launches, small-batch inefficiency, padding). Both
are fitted per engine by ``fit_cost_model`` from a short calibration run
(``dtarl.engines.auto.AutoEngine.calibrate``). ``AutoEngine`` then corrects the
predictions per shape bucket by timing the compiled programs (its autotuning).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dtarl.batch import RolloutBatch
from dtarl.engines.base import WorkFeatures
from dtarl.engines.config import EngineKind
from dtarl.model.config import ModelConfig
from dtarl.tree.cost import FlopCost, RowCost
from dtarl.tree.trie import PrefixTree, build_tree

BACKWARD_FACTOR = 2.0


def run_flops(cfg: ModelConfig, start: float, n: float) -> float:
    """Forward FLOPs of n tokens at path positions [start, start + n) (causal context)."""
    if n <= 0:
        return 0.0
    return float(n) * cfg.flops_per_token(start + (n + 1) / 2.0)


def token_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(forward FLOPs of a token at context 0, attention FLOPs per context token)."""
    f0 = cfg.flops_per_token(0.0)
    return f0, cfg.flops_per_token(1.0) - f0


def dense_partition_cost(cfg: ModelConfig, row_len: int, *, passes: float) -> RowCost:
    """A dense engine's price of one sequence: a padded row of ``row_len`` tokens, each
    attending the whole row, over ``passes`` passes (3: fwd + bwd; 4 with remat)."""
    if row_len < 1 or passes <= 0:
        raise ValueError(f"dense_partition_cost: row_len={row_len} must be >= 1, passes > 0")
    f0, fa = token_flops(cfg)
    return RowCost(row=passes * row_len * (f0 + row_len * fa))


def tree_partition_cost(cfg: ModelConfig, *, passes: float, context: float) -> FlopCost:
    """A tree engine's price of a tree token at depth p: ``passes`` x its FLOPs at a
    context of p + ``context`` tokens (FlopCost a + b p, in FLOPs)."""
    if passes <= 0 or context < 0:
        raise ValueError(
            f"tree_partition_cost: passes={passes} must be > 0, context={context} >= 0"
        )
    f0, fa = token_flops(cfg)
    return FlopCost(a=passes * (f0 + context * fa), b=passes * fa)


def _tree(x: RolloutBatch | PrefixTree | Sequence) -> PrefixTree:
    if isinstance(x, PrefixTree):
        return x
    if isinstance(x, RolloutBatch):
        return build_tree(x.tokens)
    return build_tree(x)


def dense_flops(cfg: ModelConfig, batch: RolloutBatch | PrefixTree | Sequence) -> float:
    """Forward + backward FLOPs of training every sequence separately."""
    if isinstance(batch, PrefixTree):
        lengths = _sequence_lengths(batch)
    elif isinstance(batch, RolloutBatch):
        lengths = batch.lengths
    else:
        lengths = [len(s) for s in batch]
    return (1.0 + BACKWARD_FACTOR) * sum(run_flops(cfg, 0, int(n)) for n in lengths)


def tree_flops(cfg: ModelConfig, batch: RolloutBatch | PrefixTree | Sequence) -> float:
    """Forward + backward FLOPs of training every prefix-tree node exactly once."""
    tree = _tree(batch)
    fwd = sum(
        run_flops(cfg, int(tree.start[x]), int(tree.length[x])) for x in range(1, tree.num_nodes)
    )
    return (1.0 + BACKWARD_FACTOR) * fwd


def ideal_ratio(cfg: ModelConfig, batch: RolloutBatch | PrefixTree | Sequence) -> float:
    """``dense_flops / tree_flops``: the speed-up of perfect prefix reuse."""
    tree = _tree(batch)
    return dense_flops(cfg, tree) / tree_flops(cfg, tree)


def _sequence_lengths(tree: PrefixTree) -> np.ndarray:
    return np.asarray(
        [int(tree.start[x] + tree.length[x]) for x in tree.seq_node.tolist()], np.int64
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineCoef:
    """Predicted seconds = seconds_per_flop * flops + seconds_per_step * steps."""

    seconds_per_flop: float
    seconds_per_step: float

    def __post_init__(self):
        if not (self.seconds_per_flop >= 0 and self.seconds_per_step >= 0):
            raise ValueError(
                f"EngineCoef: seconds_per_flop={self.seconds_per_flop} and "
                f"seconds_per_step={self.seconds_per_step} must be >= 0"
            )

    def predict(self, work: WorkFeatures) -> float:
        return self.seconds_per_flop * work.flops + self.seconds_per_step * work.total_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-engine coefficients. ``default()`` is uncalibrated: one FLOP rate for all
    engines and a per-step overhead that makes small sequential steps cost."""

    coefs: Mapping[str, EngineCoef]

    def __post_init__(self):
        need = [k.value for k in EngineKind.auto_candidates()]
        missing = [e for e in need if e not in self.coefs]
        if missing:
            raise ValueError(f"CostModel.coefs is missing engines {missing}; need {need}")

    @classmethod
    def default(cls) -> CostModel:
        per_flop = 1.0 / 50e9
        return cls(
            coefs={
                "dense": EngineCoef(seconds_per_flop=per_flop, seconds_per_step=2e-4),
                "prefix_reuse": EngineCoef(seconds_per_flop=per_flop, seconds_per_step=2e-4),
                "dfs": EngineCoef(seconds_per_flop=per_flop, seconds_per_step=2e-4),
            }
        )

    def predict(self, work: Mapping[str, WorkFeatures]) -> dict[str, float]:
        return {e: self.coefs[e].predict(w) for e, w in work.items()}

    def choose(self, work: Mapping[str, WorkFeatures]) -> tuple[str, dict[str, float]]:
        """The engine with the smallest predicted time (ties: dense, prefix_reuse, dfs)."""
        pred = self.predict(work)
        names = [k.value for k in EngineKind.auto_candidates()]
        best = min(names, key=lambda e: (pred[e], names.index(e)))
        return best, pred


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||x c - y||_2 subject to c >= 0, exactly, by enumerating active sets (<= 6 cols).

    Columns are scaled to unit norm first so FLOP-sized and O(1) regressors mix.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64).reshape(-1)
    m, k = x.shape
    if k > 6:
        raise ValueError(f"nnls: {k} columns; this exact solver handles at most 6")
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_r = np.zeros(k), float(y @ y)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        c, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if np.any(c < 0):
            continue
        r = float(np.sum((xs[:, cols] @ c - y) ** 2))
        if r < best_r - 1e-15 * max(best_r, 1e-300):
            best_r = r
            best = np.zeros(k)
            best[cols] = c
    return best / scale


def fit_cost_model(
    samples: Sequence[tuple[str, WorkFeatures, float]], base: CostModel | None = None
) -> CostModel:
    """Fits each engine's (seconds_per_flop, seconds_per_step) to measured seconds.

    ``samples``: (engine, work, seconds) triples. Relative errors are minimised
    (each row is divided by its measured time). Engines without samples keep the
    ``base`` coefficients (default: ``CostModel.default()``).
    """
    base = base or CostModel.default()
    coefs = dict(base.coefs)
    for e in (k.value for k in EngineKind.auto_candidates()):
        rows = [(w.flops, w.total_steps, s) for k, w, s in samples if k == e and s > 0]
        if not rows:
            continue
        arr = np.asarray(rows, np.float64)
        scale = np.maximum(arr[:, :2].max(axis=0), 1e-30)
        a = arr[:, :2] / scale / arr[:, 2:3]
        x = nnls(a, np.ones(len(rows))) / scale
        coefs[e] = EngineCoef(seconds_per_flop=float(x[0]), seconds_per_step=float(x[1]))
    return CostModel(coefs=coefs)


__all__ = [
    "BACKWARD_FACTOR",
    "CostModel",
    "EngineCoef",
    "dense_flops",
    "dense_partition_cost",
    "fit_cost_model",
    "token_flops",
    "ideal_ratio",
    "nnls",
    "run_flops",
    "tree_flops",
    "tree_partition_cost",
]
