"""Replay benchmark: drive dtarl on generated PolyTrace workloads and time every stage.

One replayed RL step of a workload (a ``WorkloadSpec``: trace, step, seed, batch
size, ``length_scale``) has five stages:

  rollout  the continuous engine (``RolloutEngine``, ``ReplayConfig.rollout_engine=
           "continuous"``) generating every turn with its *forced* trace length
           (EOS ignored): one request per trajectory, and each trajectory continues
           on its own K/V after its own tool wait (``engine_rollout``) while the
           others decode; the stage is the slowest trajectory on the replay clock.
           ``rollout_engine="static"``: the reference ``Sampler``, one generate call
           per turn (what the simulator's rollout model describes); it is reported
           as "unavailable (sampler not built)" when ``dtarl.rollout`` offers no
           forced-length sampler, and nothing is faked.
  tool     tool-call latencies drawn from the latencies of the *replayed step* of the
           workload's own multi-turn trace (``default_tool_sampler``; the shared
           search_r1 run for other sources) for every tool output in the
           trajectories. The latencies are production seconds; ``tool_time_scale``
           converts them to the replay's seconds. Without it they are reported
           apart, the engine runs without tool waits and no end-to-end total is
           formed. With it, each trajectory's waits sit on its own timeline
           between its turns (``WorkloadReplay.trajectory_timelines_s``).
           ``ToolClock.SLEEP`` really sleeps.
  reward   per-rank reward times sampled from the reward timings of the
           workload's own run and step (``reward_sampler_for``: only the rllm run
           records them; other workloads report that they have none unless
           ``ReplayConfig.reward_source`` names a run), production seconds
           converted by ``tool_time_scale`` like the tools;
  inference  ``inference_passes`` forward-only logprob passes (old / reference
           policy) with the trainer's dense ``Scorer``, timed like the rollout;
  train    ``engine.value_and_grad`` of the batch, for every engine kind asked
           (anything ``make_engine`` accepts: dense, dense_remat, dfs, ...).

``plot_stages`` draws the per-stage share of every workload (a sweep over
batch sizes / lengths is a list of specs: ``dtarl trace replay --batch-sizes
--max-lens``).

Timing protocol (``time_engines``): every (workload, engine) pair gets a fresh
engine (its shape buckets then follow this batch only) and ``warmup`` untimed
calls (the first one compiles). Then ``repeats`` *rounds* run, each calling
every pair once, so the timed calls of one pair are spread over the whole
timing phase and a burst of load from other processes hits every pair alike.
Each timed call waits until other processes use less than ``quiet_cores`` CPU
cores (``QuietGate``, bounded by ``quiet_budget_s`` in all): on a small shared
machine a busy neighbouring core slows a call by up to 2x, and the CPU time of
the call does not show it. The background during every call is recorded, and
contended minima get extra rounds while the budget lasts (``replay_rounds`` over
``dtarl.timing.interleaved_rounds``).
A call's time is host prepare + device seconds; per pair we report the minimum
(``step_min_s``, the load-robust number the simulator is validated against) and
the median (``step_s``). ``compile_s = first_call_s - step_min_s`` (the compile
estimate is reported separately and never mixed into step times).

Lengths must be scaled to fit a CPU and the tiny model: ``auto_length_scale``
picks the scale that maps the workload's longest sequence to ``max_len`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtarl.bench.replay.engine_rollout import (
    EnginePlan,
    EngineRolloutRun,
    EngineRun,
    TrajectoryPlan,
    engine_plan,
    run_engine_plan,
)
from dtarl.bench.replay.results import (
    ROLLOUT_ENGINES,
    ReplayConfig,
    ReplayResult,
    WorkloadReplay,
    load_replay_json,
    plot_stages,
)
from dtarl.bench.replay.stages import (
    ROLLOUT_UNAVAILABLE,
    InferencePhase,
    InferenceRun,
    RewardPhase,
    RolloutCall,
    RolloutPhase,
    RolloutRun,
    ToolClock,
    ToolPhase,
    default_reward_sampler,
    default_tool_sampler,
    find_forced_length_sampler,
    model_turns,
    reward_phase,
    reward_sampler_for,
    rollout_calls,
    rollout_phase,
    rollout_sampler,
    run_rollout_calls,
    tool_calls_per_trajectory,
    tool_latencies,
    tool_phase,
    trajectory_masks,
)
from dtarl.bench.replay.suite import (
    DEFAULT_SUITE,
    WorkloadSpec,
    auto_length_scale,
    default_suite,
    model_config_from_dict,
    model_config_to_dict,
)
from dtarl.bench.replay.train_stage import (
    EngineTiming,
    TimingJob,
    replay_rounds,
    time_engine,
    time_engines,
)
from dtarl.engines.base import split_model
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import init_model
from dtarl.timing import QuietGate, TimedRuns, load_avg, machine_info
from dtarl.traces.workload import Workload


def _setup(config: ReplayConfig):
    model = init_model(config.model, config.model_seed)
    _, params = split_model(model)
    return model, params, ClippedSurrogateLoss.grpo()


def _gate(config: ReplayConfig) -> QuietGate:
    return QuietGate(cores=config.quiet_cores, budget_s=config.quiet_budget_s)


def _reward(workload: Workload, config: ReplayConfig, spec: WorkloadSpec) -> RewardPhase:
    if not config.reward:
        return RewardPhase(status="skipped (ReplayConfig.reward=False)")
    sampler, where = reward_sampler_for(spec.source, workload.info.step, config.reward_source)
    return reward_phase(
        workload,
        sampler,
        time_scale=config.tool_time_scale,
        seed=spec.seed,
        missing=where,
        source=where,
    )


def _rollout_run(model, params, workload: Workload, spec, config: ReplayConfig, sampler):
    """The warmed-up rollout of one workload: on the continuous engine (each trajectory
    waits for its own tools, scaled into replay seconds; no waits without a scale) or on
    the static sampler (one generate call per turn)."""
    if config.rollout_engine == "static":
        return RolloutRun.warm(model, params, rollout_calls(workload), spec.seed)
    waits = None
    if sampler is not None and config.tool_time_scale is not None:
        lat = tool_latencies(workload, sampler, seed=spec.seed)
        waits = {t: v * config.tool_time_scale for t, v in lat.items()}
    plan = engine_plan(workload, waits)
    return EngineRolloutRun.warm(model, params, plan, spec.seed, clock=config.tool_clock)


def _assemble(
    workload: Workload, spec: WorkloadSpec, rollout, tool, timings, reward, inference
) -> WorkloadReplay:
    turns = model_turns(workload)
    return WorkloadReplay(
        reward=reward,
        inference=inference,
        turns_per_trajectory=tuple(len(turns[t][1]) for t in sorted(turns)),
        spec=spec,
        num_sequences=workload.batch.num_sequences,
        dense_tokens=workload.info.dense_tokens,
        tree_tokens=workload.info.tree_tokens,
        max_len=int(workload.batch.lengths.max()),
        rollout=rollout,
        tool=tool,
        engines=timings,
    )


def replay(
    specs: Sequence[WorkloadSpec],
    config: ReplayConfig | None = None,
    *,
    log=None,
    extra_jobs: Sequence[TimingJob] = (),
    extra_rollouts: Sequence[Sequence[RolloutCall]] = (),
) -> ReplayResult:
    """Replays every workload spec with one model; ``log`` gets a line per workload.

    The rollouts of every workload are warmed up, then timed together in
    interleaved rounds; then every (workload, engine) pair is compiled and all
    of them are timed in interleaved rounds (``time_engines``), so load from
    other processes spreads over all of them. ``extra_jobs`` / ``extra_rollouts``
    (e.g. a simulator's calibration) join those same rounds; their timings are in
    ``ReplayResult.extra_engines`` / ``extra_rollouts`` (not in the JSON).
    """
    config = ReplayConfig() if config is None else config
    if not specs:
        raise ValueError("specs: empty; pass at least one WorkloadSpec (see default_suite)")
    load_start = load_avg()
    model, params, loss = _setup(config)
    gate = _gate(config)
    built, jobs = [], []
    for spec in specs:
        w = spec.build(vocab_size=config.model.vocab_size)
        sampler = default_tool_sampler(config.tool_latency_source or spec.source, w.info.step)
        tool = tool_phase(
            w, sampler, clock=config.tool_clock, time_scale=config.tool_time_scale, seed=spec.seed
        )
        run = _rollout_run(model, params, w, spec, config, sampler) if config.rollout else None
        inf = InferenceRun.warm(model, params, w) if config.inference_passes else None
        built.append((spec, w, run, tool, inf))
        jobs += [TimingJob(kind=k, batch=w.batch, label=spec.name) for k in config.engines]
    extra_runs = [
        RolloutRun.warm(model, params, calls, config.model_seed) for calls in extra_rollouts
    ]
    runs = [b[2] for b in built if b[2] is not None] + [r for r in extra_runs if r is not None]
    infs = [b[4] for b in built if b[4] is not None]
    calls = [r.call for r in runs] + [r.call for r in infs]
    timed_all = replay_rounds(calls, repeats=config.rollout_repeats, gate=gate) if calls else []
    timed_rollouts = iter(timed_all[: len(runs)])
    timed_inference = iter(timed_all[len(runs) :])
    ts = time_engines(
        [*jobs, *extra_jobs],
        model,
        params,
        loss,
        repeats=config.repeats,
        warmup=config.warmup,
        gate=gate,
        log=log,
    )
    out = []
    k = len(config.engines)
    for i, (spec, w, run, tool, inf) in enumerate(built):
        if not config.rollout:
            rollout = RolloutPhase(status="skipped (ReplayConfig.rollout=False)")
        elif run is None:
            rollout = RolloutPhase(status=ROLLOUT_UNAVAILABLE)
        else:
            rollout = run.phase(next(timed_rollouts))
        timings = dict(zip(config.engines, ts[i * k : (i + 1) * k], strict=True))
        inference = (
            InferencePhase(status="skipped (ReplayConfig.inference_passes=0)")
            if inf is None
            else inf.phase(next(timed_inference), config.inference_passes)
        )
        r = _assemble(w, spec, rollout, tool, timings, _reward(w, config, spec), inference)
        out.append(r)
        if log is not None:
            roll = "-" if rollout.min_seconds is None else f"{rollout.min_seconds:.3f}s"
            parts = ", ".join(
                f"{kind} {t.step_min_s:.3f}s min / {t.step_s:.3f}s median "
                f"(compile {t.compile_s:.1f}s)"
                for kind, t in r.engines.items()
            )
            log(
                f"{spec.name}: {r.num_sequences} seqs, {r.dense_tokens} tokens: rollout {roll} "
                f"min; {parts}"
            )
    extra_timed = tuple(None if r is None else next(timed_rollouts) for r in extra_runs)
    machine = dict(machine_info(), load_avg_1m_start=load_start, quiet_wait_s=gate.waited_s)
    return ReplayResult(
        config=config,
        machine=machine,
        workloads=tuple(out),
        extra_engines=tuple(ts[len(jobs) :]),
        extra_rollouts=extra_timed,
    )


__all__ = [
    "DEFAULT_SUITE",
    "ROLLOUT_ENGINES",
    "EnginePlan",
    "EngineRolloutRun",
    "EngineRun",
    "TrajectoryPlan",
    "engine_plan",
    "reward_sampler_for",
    "run_engine_plan",
    "tool_latencies",
    "ROLLOUT_UNAVAILABLE",
    "EngineTiming",
    "InferencePhase",
    "InferenceRun",
    "RewardPhase",
    "QuietGate",
    "TimedRuns",
    "TimingJob",
    "ReplayConfig",
    "ReplayResult",
    "RolloutCall",
    "RolloutPhase",
    "RolloutRun",
    "ToolClock",
    "ToolPhase",
    "WorkloadReplay",
    "WorkloadSpec",
    "auto_length_scale",
    "default_suite",
    "default_reward_sampler",
    "default_tool_sampler",
    "find_forced_length_sampler",
    "load_replay_json",
    "machine_info",
    "model_turns",
    "trajectory_masks",
    "model_config_from_dict",
    "model_config_to_dict",
    "plot_stages",
    "reward_phase",
    "replay",
    "replay_rounds",
    "rollout_calls",
    "rollout_phase",
    "rollout_sampler",
    "run_rollout_calls",
    "time_engine",
    "time_engines",
    "tool_calls_per_trajectory",
    "tool_phase",
]
