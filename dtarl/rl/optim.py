"""What one update minimises and how: the loss of each algorithm, AdamW with its
learning-rate schedule, and ``update`` (one engine gradient + one optimiser step).

    loss = cfg.algo.build_loss(max_response)      # AlgoSection.build_loss
    opt = cfg.optim.build(total=100)              # OptimSection.build -> make_optimizer
    state = opt.tx.init(params)
    u = update(params, state, batch, engine=engine, loss=loss, optimizer=opt)
    params, state = u.params, u.opt_state         # unchanged when ``not u.applied``
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl.batch import RolloutBatch
from dtarl.engines import EngineAux
from dtarl.losses import ClippedSurrogateLoss
from dtarl.parallel.mesh import global_array
from dtarl.rl.schedule import Schedule, make_schedule

# optax >= 0.2.5 renamed tree_l2_norm to tree_norm (the old name warns).
_tree_norm = getattr(optax.tree_utils, "tree_norm", None) or optax.tree_utils.tree_l2_norm

# ||g||_2 over every leaf of a gradient pytree.
grad_norm = jax.jit(_tree_norm)


# ------------------------------------------------------------------ losses


def make_loss(cfg, max_response: int) -> ClippedSurrogateLoss:
    """``cfg.algo.build_loss(max_response)`` of a ``TrainerConfig`` (``AlgoSection.build_loss``)."""
    return cfg.algo.build_loss(max_response)


# --------------------------------------------------------------- optimiser


def _on_mesh(params) -> bool:
    """True when ``params`` are arrays placed on a multi-device ``NamedSharding``."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(
        isinstance(x, jax.Array)
        and isinstance(x.sharding, NamedSharding)
        and x.sharding.mesh.size > 1
        for x in leaves
    )


def put(x, sharding: NamedSharding):
    """``x`` on ``sharding`` (a no-op when it is there already); works on global arrays
    of a multi-process run and on host values every process holds alike."""
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, np.ndim(x)):
            return x
        if not x.is_fully_addressable:
            return jax.deviceput(x, sharding)
    return global_array(x, sharding)


def place_like(state, params):
    """The optimiser ``state`` with its subtrees shaped like ``params`` (Adam's mu / nu)
    split leaf by leaf like the params, every other leaf (step counts) replicated on
    their mesh."""
    p_def = jax.tree.structure(params)
    p_shard = [x.sharding for x in jax.tree.leaves(params)]
    repl = NamedSharding(p_shard[0].mesh, P())

    def is_params_like(x):
        return jax.tree.structure(x) == p_def

    def one(sub):
        if is_params_like(sub):
            leaves = [put(v, s) for v, s in zip(jax.tree.leaves(sub), p_shard, strict=True)]
            return jax.tree.unflatten(p_def, leaves)
        return put(sub, repl)

    return jax.tree.map(one, state, is_leaf=lambda x: x is not state and is_params_like(x))


def _apply_updates(tx, params, grads, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@dataclasses.dataclass(frozen=True, eq=False)
class Optimizer:
    """An optax transformation, its learning-rate schedule, and its jitted apply:
    ``apply(params, grads, opt_state) -> (params, opt_state)``."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule

    def __post_init__(self):
        object.__setattr__(self, "_fn", jax.jit(lambda p, g, s: _apply_updates(self.tx, p, g, s)))
        object.__setattr__(self, "_pinned", {})

    def init(self, params):
        """``tx.init(params)``; on a mesh every leaf shaped like a parameter is split like
        it (Adam's moments), the rest (step counts) replicated."""
        state = self.tx.init(params)
        if not _on_mesh(params):
            return state
        return place_like(state, params)

    def apply(self, params, grads, opt_state):
        """One step: ``(params, opt_state)``. On a mesh the outputs keep the inputs'
        shardings (pinned, not left to the compiler's propagation)."""
        if not _on_mesh(params):
            # Committed to the params' device, so that one executable serves every step
            # whether the caller's arrays are committed or not (a program read back from
            # the AOT store, ``dtarl.aot``, returns committed gradients; the params of
            # the first step are not): jit keys its executables on that too.
            (dev,) = jax.tree.leaves(params)[0].devices()
            return self._fn(*jax.device_put((params, grads, opt_state), dev))
        shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
        key = jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings))
        fn = self._pinned.get(key)
        if fn is None:
            fn = jax.jit(
                lambda p, g, s: _apply_updates(self.tx, p, g, s),
                out_shardings=shardings,
            )
            self._pinned[key] = fn
        return fn(params, grads, opt_state)

    def lr(self, opt_state) -> float:
        """The learning rate the next update from ``opt_state`` applies: the schedule at
        the optimiser's own step count (which skipped, non-finite updates do not advance)."""
        is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
        (state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
        return float(self.schedule(int(state.count)))


def make_optimizer(*, lr: float, warmup: int, total: int, schedule: Schedule, cfg) -> Optimizer:
    """AdamW behind global-norm clipping, on ``make_schedule(lr, warmup, total, schedule)``;
    ``cfg``: the ``OptimSection`` (b1, b2, eps, weight_decay, max_grad_norm)."""
    sched = make_schedule(lr, warmup, total, schedule)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )
    return Optimizer(tx, sched)


