"""The rollout, tool, reward and inference stages of a replayed step.

rollout: dtarl's sampler generating every response with its forced trace length
(one ``Sampler.generate`` per turn), when ``dtarl.rollout`` offers one.
tool: sampled tool-call latencies on a simulated clock (or slept).
reward: sampled per-rank reward times of the rllm trace (production seconds).
inference: the forward-only logprob passes (old / reference policy) over the
batch, timed with the trainer's dense ``Scorer``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.bench.replay.suite import RLLM_RELPATH, SEARCH_R1_RELPATH
from dtarl.bench.replay.train_stage import replay_rounds
from dtarl.rl.episodes import Scorer
from dtarl.timing import QuietGate, TimedRuns
from dtarl.traces.latency import RewardTimeSampler, ToolLatencySampler
from dtarl.traces.loaders import RunKind, RunTrace, default_polytrace_root, load_trace
from dtarl.traces.workload import Workload
from dtarl.tree.plan import bucket

ROLLOUT_UNAVAILABLE = "unavailable (sampler not built)"


class ToolClock(enum.Enum):
    """How sampled tool latencies enter the step: added to a simulated clock, or slept."""

    SIMULATED = "simulated"
    SLEEP = "sleep"


# ----------------------------------------------------------------------------- tool stage


def trajectory_masks(workload: Workload) -> dict[int, tuple[int, np.ndarray]]:
    """Per trajectory: (row of its longest sample, its model-token mask over that row).

    In per-turn mode a trajectory's samples are prefixes of each other, each
    trained on one turn only; the union of their masks marks all model turns.
    """
    b, info = workload.batch, workload.info
    best: dict[int, int] = {}
    for i, t in enumerate(info.trajectory_ids.tolist()):
        if t not in best or b.tokens[i].shape[0] > b.tokens[best[t]].shape[0]:
            best[t] = i
    out = {t: (i, b.loss_mask[i] > 0) for t, i in best.items()}
    for i, t in enumerate(info.trajectory_ids.tolist()):
        m = b.loss_mask[i] > 0
        out[t][1][: m.shape[0]] |= m
    return out


def tool_calls_per_trajectory(workload: Workload) -> dict[int, int]:
    """Tool outputs per trajectory: the runs of non-model tokens after the prompt."""
    out = {}
    for t, (i, mask) in trajectory_masks(workload).items():
        m = mask[int(workload.info.prompt_lens[i]) :]
        # A run of zeros starts where m is False and (first or previous True).
        starts = (~m) & np.concatenate([[True], m[:-1]])
        out[t] = int(starts.sum())
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolPhase:
    """The tool stage of one step.

    clock: "simulated" (critical path added to a clock) or "sleep" (really slept).
    calls: tool calls in the step; per_trajectory_s: each trajectory's summed
    call latencies (trajectory order, *production* seconds: sampled from the
    real trace); critical_path_s: their maximum; total_call_s: sum over all
    calls. time_scale: the factor from production seconds to the replay's
    seconds, or None when none was given; then ``seconds`` (the stage's wall
    time: critical path x time_scale, measured when sleeping) stays in
    production seconds and must not be added to the replay's tiny-model stages
    (``units``). status: "ok", "no tool calls" or why latencies are missing.
    """

    clock: str
    calls: int
    critical_path_s: float
    total_call_s: float
    seconds: float
    status: str = "ok"
    time_scale: float | None = None
    per_trajectory_s: tuple[float, ...] = ()

    @property
    def units(self) -> str:
        """ "replay s" when scaled into the replay's unit system, else "production s"."""
        return "production s" if self.time_scale is None else "replay s"


def default_tool_sampler(
    workload_source: str | None = None, step: int | None = None
) -> ToolLatencySampler | None:
    """The tool latencies a replayed step draws from: those of the replayed ``step`` of the
    workload's own multi-turn trace (every step when ``step`` is None); for any other
    source (a single-turn trace, ``fitted:tool``, an explicit latency trace without that
    step), the shared search_r1 run's latencies of ``step`` when it has that step, else
    of all its steps. None when no multi-turn trace is found."""
    cands = []
    if workload_source is not None and not str(workload_source).startswith("fitted:"):
        cands.append(Path(workload_source))
    cands.append(default_polytrace_root() / SEARCH_R1_RELPATH)
    for p in cands:
        try:
            tr = load_trace(p)
        except (FileNotFoundError, ValueError, OSError):
            continue
        if isinstance(tr, RunTrace) and tr.kind is RunKind.MULTI_TURN:
            for steps in ([step] if step in tr.steps else [], None):
                if steps == []:
                    continue
                try:
                    return ToolLatencySampler.from_trace(tr, steps=steps)
                except ValueError:
                    continue
    return None


