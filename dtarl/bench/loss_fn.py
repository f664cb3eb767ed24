"""The custom-VJP path (``engine.loss_fn``) against ``engine.value_and_grad``: XLA
compiles on the first call and the median step time, side by side.

    python -m dtarl.bench.loss_fn        # tiny model, CPU; numbers in docs/loss_fn.md

Four runs per engine (dfs, dense) on one GRPO batch, timed by ``time_programs``
(interleaved rounds): the engine's compiled program alone, ``value_and_grad`` of a
prepared batch (program + host decode of the logprobs), ``jax.jit(jax.value_and_grad(f))``
and eager ``jax.value_and_grad(f)``.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from dtarl.engines import DenseEngine, DFSEngine, base
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.testing import grpo_groups
from dtarl.timing import machine_info, time_programs

_COMPILE = "/jax/core/compile/backend_compile_duration"


def run(repeats: int = 15) -> dict[str, dict[str, float]]:
    """{engine: {run: median seconds}}; prints compiles per first call as it goes."""
    compiles = [0]

    def on_event(event: str, duration: float, **kwargs) -> None:
        compiles[0] += event == _COMPILE

    jax.monitoring.register_event_duration_secs_listener(on_event)
    model = init_model(ModelConfig.tiny(), seed=1)
    params = nnx.split(model, nnx.Param)[1]
    loss = ClippedSurrogateLoss.grpo()
    batch = grpo_groups(num_groups=4, group_size=4, prompt_len=32, response_len=(8, 32), seed=0)
    result = {}
    for engine in (DFSEngine(model, chunk_len=16), DenseEngine(model, microbatch=4)):
        f = engine.loss_fn(loss)
        prepared = engine.prepare(batch, loss)
        jitted = jax.jit(jax.value_and_grad(f))
        runs = {
            "program": lambda e=engine, p=prepared: e.jit(loss, p.static, params, p.args)[:2],
            "value_and_grad": lambda e=engine, p=prepared: base.run_prepared(e, params, p, loss)[
                :2
            ],
            "jit(value_and_grad(f))": lambda p=prepared, j=jitted: j(params, p),
            "eager value_and_grad(f)": lambda p=prepared, f=f: jax.value_and_grad(f)(params, p),
        }
        print(f"--- {engine.name}: {batch.num_sequences} sequences, {batch.num_tokens} tokens")
        for name, call in runs.items():
            c0, t0, traces = compiles[0], time.perf_counter(), engine.trace_count
            jax.block_until_ready(call())
            print(
                f"{name:24s} first call: {compiles[0] - c0} XLA compiles, "
                f"{time.perf_counter() - t0:.2f} s, engine traces +{engine.trace_count - traces}"
            )
        got, want = runs["eager value_and_grad(f)"](), runs["value_and_grad"]()
        diff = max(
            float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True)
        )
        print(f"same loss: {float(got[0]) == float(want[0])}, max |grad difference| {diff:.1e}")
        result[engine.name] = time_programs(runs, repeats=repeats)
        print({k: f"{v * 1e3:.1f} ms" for k, v in result[engine.name].items()})
    print(machine_info())
    return result


if __name__ == "__main__":
    run()
