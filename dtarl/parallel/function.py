"""``ShardedEngine.loss_fn``: the sharded step as a differentiable JAX function.

    f = sharded.loss_fn(loss)              # dtarl.engines.function.TreeLoss
    prepared = sharded.prepare(batch, loss)
    g = jax.grad(lambda p: f(p, prepared) + l2(p))(params)

The forward runs the sharded program (``ShardedEngine.get_fn``: every dp rank's
engine program under ``shard_map``, loss and gradients ``psum``-ed over 'dp') once;
the backward scales its gradient (``dtarl.engines.function``). Eagerly it is the very
program ``ShardedEngine.value_and_grad`` runs (params and args placed on the mesh as
there); under ``jax.jit`` that program is traced into the caller's, its in/out
shardings kept. One process only: a multi-process ``prepared`` holds only the local
ranks' arrays, which a traced argument cannot gather (use ``value_and_grad``).
"""

from __future__ import annotations

from dtarl.engines.function import TreeLoss
from dtarl.parallel.prepared import ShardedPrepared, ShardingError

__all__ = ["ShardedTreeLoss", "sharded_loss_fn"]


class ShardedTreeLoss(TreeLoss):
    """``TreeLoss`` of a ``ShardedEngine`` (module docstring); ``prepared`` is the
    ``ShardedPrepared`` that ``engine.prepare`` returns, in a one-process run."""

    def __init__(self, engine, loss, *, has_aux: bool = False):
        def program(static, params, args, traced: bool):
            view = ShardedPrepared(
                static=static,
                args=args,
                ranks=(),
                partition=None,
                dummy=(),
                num_sequences=0,
                host_seconds=0.0,
            )
            if traced:
                return engine.get_fn(loss, view, params)(params, *args)
            return engine.run(params, view, loss)

        super().__init__(
            engine, loss, has_aux=has_aux, program=program, prepared_type=ShardedPrepared
        )

    def __call__(self, params, prepared):
        local = getattr(prepared, "local_ranks", ())
        if (
            isinstance(prepared, ShardedPrepared)
            and local
            and local != tuple(range(self.engine.ranks))
        ):
            raise ShardingError(
                f"loss_fn: prepared holds data ranks {local} of {self.engine.ranks} (a "
                "multi-process run); loss_fn runs in one process: use value_and_grad"
            )
        return super().__call__(params, prepared)


def sharded_loss_fn(engine, loss, *, has_aux: bool = False) -> ShardedTreeLoss:
    """``engine.loss_fn(loss, has_aux=...)`` for a ``ShardedEngine`` (module docstring)."""
    return ShardedTreeLoss(engine, loss, has_aux=has_aux)
