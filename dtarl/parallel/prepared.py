"""What a ``ShardedEngine`` hands between its host and device sides: ``ShardedPrepared``
(a global batch split over dp and compiled on the host) and ``ShardingError``. Their own
module so that ``dtarl.parallel.function`` (``ShardedEngine.loss_fn``) can use them
without importing the engine."""

from __future__ import annotations

import dataclasses

import jax

from dtarl.parallel.partition import Partition


class ShardingError(ValueError):
    """A batch or engine that cannot be run on the given mesh (message says why)."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ShardedPrepared:
    """A global batch split over dp and compiled on the host.

    ``static`` is the engine's common shape key. ``local_ranks`` are the dp ranks
    this process prepared (all of them in a single process); ``args`` are their
    numpy ``args`` stacked along a leading [len(local_ranks)] axis and ``ranks``
    their own ``Prepared`` (for ``finish``), in that order. ``dummy[r]`` marks a
    rank that got no sequence (it runs one zero-weight sequence instead).
    """

    static: tuple
    args: tuple
    ranks: tuple
    partition: Partition
    dummy: tuple[bool, ...]
    num_sequences: int
    host_seconds: float
    local_ranks: tuple[int, ...] = ()
    cost_model: str = ""


# A pytree like ``Prepared`` (``dtarl.engines.base``): leaves ``args``, structure
# ``static``; the host fields stay on the object (an unflattened copy has none).
jax.tree_util.register_pytree_node(
    ShardedPrepared,
    lambda p: ((p.args,), p.static),
    lambda static, children: ShardedPrepared(
        static=static,
        args=children[0],
        ranks=(),
        partition=None,
        dummy=(),
        num_sequences=0,
        host_seconds=0.0,
    ),
)


__all__ = ["ShardedPrepared", "ShardingError"]
