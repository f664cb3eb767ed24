"""One RL step's batch, as stages: each a plain function of its inputs and sub-config
returning a typed record with its metrics (the step's metrics are their union).

    plan      DARTS budget: candidates per problem, early stop        -> Budget
    generate  the multi-turn rollout (local or process-sharded)        -> Generation
    score     task rewards (the verifier; tool turns already ran)      -> Scores
    shape     DARTS selection, overlong shaping, dynamic sampling      -> Shaped
    (refill: plan .. shape again on more problems until enough groups kept)
    select    the first ``len(problems)`` kept groups                  -> Selection
    forward   reference logprobs and critic values (or the streamed)   -> Forward
    advantage GRPO group advantages or PPO's GAE                       -> Advantages
    assemble  the ``RolloutBatch`` and its tree statistics

``rl_batch`` runs them; each is usable on its own (tests, notebooks).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dtarl import advantages as adv_fns
from dtarl.batch import RolloutBatch
from dtarl.rewards import RewardFn, compute_rewards
from dtarl.rl import darts
from dtarl.rl.config import Algorithm, AlgoSection, ConfigError, DartsSection, TrainerConfig
from dtarl.rl.metrics import length_stats
from dtarl.rl.multiturn import Trajectory, process_rollout, rollout
from dtarl.rl.tasks import Problem, Task
from dtarl.rl.value import ValueModel
from dtarl.rollout.protocol import Rollout
from dtarl.rollout.stream import Stream

# The reference policy's per-token logprobs of a list of sequences.
ReferenceFn = Callable[[Sequence[np.ndarray]], list[np.ndarray]]

# Rollout keys of refill batches: fold_in(key, REFILL_KEY + k) for generation batch k >= 1.
REFILL_KEY = 1 << 20

# DARTS metrics summed over a step's generation batches (the others: the last batch's).
DARTS_SUMS = (
    "darts_m_total",
    "darts_cancelled_tokens",
    "darts_early_stop_groups",
    "darts_dual_end_groups",
)
# Rollout metrics summed over a step's generation batches.
STREAM_SUMS = ("stream_tokens", "stream_lag_tokens", "stream_tail_seconds", "stream_seconds")


# ------------------------------------------------------------------ records


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budget:
    """``plan``: DARTS' allocation (None without DARTS) and the problems' state keys."""

    plan: darts.Plan | None = None
    keys: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Generation:
    """``generate``: the trajectories and the rollout's stats (DARTS reads
    ``decode_calls``); ``metrics`` are what the step reports of them."""

    trajectories: tuple[Trajectory, ...]
    stats: dict[str, Any]
    metrics: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Scores:
    """``score``: one task reward per trajectory, the reward function's failures and
    the seconds it took."""

    rewards: np.ndarray
    errors: int
    seconds: float
    # a reward dict's other numbers, per key: one per trajectory (NaN where absent)
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Shaped:
    """``shape``: one generation batch's training candidates (after DARTS selection),
    their task and shaped rewards, global group ids, the dynamic-sampling mask, and
    DARTS' metrics."""

    trajectories: tuple[Trajectory, ...]
    task_rewards: np.ndarray
    rewards: np.ndarray
    group_ids: np.ndarray
    keep: np.ndarray
    metrics: dict[str, Any]

    @property
    def kept_groups(self) -> int:
        return len(np.unique(self.group_ids[self.keep]))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Selection:
    """``select``: the trajectories trained on, with their shaped rewards and group ids."""

    trajectories: tuple[Trajectory, ...]
    rewards: np.ndarray
    group_ids: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Forward:
    """``forward``: reference logprobs and critic values per trajectory (None where the
    step has no such model); ``metrics``: ``post_rollout_forward_seconds`` if any ran."""

    ref: list[np.ndarray] | None
    values: list[np.ndarray] | None
    metrics: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Advantages:
    """``advantage``: per-sequence advantages (0 under GAE) and per-token ones (GAE)."""

    advantages: np.ndarray
    token_advantages: list[np.ndarray] | None
    metrics: dict[str, Any]


# ------------------------------------------------------------------ stages


