"""Calibration: synthetic batches and rollouts spanning the replay suite's regime,
timed with the replay's protocol, and fitted into a ``CostProfile``."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtarl.batch import RolloutBatch
from dtarl.bench.replay import (
    ReplayConfig,
    RolloutCall,
    TimingJob,
    WorkloadSpec,
    replay,
    replay_rounds,
    rollout_sampler,
    run_rollout_calls,
    time_engines,
)
from dtarl.bench.simulate.features import (
    AUTO,
    WorkFeatures,
    calibration_loss,
    check_kind,
    engine_default,
    engine_features,
    engine_kwargs,
    feature_engine,
    rollout_features,
)
from dtarl.bench.simulate.fit import (
    AutoCost,
    CalibrationPoint,
    CostProfile,
    RolloutCost,
    fit_engine_costs,
)
from dtarl.engines.base import split_model
from dtarl.engines.config import EngineKind
from dtarl.engines.cost import nnls
from dtarl.model import init_model
from dtarl.model.config import ModelConfig
from dtarl.testing import grpo_groups
from dtarl.timing import QuietGate, load_avg, machine_info


def multi_turn_batch(
    *,
    num_groups: int,
    group_size: int,
    turns: int,
    prompt_len: int,
    turn_len: tuple[int, int],
    tool_len: tuple[int, int],
    vocab_size: int = 256,
    seed: int = 0,
) -> RolloutBatch:
    """Per-turn multi-turn batch: each sample's turns k = 1..turns are sequences.

    A sample is prompt, then per turn a tool output (from turn 2 on) and a model
    response; the sequence of turn k is its path through response k, so the
    prefix tree is a chain per sample with sequences ending at internal nodes.
    """
    rs = np.random.RandomState(seed)
    toks, gids, plens = [], [], []
    for g in range(num_groups):
        prompt = rs.randint(3, vocab_size, prompt_len)
        for _ in range(group_size):
            path = [prompt]
            for k in range(turns):
                if k > 0:
                    path.append(rs.randint(3, vocab_size, rs.randint(tool_len[0], tool_len[1] + 1)))
                path.append(rs.randint(3, vocab_size, rs.randint(turn_len[0], turn_len[1] + 1)))
                toks.append(np.concatenate(path))
                gids.append(g)
                plens.append(prompt_len)
    return RolloutBatch.create(
        tokens=toks,
        prompt_lens=plens,
        advantages=rs.randn(len(toks)).astype(np.float32),
        group_ids=np.array(gids),
    )


def _suite(prefix: str, grpo_shapes, make_grpo, make_multi_turn, seed: int) -> list:
    """Named calibration items: one per (groups, group size, prompt, response range) in
    ``grpo_shapes`` from ``make_grpo``, then one multi-turn item (2 x 4, 3 turns)."""
    out = [
        (
            f"{prefix}g{g}x{n}_p{p}_r{r[0]}-{r[1]}",
            make_grpo(num_groups=g, group_size=n, prompt_len=p, response_len=r, seed=seed + i),
        )
        for i, (g, n, p, r) in enumerate(grpo_shapes)
    ]
    multi_turn = make_multi_turn(
        num_groups=2,
        group_size=4,
        turns=3,
        prompt_len=40,
        turn_len=(10, 40),
        tool_len=(20, 50),
        seed=seed + 100,
    )
    return out + [(f"{prefix}multiturn_g2x4_t3", multi_turn)]


def calibration_batches(*, seed: int = 0, size: str = "default") -> list[tuple[str, RolloutBatch]]:
    """Synthetic training batches spanning the replay suite's regime (module docstring).

    Deliberately *not* trace workloads, so validating on traces tests
    generalisation. ``size="tiny"`` gives three very small batches (tests).
    """
    if size == "tiny":
        shapes = [(1, 2, 4, (3, 6)), (2, 2, 6, (8, 20)), (2, 3, 3, (20, 40))]
        return [
            (
                f"tiny{i}",
                grpo_groups(
                    num_groups=g, group_size=n, prompt_len=p, response_len=r, seed=seed + i
                ),
            )
            for i, (g, n, p, r) in enumerate(shapes)
        ]
    if size != "default":
        raise ValueError(f"size={size!r}: expected 'default' or 'tiny'")
    grpo = [
        # (groups, group size, prompt, response range): small; medium; long responses;
        # long prompts with short and very short responses; long responses (suffix
        # rows of 256, as math/code traces); many groups
        (1, 4, 8, (20, 60)),
        (4, 8, 16, (8, 100)),
        (2, 8, 48, (40, 200)),
        (4, 8, 200, (4, 56)),
        (4, 8, 250, (4, 16)),
        (4, 8, 56, (150, 250)),
        (6, 8, 40, (30, 200)),
    ]
    return _suite("", grpo, grpo_groups, multi_turn_batch, seed)


def _grpo_calls(
    *, num_groups: int, group_size: int, prompt_len: int, response_len: tuple[int, int], seed: int
) -> list[RolloutCall]:
    """One generate call: every group's prompt once, its responses forced (a GRPO rollout)."""
    rs = np.random.RandomState(seed)
    prompts = tuple(rs.randint(3, 256, prompt_len) for _ in range(num_groups))
    lo, hi = response_len
    forced = tuple(int(rs.randint(lo, hi + 1)) for _ in range(num_groups * group_size))
    return [RolloutCall(prompts=prompts, counts=(group_size,) * num_groups, forced=forced)]


