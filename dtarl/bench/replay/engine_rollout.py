"""The rollout stage of a replayed step on the continuous engine (``RolloutEngine``).

Every trajectory of the workload is one request of its prompt's group (one ``submit``
per group, ``hold=True``): its first turn is generated with its forced trace length;
when a turn ends, the trajectory waits for its own tool calls (the sampled latencies of
its tool outputs, in replay seconds) and is then continued on its own K/V with the
tool output appended (``RolloutEngine.extend``: nothing is prefilled again) for its
next forced turn. Other trajectories keep decoding meanwhile: no lock-step turns.

Clock. A replay clock advances by the measured wall time of every engine step
(prefill, extend, one decode call, retirement). A tool wait ends at (the clock when
its turn ended) + its latency; when nothing is decoding and trajectories only wait
for tools, the clock jumps to the earliest return (``ToolClock.SIMULATED``) or the
replay really sleeps until then (``ToolClock.SLEEP``). A trajectory's time is the
clock when its last turn ends; the stage is the slowest trajectory (the makespan).
Without a ``tool_time_scale`` the waits are zero (tool seconds stay production
seconds, reported apart by the tool stage) and the makespan is the engine's alone.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from dtarl.bench.replay.stages import RolloutPhase, ToolClock, model_turns
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine, fold_seed, seed_key
from dtarl.timing import TimedRuns
from dtarl.traces.workload import Workload
from dtarl.tree.plan import bucket

ENGINE_NAME = "dtarl.rollout.engine.RolloutEngine"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TrajectoryPlan:
    """One trajectory: its prompt group, forced turn lengths and, between its turns,
    the tool output tokens and the tool wait (replay seconds) before the next turn."""

    trajectory: int  # trajectory id in the workload
    group: int  # index into ``EnginePlan.prompts``
    turns: tuple[int, ...]
    tools: tuple[np.ndarray, ...]  # len(turns) - 1 tool outputs
    waits_s: tuple[float, ...]  # len(turns) - 1 tool waits
    tail_s: float = 0.0  # a tool call after the last turn (a truncated trajectory)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class EnginePlan:
    """What the engine runs: one group per prompt, its trajectories in member order."""

    prompts: tuple[np.ndarray, ...]
    members: tuple[tuple[TrajectoryPlan, ...], ...]  # per group

    @property
    def trajectories(self) -> list[TrajectoryPlan]:
        """Every trajectory, in trajectory-id order (the tool stage's order)."""
        return sorted((t for g in self.members for t in g), key=lambda t: t.trajectory)

    def config(self, steps_per_call: int = 8) -> ContinuousConfig:
        """An engine holding the whole step at once: a slot per trajectory, a prompt row
        per group, response rows for every turn and tool output of a trajectory."""
        longest = max(sum(t.turns) + sum(x.size for x in t.tools) for t in self.trajectories)
        return ContinuousConfig(
            slots=bucket(len(self.trajectories)),
            groups=len(self.prompts),
            group_size=bucket(max(len(m) for m in self.members)),
            prompt_len=bucket(max(p.size for p in self.prompts)),
            response_len=bucket(longest + steps_per_call + 2),
            steps_per_call=steps_per_call,
            extend_batch=4,
        )


def engine_plan(workload: Workload, waits_s: Mapping[int, np.ndarray] | None = None) -> EnginePlan:
    """The workload's trajectories as engine requests.

    ``waits_s[t]``: trajectory t's tool latencies in replay seconds, one per tool output
    (its runs of non-model tokens, ``tool_calls_per_trajectory``; a trailing one after
    the last turn, whose output was cut by the length budget, only delays the
    trajectory's end); None: no waits. A trajectory's prompt is its row up to its first
    model run; trajectories of one group share it.
    """
    b, info = workload.batch, workload.info
    groups: dict[int, list[TrajectoryPlan]] = {}
    prompts: dict[int, np.ndarray] = {}
    for t, (i, runs) in sorted(model_turns(workload).items()):
        if not runs:
            continue
        row = np.asarray(b.tokens[i], np.int32)
        g = int(info.group_ids[i])
        prompts.setdefault(g, row[: runs[0][0]])
        tools = tuple(row[s + n : runs[k + 1][0]] for k, (s, n) in enumerate(runs[:-1]))
        w = np.zeros(len(tools)) if waits_s is None else np.asarray(waits_s[t], np.float64)
        if w.size < len(tools):
            raise ValueError(f"waits_s[{t}]: {w.size} tool latencies for {len(tools)} tool outputs")
        tail = float(w[len(tools)]) if w.size > len(tools) else 0.0
        order = list(prompts).index(g)
        groups.setdefault(g, []).append(
            TrajectoryPlan(
                trajectory=int(t),
                group=order,
                turns=tuple(int(n) for _, n in runs),
                tools=tools,
                waits_s=tuple(float(x) for x in w[: len(tools)]),
                tail_s=tail,
            )
        )
    if not groups:
        raise ValueError("engine_plan: the workload has no model turns to generate")
    return EnginePlan(
        prompts=tuple(prompts[g] for g in groups),
        members=tuple(tuple(groups[g]) for g in groups),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRun:
    """One rollout on the engine: ``makespan_s`` (the slowest trajectory, replay clock),
    ``trajectory_s`` (each trajectory's finish, trajectory-id order), ``engine_s``
    (seconds inside engine steps), ``idle_s`` (clock time with nothing decoding, only
    tool waits), ``generated`` tokens, ``lengths_match`` (every turn had its forced
    length), ``decode_calls`` and ``extends`` (tool turns appended in place)."""

    makespan_s: float
    trajectory_s: tuple[float, ...]
    engine_s: float
    idle_s: float
    generated: int
    lengths_match: bool
    decode_calls: int
    extends: int


def run_engine_plan(
    engine: RolloutEngine,
    weights,
    plan: EnginePlan,
    *,
    seed: int = 0,
    clock: ToolClock = ToolClock.SIMULATED,
) -> EngineRun:
    """Runs every trajectory of ``plan`` to its end on ``engine`` (module docstring)."""
    clock = ToolClock(clock)
    base = seed_key(seed)
    owner: dict[int, tuple[TrajectoryPlan, list[int]]] = {}  # id(request) -> (plan, turn)
    for gi, (prompt, members) in enumerate(zip(plan.prompts, plan.members, strict=True)):
        grp = engine.submit(
            prompt,
            n=len(members),
            forced_lengths=[m.turns[0] for m in members],
            seed=fold_seed(base, gi),
            hold=True,
        )
        for r, m in zip(grp.requests, members, strict=True):
            owner[id(r)] = (m, [0])
    now = engine_s = idle_s = 0.0
    waiting: list[tuple[float, int, Any, np.ndarray, int]] = []  # (ready, tie, req, ids, n)
    done_at: dict[int, float] = {}
    generated, ok, calls, extends, tie = 0, True, 0, 0, 0
    while engine.pending() or waiting:
        while waiting and waiting[0][0] <= now:
            _, _, r, ids, n = heapq.heappop(waiting)
            engine.extend(r, ids, max_new_tokens=n)
            extends += 1
        if not engine.pending():
            ready = waiting[0][0]
            if clock is ToolClock.SLEEP:
                t0 = time.perf_counter()
                time.sleep(max(ready - now, 0.0))
                idle_s += time.perf_counter() - t0
                now += time.perf_counter() - t0
            else:
                idle_s += ready - now
            now = max(now, ready)
            continue
        t0 = time.perf_counter()
        finished = engine.run(weights, max_calls=1)
        dt = time.perf_counter() - t0
        now, engine_s, calls = now + dt, engine_s + dt, calls + 1
        for r in finished:
            m, k = owner[id(r)]
            generated += len(r.tokens)
            ok = ok and len(r.tokens) == m.turns[k[0]]
            if k[0] + 1 < len(m.turns):
                k[0] += 1
                heapq.heappush(
                    waiting,
                    (now + m.waits_s[k[0] - 1], tie, r, m.tools[k[0] - 1], m.turns[k[0]]),
                )
                tie += 1
            else:
                engine.release(r)
                done_at[m.trajectory] = now + m.tail_s
    engine.reset()
    traj = tuple(done_at[t.trajectory] for t in plan.trajectories)
    if clock is ToolClock.SLEEP and max(traj) > now:  # trailing tool calls, really waited
        time.sleep(max(traj) - now)
    return EngineRun(
        makespan_s=max(traj),
        trajectory_s=traj,
        engine_s=engine_s,
        idle_s=idle_s,
        generated=generated,
        lengths_match=ok,
        decode_calls=calls,
        extends=extends,
    )


@dataclasses.dataclass(eq=False)
class EngineRolloutRun:
    """A warmed-up engine replaying one workload's rollout; ``call()`` times one more run
    (the makespan on the replay clock). ``warm`` compiles every program the engine can
    need (``RolloutEngine.warmup`` with extends) and runs the plan once untimed; the
    phase's ``compile_s`` = that warm-up + (first run - fastest run)."""

    engine: RolloutEngine
    weights: Any
    plan: EnginePlan
    seed: int
    clock: ToolClock
    first: EngineRun
    traces_warm: int
    warmup_s: float  # RolloutEngine.warmup: compiling every program
    timed: list = dataclasses.field(default_factory=list)  # EngineRun per call()

    @classmethod
    def warm(
        cls,
        model,
        params,
        plan: EnginePlan,
        seed: int = 0,
        clock: ToolClock = ToolClock.SIMULATED,
    ) -> EngineRolloutRun:
        engine = RolloutEngine(model, plan.config())
        weights = engine.place(params)
        t0 = time.perf_counter()
        engine.warmup(weights, filtered=False, extend=True)
        warmup_s = time.perf_counter() - t0
        first = run_engine_plan(engine, weights, plan, seed=seed, clock=clock)
        return cls(
            engine=engine,
            weights=weights,
            plan=plan,
            seed=seed,
            clock=ToolClock(clock),
            first=first,
            traces_warm=engine.trace_count,
            warmup_s=warmup_s,
        )

    def call(self) -> float:
        run = run_engine_plan(
            self.engine, self.weights, self.plan, seed=self.seed, clock=self.clock
        )
        self.timed.append(run)
        return run.makespan_s

    def phase(self, timed: TimedRuns) -> RolloutPhase:
        runs = list(timed.seconds)
        fastest = min(self.timed, key=lambda r: r.makespan_s)
        med = statistics.median(runs)
        ok = self.first.lengths_match and all(r.lengths_match for r in self.timed)
        recompiled = self.engine.trace_count - self.traces_warm
        return RolloutPhase(
            status="ok" if ok else "ok (WARNING: engine lengths differ from the forced lengths)",
            seconds=med,
            min_seconds=min(runs),
            compile_s=self.warmup_s + max(self.first.makespan_s - min(runs), 0.0),
            generated_tokens=self.first.generated,
            tokens_per_s=self.first.generated / med if med > 0 else None,
            trajectory_seconds=fastest.trajectory_s,
            tool_waits=any(w > 0 for t in self.plan.trajectories for w in (*t.waits_s, t.tail_s)),
            detail=dict(
                sampler=ENGINE_NAME,
                engine="continuous",
                tool_clock=self.clock.value,
                slots=self.engine.config.slots,
                response_len=self.engine.config.response_len,
                decode_calls=fastest.decode_calls,
                extends=fastest.extends,
                engine_s=fastest.engine_s,
                idle_s=fastest.idle_s,
                lengths_match=ok,
                runs_s=runs,
                background_cores=list(timed.background),
                traces_after_warmup=recompiled,
                note="each trajectory continues after its own tool wait on its own K/V "
                "(extend); others decode meanwhile",
            ),
        )


__all__ = [
    "ENGINE_NAME",
    "EnginePlan",
    "EngineRolloutRun",
    "EngineRun",
    "TrajectoryPlan",
    "engine_plan",
    "run_engine_plan",
]