def plan(dc: DartsSection, group_size: int, state: darts.DartsState | None, problems) -> Budget:
    """DARTS' candidates per problem and early-stop flags (``darts.plan``); none without
    ``state``."""
    if state is None:
        return Budget()
    keys = tuple(darts.prompt_key(p.prompt) for p in problems)
    alloc = darts.plan(
        state,
        list(keys),
        m=group_size,
        up_factor=dc.up_factor,
        lam=dc.lambda_,
        units=dc.lambda_units.value,
    )
    return Budget(plan=alloc, keys=keys)


def generate(
    budget: Budget,
    problems: Sequence[Problem],
    *,
    group_size: int,
    sampler: Rollout,
    params,
    tokenizer,
    task: Task,
    key: jax.Array,
    stream: Sequence[Stream] = (),
    shard_processes: bool = False,
    on_call: Callable[[Any, Any], Any] | None = None,
) -> Generation:
    """The rollout of ``problems``: this process's (``rollout``) or, with
    ``shard_processes``, each process's share all-gathered (``process_rollout``)."""
    kw: dict[str, Any] = dict(group_size=group_size, key=key)
    if budget.plan is not None:
        kw.update(counts=budget.plan.counts, early_stop=budget.plan.early_stop)
    if shard_processes:
        if stream:
            raise ConfigError(
                "rollout.streaming is not supported with a process-sharded rollout "
                "(the streaming scorers are single-process)"
            )
        trajs, stats = process_rollout(sampler, params, tokenizer, task, problems, **kw)
    else:
        trajs, stats = rollout(
            sampler, params, tokenizer, task, problems, stream=stream, on_call=on_call, **kw
        )
    names = ("rollout_seconds", "rollout_tokens", "rollout_processes", "rollout_local_prompts")
    names += STREAM_SUMS + ("decode_seconds_per_step",)
    metrics = {k: stats[k] for k in names if k in stats}
    return Generation(trajectories=tuple(trajs), stats=stats, metrics=metrics)


def score(
    reward_fn: RewardFn,
    problems: Sequence[Problem],
    gen: Generation,
    *,
    on_error,
    max_concurrency: int = 64,
) -> Scores:
    """Task rewards of the generation's trajectories (``compute_rewards``; a reward
    dict's other numbers in ``extras``)."""
    t0 = time.perf_counter()
    trajs = gen.trajectories
    scored = compute_rewards(
        reward_fn,
        [problems[t.problem_index] for t in trajs],
        [t.completion for t in trajs],
        on_error=on_error,
        max_concurrency=max_concurrency,
    )
    return Scores(
        rewards=np.asarray(scored.rewards, np.float32),
        errors=len(scored.errors),
        seconds=time.perf_counter() - t0,
        extras=scored.extras,
    )


def shape(
    cfg: TrainerConfig,
    budget: Budget,
    gen: Generation,
    scores: Scores,
    *,
    state: darts.DartsState | None,
    group_offset: int,
) -> Shaped:
    """DARTS' training groups from the candidates (``shape_darts``; updates ``state``),
    then DAPO's overlong shaping and the dynamic-sampling mask (groups whose task
    rewards are not all equal). Group ids start at ``group_offset``."""
    trajs, task_r, metrics = gen.trajectories, scores.rewards, {}
    if budget.plan is not None:
        idx, metrics = shape_darts(cfg, state, budget.plan, budget.keys, trajs, task_r, gen.stats)
        trajs, task_r = tuple(trajs[i] for i in idx), task_r[idx]
    gids = np.array([group_offset + t.problem_index for t in trajs], np.int32)
    keep = np.ones(len(trajs), bool)
    if cfg.algo.use_dynamic_sampling:
        keep = adv_fns.dynamic_sampling_mask(task_r, gids)
    return Shaped(
        trajectories=trajs,
        task_rewards=task_r,
        rewards=shaped_rewards(cfg, task_r, trajs),
        group_ids=gids,
        keep=keep,
        metrics=metrics,
    )


def select(batches: Sequence[Shaped], target: int) -> Selection | None:
    """The first ``target`` kept groups, in generation order (None: none kept)."""
    trajs = [t for b in batches for t in b.trajectories]
    keep = np.concatenate([b.keep for b in batches])
    if not keep.any():
        return None
    gids = np.concatenate([b.group_ids for b in batches])
    first = list(dict.fromkeys(gids[keep].tolist()))[:target]
    idx = np.flatnonzero(keep & np.isin(gids, first))
    rewards = np.concatenate([b.rewards for b in batches])
    return Selection(
        trajectories=tuple(trajs[i] for i in idx), rewards=rewards[idx], group_ids=gids[idx]
    )


