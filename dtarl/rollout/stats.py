"""What the continuous engine reports: ``EngineStats`` (``RolloutEngine.stats()``), the
counters behind it (``StatsRecorder``) and ``EngineView`` (``RolloutEngine.view()``, a
switch controller's snapshot). No JAX."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# (seconds, steps, sum of active slots over the steps, response window read) of a
# decode call that compiled nothing
DecodeCall = tuple[float, int, int, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """The engine's counters since the last ``stats(reset=True)`` (``seconds``: in
    ``step``/``run``, ``on_call`` included), plus its state now (``allocated_kv_bytes``,
    ``trace_count``)."""

    seconds: float
    decode_calls: int
    decode_steps: int
    prefill_calls: int
    prefill_tokens: int
    extend_calls: int
    generated_tokens: int
    calls: tuple[DecodeCall, ...]  # per decode call that compiled nothing
    peak_kv_bytes: int  # the most live K/V bytes held by a decode call
    switches: tuple[dict[str, Any], ...]  # the info dict of every ``reshard``
    control_seconds: float  # in ``run``'s on_call (switches included)
    active_per_step: np.ndarray  # [decode steps] int64 active slots
    context_per_step: np.ndarray  # [decode steps] int64 tokens the active slots attend
    slot_utilisation: float  # mean active slots / config.slots
    tokens_per_second: float  # generated_tokens / seconds
    allocated_kv_bytes: int
    trace_count: int
    callback_errors: int  # user callbacks that raised (``RolloutEngine.errors``)


class StatsRecorder:
    """The mutable counters of ``EngineStats`` (the engine adds to them)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.decode_calls = 0
        self.decode_steps = 0
        self.prefill_calls = 0
        self.prefill_tokens = 0
        self.extend_calls = 0
        self.generated_tokens = 0
        self.active: list[int] = []
        self.context: list[int] = []
        self.calls: list[DecodeCall] = []
        self.peak_kv_bytes = 0
        self.switches: list[dict[str, Any]] = []
        self.control_seconds = 0.0

    def snapshot(
        self, *, slots: int, allocated_kv_bytes: int, trace_count: int, callback_errors: int
    ) -> EngineStats:
        """The counters as an ``EngineStats``; ``slots``: config.slots (utilisation)."""
        active = np.asarray(self.active, np.int64)
        return EngineStats(
            seconds=self.seconds,
            decode_calls=self.decode_calls,
            decode_steps=self.decode_steps,
            prefill_calls=self.prefill_calls,
            prefill_tokens=self.prefill_tokens,
            extend_calls=self.extend_calls,
            generated_tokens=self.generated_tokens,
            calls=tuple(self.calls),
            peak_kv_bytes=self.peak_kv_bytes,
            switches=tuple(self.switches),
            control_seconds=self.control_seconds,
            active_per_step=active,
            context_per_step=np.asarray(self.context, np.int64),
            slot_utilisation=float(active.mean() / slots) if active.size else 0.0,
            tokens_per_second=self.generated_tokens / max(self.seconds, 1e-9),
            allocated_kv_bytes=allocated_kv_bytes,
            trace_count=trace_count,
            callback_errors=callback_errors,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineView:
    """A snapshot for a switch controller (``RolloutEngine.view``); per-request arrays
    list the running (decoding) requests."""

    dp: int
    tp: int
    slots: int  # slots now (``reshard`` may shrink them)
    active: int  # running requests
    live: int  # slots holding a request (running + held after their turn)
    waiting: int  # requests waiting for a slot (0: the queue is empty, a shrink is allowed)
    prompt_tokens: np.ndarray  # [active] prompt length
    response_tokens: np.ndarray  # [active] response K/V rows so far (all turns)
    remaining: np.ndarray  # [active] tokens it may still produce this turn
    forced: np.ndarray  # [active] its length is forced: ``remaining`` is exact
    # (seconds, steps, sum of active slots over the steps, response window read) per
    # decode call that compiled nothing, since the last ``stats(reset=True)``
    decode_calls: tuple[DecodeCall, ...]
    # What a recompute switch rebuilds (``recompute_calls``): the prompt length of each
    # resident, prefilled prompt row (row order), and the response rows of every request
    # holding a slot (running and held, slot order).
    resident_prompt_tokens: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64)
    )
    live_response_tokens: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64)
    )

    @property
    def context_tokens(self) -> int:
        """Tokens the running requests attend at the next step (PAT's T)."""
        return int((self.prompt_tokens + self.response_tokens).sum())


__all__ = ["DecodeCall", "EngineStats", "EngineView", "StatsRecorder"]
