"""The update loop of one step: passes over a batch, minibatches, old logprobs.

    out = run_updates(params, opt_state, batch, engine=engine, loss=loss,
                      optimizer=opt, times=2, minibatches=4, grad_accum=2)
    params, opt_state = out.params, out.opt_state   # after the last applied update

``times`` passes over ``batch``, each ``minibatches`` updates (``dtarl.rl.optim.update``)
on sub-batches of whole groups (each normalised on its own), each gradient
accumulated over ``grad_accum`` parts; the loop stops after a skipped update (a
non-finite loss or gradient leaves the state unchanged).

Planning ahead. Each engine call's host side (the batch's prefix tree, the DFS
plan, padding: ``engine.prepare``) runs on the engine's planning thread
(``prepare_async``) while the call before it runs on the device: ``PlannedCalls``
submits call j + 1 before call j's device program starts, so only the first call of
the loop waits for its plan. The plans are made one at a time in call order, so the
results equal those of calling ``value_and_grad`` one after the other. Engines
without ``prepare_async`` (auto, which times candidates while preparing; the sharded
runner, whose prepare is collective) run ``value_and_grad`` as before.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from typing import Any, NamedTuple

from dtarl.batch import RolloutBatch
from dtarl.engines.base import Planned, run_prepared, timed_prepare
from dtarl.rl.optim import (
    EngineCall,
    Optimizer,
    UpdateResult,
    engine_calls,
    engine_pass,
    group_splits,
    old_logprob_diff,
    on_policy,
    update,
    with_old_logprobs,
)


class Updates(NamedTuple):
    """What ``run_updates`` did: the state after it, every update, the sub-batch of the
    last one and ``recompute_old``'s metrics (``recompute_seconds``, the logprob diffs)."""

    params: Any
    opt_state: Any
    updates: list[UpdateResult]
    last: RolloutBatch
    info: dict[str, Any]


class PlannedCalls:
    """Runs engine calls with the next call's host planning ahead (module docstring).

    ``calls_of(batch)``: the batch's ``EngineCall`` list, made once per batch object so
    that a call planned ahead is recognised when it comes up (by identity).
    ``runner(params, batch, following)``: ``run(call)`` for ``engine_pass`` over
    ``batch``'s calls: each submits the call after it (the next of ``batch``'s calls,
    else the first of ``following``'s, None: nothing) before running its own device
    program. ``ahead`` / ``used``: calls planned ahead, and of those, used.
    """

    def __init__(self, engine, loss, grad_accum: int = 1, *, enabled: bool = True):
        self.engine, self.loss, self.grad_accum = engine, loss, grad_accum
        # Only an engine whose own class plans (``BucketState``): a wrapper that forwards
        # attributes to an inner engine (LoRA's, a test's recorder) runs its own
        # ``value_and_grad``, which a plan of the inner engine would bypass.
        self.enabled = enabled and callable(getattr(type(engine), "prepare_async", None))
        self._calls: dict[int, tuple[RolloutBatch, list[EngineCall]]] = {}
        self._pending: tuple[EngineCall, Future[Planned]] | None = None
        self.ahead = self.used = 0

    def calls_of(self, batch: RolloutBatch) -> list[EngineCall]:
        got = self._calls.get(id(batch))
        if got is None or got[0] is not batch:
            got = (batch, engine_calls(batch, self.loss, self.grad_accum))
            self._calls[id(batch)] = got
        return got[1]

    def submit(self, call: EngineCall | None) -> None:
        """Plans ``call`` on the engine's planning thread (after any pending plan)."""
        if not self.enabled or call is None:
            return
        self.close()
        fut = self.engine.prepare_async(call.batch, self.loss, weights=call.weights)
        self._pending = (call, fut)
        self.ahead += 1

    def close(self) -> None:
        """Waits for a plan nobody took and drops it (it grew the engine's buckets, as
        it would have if used; an error in it is dropped with it: a call that never runs
        would not have been planned without planning ahead)."""
        if self._pending is not None:
            wait([self._pending[1]])
            self._pending = None

    def _planned(self, call: EngineCall) -> Planned:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is call:
            self.used += 1
            return pending[1].result()
        if pending is not None:
            wait([pending[1]])  # plans run in call order: let it finish first
        return timed_prepare(self.engine, call.batch, self.loss, call.weights)

    def run(self, params, call: EngineCall, upcoming: EngineCall | None):
        """``engine.value_and_grad`` of ``call``, ``upcoming`` planned meanwhile."""
        if not self.enabled:
            if call.weights is None:  # engines without per-sequence weights take none
                return self.engine.value_and_grad(params, call.batch, self.loss)
            return self.engine.value_and_grad(params, call.batch, self.loss, weights=call.weights)
        planned = self._planned(call)
        self.submit(upcoming)
        return run_prepared(
            self.engine, params, planned.prepared, self.loss, host_seconds=planned.seconds
        )

    def runner(self, params, batch: RolloutBatch, following: RolloutBatch | None):
        calls = self.calls_of(batch)
        nexts = list(calls[1:])
        if following is not None:
            nexts.append(self.calls_of(following)[0])
        by_call = dict(zip(map(id, calls), nexts + [None], strict=False))
        return lambda call: self.run(params, call, by_call.get(id(call)))


