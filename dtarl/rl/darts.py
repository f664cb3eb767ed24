"""DARTS: distribution-aware rollout trajectory shaping (arXiv 2605.30859, §4 and App. B-D).

Per RL step, for N prompts and a training group size M::

    rho_t    = sigma~_L / L~                      dataset-level length spread (EMA over steps)
    M*       = rho_t / (lambda k)                 App. B, Eq. 8 (lambda_units: per_second)
             = rho_t M N / lambda                 the same with lambda = lambda' / (k M N)
                                                  (lambda_units: relative, the default)
    M_total  = clip(floor(M*), M N, 2 M N)                                   (Eq. 9)
    M'_i     = Alg. 1: start at M, give one more candidate at a time to the prompt
               with the largest  w_i (1/M'_i - 1/(M'_i + 1)),  M'_i <= M_up = up_factor M,
               w_i = min-max normalised EMA of prompt i's length std     (Eq. 5, 10)
    rollout  = M'_i candidates of prompt i, its prompt prefilled once (the rollout
               engine's group); prompts at M'_i = M_up stop as soon as M complete
               responses exist (tail pruning with early stop, Alg. 2 line 12)
    select   = the K shortest + the L = M - K longest complete candidates (Alg. 2);
               a prompt below M_up rolls out its whole pool first: its L longest
               complete ones are known only once every candidate has finished or hit
               the length cap (§4.3.1: "the full M'_i pool is required to identify
               the longest candidates"), so only prompts at M_up stop early

lambda. The paper's utility is U(M) = rho_t ln M - lambda T(M) with T(M) = k M + c
(Eq. 6-7): k is seconds per sample, so lambda is utility per second and its value
depends on the model, the hardware and the engine. ``per_second`` takes it so.
``relative`` prices the cost in units of the M N base samples' per-sample cost
(lambda = lambda' / (k M N)): then k cancels and M* = rho_t M N / lambda', the same
for any model or machine; lambda' = rho / 1.5 reproduces the paper's observed
average M_total = 1.5 M N at a length spread rho. On a fixed-shape rollout engine
(every slot decodes each step, active or not) the fitted c is ~0, so k ~ 0 and the
per-second form would put every step at the 2 M N cap (all prompts early-stopped,
no dual-end selection).

The rollout cost model (Eq. 4) prices a batch of responses with sorted lengths
l_(1) <= ... <= l_(B) as  T = sum_m (l_(m) - l_(m-1)) PTL(B - m + 1)  when all of
them decode at once; with fewer engine slots than responses the same sum runs over
the continuous batcher's schedule (queued requests start when a slot frees), with the
per-token latency PTL(b, w) = a + c b + e w fitted (non-negative least squares) from
the engine's measured decode calls (seconds, steps, active rows, attention window
w; the window grows with the longest response, R/4 -> R/2 -> R). ``k`` is the
cost of one more sample: c times the mean response length. With several
rollout processes (data parallel) each prices its own share and the step costs
the slowest one (the paper's "maximum latency across groups").

Everything here is host-side numpy; ``DartsState`` (the EMAs and the cost-model
observations) is saved in checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
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


LAMBDA_UNITS = ("relative", "per_second")


def optimal_budget(rho: float, lam: float, k: float, m: int, n: int, units: str) -> float:
    """M* of Eq. 8 before clipping (may be inf: free samples).

    ``per_second``: rho / (lambda k), k in seconds per sample. ``relative``: lambda
    in units of the base batch's per-sample cost (lambda = lambda' / (k M N)), so
    M* = rho M N / lambda' and k cancels.
    """
    if units not in LAMBDA_UNITS:
        raise ValueError(f"units={units!r} must be one of {LAMBDA_UNITS}")
    if not lam > 0:
        raise ValueError(f"lambda={lam} must be > 0")
    if units == "relative":
        return rho * m * n / lam
    if not k > 0:
        return float("inf")
    return rho / (lam * k)


# The paper's observed average budget, in units of M N (App. B: "the solved optimal
# M_total is approximately 1.5 N M on average").
PAPER_BUDGET = 1.5


def lambda_for_budget(rho: float, budget: float = PAPER_BUDGET) -> float:
    """The relative lambda' at which Eq. 8 gives M* = ``budget`` M N for a workload
    whose length spread (sigma~_L / L~) is ``rho``: lambda' = rho / budget (relative
    units: M* = rho M N / lambda'). The paper does not publish its lambda; this puts a
    workload at the budget the paper reports, after which M_total follows rho_t."""
    if not (np.isfinite(rho) and rho > 0):
        raise ValueError(f"rho={rho} must be a finite length spread > 0")
    if not (np.isfinite(budget) and 1.0 <= budget <= 2.0):
        raise ValueError(f"budget={budget} must be in [1, 2] (x M N, Eq. 9's clip range)")
    return float(rho) / float(budget)


def clip_budget(m_star: float, m: int, n: int) -> int:
    """Eq. 9: clip(floor(M*), M N, 2 M N)."""
    if not m_star < 2 * m * n:  # inf too
        return 2 * m * n
    return int(max(np.floor(m_star), m * n))


def total_budget(
    rho: float, lam: float, k: float, m: int, n: int, units: str = "per_second"
) -> int:
    """Eq. 8-9: M_total = clip(floor(M*), M N, 2 M N) (``optimal_budget``'s M*)."""
    return clip_budget(optimal_budget(rho, lam, k, m, n, units), m, n)


# ------------------------------------------------------------- cost model


@dataclasses.dataclass
class RolloutCostModel:
    """PTL(b, w) = a + c b + e w from decode calls; Eq. 4 over sorted lengths.

    b is the number of active rows in a decode step and w the response window the
    step's attention reads (the engine picks it per call from the longest active
    request: R/4, R/2 or R), so a short rollout's steps are cheaper than a long one's.
    Observations are decode calls ``(seconds, steps, sum of active rows over the
    steps, window)``; a call without a window (3 values) has w = 0.
    """

    a: float = 0.0
    c: float = 0.0
    e: float = 0.0
    obs: list[tuple[float, ...]] = dataclasses.field(default_factory=list)
    keep: int = 256  # most recent calls used in the fit

    def observe(self, seconds: float, steps: int, active_sum: int, window: int = 0) -> None:
        if steps > 0:
            self.obs.append((float(seconds), float(steps), float(active_sum), float(window)))
            del self.obs[: -self.keep]

    def fit(self) -> bool:
        """Non-negative least squares of seconds = a steps + c sum(active) + e steps w:
        each support's least squares (three unknowns: seven supports), the smallest
        residual among the non-negative ones, a smaller support winning ties."""
        if len(self.obs) < 2:
            return False
        o = np.asarray(self.obs, np.float64)
        x = np.stack([o[:, 1], o[:, 2], o[:, 1] * o[:, 3]], axis=1)
        y = o[:, 0]
        best = None
        tol = 1e-9 * float(y @ y)  # a larger support must beat a smaller one by more
        for r in (1, 2, 3):
            for cols in itertools.combinations(range(3), r):
                sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
                if np.all(sol >= 0):
                    full = np.zeros(3)
                    full[list(cols)] = sol
                    err = float(np.sum((x @ full - y) ** 2))
                    if best is None or err < best[0] - tol:
                        best = (err, full)
        if best is None:
            return False
        self.a, self.c, self.e = (float(v) for v in best[1])
        return True

    @property
    def fitted(self) -> bool:
        return self.a > 0 or self.c > 0 or self.e > 0

    def ptl(self, b, w=0.0) -> np.ndarray:
        return self.a + self.c * np.asarray(b, np.float64) + self.e * np.asarray(w, np.float64)

    def engine_shape(self) -> tuple[int, np.ndarray]:
        """(steps per decode call, the response windows) as observed: the most steps
        seen in one call, and the distinct windows seen (empty before any)."""
        o = np.asarray(self.obs, np.float64).reshape(-1, 4)
        spc = int(o[:, 1].max()) if len(o) else 1
        return spc, np.unique(o[:, 3][o[:, 3] > 0])

    def schedule(
        self, lengths: Sequence[int], slots: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(active rows, window) of each decode step of a rollout that generated
        ``lengths`` (in submission order) on a continuous batcher with ``slots`` slots
        (None: one per response). Requests wait in order for a free slot; slots are
        refilled between decode calls of ``spc`` steps, and a call ends early when
        its last request finishes. A call reads the smallest observed window that
        holds its longest request after the call (+ 1 row), the largest when none
        does (w = 0 before any window was observed). Length-0 responses (cancelled
        before they started) take no slot. With slots >= the responses this is Eq. 4's
        sum_m (l_(m) - l_(m-1)) PTL(B - m + 1), step by step."""
        spc, seen = self.engine_shape()
        queue = [int(x) for x in lengths if int(x) > 0]
        if slots is not None and slots < 1:
            raise ValueError(f"slots={slots} must be >= 1 (None: one per response)")
        cap = len(queue) if slots is None else int(slots)
        active_steps: list[np.ndarray] = []
        window_steps: list[np.ndarray] = []
        done, left = np.zeros(0, np.int64), np.zeros(0, np.int64)  # running requests
        q = 0
        while q < len(queue) or left.size:
            free = cap - left.size
            if free > 0 and q < len(queue):
                new = np.asarray(queue[q : q + free], np.int64)
                q += new.size
                done = np.concatenate([done, np.zeros(new.size, np.int64)])
                left = np.concatenate([left, new])
            n = int(min(spc, left.max()))
            t = np.arange(n)
            active_steps.append(np.sum(left[None, :] > t[:, None], axis=1))
            need = int(done.max()) + spc + 1
            w = 0.0
            if seen.size:
                w = float(seen[min(int(np.searchsorted(seen, need)), seen.size - 1)])
            window_steps.append(np.full(n, w))
            done, left = done + np.minimum(left, n), left - np.minimum(left, n)
            keep = left > 0
            done, left = done[keep], left[keep]
        if not active_steps:
            return np.zeros(0, np.int64), np.zeros(0)
        return np.concatenate(active_steps), np.concatenate(window_steps)

    def predict(self, lengths: Sequence[int], slots: int | None = None) -> float:
        """Eq. 4 on the engine's schedule: sum over decode steps of PTL(b_t, w_t)
        (``schedule``)."""
        active, window = self.schedule(lengths, slots)
        return float(np.sum(self.ptl(active, window))) if active.size else 0.0

    def per_sample_cost(self, mean_length: float) -> float:
        """k of Eq. 6: the latency one more sample adds (c per token per row; a and e
        are paid per step whatever the number of rows)."""
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
            cost=dict(
                a=self.cost.a, c=self.cost.c, e=self.cost.e, obs=[list(o) for o in self.cost.obs]
            ),
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
                e=float(c.get("e", 0.0)),
                # calls saved without their window (3 values) have w = 0
                obs=[tuple(float(x) for x in [*o, 0.0][:4]) for o in c.get("obs", [])],
            ),
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step's allocation: candidates per prompt and which prompts stop early."""

    counts: tuple[int, ...]
    early_stop: tuple[bool, ...]
    total: int
    cost_fitted: bool  # the cost model has >= 2 decode calls (its prediction is defined)
    m_star: float = float("nan")  # Eq. 8 before clipping; NaN: uniform 1.5 M N budget
    k: float = float("nan")  # per-sample cost (s) of the cost model; NaN: not fitted


def plan(
    state: DartsState,
    keys: Sequence[str],
    *,
    m: int,
    up_factor: float,
    lam: float,
    units: str = "relative",
) -> Plan:
    """M_total (Eq. 8-9) and Alg. 1.

    The budget is uniform (1.5 M N, the paper's observed average) while its inputs
    are unknown: before any lengths were seen, and with ``units="per_second"`` also
    until the cost model has two decode calls.
    """
    n = len(keys)
    m_up = max(m, int(np.floor(up_factor * m)))
    fitted = state.cost.fit()
    k = state.cost.per_sample_cost(state.mean_len) if fitted and state.mean_len else float("nan")
    m_star = float("nan")
    if state.mean_len and (units == "relative" or fitted):
        m_star = optimal_budget(state.rho, lam, k, m, n, units)
        total = clip_budget(m_star, m, n)
    else:
        total = (3 * m * n) // 2
    total = int(np.clip(total, m * n, m_up * n))
    w = normalise([state.sigma(key) for key in keys]) if n else np.zeros(0)
    counts = allocate(w, total, m, m_up)
    return Plan(
        counts=tuple(int(c) for c in counts),
        early_stop=tuple(bool(c >= m_up and m_up > m) for c in counts),
        total=total,
        cost_fitted=fitted,
        m_star=m_star,
        k=k,
    )


def step_cost(
    cost: RolloutCostModel,
    lengths: Sequence[Sequence[int]],
    calls: Sequence[Sequence[tuple]],
    slots: int | None = None,
) -> tuple[float, float]:
    """(predicted, actual) decode seconds of a step rolled out by ``len(lengths)``
    concurrent processes: process p generated ``lengths[p]`` and made decode calls
    ``calls[p]`` (seconds first), each process's engine with ``slots`` slots. Both
    are the slowest process's (the processes decode at the same time), Eq. 4 on each
    process's own lengths (``RolloutCostModel.predict``)."""
    if len(lengths) != len(calls):
        raise ValueError(f"lengths: {len(lengths)} processes, calls: {len(calls)} (need one each)")
    pred = max((cost.predict(ls, slots) for ls in lengths), default=0.0)
    actual = max((float(sum(c[0] for c in cs)) for cs in calls), default=0.0)
    return pred, actual


__all__ = [
    "DartsState",
    "Plan",
    "RolloutCostModel",
    "LAMBDA_UNITS",
    "PAPER_BUDGET",
    "allocate",
    "clip_budget",
    "dual_end_select",
    "early_stop_select",
    "lambda_for_budget",
    "normalise",
    "optimal_budget",
    "plan",
    "prompt_key",
    "step_cost",
    "total_budget",
]
