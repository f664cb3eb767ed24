"""Why a sample stopped, and the rollout's input error: shared by the static sampler
(``dtarl.rollout.sampler``) and the continuous engine's pure-Python scheduler
(``dtarl.rollout.scheduler``), so this module imports no JAX."""

from __future__ import annotations

import enum


class SamplerError(ValueError):
    """Bad sampler input; the message names the argument and the accepted range."""


class FinishReason(enum.IntEnum):
    """Why a sample stopped (``RUNNING`` while it has not)."""

    RUNNING = 0
    STOP = 1  # sampled a stop token (included in the output)
    LENGTH = 2  # reached its max_new (or forced) length
    CANCELLED = 3  # cancelled by a controller (DARTS early stop, a group predicate)
    ABORTED = 3  # the same value (an alias kept for existing code)


__all__ = ["FinishReason", "SamplerError"]
