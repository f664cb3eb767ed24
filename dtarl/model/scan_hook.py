"""A hook on each layer's parameters inside ``Decoder.scan_layers``' scan step.

    with layer_state_hook(fn):      # while a program is traced
        model(...)                  # scan step i: layer = merge(graphdef, fn(state_i))

``fn(state_i) -> state_i'`` receives layer i's sliced ``nnx.State`` (the leading
``layers`` axis removed) and returns the state the layer runs with. It is applied
inside the scan step, and so inside its ``jax.checkpoint`` when ``cfg.remat``
checkpoints the layer: whatever ``fn`` computes is recomputed in the backward pass
rather than saved. FSDP's per-layer gather (``dtarl.parallel.fsdp``,
``mesh.fsdp_gather = layer``) is the user: layer leaves enter the program split over
'fsdp' and are all-gathered one layer at a time.

The hook is a context variable read when ``scan_layers`` is traced, so it applies to
the programs traced inside the ``with`` block and to no other (the rollout, a
reference scorer and a single-device step see none).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["current_layer_hook", "layer_state_hook"]

LayerHook = Callable[[Any], Any]

_HOOK: contextvars.ContextVar[LayerHook | None] = contextvars.ContextVar(
    "dtarl_layer_state_hook", default=None
)


@contextlib.contextmanager
def layer_state_hook(fn: LayerHook | None) -> Iterator[None]:
    """Sets ``fn`` as the per-layer state hook while the block runs (None: no hook)."""
    token = _HOOK.set(fn)
    try:
        yield
    finally:
        _HOOK.reset(token)


def current_layer_hook() -> LayerHook | None:
    """The hook set by the innermost ``layer_state_hook`` block, or None."""
    return _HOOK.get()
