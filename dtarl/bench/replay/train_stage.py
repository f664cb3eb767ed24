"""The train stage of a replayed step: every (engine kind, batch) job on a fresh
engine, compiled, then timed in the replay's interleaved rounds behind the quiet
gate (``replay_rounds``, over ``dtarl.timing.interleaved_rounds``)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtarl.bench.replay.suite import jsonable
from dtarl.engines import make_engine
from dtarl.timing import QuietGate, Rounds, TimedRuns, interleaved_rounds, self_timed


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimingJob:
    """One (engine kind, batch) pair to time; ``engine_kwargs`` go to ``make_engine``."""

    kind: str
    batch: Any  # RolloutBatch
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    label: str = ""


def replay_rounds(
    calls: Sequence[Callable[[], float]], *, repeats: int, gate: QuietGate | None = None
) -> list[TimedRuns]:
    """The replay's protocol over ``dtarl.timing.interleaved_rounds``.

    Zero-argument callables that return their own measured seconds; ``repeats``
    rounds call every callable once, in order, each call after ``gate.wait()``;
    then, while the gate's budget lasts, up to ``repeats`` more rounds re-run the
    callables whose fastest call so far ran with background >= ``gate.cores``
    (contended), so that each minimum comes from a quiet call when the machine
    offers one. No untimed calls (the callers warm up).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    timed = interleaved_rounds(
        dict(enumerate(calls)), Rounds(rounds=repeats), gate=gate, measure=self_timed
    )
    return [timed[j] for j in range(len(calls))]


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
    ``warmup - 1`` more untimed calls; then ``replay_rounds`` (``repeats``
    rounds, every job once per round, each call behind ``gate``; default
    ``QuietGate()``). ``log`` gets a line per compiled job.
    """
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

    timed = replay_rounds([caller(j) for j in range(len(jobs))], repeats=repeats, gate=gate)
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
                stats=jsonable(dict(s)),
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