def _multi_turn_calls(
    *, num_groups: int, group_size: int, turns: int, prompt_len: int, turn_len, tool_len, seed
) -> list[RolloutCall]:
    """The per-turn calls of a multi-turn rollout (turn 0 shares each group's prompt)."""
    rs = np.random.RandomState(seed)
    ctx = []
    prompts0 = []
    for _ in range(num_groups):
        p = rs.randint(3, 256, prompt_len)
        prompts0.append(p)
        ctx += [p] * group_size
    calls = []
    for k in range(turns):
        forced = [int(rs.randint(turn_len[0], turn_len[1] + 1)) for _ in ctx]
        if k == 0:
            calls.append(
                RolloutCall(
                    prompts=tuple(prompts0),
                    counts=(group_size,) * num_groups,
                    forced=tuple(forced),
                )
            )
        else:
            calls.append(
                RolloutCall(prompts=tuple(ctx), counts=(1,) * len(ctx), forced=tuple(forced))
            )
        ctx = [
            np.concatenate(
                [c, rs.randint(3, 256, n), rs.randint(3, 256, rs.randint(tool_len[0], tool_len[1]))]
            )
            for c, n in zip(ctx, forced, strict=True)
        ]
    return calls


def calibration_rollouts(*, seed: int = 0, size: str = "default") -> list[tuple[str, list]]:
    """Synthetic rollouts (lists of ``RolloutCall``) spanning the replay suite's regime."""
    if size == "tiny":
        return [
            (
                "tiny_grpo",
                _grpo_calls(
                    num_groups=2, group_size=2, prompt_len=4, response_len=(3, 9), seed=seed
                ),
            )
        ]
    if size != "default":
        raise ValueError(f"size={size!r}: expected 'default' or 'tiny'")
    grpo = [
        # (groups, group size, prompt, response range)
        (1, 4, 8, (20, 60)),
        (4, 8, 16, (8, 100)),
        (2, 8, 48, (40, 250)),
        (4, 8, 200, (4, 56)),
        (8, 4, 24, (100, 240)),
    ]
    return _suite("roll_", grpo, _grpo_calls, _multi_turn_calls, seed)