# ------------------------------------------------------------------ update


class UpdateResult(NamedTuple):
    """One update: the new state (the old one when it was skipped) and what it did."""

    params: Any
    opt_state: Any
    loss: float
    grad_norm: float
    applied: bool  # False: a non-finite loss or gradient; the state is unchanged
    skip_reason: str  # "" when applied
    aux: EngineAux  # per-token logprobs and the engine's stats
    engine: str  # the engine's name (auto: "auto"; its pick is in aux.stats)
    seconds: float


def group_splits(batch: RolloutBatch, parts: int) -> list[np.ndarray]:
    """Sequence indices of ``parts`` sub-batches of ``batch`` that keep each group whole:
    the groups in order of first appearance, dealt into ``parts`` contiguous runs of
    near-equal group counts."""
    gids = batch.group_ids
    order = list(dict.fromkeys(gids.tolist()))
    if not 1 <= parts <= len(order):
        raise ValueError(
            f"cannot split a batch of {len(order)} groups into {parts} parts of whole groups "
            "(algo.minibatches x algo.grad_accum must be <= the groups per step)"
        )
    return [np.flatnonzero(np.isin(gids, chunk)) for chunk in np.array_split(order, parts)]


class EngineCall(NamedTuple):
    """One ``engine.value_and_grad`` of an update: a (sub-)batch, its sequence weights
    (None: the batch's own) and, for a part of an accumulated pass, its sequences'
    indices in the whole batch."""

    batch: RolloutBatch
    weights: np.ndarray | None = None
    index: np.ndarray | None = None


def engine_calls(batch: RolloutBatch, loss, parts: int = 1) -> list[EngineCall]:
    """The engine calls of ``engine_pass(..., grad_accum=parts)``: the batch itself, or
    ``parts`` sub-batches of whole groups (``group_splits``) weighted with the *whole*
    batch's normalisation (``accumulated_value_and_grad``)."""
    if parts <= 1:
        return [EngineCall(batch)]
    w = batch.sequence_weights(loss.norm, getattr(loss, "norm_constant", None))
    return [EngineCall(batch.select(idx), w[idx], idx) for idx in group_splits(batch, parts)]


def accumulated_value_and_grad(
    engine, params, batch: RolloutBatch, loss, parts: int, *, calls=None, run=None
):
    """``engine.value_and_grad`` of ``batch`` as the fp32 sum over ``parts`` sub-batches
    of whole groups (``group_splits``), each weighted with the *whole* batch's
    normalisation w_i (``RolloutBatch.sequence_weights``): the loss is linear in the
    per-sequence terms, L = sum_i w_i sum_t m_it l_it, so the sum equals one pass over
    the batch. Returns (value, grads, aux) with aux.logprobs in the batch's order.
    ``calls``: the batch's ``engine_calls`` if already made; ``run(call)``: how one
    call runs (default ``engine.value_and_grad(params, call.batch, loss, weights=...)``).
    """
    calls = engine_calls(batch, loss, parts) if calls is None else calls
    run = run or (lambda c: engine.value_and_grad(params, c.batch, loss, weights=c.weights))
    value, grads, logps, stats = 0.0, None, [None] * batch.num_sequences, {}
    for call in calls:
        v, g, aux = run(call)
        g = jax.tree.map(lambda x: x.astype(np.float32), g)
        grads = g if grads is None else jax.tree.map(lambda a, b: a + b, grads, g)
        value += float(v)
        for j, i in enumerate(call.index):
            logps[i] = aux.logprobs[j]
        stats = aux.stats
    return np.float32(value), grads, EngineAux(logprobs=tuple(logps), stats=stats)


