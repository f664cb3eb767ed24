"""DARTS: distribution-aware rollout trajectory shaping (papers/002, §4 and App. B-D).

Per RL step, for N prompts and a training group size M::

    rho_t    = sigma~_L / L~                      dataset-level length spread (EMA over steps)
    k        = per-sample rollout cost            from the fitted cost model (Eq. 6)
    M_total  = clip(floor(rho_t / (lambda k)), M N, 2 M N)                   (Eq. 8-9)
    M'_i     = Alg. 1: start at M, give one more candidate at a time to the prompt
               with the largest  w_i (1/M'_i - 1/(M'_i + 1)),  M'_i <= M_up = up_factor M,
               w_i = min-max normalised EMA of prompt i's length std     (Eq. 5, 10)
    rollout  = M'_i candidates of prompt i, its prompt prefilled once (the rollout
               engine's group); prompts at M'_i = M_up stop as soon as M complete
               responses exist (tail pruning with early stop, Alg. 2 line 12)
    select   = the K shortest + the L = M - K longest complete candidates (Alg. 2)

The rollout cost model (Eq. 4) prices a batch of responses with sorted lengths
l_(1) <= ... <= l_(B) as  T = sum_m (l_(m) - l_(m-1)) PTL(B - m + 1),  with the
per-token latency PTL(b) = a + c b fitted (non-negative least squares) from the
engine's measured decode calls (seconds, steps, active slots per step). ``k`` is
the cost of one more sample: c times the mean response length.

Everything here is host-side numpy; ``DartsState`` (the EMAs and the cost-model
observations) is saved in checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

# ---------------------------------------------------------------- selection


def dual_end_select(lengths: Sequence[int], complete: Sequence[bool], m: int, k: int) -> list[int]:
    """Indices of the training group: the ``k`` shortest candidates, then the ``m - k``
    longest *complete* ones among the rest (Alg. 2, lines 6-9).

    Ties break by candidate index (stable). Truncated/invalid candidates never count
    as "longest"; when fewer complete candidates than ``m - k`` remain, the group is
    filled with the next shortest candidates, so it always has ``min(m, n)`` members.
    """
    n = len(lengths)
    if not 0 <= k <= m:
        raise ValueError(f"short_k={k} must be in [0, M={m}]")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    short = order[: min(k, n)]
    rest = [i for i in order if i not in set(short)]
    longest = sorted((i for i in rest if complete[i]), key=lambda i: (-lengths[i], i))[
        : m - len(short)
    ]
    chosen = short + longest
    for i in rest:  # too few complete long candidates: fill with the next shortest
        if len(chosen) >= min(m, n):
            break
        if i not in chosen:
            chosen.append(i)
    return chosen


def early_stop_select(
    lengths: Sequence[int], complete: Sequence[bool], finish_order: Sequence[int], m: int
) -> list[int]:
    """An early-stopped group: its first ``m`` complete responses in finish order; when
    fewer than ``m`` completed, the rest by shortest length (truncated ones last)."""
    done = [i for i in finish_order if complete[i]][:m]
    rest = sorted(
        (i for i in range(len(lengths)) if i not in set(done)),
        key=lambda i: (not complete[i], lengths[i], i),
    )
    return done + rest[: m - len(done)]


# --------------------------------------------------------------- allocation


def normalise(x: Sequence[float]) -> np.ndarray:
    """Min-max normalisation over the batch (all equal -> all ones: no preference)."""
    a = np.asarray(x, np.float64)
    lo, hi = a.min(), a.max()
    if hi - lo <= 1e-12:
        return np.ones_like(a)
    return (a - lo) / (hi - lo)


def allocate(weights: Sequence[float], total: int, m_low: int, m_up: int) -> np.ndarray:
    """Alg. 1: greedy marginal-gain allocation of ``total`` candidates over prompts.

    Minimises sum_i w_i / M'_i subject to sum M'_i = total and m_low <= M'_i <= m_up
    (the objective is separable and convex in each M'_i, so the greedy is optimal).
    Equal gains go to the lowest index.
    """
    w = np.asarray(weights, np.float64)
    n = w.size
    alloc = np.full(n, m_low, np.int64)
    remain = min(int(total), n * m_up) - n * m_low
    heap = [(-wi * (1 / m_low - 1 / (m_low + 1)), i) for i, wi in enumerate(w) if m_low < m_up]
    heapq.heapify(heap)
    while remain > 0 and heap:
        _, i = heapq.heappop(heap)
        alloc[i] += 1
        remain -= 1
        if alloc[i] < m_up:
            a = alloc[i]
            heapq.heappush(heap, (-w[i] * (1 / a - 1 / (a + 1)), i))
    return alloc


def total_budget(rho: float, lam: float, k: float, m: int, n: int) -> int:
    """Eq. 8-9: M_total = clip(floor(rho / (lambda k)), M N, 2 M N)."""
    if lam <= 0 or k <= 0 or not np.isfinite(rho / (lam * k)):
        return 2 * m * n if lam * k == 0 else m * n
    return int(np.clip(np.floor(rho / (lam * k)), m * n, 2 * m * n))


# ------------------------------------------------------------- cost model


@dataclasses.dataclass
class RolloutCostModel:
    """PTL(b) = a + c b from decode calls; Eq. 4 over sorted lengths."""

    a: float = 0.0
    c: float = 0.0
    obs: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    keep: int = 256  # most recent calls used in the fit

    def observe(self, seconds: float, steps: int, active_sum: int) -> None:
        if steps > 0:
            self.obs.append((float(seconds), float(steps), float(active_sum)))
            del self.obs[: -self.keep]

    def fit(self) -> bool:
        """Non-negative least squares of seconds = a * steps + c * sum(active)."""
        if len(self.obs) < 2:
            return False
        o = np.asarray(self.obs)
        x, y = o[:, 1:], o[:, 0]
        best = None
        for cols in ((0, 1), (0,), (1,)):  # NNLS with two unknowns: try each support
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.all(sol >= 0):
                full = np.zeros(2)
                full[list(cols)] = sol
                err = float(np.sum((x @ full - y) ** 2))
                if best is None or err < best[0]:
                    best = (err, full)
        if best is None:
            return False
        self.a, self.c = float(best[1][0]), float(best[1][1])
        return True

    @property
    def fitted(self) -> bool:
        return self.a > 0 or self.c > 0

    def ptl(self, b) -> np.ndarray:
        return self.a + self.c * np.asarray(b, np.float64)

    def predict(self, lengths: Sequence[int]) -> float:
        """Eq. 4: sum_m (l_(m) - l_(m-1)) PTL(B - m + 1) over the batch's sorted lengths."""
        ls = np.sort(np.asarray(lengths, np.float64))
        if ls.size == 0:
            return 0.0
        gaps = np.diff(np.concatenate([[0.0], ls]))
        active = ls.size - np.arange(ls.size)
        return float(np.sum(gaps * self.ptl(active)))

    def per_sample_cost(self, mean_length: float) -> float:
        """k of Eq. 6: the latency one more sample adds (c per token per row)."""
        return self.c * max(mean_length, 1.0)


# ------------------------------------------------------------------ state


def prompt_key(prompt: str) -> str:
    return hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest()


@dataclasses.dataclass
class DartsState:
    """EMAs across steps (saved in checkpoints): per-prompt length std, dataset-level
    length mean and std, and the cost model's observations."""

    ema: float = 0.9
    prompt_std: dict[str, float] = dataclasses.field(default_factory=dict)
    mean_len: float | None = None
    std_len: float | None = None
    cost: RolloutCostModel = dataclasses.field(default_factory=RolloutCostModel)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else self.ema * old + (1 - self.ema) * new

    def update(self, groups: dict[str, Sequence[int]]) -> None:
        """Folds one step's candidate lengths (per prompt key) into the EMAs."""
        all_lens = [x for v in groups.values() for x in v]
        if not all_lens:
            return
        for key, lens in groups.items():
            if len(lens) > 1:
                self.prompt_std[key] = self._blend(
                    self.prompt_std.get(key), float(np.std(lens, ddof=1))
                )
        self.mean_len = self._blend(self.mean_len, float(np.mean(all_lens)))
        self.std_len = self._blend(self.std_len, float(np.std(all_lens)))

    @property
    def rho(self) -> float:
        if not self.mean_len:
            return 0.0
        return float(self.std_len or 0.0) / self.mean_len

    def sigma(self, key: str) -> float:
        """The prompt's EMA length std; an unseen prompt takes the dataset-level one."""
        return self.prompt_std.get(key, self.std_len or 0.0)

    def state_dict(self) -> dict[str, Any]:
        return dict(
            ema=self.ema,
            prompt_std=dict(self.prompt_std),
            mean_len=self.mean_len,
            std_len=self.std_len,
            cost=dict(a=self.cost.a, c=self.cost.c, obs=[list(o) for o in self.cost.obs]),
        )

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> DartsState:
        c = d.get("cost", {})
        return cls(
            ema=float(d["ema"]),
            prompt_std={str(k): float(v) for k, v in d.get("prompt_std", {}).items()},
            mean_len=d.get("mean_len"),
            std_len=d.get("std_len"),
            cost=RolloutCostModel(
                a=float(c.get("a", 0.0)),
                c=float(c.get("c", 0.0)),
                obs=[tuple(float(x) for x in o) for o in c.get("obs", [])],
            ),
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step's allocation: candidates per prompt and which prompts stop early."""

    counts: tuple[int, ...]
    early_stop: tuple[bool, ...]
    total: int
    cost_fitted: bool  # False: no decode calls seen yet (uniform 1.5 M N budget)


def plan(
    state: DartsState,
    keys: Sequence[str],
    *,
    m: int,
    up_factor: float,
    lam: float,
) -> Plan:
    """M_total (Eq. 8-9, uniform 1.5 M N until the cost model has data) and Alg. 1."""
    n = len(keys)
    m_up = max(m, int(np.floor(up_factor * m)))
    fitted = state.cost.fit()
    if fitted and state.cost.c > 0 and state.mean_len:
        k = state.cost.per_sample_cost(state.mean_len)
        total = total_budget(state.rho, lam, k, m, n)
    else:
        total = (3 * m * n) // 2
    total = int(np.clip(total, m * n, m_up * n))
    w = normalise([state.sigma(k) for k in keys]) if n else np.zeros(0)
    counts = allocate(w, total, m, m_up)
    return Plan(
        counts=tuple(int(c) for c in counts),
        early_stop=tuple(bool(c >= m_up and m_up > m) for c in counts),
        total=total,
        cost_fitted=fitted,
    )


__all__ = [
    "DartsState",
    "Plan",
    "RolloutCostModel",
    "allocate",
    "dual_end_select",
    "early_stop_select",
    "normalise",
    "plan",
    "prompt_key",
    "total_budget",
]