def _time_rollouts(model, params, rollouts, *, repeats: int, seed: int, gate, log=None):
    """Interleaved timing of calibration rollouts: warm-up each, then
    ``replay_rounds`` behind ``gate``.

    Returns [(min_s, median_s, background cores of the fastest run, every run)] per
    rollout, or None without a forced-length sampler.
    """
    samplers = []
    for name, calls in rollouts:
        s = rollout_sampler(model, calls)
        if s is None:
            return None
        t0 = time.perf_counter()
        run_rollout_calls(s, params, calls, seed)
        samplers.append(s)
        if log is not None:
            log(f"compiled rollout {name}: first run {time.perf_counter() - t0:.2f}s")

    def caller(calls, s):
        return lambda: run_rollout_calls(s, params, calls, seed)[0]

    fns = [caller(calls, s) for (_, calls), s in zip(rollouts, samplers, strict=True)]
    timed = replay_rounds(fns, repeats=repeats, gate=gate)
    return [
        (min(t.seconds), statistics.median(t.seconds), t.background[t.best], t.seconds)
        for t in timed
    ]


def _time_auto_choice(cfg, batches, *, repeats: int, gate=None) -> list[tuple[float, float]]:
    """Auto's extra host time per batch (3): ``choose`` minus its pick's own ``prepare``
    (which the pick's calibrated cost already contains), each the minimum of
    ``repeats`` calls behind ``gate``; returns (extra from minima, from medians)."""
    engine = feature_engine(AUTO, cfg)
    loss = calibration_loss()
    out = []
    for _, b in batches:
        inner = engine.engines[engine.choose(b, loss)[0]]

        def timed(fn, b=b):
            def call() -> float:
                t0 = time.perf_counter()
                fn(b, loss)
                return time.perf_counter() - t0

            return call

        t_choose, t_prep = replay_rounds(
            [timed(engine.choose), timed(inner.prepare)], repeats=max(repeats, 3), gate=gate
        )
        mn = min(t_choose.seconds) - min(t_prep.seconds)
        med = statistics.median(t_choose.seconds) - statistics.median(t_prep.seconds)
        out.append((max(mn, 1e-7), max(med, 1e-7)))
    return out


def calibration_kinds(kinds: Sequence[str]) -> tuple[list[str], bool]:
    """(engine kinds to time, whether auto is priced): auto adds its candidates."""
    want = [check_kind(k) for k in kinds]
    if not want:
        raise ValueError("engines: empty; give at least one engine kind")
    auto = AUTO in want
    out = [k for k in want if k != AUTO]
    if auto:
        kinds = engine_default(AUTO, "candidates") or [
            k.value for k in EngineKind.auto_candidates()
        ]
        out += [k for k in kinds if k not in out]
    return list(dict.fromkeys(out)), auto


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CalibrationPlan:
    """What a calibration times: engine jobs (with their features) and rollouts."""

    model: ModelConfig
    chunk_len: int
    microbatch: int
    train_kinds: tuple[str, ...]
    with_auto: bool
    batches: tuple[tuple[str, RolloutBatch], ...]
    jobs: tuple[TimingJob, ...]
    features: tuple[WorkFeatures, ...]
    rollouts: tuple[tuple[str, list], ...]


def calibration_plan(
    kinds: Sequence[str] = ("dense", "dfs"),
    *,
    model: ModelConfig | None = None,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    rollouts: Sequence[tuple[str, list]] | None = None,
    rollout: bool = True,
    chunk_len: int | None = None,
    microbatch: int | None = None,
    seed: int = 0,
) -> CalibrationPlan:
    """The jobs of a calibration: every engine kind (auto adds its candidates) on
    every batch (default ``calibration_batches``), and the rollouts (default
    ``calibration_rollouts``; none when ``rollout`` is False)."""
    cfg = ModelConfig.tiny() if model is None else model
    chunk_len = engine_default("dfs", "chunk_len") if chunk_len is None else chunk_len
    microbatch = engine_default("dense", "microbatch") if microbatch is None else microbatch
    batches = calibration_batches(seed=seed) if batches is None else list(batches)
    if not batches:
        raise ValueError("batches: empty; the calibration needs at least one batch")
    train_kinds, with_auto = calibration_kinds(kinds)
    jobs, feats = [], []
    for kind in train_kinds:
        kw = engine_kwargs(kind, chunk_len=chunk_len, microbatch=microbatch)
        for name, b in batches:
            jobs.append(TimingJob(kind=kind, batch=b, engine_kwargs=kw, label=name))
            feats.append(engine_features(kind, b, cfg, chunk_len=chunk_len, microbatch=microbatch))
    auto_chunk = engine_default(AUTO, "chunk_len")
    if with_auto and "dfs" in train_kinds and auto_chunk != chunk_len:
        # Auto runs dfs with its own chunk: every other batch at that chunk too, so the
        # dfs fit separates per-step from per-token cost and covers both programs.
        for name, b in batches[::2]:
            kw = dict(chunk_len=auto_chunk)
            jobs.append(
                TimingJob(kind="dfs", batch=b, engine_kwargs=kw, label=f"{name}@c{auto_chunk}")
            )
            feats.append(engine_features("dfs", b, cfg, chunk_len=auto_chunk))
    if rollout:
        rollouts = calibration_rollouts(seed=seed) if rollouts is None else list(rollouts)
    return CalibrationPlan(
        model=cfg,
        chunk_len=chunk_len,
        microbatch=microbatch,
        train_kinds=tuple(train_kinds),
        with_auto=with_auto,
        batches=tuple(batches),
        jobs=tuple(jobs),
        features=tuple(feats),
        rollouts=tuple(rollouts or ()) if rollout else (),
    )


