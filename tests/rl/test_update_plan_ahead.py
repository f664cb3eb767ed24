"""The update loop plans engine call j + 1 on the engine's planning thread while call j
runs on the device (``dtarl.rl.update.PlannedCalls``), with the results of planning
each call just before it runs."""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.engines import Capacity, DFSEngine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.rl.optim import make_optimizer
from dtarl.rl.schedule import Schedule
from dtarl.rl.sections import OptimSection
from dtarl.rl.update import run_updates
from dtarl.testing import grpo_groups

LOSS = ClippedSurrogateLoss.grpo()


@functools.cache
def _setup():
    """A tiny model, its optimiser, a batch of 4 groups and one DFS engine whose
    buckets are reserved for every sub-batch (one program serves all the calls)."""
    model = init_model(ModelConfig.tiny(num_layers=1), seed=3)
    _, params = nnx.split(model, nnx.Param)
    opt = make_optimizer(
        lr=1e-2, warmup=0, total=10, schedule=Schedule.CONSTANT, cfg=OptimSection()
    )
    batch = grpo_groups(
        num_groups=4,
        group_size=2,
        prompt_len=5,
        response_len=(2, 9),
        seed=7,
        with_old_logprobs=True,
    )
    engine = DFSEngine(model, chunk_len=4, prefix_levels=1)  # the fewest branches to compile
    engine.reserve(Capacity(sequences=8, length=14, group_size=2, groups=4))
    return engine, params, opt, batch


class _Spy:
    """Wraps an engine's ``prepare``, ``prepare_async`` and device program to record,
    in the caller's thread, the order of plans, submissions and device calls. With
    ``wait``, the first device call waits until the second call's plan is done."""

    def __init__(self, engine, *, wait: bool):
        main = threading.get_ident()
        self.events: list[tuple[str, int]] = []
        self.second_planned = threading.Event()
        self.overlapped = None
        prepare, prepare_async, jit = engine.prepare, engine.prepare_async, engine.jit
        count = dict(plan=0, submit=0, device=0)

        def note(kind: str) -> int:
            i = count[kind]
            count[kind] += 1
            if threading.get_ident() == main:
                self.events.append((kind, i))
            return i

        def spy_prepare(*a, **k):
            i = note("plan")
            out = prepare(*a, **k)
            if i == 1:
                self.second_planned.set()
            return out

        def spy_prepare_async(*a, **k):
            note("submit")
            return prepare_async(*a, **k)

        class SpyJit:
            trace_count = property(lambda _: jit.trace_count)

            def __call__(_, *a):
                if note("device") == 0 and wait:
                    # Call 1's plan must complete while call 0's device program waits.
                    self.overlapped = self.second_planned.wait(timeout=120)
                return jit(*a)

        self._restore = lambda: setattr(engine, "jit", jit)
        engine.prepare, engine.prepare_async, engine.jit = (
            spy_prepare,
            spy_prepare_async,
            SpyJit(),
        )

    def restore(self, engine) -> None:
        del engine.prepare, engine.prepare_async
        self._restore()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_next_plan_is_made_while_the_device_runs_and_results_are_unchanged(grad_accum):
    engine, params, opt, batch = _setup()
    outs = {}
    for ahead in (True, False):
        buckets = engine.buckets
        spy = _Spy(engine, wait=ahead)
        try:
            out = run_updates(
                params,
                opt.init(params),
                batch,
                engine=engine,
                loss=LOSS,
                optimizer=opt,
                times=2,
                minibatches=2,
                grad_accum=grad_accum,
                recompute_old=True,
                plan_ahead=ahead,
            )
        finally:
            spy.restore(engine)
        assert engine.buckets == buckets  # reserved: every call fits
        outs[ahead] = out, spy
    (a, spy_a), (b, spy_b) = outs[True], outs[False]
    calls = (1 + 2 * 2) * grad_accum  # recompute pass over part 1, then 2 passes x 2 parts
    # Planning ahead: only call 0 is planned in the caller's thread; call j + 1 is
    # submitted before call j reaches the device, and call 1's plan was completed
    # while call 0's device program waited for it.
    assert spy_a.overlapped is True
    want = [("plan", 0)]
    for j in range(calls):  # submission j plans call j + 1
        want += [("submit", j)] if j + 1 < calls else []
        want += [("device", j)]
    assert spy_a.events == want
    assert a.info["planned_ahead"] == a.info["planned_ahead_used"] == calls - 1
    # Without it, each call is planned right before it runs.
    assert spy_b.events == [(k, i) for i in range(calls) for k in ("plan", "device")]
    assert b.info["planned_ahead"] == 0
    # Bit-identical updates, logprobs and parameters.
    assert len(a.updates) == len(b.updates) == 4
    for ua, ub in zip(a.updates, b.updates, strict=True):
        assert ua.loss == ub.loss and ua.grad_norm == ub.grad_norm
        for la, lb in zip(ua.aux.logprobs, ub.aux.logprobs, strict=True):
            np.testing.assert_array_equal(la, lb)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