def forward(
    trajs: Sequence[Trajectory],
    *,
    reference: ReferenceFn | None,
    value: ValueModel | None,
    tail_seconds: float = 0.0,
) -> Forward:
    """The forward-only passes left after generation: the streamed models' results (their
    tail, ``tail_seconds``, was scored in the rollout) or the forward over the finished
    batch of any model not streamed."""
    toks = [t.tokens for t in trajs]
    seconds, ran = tail_seconds, False
    t0 = time.perf_counter()
    if all(t.ref_logprobs is not None for t in trajs):  # streamed during the rollout
        ref, ran = [t.ref_logprobs for t in trajs], True
    else:
        ref = reference(toks) if reference is not None else None
        if ref is not None:
            seconds, ran = seconds + time.perf_counter() - t0, True
    values = None
    if value is not None:
        t0 = time.perf_counter()
        if all(t.values is not None for t in trajs):  # streamed during the rollout
            values = [t.values for t in trajs]
        else:
            values = value.values(toks)
            seconds += time.perf_counter() - t0
        ran = True
    metrics = dict(post_rollout_forward_seconds=seconds) if ran else {}
    return Forward(ref=ref, values=values, metrics=metrics)


def advantage(
    cfg: TrainerConfig, sel: Selection, fwd: Forward, value: ValueModel | None
) -> Advantages:
    """GAE per token from the critic's values (PPO; ``ValueModel.advantages``), else
    GRPO's group-normalised advantages (``group_advantages``)."""
    if value is None:
        advs = group_advantages(cfg, sel.rewards, sel.group_ids)
        return Advantages(advantages=advs, token_advantages=None, metrics={})
    a: AlgoSection = cfg.algo
    token_adv, value_stats = value.advantages(
        [t.tokens for t in sel.trajectories],
        [t.loss_mask for t in sel.trajectories],
        [t.old_logprobs for t in sel.trajectories],
        sel.rewards,
        fwd.ref,
        kl_coef=a.kl_coef,
        gamma=a.gamma,
        lam=a.lam,
        values=fwd.values,
    )
    return Advantages(
        advantages=np.zeros(len(sel.trajectories), np.float32),
        token_advantages=token_adv,
        metrics=value_stats,
    )


def assemble(sel: Selection, fwd: Forward, adv: Advantages) -> tuple[RolloutBatch, dict]:
    """The ``RolloutBatch`` and its prefix tree's statistics (the tree is built once: the
    training engine reuses it)."""
    batch = RolloutBatch.create(
        tokens=[t.tokens for t in sel.trajectories],
        loss_mask=[t.loss_mask for t in sel.trajectories],
        advantages=adv.advantages,
        old_logprobs=[t.old_logprobs for t in sel.trajectories],
        ref_logprobs=fwd.ref,
        token_advantages=adv.token_advantages,
        group_ids=sel.group_ids,
        rewards=sel.rewards,
    )
    tree = batch.prefix_tree()
    return batch, dict(
        advantage_abs_mean=advantage_abs_mean(batch),
        tree_token_ratio=tree.stats.ideal_token_ratio,
        num_tokens=batch.num_tokens,
        tree_tokens=tree.stats.tree_tokens,
    )


# ------------------------------------------------------------------ the step


