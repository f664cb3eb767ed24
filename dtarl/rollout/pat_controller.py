"""PAT's controller (PAT, arXiv 2605.23945; the model is described in ``dtarl.rollout.pat``): the
engine's state as the predictor sees it (``EngineState``), the switch decision
(``decide``), the ``on_call`` hook that switches a running engine
(``PatController``), and ``replay`` of a recorded generation under a profile."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtarl.rollout.config import decode_windows, merged_slots
from dtarl.rollout.pat_predictor import (
    TP_DEGREES,
    PatError,
    Predictor,
    SwitchCost,
    switch_cost,
)

# ----------------------------------------------------------------------------- engine model


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineState:
    """What the controller reads from the engine between two decode calls.

    lengths / remaining: response rows held and tokens still to generate of each
    live (running) request; tp, dp, slots: the current program; cells: prompt
    rows x members (Q M); prompt_len, response_len, steps_per_call, max_slots:
    the engine's config; waiting: a request waits in the queue; cached(dp, tp,
    slots): the target program is compiled. resident / live_lengths (None: unknown,
    the recompute cost falls back to Eq. 3-4): what a recompute switch rebuilds, the
    resident prompt rows' prompt lengths and the response rows of every request
    holding a slot (running and held, slot order)."""

    tp: int
    dp: int
    slots: int
    lengths: np.ndarray
    prompts: np.ndarray
    remaining: np.ndarray
    waiting: bool
    cells: int
    prompt_len: int
    response_len: int
    steps_per_call: int
    max_slots: int
    live: int = -1  # requests holding a slot (running + held); -1: len(lengths)
    cached: Callable[[int, int, int], bool] = lambda dp, tp, slots: True
    resident: np.ndarray | None = None
    live_lengths: np.ndarray | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.tp


def program_tokens(state: EngineState, slots: int, dp: int, window) -> np.ndarray:
    """T of the engine's decode program per DP group (module docstring)."""
    w = np.asarray(window, np.float64)
    return (state.cells * state.prompt_len + slots * w) / dp