def fit_profile(
    plan: CalibrationPlan,
    timings: Sequence,
    rollout_timings: Sequence[tuple] | None,
    auto_choice: Sequence[tuple[float, float]] | None,
    *,
    machine: dict[str, Any],
) -> CostProfile:
    """A ``CostProfile`` from measured calibration jobs (minima are fitted).

    timings: ``EngineTiming`` per ``plan.jobs``; rollout_timings: (min, median,
    background of the fastest, every run) per ``plan.rollouts`` (None: no
    sampler); auto_choice: (extra from
    minima, from medians) per batch (``plan.with_auto``).
    """
    points = [
        CalibrationPoint(
            kind=job.kind,
            name=job.label,
            features=f,
            measured_s=t.step_min_s,
            median_s=t.step_s,
            background_cores=t.min_background_cores,
            runs_s=tuple(t.runs_s),
        )
        for job, f, t in zip(plan.jobs, plan.features, timings, strict=True)
    ]
    costs = fit_engine_costs(
        {
            kind: [(p.features, p.measured_s) for p in points if p.kind == kind]
            for kind in plan.train_kinds
        }
    )
    auto = None
    if plan.with_auto and auto_choice is not None:
        # Absolute least squares: the extras are small differences of two timings, so
        # relative weights would let a near-zero (noisy) difference dominate the fit.
        x = np.array([[float(b.num_tokens), 1.0] for _, b in plan.batches])
        y = np.array([t for t, _ in auto_choice])
        c = nnls(x, y)
        mape = float(np.mean(np.abs(x @ c - y) / np.maximum(y, 1e-4)) * 100.0)
        auto = AutoCost(s_per_token=float(c[0]), const_s=float(c[1]), fit_mape=mape)
        for (name, _), (mn, med) in zip(plan.batches, auto_choice, strict=True):
            points.append(
                CalibrationPoint(
                    kind="auto_choose", name=name, features=None, measured_s=mn, median_s=med
                )
            )
    roll = None
    if plan.rollouts and rollout_timings is not None:
        rf = [rollout_features(calls, plan.model) for _, calls in plan.rollouts]
        roll = RolloutCost.fit(rf, [t[0] for t in rollout_timings])
        for (name, _), f, (mn, med, bg, runs) in zip(
            plan.rollouts, rf, rollout_timings, strict=True
        ):
            points.append(
                CalibrationPoint(
                    kind="rollout",
                    name=name,
                    features=f,
                    measured_s=mn,
                    median_s=med,
                    background_cores=bg,
                    runs_s=tuple(runs),
                )
            )
    return CostProfile(
        engines=costs,
        model=plan.model,
        chunk_len=plan.chunk_len,
        microbatch=plan.microbatch,
        auto=auto,
        rollout=roll,
        machine=machine,
        points=tuple(points),
    )