def run_updates(
    params,
    opt_state,
    batch: RolloutBatch,
    *,
    engine,
    loss,
    optimizer: Optimizer,
    times: int = 1,
    minibatches: int = 1,
    grad_accum: int = 1,
    recompute_old: bool = False,
    plan_ahead: bool = True,
) -> Updates:
    """``times`` passes of ``minibatches`` updates over ``batch`` (module docstring).

    ``recompute_old`` (``algo.recompute_old_logprobs``): the old-policy logprobs are
    the engine's at the params before the first update, with no gradient through
    them, instead of the sampler's. The first update runs on-policy (old =
    stop_gradient(logp): the same forward, so its ratio is exactly 1 and no extra pass
    is needed) and its logprobs become the old ones of the later passes; every other
    minibatch gets its own from one engine pass at those params before the first
    update (its gradient discarded).

    ``plan_ahead``: plan each engine call while the one before it runs on the device
    (``PlannedCalls``; off: every call plans, then runs, as ``update`` alone does).
    """
    updates: list[UpdateResult] = []
    parts = (
        [batch]
        if minibatches == 1
        else [batch.select(ix) for ix in group_splits(batch, minibatches)]
    )
    sampled = [p.old_logprobs for p in parts]
    info: dict[str, Any] = {}
    planner = PlannedCalls(engine, loss, grad_accum, enabled=plan_ahead)
    # The update loop's (pass, part) items in order; ``following`` is the next one's
    # batch, None where it is not known yet: after the first update of a
    # recompute_old run, whose logprobs become part 0's old ones.
    items = [(i, k) for i in range(times) for k in range(len(parts))]

    def following(n: int) -> RolloutBatch | None:
        if n + 1 >= len(items) or (recompute_old and n == 0 and items[n + 1][1] == 0):
            return None
        return parts[items[n + 1][1]]

    if recompute_old:
        t0 = time.perf_counter()
        parts[0] = on_policy(parts[0])
        olds = [on_policy(p) for p in parts[1:]]
        for k, part in enumerate(olds):
            after = olds[k + 1] if k + 1 < len(olds) else parts[0]
            run = planner.runner(params, part, after)
            _, _, aux = engine_pass(
                engine, params, part, loss, grad_accum, calls=planner.calls_of(part), run=run
            )
            parts[k + 1] = with_old_logprobs(parts[k + 1], aux.logprobs)
        info["recompute_seconds"] = time.perf_counter() - t0
    last = parts[-1]
    try:
        for n, (i, k) in enumerate(items):
            part = parts[k]
            u = update(
                params,
                opt_state,
                part,
                engine=engine,
                loss=loss,
                optimizer=optimizer,
                grad_accum=grad_accum,
                calls=planner.calls_of(part),
                run=planner.runner(params, part, following(n)),
            )
            if recompute_old and i == 0 and k == 0:
                parts[0] = part = with_old_logprobs(part, u.aux.logprobs)
            params, opt_state = u.params, u.opt_state
            updates.append(u)
            last = part
            if not u.applied:
                break
    finally:
        planner.close()
    info.update(planned_ahead=planner.ahead, planned_ahead_used=planner.used)
    if recompute_old:
        info.update(recompute_old_logprobs=1, **old_logprob_diff(parts, sampled))
    return Updates(params=params, opt_state=opt_state, updates=updates, last=last, info=info)


__all__ = ["PlannedCalls", "Updates", "run_updates"]