def engine_rem_time(predictor: Predictor, state: EngineState, tp: int, slots: int) -> float:
    """Predicted seconds of the decode steps left when the live requests run on a program
    of ``slots`` slots at ``tp`` (B = slots / dp; the window follows the longest active
    request as the engine picks it, per call)."""
    if state.lengths.size == 0:
        return 0.0
    dp = state.devices // tp
    n = int(state.remaining.max())
    k = np.arange(n)
    active = state.remaining[None, :] > k[:, None]
    longest = np.max(np.where(active, state.lengths[None, :] + k[:, None], 0), axis=1)
    s = state.steps_per_call
    # The engine picks a window per call, from the longest length at the call's start.
    start = (k // s) * s
    longest_at_call = longest[start]
    need = longest_at_call + s + 1
    ws = np.asarray(decode_windows(state.response_len))
    idx = np.minimum(np.searchsorted(ws, need), ws.size - 1)
    t = program_tokens(state, slots, dp, ws[idx])
    return float(np.sum(predictor.step_seconds(tp, slots / dp, t)))


# ----------------------------------------------------------------------------- controller


@dataclasses.dataclass(frozen=True)
class Decision:
    """Alg. 1's outcome at one check: ``tp`` (and ``slots``) to run next."""

    tp: int
    slots: int
    mode: str
    now_s: float  # predicted remaining time without a switch
    best_s: float  # remaining time + switch cost of the chosen target
    cost: SwitchCost | None
    candidates: dict[int, float]  # tp -> remaining + cost

    @property
    def switch(self) -> bool:
        return self.cost is not None


def decide(
    predictor: Predictor,
    state: EngineState,
    candidates: Sequence[int],
    *,
    compile_reuse: int = 1,
) -> Decision:
    """Algorithm 1 on one engine state: the candidate with the least remaining time +
    switch cost; a switch only when that beats the remaining time now. An uncached
    target's compile seconds count ``1 / compile_reuse`` (the generations expected to
    reuse its programs: the engine keeps them, PAT's communication-group cache)."""
    now = engine_rem_time(predictor, state, state.tp, state.slots)
    best = Decision(state.tp, state.slots, "none", now, now, None, {state.tp: now})
    live = int(state.lengths.size if state.live < 0 else state.live)
    if state.waiting or state.lengths.size == 0:
        return best
    contexts = state.prompts + state.lengths
    # The current TP is a candidate too, with the live requests compacted into fewer
    # slots (no weight move).
    for tp in sorted(set(candidates) | {state.tp}):
        dp = state.devices // tp
        slots = merged_slots(live, dp, state.max_slots)
        if tp == state.tp and slots >= state.slots:
            continue
        rem = engine_rem_time(predictor, state, tp, slots)
        cost = switch_cost(
            predictor,
            tp_src=state.tp,
            tp_dst=tp,
            contexts=contexts,
            cached=state.cached(dp, tp, slots),
            resident=state.resident,
            live_lengths=state.live_lengths,
        )
        if compile_reuse > 1:
            cost = dataclasses.replace(cost, compile_s=cost.compile_s / compile_reuse)
        total = rem + cost.total
        best.candidates[tp] = min(total, best.candidates.get(tp, total))
        if total < best.best_s:
            best = Decision(tp, slots, cost.mode, now, total, cost, best.candidates)
    return best


def engine_state(
    engine,
    cached: Callable[[int, int, int], bool],
    *,
    l_max: int | None = None,
    oracle: bool = False,
) -> EngineState:
    """The controller's ``EngineState`` from ``engine.view()`` and ``engine.config``.

    A request with a forced length (a trace replay, a benchmark) has its exact
    remaining length as its budget. The paper's controller knows only L_max, so by
    default such a request's remaining tokens are ``l_max`` (default, and at most:
    the engine's response rows) minus its response rows so far, at least 1;
    ``oracle=True`` reads the exact remaining length (an upper bound on what the
    controller could do). Unforced requests' budgets are what any controller knows
    (their max_new_tokens left)."""
    v, c = engine.view(), engine.config
    remaining = np.asarray(v.remaining, np.int64)
    lengths = np.asarray(v.response_tokens, np.int64)
    if not oracle and remaining.size:
        cap = c.response_len if l_max is None else int(l_max)
        guess = np.maximum(np.minimum(cap, c.response_len) - lengths, 1)
        remaining = np.where(np.asarray(v.forced, bool), guess, remaining)
    return EngineState(
        tp=int(v.tp),
        dp=int(v.dp),
        slots=int(v.slots),
        lengths=lengths,
        prompts=np.asarray(v.prompt_tokens, np.int64),
        remaining=remaining,
        waiting=bool(v.waiting),
        cells=c.prompt_slots * c.group_size,
        prompt_len=c.prompt_len,
        response_len=c.response_len,
        steps_per_call=c.steps_per_call,
        max_slots=c.slots,
        live=int(v.live),
        cached=cached,
        resident=np.asarray(v.resident_prompt_tokens, np.int64),
        live_lengths=np.asarray(v.live_response_tokens, np.int64),
    )


class PatController:
    """Algorithm 1 as the engine's ``on_call`` hook (``RolloutEngine.run(weights,
    on_call=controller)``; ``ContinuousSampler.generate(..., on_call=controller)``).

    After the first decode call and then every ``check_every`` calls it reads the
    engine (``engine_state``), runs
    ``decide`` over ``candidates`` and, when a switch pays, calls
    ``engine.reshard((dp, tp), weights, slots=..., mode=...)`` with the cheaper K/V
    mode and returns the re-placed weights. ``timeline`` lists this generation's
    switches (``begin`` starts a new one; ``history`` keeps every generation's):
    call index, seconds since ``begin``, from/to (dp, tp, slots), predicted
    remaining time without and with the switch (cost included), the predicted cost,
    the switch's measured seconds and the engine's ``info``.

    Compiled programs: a target (dp, tp, slots) counts as cached once this
    controller has switched into it (the engine keeps its programs) or it is the
    shape the engine started in; otherwise the profile's compile seconds, divided
    by ``compile_reuse`` (the generations expected to reuse the compiled programs,
    e.g. the RL steps of a run), are added to its cost. Keep one controller per
    engine across iterations for that memory.

    Remaining lengths: Alg. 1 knows L_max (``l_max``; None: the engine's response
    rows), not a forced request's exact length, unless ``oracle=True`` (the
    benchmark's upper bound; ``engine_state``).
    """

    def __init__(
        self,
        predictor: Predictor,
        *,
        candidates: Sequence[int] = TP_DEGREES,
        check_every: int = 4,
        compile_reuse: int = 1,
        l_max: int | None = None,
        oracle: bool = False,
    ):
        if not isinstance(check_every, int) or check_every < 1:
            raise PatError(f"check_every={check_every!r} must be an int >= 1")
        if not isinstance(compile_reuse, int) or compile_reuse < 1:
            raise PatError(f"compile_reuse={compile_reuse!r} must be an int >= 1")
        if l_max is not None and (not isinstance(l_max, int) or l_max < 1):
            raise PatError(f"l_max={l_max!r} must be an int >= 1 (None: the engine's rows)")
        self.compile_reuse = compile_reuse
        self.l_max, self.oracle = l_max, bool(oracle)
        self.predictor = predictor
        missing = [tp for tp in candidates if tp not in predictor.tps]
        if missing:
            raise PatError(
                f"tp_candidates: {missing} not in the profile (profiled: {list(predictor.tps)})"
            )
        self.candidates = tuple(candidates)
        self.check_every = check_every
        self.timeline: list[dict[str, Any]] = []
        self.history: list[list[dict[str, Any]]] = []
        self.checks = 0
        self._calls = 0
        self._t0 = time.perf_counter()
        self._cached: set[tuple[int, int, int]] = set()
        self._engine = None  # the engine whose compiled programs ``_cached`` describes

    def begin(self) -> None:
        """Starts a generation: call count and clock from zero, a new timeline."""
        self._calls = 0
        self._t0 = time.perf_counter()
        self.timeline = []
        self.history.append(self.timeline)

    def adopt(self, engine, compiled: Sequence[tuple[int, int, int]] = ()) -> None:
        """Starts tracking ``engine`` whose programs for the (dp, tp, slots) shapes in
        ``compiled`` exist already (e.g. the profile was taken on it:
        ``dtarl.bench.pat_profile.profile_engine(..., engine=engine)``), so switching
        into them is not charged a compile."""
        self._engine = engine
        self._cached = {(int(a), int(b), int(c)) for a, b, c in compiled}

    def cached(self, dp: int, tp: int, slots: int) -> bool:
        return (dp, tp, slots) in self._cached

    def __call__(self, engine, weights):
        self._calls += 1
        if engine is not self._engine:  # e.g. a sampler rebuilt its engine: nothing compiled
            self._engine, self._cached = engine, set()
        if self._calls > 1 and self._calls % self.check_every:
            return None  # Alg. 1 runs at the first call (the start layout may be a bad
            # fit for the whole generation) and then every ``check_every`` calls
        state = engine_state(engine, self.cached, l_max=self.l_max, oracle=self.oracle)
        self._cached.add((state.dp, state.tp, state.slots))
        self.checks += 1
        d = decide(self.predictor, state, self.candidates, compile_reuse=self.compile_reuse)
        if not d.switch:
            return None
        dp = state.devices // d.tp
        t0 = time.perf_counter()
        new, info = engine.reshard((dp, d.tp), weights, slots=d.slots, mode=d.mode)
        seconds = time.perf_counter() - t0
        self._cached.add((dp, d.tp, d.slots))
        self.timeline.append(
            dict(
                call=self._calls,
                time_s=t0 - self._t0,
                src=(state.dp, state.tp, state.slots),
                dst=(dp, d.tp, d.slots),
                live=int(state.live),
                predicted_now_s=d.now_s,
                predicted_after_s=d.best_s,
                predicted_cost_s=d.cost.total,
                predicted_gain_s=d.now_s - d.best_s,
                mode=d.mode,
                seconds=seconds,
                info={k: v for k, v in info.items() if isinstance(v, int | float | str)},
            )
        )
        return new


def _trajectory_seconds(predictor: Predictor, tp: int, active, context) -> np.ndarray:
    """Per-step predicted seconds of a (B, T) trajectory (global) run at ``tp``."""
    dp = predictor.profile.devices // tp
    b = np.ceil(np.asarray(active, np.float64) / dp)
    t = np.asarray(context, np.float64) / dp
    out = np.zeros(b.shape)
    for bb in np.unique(b):
        sel = b == bb
        out[sel] = predictor.step_seconds(tp, bb, t[sel]) if bb > 0 else 0.0
    return out


def replay(
    predictor: Predictor,
    active: Sequence[int],
    context: Sequence[int],
    *,
    candidates: Sequence[int] | None = None,
    check_every_steps: int = 16,
) -> dict[str, Any]:
    """PREDICTED latency of a generation's decode trajectory (``active`` requests and
    their summed ``context`` tokens per step, e.g. ``stats().active_per_step`` and
    ``.context_per_step``) on the profiled machine, with the paper's step cost
    ``l(B / dp, T / dp; tp)``: per static TP, and with Algorithm 1 run every
    ``check_every_steps`` steps from the best static TP (remaining time estimated with
    every active request running to the trajectory's end, as Alg. 1's L_max; switch
    cost from the profile, programs assumed compiled, K/V of the active requests at
    their mean context). Returns ``static`` {tp: s}, ``pat`` s, ``start_tp``,
    ``switches`` [(step, from, to, cost_s)], ``label`` = "PREDICTION"."""
    a = np.asarray(active, np.int64)
    c = np.asarray(context, np.float64)
    if a.shape != c.shape or a.ndim != 1 or a.size == 0:
        raise PatError(
            f"replay: active {a.shape} and context {c.shape} must be equal non-empty 1-D arrays"
        )
    tps = tuple(candidates or predictor.tps)
    per_step = {tp: _trajectory_seconds(predictor, tp, a, c) for tp in tps}
    static = {tp: float(v.sum()) for tp, v in per_step.items()}
    tp = min(static, key=static.get)
    start, total, switches = tp, 0.0, []
    n, d = a.size, predictor.profile.devices
    for k in range(n):
        if k and k % check_every_steps == 0 and a[k] > 0:

            def rem(t, k=k):
                dp = d // t
                b = math.ceil(a[k] / dp)
                return predictor.est_rem_time(t, b, n, k, context=c[k] / dp)

            now_s, best, best_s, best_cost = rem(tp), tp, None, None
            for t in tps:
                if t == tp:
                    continue
                ctx = np.full(int(a[k]), c[k] / a[k])
                cost = switch_cost(predictor, tp_src=tp, tp_dst=t, contexts=ctx, cached=True)
                total_s = rem(t) + cost.total
                if total_s < now_s and (best_s is None or total_s < best_s):
                    best, best_s, best_cost = t, total_s, cost.total
            if best != tp:
                switches.append((k, tp, best, best_cost))
                total += best_cost
                tp = best
        total += float(per_step[tp][k])
    return dict(label="PREDICTION", static=static, pat=total, start_tp=start, switches=switches)


def check_candidates(candidates: Sequence[int], *, devices: int, kv_heads: int) -> tuple[int, ...]:
    """The TP candidates, validated: each in (1, 2, 4, 8), dividing the devices and the kv
    heads."""
    out = []
    for tp in candidates:
        if tp not in TP_DEGREES or devices % tp or kv_heads % tp:
            raise PatError(
                f"tp_candidates: {tp} must be one of {TP_DEGREES} dividing the devices "
                f"({devices}) and the kv heads ({kv_heads})"
            )
        out.append(int(tp))
    if not out:
        raise PatError("tp_candidates: empty (need at least one TP degree)")
    return tuple(sorted(set(out)))


__all__ = [
    "Decision",
    "EngineState",
    "PatController",
    "check_candidates",
    "decide",
    "engine_rem_time",
    "engine_state",
    "program_tokens",
    "replay",
]
