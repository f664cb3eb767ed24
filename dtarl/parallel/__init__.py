"""Parallel training: meshes and rule tables, the DP partition, sharded engines, launch.

    partition      load-balanced DP partition of a rollout batch (AREAL-DTA §4)
    mesh           ('dp', 'tp') and ('dp', 'fsdp', 'tp') meshes; logical axis -> mesh axis rules
    fsdp           ZeRO-3 inside the sharded step: gather weights, reduce-scatter gradients
    sharded        ShardedEngine: one tree engine per data rank, tp by the compiler
    launch         multi-process runs (jax.distributed), ``dtarl launch``

Names are imported lazily so that ``python -m dtarl.parallel.launch`` (the
launcher process) does not import JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Partition": "partition",
    "PartitionMethod": "partition",
    "TreeTokenCost": "partition",
    "FlopCost": "partition",
    "partition_batch": "partition",
    "DEFAULT_RULES": "mesh",
    "MeshConfig": "mesh",
    "MeshError": "mesh",
    "make_mesh": "mesh",
    "make_train_mesh": "mesh",
    "param_specs": "mesh",
    "param_shardings": "mesh",
    "shard_params": "mesh",
    "ShardedEngine": "sharded",
    "ShardingError": "sharded",
    "Strategy": "sharded",
    "to_host": "sharded",
    "DistributedConfig": "launch",
    "initialize": "launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dtarl.parallel' has no attribute {name!r}")
    # (``partition`` and ``launch`` are submodules; their functions live in them.)
    return getattr(importlib.import_module(f"dtarl.parallel.{module}"), name)
