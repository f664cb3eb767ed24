"""The ``eval:`` and ``logging:`` sections of ``TrainerConfig``: what a run measures
on held-out problems, and where its metrics go.

    eval:
      every: 25          # RL steps between evaluations (0: only before and after)
      num_problems: 128  # held-out problems from the task's generator (0: no evaluation)
      num_samples: 4     # k: pass@k at the rollout temperature, besides greedy pass@1
    logging:
      backends: [jsonl, tensorboard, wandb]   # jsonl is always written
      project: dtarl                           # the W&B project
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import typing

from dtarl.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
    """Evaluation on held-out problems with the configured reward: greedy ``val/pass@1``
    and ``val/reward_mean``, and with ``num_samples`` = k > 1 ``val/pass@k`` (a
    problem counts when one of k samples at the rollout temperature succeeds)."""

    SECTION: typing.ClassVar[str] = "eval"
    every: int = 0  # also every N RL steps (0 = only before and after training)
    # held-out problems from the task's generator, fixed for the run (0 = no evaluation)
    num_problems: int = 64
    # k of pass@k, sampled at rollout.temperature (1 = greedy pass@1 only)
    num_samples: int = 1

    def __post_init__(self):
        for name in ("every", "num_problems"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"eval.{name}={v!r} must be an integer >= 0")
        k = self.num_samples
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"eval.num_samples={k!r} must be an integer >= 1 (k of pass@k)")


class LoggingBackend(enum.Enum):
    """Where metrics go besides the console: ``jsonl`` (``OUT_DIR/metrics.jsonl``,
    always), ``tensorboard`` (``OUT_DIR/tb``; the ``tensorboard`` extra), ``wandb``
    (Weights & Biases; the ``wandb`` extra, ``WANDB_MODE=offline`` works offline)."""

    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"


# The module each optional backend needs, and the extra that installs it.
BACKEND_MODULES = {
    LoggingBackend.TENSORBOARD: ("tensorboardX", "pip install 'dtarl[tensorboard]'"),
    LoggingBackend.WANDB: ("wandb", "pip install 'dtarl[wandb]'"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingSection:
    SECTION: typing.ClassVar[str] = "logging"
    # metric sinks: jsonl (always written), tensorboard, wandb
    backends: tuple[LoggingBackend, ...] = (LoggingBackend.JSONL,)
    project: str = "dtarl"  # the W&B project
    run_name: str | None = None  # the W&B run name (null: the out_dir's last component)

    def __post_init__(self):
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError(
                f"logging.backends={[b.value for b in self.backends]} names a backend twice"
            )
        for b in self.backends:
            module, how = BACKEND_MODULES.get(b, (None, ""))
            if module is not None and importlib.util.find_spec(module) is None:
                raise ConfigError(
                    f"logging.backends lists {b.value!r} but {module} is not installed: "
                    f"{how}, or drop {b.value!r} (accepted: {[x.value for x in LoggingBackend]})"
                )

    def has(self, backend: LoggingBackend) -> bool:
        return backend in self.backends


__all__ = ["BACKEND_MODULES", "EvalSection", "LoggingBackend", "LoggingSection"]