def rl_batch(
    cfg: TrainerConfig,
    problems: Sequence[Problem],
    *,
    sampler: Rollout,
    params,
    tokenizer,
    task: Task,
    reward_fn: RewardFn,
    key: jax.Array,
    reference: ReferenceFn | None = None,
    value: ValueModel | None = None,
    more_problems: Callable[[int], Sequence[Problem]] | None = None,
    darts_state: darts.DartsState | None = None,
    stream: Sequence[Stream] = (),
    shard_processes: bool = False,
    on_call: Callable[[Any, Any], Any] | None = None,
) -> tuple[RolloutBatch | None, dict[str, Any]]:
    """One RL step's batch: ``cfg.rollout.group_size`` samples of each problem under
    ``params``, scored by ``reward_fn`` and shaped, filtered by dynamic sampling
    (DAPO), with reference logprobs (``reference``, for a KL term) and advantages:
    GRPO's group-normalised ones, or per-token GAE from ``value`` (PPO).

    Dynamic sampling keeps the groups whose *task* rewards (the verifier's scores,
    before overlong shaping) are not all equal, as DAPO filters on accuracy. While
    fewer than ``len(problems)`` groups are kept it samples another batch of
    ``more_problems(k)`` (k = 1, 2, ...), up to ``algo.max_generation_batches`` in
    all, and trains on the first ``len(problems)`` kept groups. Metrics:
    ``generation_batches``, ``kept_fraction`` (kept / generated groups) and
    ``groups_short`` (groups missing from the target; 0 when it was filled).

    With ``darts_state`` (``algo.darts.enabled``) each problem gets the DARTS
    allocation's number of candidates and its training group is shaped from them
    (``shape_darts``); the state's statistics are updated in place.

    With ``shard_processes`` (a multi-process run) each generation batch is
    ``process_rollout``: every process samples its share of the problems and all of
    them get the whole batch (metrics ``rollout_processes``, ``rollout_local_prompts``:
    this process's share of the step's problems, summed over generation batches).

    Returns ``(batch, metrics)``; ``batch`` is None when dynamic sampling kept no
    group (``metrics`` then say ``skipped=1`` and why).

    ``on_call``: the sampler's hook between decode calls (PAT's controller).
    """
    target, todo = len(problems), list(problems)
    gens: list[Generation] = []
    scores: list[Scores] = []
    shaped: list[Shaped] = []
    while True:
        k = len(gens)
        budget = plan(cfg.algo.darts, cfg.rollout.group_size, darts_state, todo)
        gen = generate(
            budget,
            todo,
            group_size=cfg.rollout.group_size,
            sampler=sampler,
            params=params,
            tokenizer=tokenizer,
            task=task,
            key=key if k == 0 else jax.random.fold_in(key, REFILL_KEY + k),
            stream=stream,
            shard_processes=shard_processes,
            on_call=on_call,
        )
        rw = cfg.reward
        sc = score(reward_fn, todo, gen, on_error=rw.on_error, max_concurrency=rw.max_concurrency)
        gens.append(gen)
        scores.append(sc)
        shaped.append(shape(cfg, budget, gen, sc, state=darts_state, group_offset=k * target))
        if not refill(cfg.algo, shaped, target, more_problems):
            break
        todo = list(more_problems(len(gens)))
        if len(todo) != target:
            raise ValueError(
                f"more_problems({len(gens)}) gave {len(todo)} problems; "
                f"expected {target} (one generation batch)"
            )
    m = batch_metrics(gens, scores, shaped, target)
    sel = select(shaped, target)
    if sel is None:
        m.update(skipped=1, skip_reason="every group has equal task rewards (no signal)")
        return None, m
    tail = m.get("stream_tail_seconds", 0.0)
    fwd = forward(sel.trajectories, reference=reference, value=value, tail_seconds=tail)
    adv = advantage(cfg, sel, fwd, value)
    batch, tree_m = assemble(sel, fwd, adv)
    return batch, {**m, **fwd.metrics, **adv.metrics, **tree_m}


def reward_extras(scores: Sequence[Scores]) -> dict[str, float]:
    """``reward/<key>``: the mean of each reward-dict number over the generated samples
    that reported it (every generation batch of the step)."""
    keys = sorted({k for s in scores for k in s.extras})
    out = {}
    for k in keys:
        v = np.concatenate([s.extras.get(k, np.full(len(s.rewards), np.nan)) for s in scores])
        if np.isfinite(v).any():
            out[f"reward/{k}"] = float(np.nanmean(v))
    return out


def refill(algo: AlgoSection, shaped: Sequence[Shaped], target: int, more) -> bool:
    """Whether dynamic sampling needs another generation batch (and may have one)."""
    kept = sum(b.kept_groups for b in shaped)
    return (
        algo.use_dynamic_sampling
        and kept < target
        and more is not None
        and len(shaped) < algo.max_generation_batches
    )