def tool_latencies(
    workload: Workload, sampler: ToolLatencySampler, *, seed: int = 0
) -> dict[int, np.ndarray]:
    """Every trajectory's tool-call latencies (production seconds, one per tool output in
    order; ``tool_calls_per_trajectory``), drawn from ``sampler`` (seeded). The tool stage
    and the engine rollout draw the same latencies for the same seed."""
    per_traj = tool_calls_per_trajectory(workload)
    lat = sampler.sample(sum(per_traj.values()), seed=np.random.default_rng([seed, 7]))
    out, k = {}, 0
    for t in sorted(per_traj):
        out[t] = lat[k : k + per_traj[t]]
        k += per_traj[t]
    return out


def tool_phase(
    workload: Workload,
    sampler: ToolLatencySampler | None,
    *,
    clock: ToolClock = ToolClock.SIMULATED,
    time_scale: float | None = None,
    seed: int = 0,
) -> ToolPhase:
    """Samples every tool call's latency (seeded) and runs the tool stage's clock.

    ``time_scale``: production seconds -> replay seconds (None: keep production seconds).
    """
    clock = ToolClock(clock)
    per_traj = tool_calls_per_trajectory(workload)
    n = sum(per_traj.values())
    if n == 0:
        return ToolPhase(
            clock=clock.value,
            calls=0,
            critical_path_s=0.0,
            total_call_s=0.0,
            seconds=0.0,
            status="no tool calls",
            time_scale=time_scale,
            per_trajectory_s=tuple(0.0 for _ in per_traj),
        )
    if sampler is None:
        return ToolPhase(
            clock=clock.value,
            calls=n,
            critical_path_s=0.0,
            total_call_s=0.0,
            seconds=0.0,
            status="no tool-latency data (pass a multi-turn trace)",
            time_scale=time_scale,
        )
    per = tool_latencies(workload, sampler, seed=seed)
    lat = np.concatenate(list(per.values()))
    sums = [float(per[t].sum()) for t in sorted(per)]
    crit = max(sums)
    wall = crit * (1.0 if time_scale is None else time_scale)
    if clock is ToolClock.SLEEP:
        t0 = time.perf_counter()
        time.sleep(wall)
        wall = time.perf_counter() - t0
    return ToolPhase(
        clock=clock.value,
        calls=n,
        critical_path_s=crit,
        total_call_s=float(lat.sum()),
        seconds=wall,
        time_scale=time_scale,
        per_trajectory_s=tuple(sums),
    )


# ----------------------------------------------------------------------------- reward stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardPhase:
    """The reward stage: ``ranks`` = ceil(responses / the source's per-rank batch) ranks
    score in parallel, each taking a sampled per-rank time of the trace (a partial rank
    is charged a full one: an upper bound); the stage is the slowest rank.

    seconds: that maximum x time_scale (production seconds when time_scale is None);
    status: "ok" or why no timings are available (then seconds = 0).
    """

    status: str
    seconds: float = 0.0
    ranks: int = 0
    production_s: float = 0.0
    time_scale: float | None = None
    source: str = ""  # the run (and step) the times were drawn from

    @property
    def units(self) -> str:
        return "production s" if self.time_scale is None else "replay s"


def default_reward_sampler() -> RewardTimeSampler | None:
    """Reward timings of the shared rllm run (None when absent)."""
    try:
        return RewardTimeSampler.from_trace(default_polytrace_root() / RLLM_RELPATH)
    except (FileNotFoundError, ValueError, OSError):
        return None


