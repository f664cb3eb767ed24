"""Stage times replayed from a trace: tool-call latencies and reward times (bootstrap).

    ToolLatencySampler   every tool call's latency in a multi-turn trace
    RewardTimeSampler    the per-rank reward-stage times of a run

Both draw uniformly, with replacement, from the observed values (seeded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dtarl.traces.loaders import RunKind, RunTrace, load_trace
from dtarl.traces.records import TraceFormatError

__all__ = ["RewardTimeSampler", "ToolLatencySampler"]


def _bootstrap(values: np.ndarray, n: int, seed: int | np.random.Generator) -> np.ndarray:
    """[n] entries of ``values`` drawn uniformly with replacement (``seed``: int or Generator)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return values[rng.integers(0, values.size, size=n)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolLatencySampler:
    """Draws tool-call latencies from an empirical distribution (bootstrap, seeded).

    Attributes:
      latencies_s: observed latencies in seconds, sorted ascending, all >= 0.
    """

    latencies_s: np.ndarray

    def __post_init__(self):
        a = np.sort(np.asarray(self.latencies_s, np.float64).reshape(-1))
        if a.size == 0:
            raise ValueError("latencies_s: empty; need at least one observed latency")
        if not np.all(np.isfinite(a)) or a[0] < 0:
            raise ValueError("latencies_s: entries must be finite and >= 0")
        object.__setattr__(self, "latencies_s", a)

    @classmethod
    def from_trace(
        cls, source, *, steps: Sequence[int] | None = None, statuses: Sequence[str] | None = None
    ) -> ToolLatencySampler:
        """Latencies of every tool call in a multi-turn trace, filtered by ``statuses``."""
        run = source if isinstance(source, RunTrace) else load_trace(Path(source))
        if not isinstance(run, RunTrace) or run.kind is not RunKind.MULTI_TURN:
            raise TraceFormatError(f"{source}: not a multi-turn trace (no tool calls)")
        lat = [
            c.latency_s
            for t in run.iter_records(steps)
            for c in t.tool_calls
            if statuses is None or c.status in statuses
        ]
        return cls(latencies_s=np.asarray(lat, np.float64))

    def sample(self, n: int, *, seed: int | np.random.Generator = 0) -> np.ndarray:
        """[n] latencies drawn uniformly (with replacement) from the observed ones."""
        return _bootstrap(self.latencies_s, n, seed)

    def quantile(self, q) -> np.ndarray:
        return np.quantile(self.latencies_s, q)

    @property
    def mean_s(self) -> float:
        return float(self.latencies_s.mean())


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardTimeSampler:
    """Draws per-rank reward-stage times from a run's reward timings (bootstrap, seeded).

    The rllm trace's reward time (sandboxed test execution) barely follows the
    response lengths (``dtarl trace validate``: a length model scores ~55%), so
    the stage is replayed from the observed per-rank times themselves.

    Attributes:
      times_s: observed per-rank reward times in seconds (> 0), sorted.
      batch_size: responses per rank in the source run (the largest seen).
    """

    times_s: np.ndarray
    batch_size: int

    def __post_init__(self):
        a = np.sort(np.asarray(self.times_s, np.float64).reshape(-1))
        if a.size == 0:
            raise ValueError("times_s: empty; need at least one reward timing")
        if not np.all(np.isfinite(a)) or a[0] <= 0:
            raise ValueError("times_s: entries must be finite and > 0")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1")
        object.__setattr__(self, "times_s", a)

    @classmethod
    def from_trace(cls, source, *, steps: Sequence[int] | None = None) -> RewardTimeSampler:
        run = source if isinstance(source, RunTrace) else load_trace(Path(source))
        if not isinstance(run, RunTrace) or not run.reward_files:
            raise TraceFormatError(f"{source}: no reward_timings_step_<k>.jsonl files")
        recs = [r for r in run.iter_reward_timings(steps) if not r.validate and r.reward_time_s > 0]
        if not recs:
            raise TraceFormatError(f"{source}: no positive training reward timings")
        return cls(
            times_s=np.array([r.reward_time_s for r in recs]),
            batch_size=max(r.batch_size for r in recs),
        )

    def sample(self, n: int, *, seed: int | np.random.Generator = 0) -> np.ndarray:
        """[n] per-rank reward times drawn uniformly (with replacement) from the observed."""
        return _bootstrap(self.times_s, n, seed)