def batch_metrics(
    gens: Sequence[Generation], scores: Sequence[Scores], shaped: Sequence[Shaped], target: int
) -> dict[str, Any]:
    """The union of the generation batches' records: rewards over every candidate kept
    by DARTS, rollout totals, DARTS' sums (the rest: the last batch's), kept groups."""
    roll: dict[str, Any] = dict(rollout_seconds=0.0, rollout_tokens=0)
    darts_m: dict[str, Any] = {}
    for g, s in zip(gens, shaped, strict=True):
        for name, v in g.metrics.items():
            summed = name in STREAM_SUMS or name in ("rollout_seconds", "rollout_tokens")
            if name == "rollout_local_prompts" or summed:
                roll[name] = roll.get(name, 0.0 if name in STREAM_SUMS else 0) + v
            else:  # the last batch's
                roll[name] = v
        for name, v in s.metrics.items():
            darts_m[name] = darts_m.get(name, 0.0) + v if name in DARTS_SUMS else v
    trajs = [t for b in shaped for t in b.trajectories]
    rewards = np.concatenate([b.rewards for b in shaped])
    kept = sum(b.kept_groups for b in shaped)
    return dict(
        **reward_extras(scores),
        score_mean=float(np.concatenate([b.task_rewards for b in shaped]).mean()),
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        success_rate=success_rate(np.concatenate([b.task_rewards for b in shaped])),
        truncated_fraction=float(np.mean([t.truncated for t in trajs])),
        turns_mean=float(np.mean([t.num_turns for t in trajs])),
        reward_errors=sum(s.errors for s in scores),
        reward_seconds=sum(s.seconds for s in scores),
        rollout_tokens_per_s=roll["rollout_tokens"] / max(roll["rollout_seconds"], 1e-9),
        **roll,
        **length_stats([t.response_len for t in trajs]),
        generation_batches=len(gens),
        kept_fraction=kept / (len(gens) * target),
        groups_short=max(0, target - kept),
        **darts_m,
    )


# ------------------------------------------------------------------ pieces


def shape_darts(
    cfg: TrainerConfig,
    state: darts.DartsState,
    plan: darts.Plan,
    keys: Sequence[str],
    trajs: Sequence[Trajectory],
    rewards: np.ndarray,
    stats: dict[str, Any],
) -> tuple[np.ndarray, dict[str, Any]]:
    """DARTS selection of each problem's training group from its candidates (Alg. 2),
    then the state's updates: length EMAs and the cost model's decode calls.

    Returns (indices into ``trajs`` of the training groups, metrics). The cost
    model's prediction of this step's decode time (Eq. 4 on the lengths generated)
    uses only earlier steps' calls, so ``darts_cost_error`` is a held-out error.
    """
    m = cfg.rollout.group_size
    short_k = cfg.algo.darts.short_k or m - 1
    by_problem: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        by_problem.setdefault(t.problem_index, []).append(i)
    chosen: list[int] = []
    lengths = np.asarray([t.response_len for t in trajs], np.int64)
    complete = np.asarray([not t.truncated for t in trajs], bool)
    for p, rows in sorted(by_problem.items()):
        lens, ok = lengths[rows].tolist(), complete[rows].tolist()
        if plan.early_stop[p]:
            order = sorted(range(len(rows)), key=lambda j: trajs[rows[j]].finish_rank)
            pick = darts.early_stop_select(lens, ok, order, m)
        else:
            pick = darts.dual_end_select(lens, ok, m, min(short_k, m))
        chosen += [rows[j] for j in pick]
    idx = np.asarray(chosen, np.int64)
    finished = ~np.asarray([t.cancelled for t in trajs], bool)
    metrics = darts_metrics(state, plan, m, trajs, lengths, idx, rewards, stats)
    state.update(
        {keys[p]: [int(lengths[i]) for i in rows if finished[i]] for p, rows in by_problem.items()}
    )
    for call in stats.get("decode_calls", []):  # every process's calls
        state.cost.observe(*call)
    return idx, metrics


