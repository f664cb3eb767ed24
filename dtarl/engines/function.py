"""Tree training as a differentiable JAX function: ``engine.loss_fn(loss)``.

    f = engine.loss_fn(loss)                          # a TreeLoss
    prepared = engine.prepare(batch, loss)            # host side, once per batch
    L = f(params, prepared)                           # L(theta) = sum_i w_i loss_i(theta)
    g = jax.grad(lambda p: 0.5 * f(p, prepared) + l2(p))(params)

``f`` is a ``jax.custom_vjp`` of the parameters. Its forward runs the engine's own
program once (the one ``engine.value_and_grad`` runs: the tree traversal with
forward and backward interleaved) and keeps the parameter gradient dL/dtheta as
its only residual; its backward is

    vjp(ct) = ct * dL/dtheta                                                    (1)

(cast to each parameter's dtype), so ``jax.grad``, ``jax.value_and_grad``, sums
with regularisers, ``jax.jit`` of all of these and optax wrappers compose with it.
With ``has_aux=True`` f returns ``(L, LossAux)``: the program's per-token logprobs
(device arrays in the engine's layout; ``f.logprobs(prepared, aux)`` decodes them on
the host into one [n_i] array per sequence, entry 0 = 0) and device stats.

``prepared`` is a pytree: its leaves are the program's arrays (``Prepared.args``),
its tree structure holds the static shape key (``Prepared.static``), and the host
metadata (``host``, ``stats``) stays on the Python object, never traced. Two batches
of one shape bucket have the same structure and shapes, so a jitted step that takes
``prepared`` as an argument does not retrace. Build it with the same loss as f
(``f.prepare(batch)`` does): the loss's normaliser sets its sequence weights.

Eager calls reuse the engine's compiled program (``engine.jit``: the same executable
and trace count as ``value_and_grad``); inside ``jax.jit`` the program is traced into
the caller's program. Forward mode (``jax.jvp``) and differentiating with respect to
``prepared`` or through ``LossAux`` are errors (the residual holds dL/dtheta only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from dtarl import aot
from dtarl.losses import check_sequence_loss

__all__ = ["LossAux", "TreeLoss", "loss_fn"]


class LossAux(NamedTuple):
    """What ``f(params, prepared)`` returns beside the loss with ``has_aux=True``.

    out: the program's per-token logprobs, device arrays in the engine's own layout
      (decode with ``TreeLoss.logprobs(prepared, aux)``).
    grad_norm: ||dL/dtheta|| (fp32, global norm) of f's own loss, from the residual.
    """

    out: Any
    grad_norm: jax.Array


# program(static, params, args, traced) -> (loss, grads_f32, out)
Program = Callable[[Any, Any, tuple, bool], tuple[jax.Array, Any, Any]]


def engine_program(engine, loss) -> Program:
    """The device program of an engine with a ``JitCache`` (``engine.jit``): dense,
    dfs, prefix_reuse and auto (whose cache delegates to the engine it picked)."""
    plain: dict[Any, Any] = {}

    def run(static, params, args, traced: bool):
        if traced and aot.program_store() is not None:
            # A stored program is looked up by concrete input signatures; under a
            # trace the engine's device function is traced into the caller instead.
            if static not in plain:
                plain[static] = jax.jit(engine.device_fn(loss, static))
            return plain[static](params, *args)
        return engine.jit.get(loss, static)(params, *args)

    return run


class TreeLoss:
    """``f(params, prepared) -> loss`` (or ``(loss, LossAux)`` with ``has_aux``) of one
    engine and one loss, differentiable by ``jax.custom_vjp`` (module docstring).

    Attributes: engine, loss, has_aux. ``prepare(batch)`` is ``engine.prepare(batch,
    loss)``; ``logprobs(prepared, aux)`` decodes ``aux.out`` on the host.
    """

    def __init__(
        self,
        engine,
        loss,
        *,
        has_aux: bool = False,
        prepared_type: type,
        program: Program | None = None,
    ):
        check_sequence_loss(loss)
        if not isinstance(has_aux, bool):
            raise TypeError(f"loss_fn: has_aux must be a bool, got {has_aux!r}")
        self.engine = engine
        self.loss = loss
        self.has_aux = has_aux
        self._program = program or engine_program(engine, loss)
        self._prepared_type = prepared_type
        core = jax.custom_vjp(self._primal, nondiff_argnums=(0,))
        core.defvjp(self._fwd, self._bwd, symbolic_zeros=True)
        self._core = core

    def __repr__(self) -> str:
        name = getattr(self.engine, "name", type(self.engine).__name__)
        return f"TreeLoss({name}, {self.loss!r}, has_aux={self.has_aux})"

    # ------------------------------------------------------------------ host side

    def prepare(self, batch, *, weights=None):
        """``engine.prepare(batch, loss, weights=weights)`` with f's own loss."""
        return self.engine.prepare(batch, self.loss, weights=weights)

    def logprobs(self, prepared, aux: LossAux) -> tuple[np.ndarray, ...]:
        """Per-sequence logprobs ([n_i] fp32, entry 0 = 0) from ``aux`` (host side).

        ``prepared`` must be the object ``prepare`` returned: its host metadata does
        not travel through JAX transformations."""
        if not isinstance(aux, LossAux):
            raise TypeError(f"logprobs: aux must be the LossAux f returned, got {type(aux)}")
        kept = getattr(prepared, "host", None) is not None or getattr(prepared, "ranks", ())
        if not kept:
            raise ValueError(
                "logprobs: prepared has no host metadata; pass the object engine.prepare "
                "returned (host metadata does not travel through jax transformations)"
            )
        return tuple(self.engine.finish(prepared, aux.out))

    # ---------------------------------------------------------------- the function

    def __call__(self, params, prepared):
        if not isinstance(prepared, self._prepared_type):
            raise TypeError(
                f"{self!r}: prepared must be the {self._prepared_type.__name__} that "
                f"engine.prepare(batch, loss) returns, got {type(prepared).__name__}"
            )
        total, out, gnorm = self._core(prepared.static, params, prepared.args)
        if self.has_aux:
            return total, LossAux(out=out, grad_norm=gnorm)
        return total

    def _run(self, static, params, args):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, args)))
        total, grads, out = self._program(static, params, args, traced)
        if not self.has_aux:  # nobody reads it
            return total, grads, out, jnp.zeros((), jnp.float32)
        gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return total, grads, out, gnorm

    def _primal(self, static, params, args):
        total, _, out, gnorm = self._run(static, params, args)
        return total, out, gnorm

    def _fwd(self, static, params, args):
        if any(x.perturbed for x in jax.tree.leaves(args, is_leaf=_is_primal)):
            raise ValueError(
                f"{self!r}: cannot differentiate with respect to prepared (the batch); "
                "differentiate with respect to params (argnums=0) only"
            )
        params = jax.tree.map(lambda x: x.value, params, is_leaf=_is_primal)
        args = jax.tree.map(lambda x: x.value, args, is_leaf=_is_primal)
        total, grads, out, gnorm = self._run(static, params, args)
        grads = jax.tree.map(_cast_like, grads, params)
        return (total, out, gnorm), grads

    def _bwd(self, static, grads, cts):
        ct_loss, ct_out, ct_gnorm = cts
        if not all(isinstance(c, SymbolicZero) for c in jax.tree.leaves((ct_out, ct_gnorm))):
            raise ValueError(
                f"{self!r}: LossAux (logprobs, grad_norm) is not differentiable; only the "
                "loss is (use value_and_grad(..., has_aux=True) to return it alongside)"
            )
        if isinstance(ct_loss, SymbolicZero):
            return None, None
        return _scale(ct_loss, grads), None


@jax.jit
def _scale(ct, grads):
    """(1): ct * dL/dtheta in each gradient's dtype (one dispatch when run eagerly)."""
    return jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads)


def _cast_like(g, p):
    dtype = jnp.result_type(p)
    return g if g.dtype == dtype else g.astype(dtype)


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def loss_fn(engine, loss, *, has_aux: bool = False) -> TreeLoss:
    """``engine.loss_fn(loss, has_aux=...)`` for any engine with ``prepare`` /
    ``jit`` / ``finish`` (dense, dfs, prefix_reuse, auto)."""
    return engine.loss_fn(loss, has_aux=has_aux)
