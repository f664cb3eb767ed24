"""Training engines behind one interface: dense (baseline) and dfs (AREAL-DTA)."""

import enum

from dtarl.engines.base import Engine, EngineAux
from dtarl.engines.batch import BatchError, LossNorm, RolloutBatch
from dtarl.engines.dense import DenseEngine
from dtarl.engines.dfs import DFSEngine


class EngineKind(enum.Enum):
    DENSE = "dense"
    DENSE_REMAT = "dense_remat"
    DFS = "dfs"


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
    return DFSEngine(model, **kwargs)


__all__ = [
    "BatchError",
    "DFSEngine",
    "DenseEngine",
    "Engine",
    "EngineAux",
    "EngineKind",
    "LossNorm",
    "RolloutBatch",
    "make_engine",
]
