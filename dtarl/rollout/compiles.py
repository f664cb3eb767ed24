"""What XLA actually compiled: a process-wide count of backend compiles, read from
JAX's compile events (``jax.monitoring``).

A program's trace count says when Python traced it, not when XLA compiled it: JAX
also compiles without retracing when only the inputs' placement changes (an array
committed to its device after an update, a different sharding object over the same
devices), and such a call's seconds are mostly the compile. So the rollout cost
observations (DARTS) exclude a call during which any backend compile happened,
whatever thread started it (conservative: a compile elsewhere drops a sample, it
never lets a compile-inflated one in). A persistent-cache hit counts too: loading
an executable is not a decode.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """Backend compiles in this process since the first call (monotonic)."""
    global _registered
    if not _registered:
        with _lock:
            if not _registered:
                jax.monitoring.register_event_duration_secs_listener(_listener)
                _registered = True
    return _count


__all__ = ["BACKEND_COMPILE_EVENT", "compile_count"]
