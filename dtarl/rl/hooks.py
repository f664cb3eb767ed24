"""What the training loop calls after each step (levanter's ``Trainer.add_hook``).

    trainer.add_hook(fn, every=N)                 # after global steps N, 2N, ...
    trainer.add_hook(fn, every=N, phase=Phase.RL) # after RL steps N, 2N, ... (counted in RL)
    trainer.add_hook(fn, final=True)              # once, when the run reaches its last step

Hooks run in the order they were added. A ``Trainer`` adds its own first, so a hook
added later sees ``info.metrics`` as they were logged:

    eval        every ``eval.every`` RL steps (not the last): ``val/pass@1`` (alias
                ``eval_success_rate``), ``val/reward_mean``, ``val/pass@k``, ...
    log         every step: metrics.jsonl, console, ``logging.backends``; ``TrainResult.history``
    checkpoint  every ``checkpoint_every`` global steps
    final: checkpoint (unless the last step's was just written), export
           (``export.hf_dir``), evaluation (``TrainResult.eval_end``)

A final hook gets the ``StepInfo`` of the run's last step (``metrics`` empty when the
run resumed at its end and ran no step).
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
    steps, or the steps of ``phase`` only when one is given; a ``final`` hook runs
    once instead, at the end of a run that reached its last step."""

    fn: Callable[[StepInfo], None]
    every: int = 1
    phase: Phase | None = None
    final: bool = False

    def __post_init__(self):
        if not (isinstance(self.every, int) and self.every >= 1):
            raise ValueError(f"Hook.every={self.every!r}: must be an int >= 1")

    def due(self, info: StepInfo) -> bool:
        if self.final:
            return False
        if self.phase is None:
            return info.step % self.every == 0
        return info.phase is self.phase and info.phase_step % self.every == 0


def run_hooks(hooks: list[Hook], info: StepInfo) -> None:
    """Calls, in order, each hook due after ``info``'s step."""
    for hook in hooks:
        if hook.due(info):
            hook.fn(info)


def run_final_hooks(hooks: list[Hook], info: StepInfo) -> None:
    """Calls, in order, each ``final`` hook (the run reached its last step, ``info``)."""
    for hook in hooks:
        if hook.final:
            hook.fn(info)


def trainer_hooks(trainer) -> list[Hook]:
    """A ``Trainer``'s own hooks, in the order of the module docstring, from its config;
    they use the trainer's public methods (``evaluate``, ``log``, ``eval_record``,
    ``save_checkpoint``, ``export_hf``) and its ``logger``."""
    cfg = trainer.cfg
    hooks = []
    if cfg.eval.every and cfg.eval.num_problems:

        def evaluate(info: StepInfo) -> None:
            if info.step < cfg.total_steps:  # the last step's evaluation is the final one
                info.metrics.update(trainer.evaluate())

        hooks.append(Hook(fn=evaluate, every=cfg.eval.every, phase=Phase.RL))
    hooks.append(Hook(fn=lambda info: trainer.log(info.metrics)))
    if cfg.checkpoint_every:
        hooks.append(Hook(fn=lambda info: trainer.save_checkpoint(), every=cfg.checkpoint_every))

    def final_checkpoint(info: StepInfo) -> None:
        if not (cfg.checkpoint_every and info.step % cfg.checkpoint_every == 0):
            trainer.save_checkpoint()  # (else the last step's hook wrote it)

    hooks.append(Hook(fn=final_checkpoint, final=True))
    if cfg.export.hf_dir:

        def export(info: StepInfo) -> None:
            trainer.logger.print(f"exported the policy to {trainer.export_hf(cfg.export.hf_dir)}")

        hooks.append(Hook(fn=export, final=True))
    if cfg.eval.num_problems:

        def final_eval(info: StepInfo) -> None:
            trainer.eval_end = trainer.eval_record(info.step)

        hooks.append(Hook(fn=final_eval, final=True))
    return hooks


__all__ = ["Hook", "Phase", "StepInfo", "run_final_hooks", "run_hooks", "trainer_hooks"]
