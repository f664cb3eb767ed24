"""Training engines behind one interface: dense (baseline), dfs (AREAL-DTA),
prefix_reuse (schedule-level, papers/001) and auto (cost-model choice per batch)."""

import enum

from dtarl.batch import BatchError, LossNorm, RolloutBatch
from dtarl.engines.auto import AutoEngine
from dtarl.engines.base import Engine, EngineAux
from dtarl.engines.dense import DenseEngine
from dtarl.engines.dfs import DFSEngine
from dtarl.engines.prefix_reuse import DeepTrees, PrefixActivations, PrefixReuseEngine


class EngineKind(enum.Enum):
    DENSE = "dense"
    DENSE_REMAT = "dense_remat"
    DFS = "dfs"
    PREFIX_REUSE = "prefix_reuse"
    AUTO = "auto"


def make_engine(kind: EngineKind | str, model, **kwargs) -> Engine:
    """Builds an engine by kind (``EngineKind`` or its value)."""
    try:
        kind = EngineKind(kind)
    except ValueError:
        raise ValueError(
            f"engine={kind!r} is not known; accepted: {[k.value for k in EngineKind]}"
        ) from None
    if kind is EngineKind.DENSE:
        return DenseEngine(model, **kwargs)
    if kind is EngineKind.DENSE_REMAT:
        return DenseEngine(model, remat=True, name="dense_remat", **kwargs)
    if kind is EngineKind.PREFIX_REUSE:
        return PrefixReuseEngine(model, **kwargs)
    if kind is EngineKind.AUTO:
        return AutoEngine(model, **kwargs)
    return DFSEngine(model, **kwargs)


__all__ = [
    "AutoEngine",
    "BatchError",
    "DFSEngine",
    "DeepTrees",
    "DenseEngine",
    "Engine",
    "EngineAux",
    "EngineKind",
    "LossNorm",
    "PrefixActivations",
    "PrefixReuseEngine",
    "RolloutBatch",
    "make_engine",
]
