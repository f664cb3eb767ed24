"""What the training loop calls after each step (levanter's ``Trainer.add_hook``).

    trainer.add_hook(fn, every=N)                 # after global steps N, 2N, ...
    trainer.add_hook(fn, every=N, phase=Phase.RL) # after RL steps N, 2N, ... (counted in RL)

Hooks run in the order they were added. A ``Trainer`` adds its own first (eval,
which adds ``eval_success_rate`` to the step's metrics; log; checkpoint), so a
hook added later sees ``info.metrics`` as they were logged.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any


class Phase(enum.Enum):
    """A step's phase (also the ``phase`` field of its metrics)."""

    SFT = "sft"
    RL = "rl"
    EVAL = "eval"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StepInfo:
    """A finished step: ``step`` global steps are done, ``phase_step`` of them in ``phase``."""

    step: int
    phase: Phase
    phase_step: int
    metrics: dict[str, Any]  # the step's metrics; hooks may add to them


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hook:
    """``fn`` runs after the steps where ``every`` divides the step count: global
    steps, or the steps of ``phase`` only when one is given."""

    fn: Callable[[StepInfo], None]
    every: int = 1
    phase: Phase | None = None

    def __post_init__(self):
        if not (isinstance(self.every, int) and self.every >= 1):
            raise ValueError(f"Hook.every={self.every!r}: must be an int >= 1")

    def due(self, info: StepInfo) -> bool:
        if self.phase is None:
            return info.step % self.every == 0
        return info.phase is self.phase and info.phase_step % self.every == 0


def run_hooks(hooks: list[Hook], info: StepInfo) -> None:
    """Calls, in order, each hook due after ``info``'s step."""
    for hook in hooks:
        if hook.due(info):
            hook.fn(info)


__all__ = ["Hook", "Phase", "StepInfo", "run_hooks"]
