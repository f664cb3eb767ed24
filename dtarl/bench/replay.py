"""Replay benchmark: drive dtarl on generated PolyTrace workloads and time every stage.

One replayed RL step of a workload (a ``WorkloadSpec``: trace, step, seed, batch
size, ``length_scale``) has three stages:

  rollout  dtarl's sampler generating every response with its *forced* trace
           length (EOS ignored). Runs only when ``dtarl.rollout`` offers a
           sampler with forced per-sequence lengths; otherwise the stage is
           reported as "unavailable (sampler not built)" and nothing is faked.
  tool     tool-call latencies drawn from the real search_r1 latencies
           (``ToolLatencySampler``) for every tool output in the trajectories.
           Trajectories run concurrently and their calls sequentially, so the
           stage's wall time is the critical path  max_traj sum_calls latency.
           ``ToolClock.SIMULATED`` adds that number to a simulated clock;
           ``ToolClock.SLEEP`` really sleeps it (times ``tool_time_scale``).
  train    ``engine.value_and_grad`` of the batch, for every engine kind asked
           (anything ``make_engine`` accepts: dense, dense_remat, dfs, ...).

Timing protocol (``time_engines``): every (workload, engine) pair gets a fresh
engine (its shape buckets then follow this batch only) and ``warmup`` untimed
calls (the first one compiles). Then ``repeats`` *rounds* run, each calling
every pair once, so the timed calls of one pair are spread over the whole
timing phase and a burst of load from other processes hits every pair alike.
Each timed call waits until other processes use less than ``quiet_cores`` CPU
cores (``QuietGate``, bounded by ``quiet_budget_s`` in all): on a small shared
machine a busy neighbouring core slows a call by up to 2x, and the CPU time of
the call does not show it. The background during every call is recorded, and
contended minima get extra rounds while the budget lasts (``interleaved_rounds``).
A call's time is host prepare + device seconds; per pair we report the minimum
(``step_min_s``, the load-robust number the simulator is validated against) and
the median (``step_s``). ``compile_s = first_call_s - step_min_s`` (the compile
estimate is reported separately and never mixed into step times).

Lengths must be scaled to fit a CPU and the tiny model: ``auto_length_scale``
picks the scale that maps the workload's longest sequence to ``max_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.model.config import AttentionBackend, ModelConfig, ModelFamily, RopeScaling
from dtarl.traces.loaders import RunKind, RunTrace, default_polytrace_root, load_trace
from dtarl.traces.workload import (
    ToolLatencySampler,
    Workload,
    WorkloadMode,
    generate_workload,
    sample_group_specs,
)

ROLLOUT_UNAVAILABLE = "unavailable (sampler not built)"
SEARCH_R1_RELPATH = Path("search_r1/profile/multiturn_workload_log/0617_0223")

#: The default replay suite: (name, trace folder below the PolyTrace root, step, mode,
#: batch size, n_sampling, max_len). Lengths are scaled by ``auto_length_scale`` so the
#: longest sequence has ``max_len`` tokens (a CPU with the tiny model).
DEFAULT_SUITE = (
    ("math_verl", "verl/profile/packed_length_log/20260610_092349", 1, "trajectory", 4, None, 256),
    (
        "video_verl",
        "verl-video/profile/packed_length_log/20260609_033329",
        2,
        "trajectory",
        4,
        None,
        256,
    ),
    (
        "search_r1",
        "search_r1/profile/multiturn_workload_log/0617_0223",
        1,
        "per_turn",
        2,
        4,
        250,
    ),
    (
        "coding_rllm",
        "rllm/profile/packed_length_log/20260616_024512",
        1,
        "trajectory",
        3,
        None,
        256,
    ),
)


class ToolClock(enum.Enum):
    """How sampled tool latencies enter the step: added to a simulated clock, or slept."""

    SIMULATED = "simulated"
    SLEEP = "sleep"


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Everything that regenerates one replayed batch deterministically.

    ``source`` is a trace path or ``fitted:math`` / ``fitted:tool`` (see
    ``generate_workload``); the other fields are its arguments.
    """

    name: str
    source: str
    batch_size: int
    n_sampling: int | None = None
    step: int | None = None
    seed: int = 0
    length_scale: float = 1.0
    mode: str = "trajectory"
    min_len: int = 1

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"WorkloadSpec.batch_size={self.batch_size}: must be >= 1")
        if not self.length_scale > 0:
            raise ValueError(f"WorkloadSpec.length_scale={self.length_scale}: must be > 0")
        try:
            WorkloadMode(self.mode)
        except ValueError:
            raise ValueError(
                f"WorkloadSpec.mode={self.mode!r}; accepted: {[m.value for m in WorkloadMode]}"
            ) from None

    def build(self, *, vocab_size: int = 256) -> Workload:
        return generate_workload(
            self.source,
            batch_size=self.batch_size,
            n_sampling=self.n_sampling,
            step=self.step,
            seed=self.seed,
            length_scale=self.length_scale,
            mode=self.mode,
            vocab_size=vocab_size,
            min_len=self.min_len,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def auto_length_scale(
    source,
    *,
    batch_size: int,
    max_len: int,
    n_sampling: int | None = None,
    step: int | None = None,
    seed: int = 0,
) -> float:
    """The ``length_scale`` that maps the sampled batch's longest sequence to ``max_len``.

    Longest sequence = prompt + whole response (RLE runs) of the unscaled specs;
    the scale is capped at 1 (never stretch a trace).
    """
    if max_len < 2:
        raise ValueError(f"max_len={max_len}: must be >= 2")
    specs, _, _ = sample_group_specs(
        source, batch_size=batch_size, n_sampling=n_sampling, step=step, seed=seed
    )
    longest = max(s.prompt_len + sum(n for _, n in r) for s in specs for r in s.responses)
    return min(1.0, max_len / max(longest, 1))


def default_suite(
    root: str | os.PathLike | None = None, *, max_len: int | None = None, seed: int = 0
) -> list[WorkloadSpec]:
    """The real-trace replay suite (``DEFAULT_SUITE``) found under ``root``, auto-scaled.

    ``max_len`` overrides every entry's longest-sequence target. Traces missing
    under ``root`` are skipped; an empty list means no PolyTrace data.
    """
    root = default_polytrace_root() if root is None else Path(root)
    out = []
    for name, rel, step, mode, bs, ns, entry_max in DEFAULT_SUITE:
        target = entry_max if max_len is None else max_len
        path = root / rel
        if not path.exists():
            continue
        scale = auto_length_scale(
            str(path), batch_size=bs, max_len=target, n_sampling=ns, step=step, seed=seed
        )
        out.append(
            WorkloadSpec(
                name=name,
                source=str(path),
                batch_size=bs,
                n_sampling=ns,
                step=step,
                seed=seed,
                length_scale=round(scale, 6),
                mode=mode,
            )
        )
    return out


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
    calls: tool calls in the step; critical_path_s: max over trajectories of the
    sum of their call latencies; total_call_s: sum over all calls; seconds: the
    stage's wall time (critical path x time scale; measured when sleeping);
    status: "ok", "no tool calls" or why latencies are missing.
    """

    clock: str
    calls: int
    critical_path_s: float
    total_call_s: float
    seconds: float
    status: str = "ok"


def default_tool_sampler(workload_source: str | None = None) -> ToolLatencySampler | None:
    """Latencies of the workload's own multi-turn trace, else the shared search_r1 run."""
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
            steps = tr.steps[:1]
            try:
                return ToolLatencySampler.from_trace(tr, steps=steps)
            except ValueError:
                continue
    return None


def tool_phase(
    workload: Workload,
    sampler: ToolLatencySampler | None,
    *,
    clock: ToolClock = ToolClock.SIMULATED,
    time_scale: float = 1.0,
    seed: int = 0,
) -> ToolPhase:
    """Samples every tool call's latency (seeded) and runs the tool stage's clock."""
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
        )
    if sampler is None:
        return ToolPhase(
            clock=clock.value,
            calls=n,
            critical_path_s=0.0,
            total_call_s=0.0,
            seconds=0.0,
            status="no tool-latency data (pass a multi-turn trace)",
        )
    rng = np.random.default_rng([seed, 7])
    lat = sampler.sample(n, seed=rng)
    sums, k = [], 0
    for t in sorted(per_traj):
        c = per_traj[t]
        sums.append(float(lat[k : k + c].sum()))
        k += c
    crit = max(sums)
    wall = crit * time_scale
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
    )


