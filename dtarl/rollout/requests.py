"""A request group and its requests, as the continuous engine hands them out
(``RolloutEngine.submit`` returns a ``Group``; ``run`` returns finished ``Request``s),
and ``complete``, the stock ``until`` predicate. No JAX."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from dtarl.rollout.reasons import FinishReason


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # this turn is over (held requests keep their slot)
    RELEASED = "released"  # slot given back (or never had one)


def complete(m: int) -> Callable[[Group], bool]:
    """Group predicate: ``m`` members finished with a *final* stop (not truncated, not
    cancelled). A held member (``hold=True``: a multi-turn request) whose turn stopped
    still holds its slot until its owner either extends it (a tool call: the stop was
    not final) or releases it (the response is over), so it counts only once released;
    ``Scheduler.release`` re-checks the group's ``until``."""

    def pred(group: Group) -> bool:
        return sum(final_stop(r) for r in group.requests) >= m

    pred.__name__ = f"complete({m})"
    return pred


def final_stop(r: Request) -> bool:
    """Whether ``r`` stopped for good: a stop, and not a held turn awaiting its owner's
    extend-or-release decision."""
    return r.finish is FinishReason.STOP and (not r.hold or r.status is Status.RELEASED)


@dataclasses.dataclass(eq=False)
class Request:
    """One sample of a group. ``tokens``/``logprobs``: this turn's generated tokens."""

    group: Group
    index: int  # member j of its group
    key: np.ndarray  # [2] uint32
    max_new_tokens: int
    forced: bool
    hold: bool
    status: Status = Status.WAITING
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: FinishReason = FinishReason.RUNNING
    turns: int = 0
    streamed: int = 0
    error: str | None = None
    length: int = 0  # response K/V rows (host mirror)
    # Every response-side token of every turn (generated and appended): K/V row j > 0
    # holds the token context[j - 1], row 0 the prompt's last token (``reshard`` in
    # recompute mode rebuilds the rows from it).
    context: list[int] = dataclasses.field(default_factory=list)
    pending: np.ndarray | None = None  # tokens waiting to be appended (extend)

    @property
    def id(self) -> tuple[int, int]:
        return (self.group.id, self.index)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.RELEASED)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.tokens, np.int32), np.asarray(self.logprobs, np.float32)


@dataclasses.dataclass(eq=False)
class Group:
    """The requests of one ``submit`` (one prompt)."""

    id: int
    prompt: np.ndarray
    requests: list[Request]
    temperature: float
    top_p: float
    top_k: int
    stop_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    on_tokens: Callable | None
    on_finish: Callable | None
    until: Callable[[Group], bool] | None
    pslot: int | None = None
    stopped: bool = False  # ``until`` fired
    owner: Any = None  # the scheduler that accepted it

    @property
    def done(self) -> bool:
        return all(r.done for r in self.requests)


__all__ = ["Group", "Request", "Status", "complete"]
