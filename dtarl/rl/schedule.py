"""Learning-rate schedules: ``Schedule`` (the ``optim.schedule`` key) and ``make_schedule``."""

from __future__ import annotations

import enum

import optax


class Schedule(enum.Enum):
    CONSTANT = "constant"  # linear warm-up then constant
    COSINE = "cosine"  # linear warm-up then cosine decay to 0.1 x lr
    LINEAR = "linear"  # linear warm-up then linear decay to 0


def make_schedule(lr: float, warmup: int, total: int, kind: Schedule) -> optax.Schedule:
    """Linear warm-up over ``warmup`` steps, then ``kind`` over the remaining ones."""
    decay = max(total - warmup, 1)
    if kind is Schedule.CONSTANT:
        main = optax.constant_schedule(lr)
    elif kind is Schedule.COSINE:
        main = optax.cosine_decay_schedule(lr, decay, alpha=0.1)
    else:
        main = optax.linear_schedule(lr, 0.0, decay)
    if warmup <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])


__all__ = ["Schedule", "make_schedule"]