def _machine(load_start, gate) -> dict[str, Any]:
    return dict(
        machine_info(),
        load_avg_1m_start=load_start,
        quiet_wait_s=gate.waited_s,
        profiled_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def profile_engines(
    kinds: Sequence[str] = ("dense", "dfs"),
    *,
    model: ModelConfig | None = None,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    rollouts: Sequence[tuple[str, list]] | None = None,
    rollout: bool = True,
    repeats: int = 5,
    gate=None,
    chunk_len: int | None = None,
    microbatch: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> CostProfile:
    """Times every engine on the calibration batches and fits (1) per engine.

    Every (engine, batch) of ``calibration_plan`` is compiled on a fresh engine,
    then all are timed in ``repeats`` interleaved rounds (``replay.time_engines``);
    the minimum is fitted. "auto" adds its candidate engines and times its choice
    (3). ``gate`` (default ``dtarl.timing.QuietGate()``, shared by every timing here)
    holds each timed call until other processes are quiet. ``rollout``: also
    calibrate (2) when ``dtarl.rollout`` has a forced-length sampler.
    """
    gate = QuietGate(budget_s=120.0) if gate is None else gate
    plan = calibration_plan(
        kinds,
        model=model,
        batches=batches,
        rollouts=rollouts,
        rollout=rollout,
        chunk_len=chunk_len,
        microbatch=microbatch,
        seed=seed,
    )
    load_start = load_avg()
    m = init_model(plan.model, seed)
    _, params = split_model(m)
    timings = time_engines(
        list(plan.jobs), m, params, calibration_loss(), repeats=repeats, gate=gate, log=log
    )
    choice = (
        _time_auto_choice(plan.model, plan.batches, repeats=repeats, gate=gate)
        if plan.with_auto
        else None
    )
    measured = None
    if plan.rollouts:
        measured = _time_rollouts(
            m, params, plan.rollouts, repeats=repeats, seed=seed, gate=gate, log=log
        )
        if measured is None and log is not None:
            log("rollout: no forced-length sampler in dtarl.rollout; not calibrated")
    return fit_profile(plan, timings, measured, choice, machine=_machine(load_start, gate))


def calibrate_and_replay(
    specs: Sequence[WorkloadSpec],
    kinds: Sequence[str],
    config=None,
    *,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    rollouts: Sequence[tuple[str, list]] | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
):
    """Calibration and replay timed in the *same* interleaved rounds; (profile, replay).

    On a shared machine the speed drifts by tens of percent within minutes
    (other processes, the neighbouring core); a profile made earlier than the
    replay then carries that drift into the validation. Here every calibration
    job joins the replay's rounds (``replay(extra_jobs=..., extra_rollouts=...)``),
    so both see the same machine and ``validate`` measures the model's error.
    ``config``: the ``ReplayConfig`` (its ``engines`` become ``kinds``).
    """
    config = ReplayConfig() if config is None else config
    # The rollout cost model (2) describes the static sampler's generate calls.
    config = dataclasses.replace(
        config, engines=tuple(check_kind(k) for k in kinds), rollout_engine="static"
    )
    plan = calibration_plan(
        kinds,
        model=config.model,
        batches=batches,
        rollouts=rollouts,
        rollout=config.rollout,
        seed=seed,
    )
    load_start = load_avg()
    res = replay(
        specs,
        config,
        log=log,
        extra_jobs=plan.jobs,
        extra_rollouts=[calls for _, calls in plan.rollouts],
    )
    gate = QuietGate(cores=config.quiet_cores, budget_s=config.quiet_budget_s)
    choice = (
        _time_auto_choice(plan.model, plan.batches, repeats=config.repeats, gate=gate)
        if plan.with_auto
        else None
    )
    measured = None
    if plan.rollouts and all(t is not None for t in res.extra_rollouts):
        measured = [
            (min(t.seconds), statistics.median(t.seconds), t.background[t.best], t.seconds)
            for t in res.extra_rollouts
        ]
    machine = dict(_machine(load_start, gate), joint_with_replay=True)
    return fit_profile(plan, res.extra_engines, measured, choice, machine=machine), res