def engine_pass(
    engine, params, batch: RolloutBatch, loss, grad_accum: int = 1, *, calls=None, run=None
):
    """``(value, grads, aux)`` of ``batch``: ``engine.value_and_grad``, or with
    ``grad_accum > 1`` its sum over that many parts (``accumulated_value_and_grad``).
    ``calls``: the batch's ``engine_calls`` if already made; ``run(call)`` runs one
    ``EngineCall`` (default: ``engine.value_and_grad``). The update loop passes both,
    to plan the next call while this one runs (``dtarl.rl.update``)."""
    if grad_accum > 1:
        return accumulated_value_and_grad(
            engine, params, batch, loss, grad_accum, calls=calls, run=run
        )
    if run is not None:
        return run(calls[0] if calls else EngineCall(batch))
    return engine.value_and_grad(params, batch, loss)


def update(
    params,
    opt_state,
    batch: RolloutBatch,
    *,
    engine,
    loss,
    optimizer: Optimizer,
    grad_accum: int = 1,
    calls=None,
    run=None,
) -> UpdateResult:
    """``engine.value_and_grad(params, batch, loss)`` (with ``grad_accum > 1``: accumulated
    over that many sub-batches of whole groups, ``accumulated_value_and_grad``), then one
    optimiser step, unless the loss or the gradient norm is not finite (then the state
    comes back unchanged). ``calls`` / ``run``: the engine calls and how one runs
    (``engine_pass``)."""
    t0 = time.perf_counter()
    value, grads, aux = engine_pass(engine, params, batch, loss, grad_accum, calls=calls, run=run)
    gnorm = float(grad_norm(grads))
    applied = bool(np.isfinite(float(value)) and np.isfinite(gnorm))
    why = ""
    if applied:
        params, opt_state = optimizer.apply(params, grads, opt_state)
    else:
        why = "non-finite loss or gradient"
    return UpdateResult(
        params=params,
        opt_state=opt_state,
        loss=float(value),
        grad_norm=gnorm,
        applied=applied,
        skip_reason=why,
        aux=aux,
        engine=aux.stats.get("engine", getattr(engine, "name", "?")),
        seconds=time.perf_counter() - t0,
    )


def on_policy(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` without old logprobs: the loss takes old = stop_gradient(logp)."""
    return dataclasses.replace(batch, old_logprobs=None)


def with_old_logprobs(batch: RolloutBatch, logprobs) -> RolloutBatch:
    """``batch`` with ``logprobs`` as its old logprobs (0 off the loss mask, like the
    sampler's)."""
    old = tuple(
        np.where(m > 0, lp, 0.0).astype(np.float32)
        for lp, m in zip(logprobs, batch.loss_mask, strict=True)
    )
    return dataclasses.replace(batch, old_logprobs=old)


def old_logprob_diff(parts, sampled) -> dict[str, float]:
    """``old_logprob_diff_max`` / ``_mean``: |old - sampled| over the trained tokens of
    each batch in ``parts`` (its old logprobs) against ``sampled`` (the sampler's)."""
    diffs = []
    for part, olds in zip(parts, sampled, strict=True):
        if part.old_logprobs is None or olds is None:
            continue
        for new, old, m in zip(part.old_logprobs, olds, part.loss_mask, strict=True):
            diffs.append(np.abs(np.asarray(new, np.float64) - old)[np.asarray(m) > 0])
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    if d.size == 0:
        return dict(old_logprob_diff_max=0.0, old_logprob_diff_mean=0.0)
    return dict(old_logprob_diff_max=float(d.max()), old_logprob_diff_mean=float(d.mean()))


__all__ = [
    "Optimizer",
    "UpdateResult",
    "EngineCall",
    "accumulated_value_and_grad",
    "engine_calls",
    "engine_pass",
    "grad_norm",
    "group_splits",
    "make_loss",
    "make_optimizer",
    "make_schedule",
    "old_logprob_diff",
    "on_policy",
    "place_like",
    "put",
    "update",
    "with_old_logprobs",
]