def reward_sampler_for(
    workload_source: str, step: int | None = None, reward_source: str | None = None
) -> tuple[RewardTimeSampler | None, str]:
    """The reward times of the trace that matches the workload: ``(sampler, where)``, or
    ``(None, why not)``.

    Drawn from the workload's own run (``reward_timings_step_<k>.jsonl`` of the replayed
    ``step``; every step when ``step`` is None), or from ``reward_source`` when given
    (another run's timings, its ``step`` when it has it, else every step). A workload
    whose trace records no reward times (verl math, search_r1, fitted distributions)
    gets None and a reason naming the source: nothing is borrowed from another task.
    """
    src = workload_source if reward_source is None else reward_source
    if str(src).startswith("fitted:"):
        return None, (
            f"no reward timings: {src} is a fitted distribution (pass a run with "
            "reward_timings_step_<k>.jsonl as the reward source)"
        )
    try:
        run = load_trace(Path(src))
    except (FileNotFoundError, ValueError, OSError) as e:
        return None, f"no reward timings: {src}: {e}"
    files = getattr(run, "reward_files", {})
    if not files:
        return None, (
            f"no reward timings in {src} (it has no reward_timings_step_<k>.jsonl; only the "
            "rllm run records them; pass one as the reward source)"
        )
    if step is not None and step not in files and reward_source is None:
        return None, (
            f"no reward timings for step {step} in {src} (steps with timings: {sorted(files)})"
        )
    steps = [step] if step in files else None
    try:
        sampler = RewardTimeSampler.from_trace(run, steps=steps)
    except ValueError as e:
        return None, f"no reward timings: {e}"
    where = f"{getattr(run, 'name', src)} step {step}" if steps else f"{src} (all steps)"
    return sampler, where


