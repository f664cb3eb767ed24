"""Decode calls that compiled are kept out of the cost observations by what XLA
compiled, not by traces (issue 39: a recompile without a retrace entered DARTS's fit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rollout.compiles import compile_count
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine

CFG = ModelConfig.tiny()
SMALL = ContinuousConfig(
    slots=4, groups=2, group_size=2, prompt_len=16, response_len=24, steps_per_call=4
)


def test_compile_count_sees_a_recompile_without_a_retrace():
    traces = []
    f = jax.jit(lambda x: traces.append(1) or x * 2)
    x = jnp.ones(3)
    f(x)
    n = compile_count()
    f(x)
    assert compile_count() == n  # a cached executable: nothing compiled
    f(jax.device_put(x, jax.devices()[0]))  # committed: a new executable, same trace
    assert len(traces) == 1 and compile_count() == n + 1


def test_decode_call_that_recompiled_is_not_a_cost_observation():
    model = Decoder(CFG, seed=0)
    weights = nnx.split(model, nnx.Param)[1]
    eng = RolloutEngine(model, SMALL).warmup(weights)

    def generate(w):
        eng.stats(reset=True)
        eng.submit([3, 4, 5], n=2, forced_lengths=[10, 10], seed=1)
        eng.run(w)
        return eng.stats(reset=True)

    first = generate(weights)
    assert first.decode_calls == 3 and len(first.calls) == 3  # warmed: nothing compiled
    traces = eng.trace_count
    # The same weights committed to their device (as after an optimizer update): JAX
    # compiles the decode program again without tracing it.
    committed = jax.device_put(weights, jax.devices()[0])
    second = generate(committed)
    assert eng.trace_count == traces  # no retrace ...
    assert second.decode_calls == 3 and len(second.calls) == 2  # ... but a compile
    third = generate(committed)
    assert len(third.calls) == 3
