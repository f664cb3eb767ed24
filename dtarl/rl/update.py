"""The update loop of one step: passes over a batch, minibatches, old logprobs.

    out = run_updates(params, opt_state, batch, engine=engine, loss=loss,
                      optimizer=opt, times=2, minibatches=4, grad_accum=2)
    params, opt_state = out.params, out.opt_state   # after the last applied update

``times`` passes over ``batch``, each ``minibatches`` updates (``dtarl.rl.optim.update``)
on sub-batches of whole groups (each normalised on its own), each gradient
accumulated over ``grad_accum`` parts; the loop stops after a skipped update (a
non-finite loss or gradient leaves the state unchanged).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from dtarl.batch import RolloutBatch
from dtarl.rl.optim import (
    Optimizer,
    UpdateResult,
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
) -> Updates:
    """``times`` passes of ``minibatches`` updates over ``batch`` (module docstring).

    ``recompute_old`` (``algo.recompute_old_logprobs``): the old-policy logprobs are
    the engine's at the params before the first update, with no gradient through
    them, instead of the sampler's. The first update runs on-policy (old =
    stop_gradient(logp): the same forward, so its ratio is exactly 1 and no extra pass
    is needed) and its logprobs become the old ones of the later passes; every other
    minibatch gets its own from one engine pass at those params before the first
    update (its gradient discarded).
    """
    updates: list[UpdateResult] = []
    parts = (
        [batch]
        if minibatches == 1
        else [batch.select(ix) for ix in group_splits(batch, minibatches)]
    )
    sampled = [p.old_logprobs for p in parts]
    info: dict[str, Any] = {}
    if recompute_old:
        t0 = time.perf_counter()
        for k in range(1, len(parts)):
            _, _, aux = engine_pass(engine, params, on_policy(parts[k]), loss, grad_accum)
            parts[k] = with_old_logprobs(parts[k], aux.logprobs)
        info["recompute_seconds"] = time.perf_counter() - t0
        parts[0] = on_policy(parts[0])
    last = parts[-1]
    stopped = False
    for i in range(times):
        for k, part in enumerate(parts):
            u = update(
                params,
                opt_state,
                part,
                engine=engine,
                loss=loss,
                optimizer=optimizer,
                grad_accum=grad_accum,
            )
            if recompute_old and i == 0 and k == 0:
                parts[0] = part = with_old_logprobs(part, u.aux.logprobs)
            params, opt_state = u.params, u.opt_state
            updates.append(u)
            last = part
            if not u.applied:
                stopped = True
                break
        if stopped:
            break
    if recompute_old:
        info.update(recompute_old_logprobs=1, **old_logprob_diff(parts, sampled))
    return Updates(params=params, opt_state=opt_state, updates=updates, last=last, info=info)


__all__ = ["Updates", "run_updates"]
