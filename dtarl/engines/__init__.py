"""Training engines behind one interface: dense (baseline), dfs (AREAL-DTA),
prefix_reuse (schedule-level, the shared-prefix reuse paper) and auto (cost-model choice per batch).

    engine = make_engine(EngineKind.DFS, model, EngineConfig(dfs=DFSConfig(chunk_len=64)))
    engine.reserve(Capacity(sequences=64, length=512))   # optional: no recompiles below
    loss, grads, aux = engine.value_and_grad(params, batch, loss_fn)
"""

from dtarl.batch import BatchError, LossNorm, RolloutBatch
from dtarl.engines.auto import AutoEngine
from dtarl.engines.base import Engine, EngineAux, logprob_temperature, training_temperature
from dtarl.engines.config import (
    AutoConfig,
    Capacity,
    DeepTrees,
    DenseConfig,
    DFSConfig,
    EngineConfig,
    EngineKind,
    PrefixActivations,
    PrefixReuseConfig,
)
from dtarl.engines.dense import DenseEngine
from dtarl.engines.dfs import DFSEngine
from dtarl.engines.prefix_reuse import PrefixReuseEngine


def make_engine(
    kind: EngineKind | str,
    model,
    config: EngineConfig | None = None,
    *,
    temperature: float = 1.0,
    **settings,
) -> Engine:
    """Builds the engine of ``kind`` from ``config`` (default ``EngineConfig()``).

    ``temperature``: the engine's logprobs are those of logits / T, as the sampler's
    at temperature T (default 1.0; greedy rollouts train at 1.0,
    ``training_temperature``). ``settings`` override fields of that kind's own
    config (``chunk_len=64`` for dfs); for auto, runtime arguments (``engines``,
    ``cost_model``, ``timer``, ``host_seconds``) and ``AutoConfig`` fields. An
    unknown kind or setting, or a temperature that is not a finite number > 0, is a
    ValueError naming the accepted ones.
    """
    kind = EngineKind.parse(kind)
    config = config or EngineConfig()
    t = dict(temperature=temperature)
    if kind is EngineKind.DENSE:
        return DenseEngine(model, config.dense, **t, **settings)
    if kind is EngineKind.DENSE_REMAT:
        return DenseEngine(
            model, config.dense, name="dense_remat", **t, **{"remat": True, **settings}
        )
    if kind is EngineKind.DFS:
        return DFSEngine(model, config.dfs, **t, **settings)
    if kind is EngineKind.PREFIX_REUSE:
        return PrefixReuseEngine(model, config.prefix_reuse, **t, **settings)
    return AutoEngine(model, config.auto, engine_config=config, **t, **settings)


__all__ = [
    "AutoConfig",
    "AutoEngine",
    "BatchError",
    "Capacity",
    "DFSConfig",
    "DFSEngine",
    "DeepTrees",
    "DenseConfig",
    "DenseEngine",
    "Engine",
    "EngineAux",
    "EngineConfig",
    "EngineKind",
    "LossNorm",
    "PrefixActivations",
    "PrefixReuseConfig",
    "PrefixReuseEngine",
    "RolloutBatch",
    "logprob_temperature",
    "make_engine",
    "training_temperature",
]