# ----------------------------------------------------------------------------- rollout stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutPhase:
    """The generation stage: ``status`` is "ok" or why it did not run (seconds None).

    seconds / min_seconds: median / minimum over the timed rollouts.
    """

    status: str
    seconds: float | None = None
    min_seconds: float | None = None
    compile_s: float | None = None
    generated_tokens: int = 0
    tokens_per_s: float | None = None
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


def find_forced_length_sampler():
    """``dtarl.rollout``'s sampler class if it generates with forced lengths, else None.

    Accepted: a class ``Sampler(model, SamplingParams)`` in ``dtarl.rollout`` or
    ``dtarl.rollout.sampler`` whose ``generate`` takes ``forced_lengths``.
    """
    import importlib
    import inspect

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
    total_s, gen, ok = 0.0, 0, True
    for k, call in enumerate(calls):
        res = sampler.generate(
            params,
            list(call.prompts),
            num_samples=list(call.counts),
            seed=seed + k,
            forced_lengths=list(call.forced),
        )
        total_s += float(res.stats["seconds"])
        gen += int(res.lengths.sum())
        ok = ok and bool(np.array_equal(np.sort(res.lengths), np.sort(np.asarray(call.forced))))
    return total_s, gen, ok


def rollout_sampler(model, calls: Sequence[RolloutCall]):
    """A fresh forced-length sampler sized for ``calls`` (None without ``dtarl.rollout``)."""
    found = find_forced_length_sampler()
    if found is None:
        return None
    from dtarl.tree.plan import bucket

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
        return run_rollout_calls(self.sampler, self.params, self.calls, self.seed)[0]

    def phase(self, timed: TimedRuns) -> RolloutPhase:
        runs = list(timed.seconds)
        med = statistics.median(runs)
        return RolloutPhase(
            status=(
                "ok" if self.ok else "ok (WARNING: sampler lengths differ from the forced lengths)"
            ),
            seconds=med,
            min_seconds=min(runs),
            compile_s=max(self.first_s - min(runs), 0.0),
            generated_tokens=self.generated,
            tokens_per_s=self.generated / med if med > 0 else None,
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
    ``gate`` (``interleaved_rounds``); seconds = median, min_seconds = minimum;
    compile_s = first - minimum. Without a forced-length sampler in
    ``dtarl.rollout`` the stage is reported unavailable, never faked.
    """
    run = RolloutRun.warm(model, params, rollout_calls(workload), seed)
    if run is None:
        return RolloutPhase(status=ROLLOUT_UNAVAILABLE)
    gate = QuietGate() if gate is None else gate
    (timed,) = interleaved_rounds([run.call], repeats=repeats, gate=gate)
    return run.phase(timed)


# ----------------------------------------------------------------------------- train stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineTiming:
    """Training-stage timing of one engine on one batch (seconds).

    step_s / device_s / host_s: medians over the timed calls (host prepare +
    device, device only, host prepare only); step_min_s: the fastest timed call
    (the load-robust number); runs_s / device_runs_s / host_runs_s: every timed call;
    background_cores: other processes' CPU use during each call (``QuietGate``).
    """

    kind: str
    first_call_s: float
    compile_s: float
    step_s: float
    step_min_s: float
    device_s: float
    host_s: float
    runs_s: tuple[float, ...]
    device_runs_s: tuple[float, ...]
    host_runs_s: tuple[float, ...]
    background_cores: tuple[float | None, ...]
    num_tokens: int
    tree_tokens: int | None
    computed_tokens: int | None
    trace_count: int
    stats: dict[str, Any]

    @property
    def min_background_cores(self) -> float | None:
        """Background during the fastest call."""
        return self.background_cores[int(np.argmin(self.runs_s))]

    @property
    def tokens_per_s(self) -> float:
        """Dense (trained-sequence) tokens per second of step time."""
        return self.num_tokens / self.step_s if self.step_s > 0 else float("nan")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, bool | int | float | str) or x is None:
        return x
    return repr(x)


def _proc_busy_s() -> float | None:
    """CPU seconds spent busy by all processes (all CPUs) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclasses.dataclass
class QuietGate:
    """Background CPU use of *other* processes, and a wait for it to drop.

    background = (CPU seconds all processes were busy - this process's CPU
    seconds) / wall seconds, in cores (Linux ``/proc/stat``; None elsewhere).
    On a small shared machine another process on the neighbouring core slows a
    CPU-bound call by up to 2x, so timings are taken when background <
    ``cores``: ``wait`` polls windows of ``window_s`` until then, spending at most
    ``budget_s`` over the gate's life (then it stops waiting). ``cores=None``: off.
    """

    cores: float | None = 0.3
    budget_s: float = 60.0
    window_s: float = 0.1
    waited_s: float = 0.0

    def snapshot(self) -> tuple[float | None, float, float]:
        return _proc_busy_s(), _self_cpu_s(), time.perf_counter()

    @staticmethod
    def between(a, b) -> float | None:
        """Background cores between two snapshots (None off Linux)."""
        if a[0] is None or b[0] is None or b[2] <= a[2]:
            return None
        return max(((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2]), 0.0)

    def wait(self) -> float | None:
        """Blocks until background < cores (or the budget is spent); the last reading."""
        if self.cores is None or _proc_busy_s() is None:
            return None
        while True:
            a = self.snapshot()
            time.sleep(self.window_s)
            bg = self.between(a, self.snapshot())
            if bg is None or bg < self.cores or self.waited_s >= self.budget_s:
                return bg
            self.waited_s += self.window_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimedRuns:
    """Seconds of every timed call of one job and the background cores during each."""

    seconds: tuple[float, ...]
    background: tuple[float | None, ...]

    @property
    def best(self) -> int:
        return int(np.argmin(self.seconds))


def interleaved_rounds(
    calls: Sequence, *, repeats: int, gate: QuietGate | None = None
) -> list[TimedRuns]:
    """Times zero-argument callables (each returns its own measured seconds) in rounds.

    ``repeats`` rounds call every callable once, in order, each call after
    ``gate.wait()``; then, while the gate's budget lasts, up to ``repeats`` more
    rounds re-run the callables whose fastest call so far ran with background >=
    ``gate.cores`` (contended), so that each minimum comes from a quiet call when
    the machine offers one.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    secs: list[list[float]] = [[] for _ in calls]
    bgs: list[list[float | None]] = [[] for _ in calls]

    def one(j: int) -> None:
        if gate is not None:
            gate.wait()
        a = gate.snapshot() if gate is not None else None
        secs[j].append(float(calls[j]()))
        bgs[j].append(gate.between(a, gate.snapshot()) if gate is not None else None)

    for _ in range(repeats):
        for j in range(len(calls)):
            one(j)
    if gate is not None and gate.cores is not None:
        for _ in range(repeats):
            loud = []
            for j in range(len(calls)):
                b = bgs[j][int(np.argmin(secs[j]))]
                if b is not None and b >= gate.cores:
                    loud.append(j)
            if not loud or gate.waited_s >= gate.budget_s:
                break
            for j in loud:
                one(j)
    return [
        TimedRuns(seconds=tuple(s), background=tuple(b)) for s, b in zip(secs, bgs, strict=True)
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimingJob:
    """One (engine kind, batch) pair to time; ``engine_kwargs`` go to ``make_engine``."""

    kind: str
    batch: Any  # RolloutBatch
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    label: str = ""


def time_engines(
    jobs: Sequence[TimingJob],
    model,
    params,
    loss,
    *,
    repeats: int = 5,
    warmup: int = 1,
    gate: QuietGate | None = None,
    log=None,
) -> list[EngineTiming]:
    """Interleaved timing of several jobs (module docstring: timing protocol).

    Each job gets a fresh ``make_engine`` engine, its first call (compile) and
    ``warmup - 1`` more untimed calls; then ``interleaved_rounds`` (``repeats``
    rounds, every job once per round, each call behind ``gate``; default
    ``QuietGate()``). ``log`` gets a line per compiled job.
    """
    from dtarl.engines import make_engine

    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: both must be >= 1")
    if not jobs:
        raise ValueError("jobs: empty; pass at least one TimingJob")
    gate = QuietGate() if gate is None else gate
    engines, firsts = [], []
    for job in jobs:
        engine = make_engine(job.kind, model, **job.engine_kwargs)
        t0 = time.perf_counter()
        engine.value_and_grad(params, job.batch, loss)
        firsts.append(time.perf_counter() - t0)
        for _ in range(warmup - 1):
            engine.value_and_grad(params, job.batch, loss)
        engines.append(engine)
        if log is not None:
            log(f"compiled {job.label or job.kind} {job.kind}: first call {firsts[-1]:.2f}s")
    dev: list[list[float]] = [[] for _ in jobs]
    host: list[list[float]] = [[] for _ in jobs]
    last: list[Any] = [None] * len(jobs)

    def caller(j: int):
        def call() -> float:
            _, _, aux = engines[j].value_and_grad(params, jobs[j].batch, loss)
            dev[j].append(float(aux.stats["seconds"]))
            host[j].append(float(aux.stats.get("host_seconds", 0.0)))
            last[j] = aux
            return dev[j][-1] + host[j][-1]

        return call

    timed = interleaved_rounds([caller(j) for j in range(len(jobs))], repeats=repeats, gate=gate)
    if log is not None and gate.waited_s > 0:
        log(f"waited {gate.waited_s:.1f}s for other processes to go quiet")
    out = []
    for j, job in enumerate(jobs):
        runs = list(timed[j].seconds)
        s = last[j].stats
        out.append(
            EngineTiming(
                kind=str(job.kind),
                first_call_s=firsts[j],
                compile_s=max(firsts[j] - min(runs), 0.0),
                step_s=statistics.median(runs),
                step_min_s=min(runs),
                device_s=statistics.median(dev[j]),
                host_s=statistics.median(host[j]),
                runs_s=tuple(runs),
                device_runs_s=tuple(dev[j]),
                host_runs_s=tuple(host[j]),
                background_cores=timed[j].background,
                num_tokens=int(s.get("num_tokens", job.batch.num_tokens)),
                tree_tokens=None if s.get("tree_tokens") is None else int(s["tree_tokens"]),
                computed_tokens=(
                    None if s.get("computed_tokens") is None else int(s["computed_tokens"])
                ),
                trace_count=int(s.get("trace_count", -1)),
                stats=_jsonable(dict(s)),
            )
        )
    return out


def time_engine(
    kind: str,
    model,
    params,
    batch,
    loss,
    *,
    repeats: int = 5,
    warmup: int = 1,
    engine_kwargs: dict[str, Any] | None = None,
) -> EngineTiming:
    """``time_engines`` of a single (kind, batch) job."""
    job = TimingJob(kind=str(kind), batch=batch, engine_kwargs=dict(engine_kwargs or {}))
    return time_engines([job], model, params, loss, repeats=repeats, warmup=warmup)[0]


# ----------------------------------------------------------------------------- replay


def model_config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return _jsonable(dataclasses.asdict(cfg))


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    d["family"] = ModelFamily(d["family"])
    d["attention_backend"] = AttentionBackend(d.get("attention_backend", "xla"))
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """How to replay: engines, timing protocol, tool clock and the model.

    engines: engine kinds (``make_engine``); "dense" is the speedup baseline.
    repeats / warmup: timed and untimed (compile) calls per engine.
    tool_clock / tool_time_scale: see ``ToolClock``; the scale shrinks slept time.
    tool_latency_source: a multi-turn trace for latencies (None: the default).
    model: the policy (the tiny test model by default); model_seed: its init.
    rollout / rollout_repeats: run the rollout stage (when a sampler exists) and
    how many timed rollouts (min, median) follow its untimed warm-up.
    quiet_cores / quiet_budget_s: time calls when other processes use less than
    this many cores, waiting at most this long in all (``QuietGate``; None: off).
    """

    engines: tuple[str, ...] = ("dense", "dfs")
    repeats: int = 5
    warmup: int = 1
    tool_clock: ToolClock = ToolClock.SIMULATED
    tool_time_scale: float = 1.0
    tool_latency_source: str | None = None
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    model_seed: int = 0
    rollout: bool = True
    rollout_repeats: int = 3
    quiet_cores: float | None = 0.3
    quiet_budget_s: float = 120.0

    def __post_init__(self):
        if self.rollout_repeats < 1:
            raise ValueError(f"ReplayConfig.rollout_repeats={self.rollout_repeats}: must be >= 1")
        if not self.engines:
            raise ValueError("ReplayConfig.engines: empty; give at least one engine kind")
        if self.repeats < 1:
            raise ValueError(f"ReplayConfig.repeats={self.repeats}: must be >= 1")
        if self.warmup < 1:
            raise ValueError(f"ReplayConfig.warmup={self.warmup}: must be >= 1 (it compiles)")
        if not self.tool_time_scale >= 0:
            raise ValueError(f"ReplayConfig.tool_time_scale={self.tool_time_scale}: must be >= 0")
        if self.quiet_cores is not None and not self.quiet_cores > 0:
            raise ValueError(f"ReplayConfig.quiet_cores={self.quiet_cores}: must be > 0 or None")
        if not self.quiet_budget_s >= 0:
            raise ValueError(f"ReplayConfig.quiet_budget_s={self.quiet_budget_s}: must be >= 0")
        object.__setattr__(self, "tool_clock", ToolClock(self.tool_clock))
        object.__setattr__(self, "engines", tuple(str(e) for e in self.engines))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadReplay:
    """All stages of one replayed workload."""

    spec: WorkloadSpec
    num_sequences: int
    dense_tokens: int
    tree_tokens: int
    max_len: int
    rollout: RolloutPhase
    tool: ToolPhase
    engines: dict[str, EngineTiming]

    def speedup(self, kind: str, baseline: str = "dense") -> float | None:
        """Training step-time speedup of ``kind`` over ``baseline`` (None if not run)."""
        if baseline not in self.engines or kind not in self.engines:
            return None
        return self.engines[baseline].step_s / self.engines[kind].step_s

    def step_s(self, kind: str) -> float:
        """End-to-end step: rollout (when it ran) + tool + training."""
        roll = self.rollout.seconds or 0.0  # None when the stage did not run
        return roll + self.tool.seconds + self.engines[kind].step_s

    def to_dict(self) -> dict[str, Any]:
        engines = {}
        for k, t in self.engines.items():
            d = dataclasses.asdict(t)
            d["runs_s"] = list(t.runs_s)
            d["tokens_per_s"] = t.tokens_per_s
            d["tree_tokens_per_s"] = self.tree_tokens / t.step_s if t.step_s > 0 else float("nan")
            d["speedup_vs_dense"] = self.speedup(k)
            d["end_to_end_step_s"] = self.step_s(k)
            engines[k] = d
        return dict(
            spec=self.spec.to_dict(),
            num_sequences=self.num_sequences,
            dense_tokens=self.dense_tokens,
            tree_tokens=self.tree_tokens,
            ideal_speedup=self.dense_tokens / max(self.tree_tokens, 1),
            max_len=self.max_len,
            stages=dict(
                rollout=dataclasses.asdict(self.rollout), tool=dataclasses.asdict(self.tool)
            ),
            engines=engines,
        )


def _load_avg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return dict(
        platform=dev.platform,
        device=str(getattr(dev, "device_kind", dev.platform)),
        jax=jax.__version__,
        cpu_count=os.cpu_count(),
        host=platform.node(),
        python=platform.python_version(),
        load_avg_1m=_load_avg(),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """extra_engines / extra_rollouts: timings of ``replay``'s extra jobs (not saved)."""

    config: ReplayConfig
    machine: dict[str, Any]
    workloads: tuple[WorkloadReplay, ...]
    extra_engines: tuple[EngineTiming, ...] = ()
    extra_rollouts: tuple[TimedRuns | None, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        cfg["tool_clock"] = self.config.tool_clock.value
        cfg["model"] = model_config_to_dict(self.config.model)
        cfg["engines"] = list(self.config.engines)
        return dict(
            kind="dtarl.trace.replay",
            config=_jsonable(cfg),
            machine=self.machine,
            timing=(
                "train: host prepare + device seconds per call after warm-up, timed in "
                "interleaved rounds over every (workload, engine); step_min_s = minimum, "
                "step_s = median; compile_s = first call - step_min_s; rollout: seconds = "
                "median, min_seconds = minimum of the timed rollouts; tool per its clock"
            ),
            workloads=[w.to_dict() for w in self.workloads],
        )

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1))
        return p

    def table(self) -> str:
        """A plain-text summary: one row per (workload, engine)."""
        head = (
            f"{'workload':<14}{'engine':<14}{'seqs':>5}{'dense':>7}{'tree':>7}"
            f"{'compile_s':>10}{'min_s':>8}{'median_s':>9}{'tok/s':>9}{'speedup':>9}"
            f"{'tool_s':>8}"
        )
        lines = [head]
        for w in self.workloads:
            for k, t in w.engines.items():
                sp = w.speedup(k)
                lines.append(
                    f"{w.spec.name:<14}{k:<14}{w.num_sequences:>5}{w.dense_tokens:>7}"
                    f"{w.tree_tokens:>7}{t.compile_s:>10.2f}{t.step_min_s:>8.3f}{t.step_s:>9.3f}"
                    f"{t.tokens_per_s:>9.0f}{'-' if sp is None else f'{sp:.2f}x':>9}"
                    f"{w.tool.seconds:>8.2f}"
                )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> Path:
        """PNG: training step time per engine and workload, and the speedup over dense."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [w.spec.name for w in self.workloads]
        kinds = list(self.config.engines)
        x = np.arange(len(names))
        width = 0.8 / max(len(kinds), 1)
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
        for j, k in enumerate(kinds):
            ys = [w.engines[k].step_s if k in w.engines else np.nan for w in self.workloads]
            ax0.bar(x + j * width, ys, width, label=k)
            sp = [w.speedup(k) or np.nan for w in self.workloads]
            ax1.bar(x + j * width, sp, width, label=k)
        for ax in (ax0, ax1):
            ax.set_xticks(x + width * (len(kinds) - 1) / 2)
            ax.set_xticklabels(names, rotation=15)
            ax.legend()
        ax0.set_ylabel("training step time (s, median)")
        ax0.set_title("replay: train stage per engine")
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.set_ylabel("speedup over dense")
        ax1.set_title("speedup on the real length distribution")
        fig.tight_layout()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        return p


def _setup(config: ReplayConfig, model, params, loss):
    from dtarl.engines.base import split_model
    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.model import init_model

    if model is None:
        model = init_model(config.model, config.model_seed)
    if params is None:
        _, params = split_model(model)
    loss = ClippedSurrogateLoss.grpo() if loss is None else loss
    return model, params, loss


def _gate(config: ReplayConfig) -> QuietGate:
    return QuietGate(cores=config.quiet_cores, budget_s=config.quiet_budget_s)


def _stages(
    workload: Workload, config: ReplayConfig, spec: WorkloadSpec, model, params, sampler, gate
):
    """The rollout and tool stages of one workload (timed on their own)."""
    if sampler is None:
        sampler = default_tool_sampler(config.tool_latency_source or spec.source)
    rollout = (
        rollout_phase(
            workload, model, params, repeats=config.rollout_repeats, seed=spec.seed, gate=gate
        )
        if config.rollout
        else RolloutPhase(status="skipped (ReplayConfig.rollout=False)")
    )
    tool = tool_phase(
        workload,
        sampler,
        clock=config.tool_clock,
        time_scale=config.tool_time_scale,
        seed=spec.seed,
    )
    return rollout, tool


def _assemble(workload: Workload, spec: WorkloadSpec, rollout, tool, timings) -> WorkloadReplay:
    return WorkloadReplay(
        spec=spec,
        num_sequences=workload.batch.num_sequences,
        dense_tokens=workload.info.dense_tokens,
        tree_tokens=workload.info.tree_tokens,
        max_len=int(workload.batch.lengths.max()),
        rollout=rollout,
        tool=tool,
        engines=timings,
    )


def replay_workload(
    workload: Workload,
    config: ReplayConfig,
    *,
    spec: WorkloadSpec | None = None,
    model=None,
    params=None,
    loss=None,
    sampler: ToolLatencySampler | None = None,
    engine_kwargs: dict[str, dict[str, Any]] | None = None,
) -> WorkloadReplay:
    """Replays one generated workload: rollout (if available), tool, then every engine
    (timed interleaved, ``time_engines``)."""
    model, params, loss = _setup(config, model, params, loss)
    info = workload.info
    spec = spec or WorkloadSpec(name=info.source, source=info.source, batch_size=1)
    gate = _gate(config)
    rollout, tool = _stages(workload, config, spec, model, params, sampler, gate)
    jobs = [
        TimingJob(
            kind=k, batch=workload.batch, engine_kwargs=dict((engine_kwargs or {}).get(k) or {})
        )
        for k in config.engines
    ]
    ts = time_engines(
        jobs, model, params, loss, repeats=config.repeats, warmup=config.warmup, gate=gate
    )
    return _assemble(workload, spec, rollout, tool, dict(zip(config.engines, ts, strict=True)))


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
    load_start = _load_avg()
    model, params, loss = _setup(config, None, None, None)
    gate = _gate(config)
    built, jobs = [], []
    for spec in specs:
        w = spec.build(vocab_size=config.model.vocab_size)
        sampler = default_tool_sampler(config.tool_latency_source or spec.source)
        tool = tool_phase(
            w, sampler, clock=config.tool_clock, time_scale=config.tool_time_scale, seed=spec.seed
        )
        run = (
            RolloutRun.warm(model, params, rollout_calls(w), spec.seed) if config.rollout else None
        )
        built.append((spec, w, run, tool))
        jobs += [TimingJob(kind=k, batch=w.batch, label=spec.name) for k in config.engines]
    extra_runs = [
        RolloutRun.warm(model, params, calls, config.model_seed) for calls in extra_rollouts
    ]
    runs = [r for _, _, r, _ in built if r is not None] + [r for r in extra_runs if r is not None]
    timed_rollouts = iter(
        interleaved_rounds([r.call for r in runs], repeats=config.rollout_repeats, gate=gate)
        if runs
        else []
    )
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
    for i, (spec, w, run, tool) in enumerate(built):
        if not config.rollout:
            rollout = RolloutPhase(status="skipped (ReplayConfig.rollout=False)")
        elif run is None:
            rollout = RolloutPhase(status=ROLLOUT_UNAVAILABLE)
        else:
            rollout = run.phase(next(timed_rollouts))
        timings = dict(zip(config.engines, ts[i * k : (i + 1) * k], strict=True))
        r = _assemble(w, spec, rollout, tool, timings)
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


def load_replay_json(path: str | os.PathLike) -> dict[str, Any]:
    """A saved replay (``ReplayResult.save``) as a dict; checks its ``kind``."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"{p}: no replay JSON; create one with `dtarl trace replay --out DIR`"
        )
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(d, dict) or d.get("kind") != "dtarl.trace.replay":
        kind = d.get("kind") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{path}: not a dtarl replay JSON (kind={kind!r})")
    return d


__all__ = [
    "DEFAULT_SUITE",
    "ROLLOUT_UNAVAILABLE",
    "EngineTiming",
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
    "default_tool_sampler",
    "find_forced_length_sampler",
    "interleaved_rounds",
    "load_replay_json",
    "machine_info",
    "model_turns",
    "trajectory_masks",
    "model_config_from_dict",
    "model_config_to_dict",
    "replay",
    "replay_workload",
    "rollout_calls",
    "rollout_phase",
    "rollout_sampler",
    "run_rollout_calls",
    "time_engine",
    "time_engines",
    "tool_calls_per_trajectory",
    "tool_phase",
]