def reward_phase(
    workload: Workload,
    sampler: RewardTimeSampler | None,
    *,
    time_scale: float | None = None,
    seed: int = 0,
    missing: str | None = None,
    source: str = "",
) -> RewardPhase:
    """Samples the reward stage of the workload's responses (seeded); ``missing``: the
    status when ``sampler`` is None (why there are no timings), ``source``: where the
    sampler's times come from (kept in the phase)."""
    if sampler is None:
        return RewardPhase(
            status=missing or "no reward timings (pass a run with reward_timings_step_<k>.jsonl)",
            time_scale=time_scale,
        )
    n = len(np.unique(workload.info.trajectory_ids))
    ranks = -(-n // sampler.batch_size)
    prod = float(sampler.sample(ranks, seed=np.random.default_rng([seed, 11])).max())
    return RewardPhase(
        status="ok",
        seconds=prod * (1.0 if time_scale is None else time_scale),
        ranks=ranks,
        production_s=prod,
        time_scale=time_scale,
        source=source,
    )


# ----------------------------------------------------------------------------- inference stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferencePhase:
    """Forward-only logprob passes over the batch (old and/or reference policy).

    passes: forward passes per step (1: old logprobs or reference; 2: both);
    seconds / min_seconds: passes x median / minimum of one timed pass;
    compile_s: first call - fastest pass; status: "ok" or "skipped (...)".
    """

    status: str
    passes: int = 0
    seconds: float | None = None
    min_seconds: float | None = None
    compile_s: float | None = None
    tokens: int = 0


@dataclasses.dataclass(eq=False)
class InferenceRun:
    """A warmed-up dense scorer (the trainer's ``Scorer``) over one workload's sequences."""

    scorer: Any
    params: Any
    tokens: tuple[np.ndarray, ...]
    first_s: float

    @classmethod
    def warm(cls, model, params, workload: Workload) -> InferenceRun:
        scorer = Scorer(model)
        tokens = tuple(np.asarray(t, np.int32) for t in workload.batch.tokens)
        t0 = time.perf_counter()
        scorer(params, list(tokens))  # compiles; returns host arrays (synchronised)
        return cls(scorer=scorer, params=params, tokens=tokens, first_s=time.perf_counter() - t0)

    def call(self) -> float:
        t0 = time.perf_counter()
        self.scorer(self.params, list(self.tokens))
        return time.perf_counter() - t0

    def phase(self, timed: TimedRuns, passes: int) -> InferencePhase:
        runs = list(timed.seconds)
        return InferencePhase(
            status="ok",
            passes=passes,
            seconds=passes * statistics.median(runs),
            min_seconds=passes * min(runs),
            compile_s=max(self.first_s - min(runs), 0.0),
            tokens=int(sum(t.shape[0] for t in self.tokens)),
        )


# ----------------------------------------------------------------------------- rollout stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutPhase:
    """The generation stage: ``status`` is "ok" or why it did not run (seconds None).

    seconds / min_seconds: median / minimum over the timed rollouts;
    turn_seconds: the fastest rollout's seconds per turn (one generate call each).
    """

    status: str
    seconds: float | None = None
    min_seconds: float | None = None
    compile_s: float | None = None
    generated_tokens: int = 0
    tokens_per_s: float | None = None
    turn_seconds: tuple[float, ...] = ()  # per generate call (turn) of the fastest rollout
    # The continuous engine: each trajectory's finish on the replay clock (the fastest
    # rollout, trajectory-id order), tool waits included when ``tool_waits``.
    trajectory_seconds: tuple[float, ...] = ()
    tool_waits: bool = False
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


def find_forced_length_sampler():
    """``dtarl.rollout``'s sampler class if it generates with forced lengths, else None.

    Accepted: a class ``Sampler(model, SamplingParams)`` in ``dtarl.rollout`` or
    ``dtarl.rollout.sampler`` whose ``generate`` takes ``forced_lengths``.
    """
    for mod_name in ("dtarl.rollout", "dtarl.rollout.sampler"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        cls = getattr(mod, "Sampler", None)
        params_cls = getattr(mod, "SamplingParams", None)
        gen = getattr(cls, "generate", None)
        if cls is None or params_cls is None or gen is None:
            continue
        try:
            if "forced_lengths" in inspect.signature(gen).parameters:
                return cls, params_cls
        except (TypeError, ValueError):
            continue
    return None


def model_turns(workload: Workload) -> dict[int, tuple[int, list[tuple[int, int]]]]:
    """Per trajectory: (row of its longest sample, [(start, length)] of its model runs).

    Model runs are the model-token runs after the prompt (``trajectory_masks``);
    everything between them is tool output, which the rollout appends instead
    of generating.
    """
    out = {}
    for t, (i, m) in trajectory_masks(workload).items():
        p = int(workload.info.prompt_lens[i])
        runs, j = [], p
        while j < m.shape[0]:
            if m[j]:
                k = j
                while k < m.shape[0] and m[k]:
                    k += 1
                runs.append((j, k - j))
                j = k
            else:
                j += 1
        out[t] = (i, runs)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RolloutCall:
    """One ``Sampler.generate`` call of a replayed rollout (one turn).

    prompts: the distinct contexts; counts: samples per context; forced: every
    sample's exact length (rows ordered context by context).
    """

    prompts: tuple[np.ndarray, ...]
    counts: tuple[int, ...]
    forced: tuple[int, ...]


def rollout_calls(workload: Workload) -> list[RolloutCall]:
    """The generate calls of a replayed rollout, one per turn.

    Per turn k, every trajectory with a k-th model run generates it with its
    forced length from its context (prompt + earlier turns + tool outputs);
    turn 0 prefills each group's shared prompt once (count = its rows).
    """
    b, info = workload.batch, workload.info
    turns = model_turns(workload)
    n_turns = max((len(r) for _, r in turns.values()), default=0)
    out = []
    for k in range(n_turns):
        rows = [(t, i, r[k]) for t, (i, r) in sorted(turns.items()) if len(r) > k]
        if k == 0:
            prompts, counts, forced = [], [], []
            for g in dict.fromkeys(int(info.group_ids[i]) for _, i, _ in rows):
                mine = [(i, run) for _, i, run in rows if int(info.group_ids[i]) == g]
                i0, (st0, _) = mine[0]
                prompts.append(b.tokens[i0][:st0])
                counts.append(len(mine))
                forced.extend(run[1] for _, run in mine)
        else:
            prompts = [b.tokens[i][: run[0]] for _, i, run in rows]
            counts = [1] * len(rows)
            forced = [run[1] for _, _, run in rows]
        out.append(
            RolloutCall(
                prompts=tuple(prompts),
                counts=tuple(int(c) for c in counts),
                forced=tuple(int(f) for f in forced),
            )
        )
    return out


def run_rollout_calls(sampler, params, calls: Sequence[RolloutCall], seed: int):
    """Runs the calls in order on one sampler.

    Returns (seconds, generated tokens, lengths honoured); seconds sums the
    sampler's own per-call timing (prefill + decode, device synchronised).
    """
    turn_s, gen, ok = run_rollout_turns(sampler, params, calls, seed)
    return sum(turn_s), gen, ok


def run_rollout_turns(sampler, params, calls: Sequence[RolloutCall], seed: int):
    """``run_rollout_calls`` with the seconds of every call (turn): (list, tokens, ok)."""
    turn_s, gen, ok = [], 0, True
    for k, call in enumerate(calls):
        res = sampler.generate(
            params,
            list(call.prompts),
            num_samples=list(call.counts),
            seed=seed + k,
            forced_lengths=list(call.forced),
        )
        turn_s.append(float(res.stats["seconds"]))
        gen += int(res.lengths.sum())
        ok = ok and bool(np.array_equal(np.sort(res.lengths), np.sort(np.asarray(call.forced))))
    return turn_s, gen, ok


def rollout_sampler(model, calls: Sequence[RolloutCall]):
    """A fresh forced-length sampler sized for ``calls`` (None without ``dtarl.rollout``)."""
    found = find_forced_length_sampler()
    if found is None:
        return None
    sampler_cls, params_cls = found
    longest = max((f for c in calls for f in c.forced), default=1)
    return sampler_cls(model, params_cls(temperature=1.0, max_new_tokens=bucket(longest)))


@dataclasses.dataclass(eq=False)
class RolloutRun:
    """A warmed-up replayed rollout on its own sampler; ``call()`` times one more run.

    ``warm`` runs the calls once untimed (it compiles every bucket; buckets only
    grow, so every timed call then runs the largest bucket of any turn).
    """

    sampler: Any
    params: Any
    calls: tuple[RolloutCall, ...]
    seed: int
    first_s: float
    generated: int
    ok: bool
    timed_turns: list = dataclasses.field(default_factory=list)  # per-turn seconds per call()

    @classmethod
    def warm(cls, model, params, calls: Sequence[RolloutCall], seed: int = 0) -> RolloutRun | None:
        """None without a forced-length sampler in ``dtarl.rollout``."""
        sampler = rollout_sampler(model, calls)
        if sampler is None:
            return None
        first, gen, ok = run_rollout_calls(sampler, params, calls, seed)
        return cls(
            sampler=sampler,
            params=params,
            calls=tuple(calls),
            seed=seed,
            first_s=first,
            generated=gen,
            ok=ok,
        )

    def call(self) -> float:
        turn_s = run_rollout_turns(self.sampler, self.params, self.calls, self.seed)[0]
        self.timed_turns.append(tuple(turn_s))
        return sum(turn_s)

    def phase(self, timed: TimedRuns) -> RolloutPhase:
        runs = list(timed.seconds)
        med = statistics.median(runs)
        by_total = {sum(t): t for t in self.timed_turns}
        fastest = by_total.get(min(runs), min(self.timed_turns, key=sum, default=()))
        return RolloutPhase(
            status=(
                "ok" if self.ok else "ok (WARNING: sampler lengths differ from the forced lengths)"
            ),
            seconds=med,
            min_seconds=min(runs),
            compile_s=max(self.first_s - min(runs), 0.0),
            generated_tokens=self.generated,
            tokens_per_s=self.generated / med if med > 0 else None,
            turn_seconds=tuple(fastest),
            detail=dict(
                sampler=f"{type(self.sampler).__module__}.{type(self.sampler).__name__}",
                turns=len(self.calls),
                lengths_match=self.ok,
                runs_s=runs,
                background_cores=list(timed.background),
                note="multi-turn contexts are re-prefilled per turn (no cross-turn KV reuse)",
            ),
        )


def rollout_phase(
    workload: Workload,
    model,
    params,
    *,
    repeats: int = 1,
    seed: int = 0,
    gate: QuietGate | None = None,
) -> RolloutPhase:
    """The rollout stage with forced per-sequence lengths (EOS ignored), if a sampler exists.

    Calls: ``rollout_calls`` (one per turn) on one sampler. Protocol: one
    untimed rollout (``RolloutRun.warm``), then ``repeats`` timed ones behind
    ``gate`` (``replay_rounds``); seconds = median, min_seconds = minimum;
    compile_s = first - minimum. Without a forced-length sampler in
    ``dtarl.rollout`` the stage is reported unavailable, never faked.
    """
    run = RolloutRun.warm(model, params, rollout_calls(workload), seed)
    if run is None:
        return RolloutPhase(status=ROLLOUT_UNAVAILABLE)
    gate = QuietGate() if gate is None else gate
    (timed,) = replay_rounds([run.call], repeats=repeats, gate=gate)
    return run.phase(timed)