def darts_metrics(
    state: darts.DartsState,
    plan: darts.Plan,
    m: int,
    trajs: Sequence[Trajectory],
    lengths: np.ndarray,
    idx: np.ndarray,
    rewards: np.ndarray,
    stats: dict[str, Any],
) -> dict[str, Any]:
    """The allocation, the kept lengths and the cost model's held-out error of a step."""
    cancelled = np.asarray([t.cancelled for t in trajs], bool)
    finished = ~cancelled
    # The processes of a sharded rollout decode concurrently: the step's decode time is
    # the slowest process's, each priced by Eq. 4 on its own share's lengths.
    parts = stats.get("decode_calls_per_process") or [
        (0, len(plan.counts), stats.get("decode_calls", []))
    ]
    share_lens = [
        [int(lengths[i]) for i, t in enumerate(trajs) if lo <= t.problem_index < hi]
        for lo, hi, _ in parts
    ]
    slots = stats.get("decode_slots")
    pred, actual = darts.step_cost(state.cost, share_lens, [c for _, _, c in parts], slots)
    if not plan.cost_fitted:
        pred = float("nan")
    # The schedule's decode steps against the engine's (a check free of machine load).
    steps_pred = max(len(state.cost.schedule(ls, slots)[0]) for ls in share_lens)
    steps_actual = max(int(sum(c[1] for c in cs)) for _, _, cs in parts)
    return dict(
        darts_m_total=float(plan.total),
        darts_m_star=plan.m_star,
        darts_k_s=plan.k,
        darts_alloc_min=float(min(plan.counts)),
        darts_alloc_mean=float(np.mean(plan.counts)),
        darts_alloc_max=float(max(plan.counts)),
        darts_alloc_hist=np.bincount(plan.counts).tolist(),
        darts_early_stop_groups=float(sum(plan.early_stop)),
        # groups with redundant candidates that dual-end selection shapes (Alg. 2)
        darts_dual_end_groups=float(
            sum(c > m and not e for c, e in zip(plan.counts, plan.early_stop, strict=True))
        ),
        darts_generated_len_mean=float(lengths[finished].mean()) if finished.any() else 0.0,
        darts_kept_len_mean=float(lengths[idx].mean()),
        darts_cancelled_tokens=float(lengths[cancelled].sum()),
        darts_reward_shift=float(rewards[idx].mean() - rewards[finished].mean())
        if finished.any()
        else 0.0,
        darts_cost_predicted_s=pred,
        darts_cost_actual_s=actual,
        darts_decode_steps_predicted=float(steps_pred),
        darts_decode_steps=float(steps_actual),
        darts_cost_error=abs(pred - actual) / actual
        if plan.cost_fitted and actual
        else float("nan"),
        darts_rho=state.rho,
    )


def shaped_rewards(cfg: TrainerConfig, rewards: np.ndarray, trajs: Sequence[Trajectory]):
    """Task rewards plus DAPO's overlong shaping (when ``algo.overlong_buffer > 0``)."""
    r = np.asarray(rewards, np.float32)
    if cfg.algo.overlong_buffer > 0:
        max_len = cfg.rollout.max_new_tokens * cfg.task.max_turns
        lens = [t.response_len for t in trajs]
        r = r + adv_fns.overlong_penalty(
            lens, max_len=max_len, buffer=min(cfg.algo.overlong_buffer, max_len)
        )
    return r


def group_advantages(cfg: TrainerConfig, rewards: np.ndarray, group_ids: np.ndarray):
    """``grpo_advantages`` with the algorithm's options (Dr.GRPO: no std scaling;
    ``algo.std_ddof``)."""
    scale = cfg.algo.algorithm is not Algorithm.DR_GRPO
    return adv_fns.grpo_advantages(rewards, group_ids, scale_std=scale, ddof=cfg.algo.std_ddof)


def success_rate(rewards: np.ndarray) -> float:
    """Fraction of samples with reward >= 1 (the built-in tasks score 0 or 1)."""
    r = np.asarray(rewards)
    return float(np.mean(r >= 1.0)) if r.size else 0.0


def advantage_abs_mean(batch: RolloutBatch) -> float:
    """Mean |A| of the advantages the loss uses: per trained token where the batch has
    per-token advantages (PPO/GAE; its sequence advantages are then 0), else per sequence."""
    if batch.token_advantages is None:
        return float(np.abs(batch.advantages).mean())
    pairs = zip(batch.token_advantages, batch.loss_mask, strict=True)
    num = sum(float(np.sum(m * np.abs(a))) for a, m in pairs)
    return num / max(sum(float(m.sum()) for m in batch.loss_mask), 1e-30)


__all__ = [
    "Advantages",
    "Budget",
    "Forward",
    "Generation",
    "ReferenceFn",
    "Scores",
    "Selection",
    "Shaped",
    "advantage",
    "advantage_abs_mean",
    "assemble",
    "batch_metrics",
    "darts_metrics",
    "forward",
    "generate",
    "group_advantages",
    "plan",
    "refill",
    "rl_batch",
    "score",
    "select",
    "shape",
    "shape_darts",
    "shaped_rewards",
    "success_rate",
]
