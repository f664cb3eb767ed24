"""The one timing harness: interleaved rounds of side-by-side runs, the quiet-machine
gate, and the machine a measurement ran on.

Every timing in dtarl goes through ``interleaved_rounds``: auto's per-bucket tuner
(``time_programs``), ``dtarl bench train`` (its rounds and its pairwise auto-vs-best
turns), the replay benchmark and the simulator's calibration. Only the protocol
(``Rounds``) differs between them.

Why rounds. This machine's speed moves by 10-30% over seconds (other processes,
the neighbouring core, frequency scaling), which would land on whichever run was
timed in the slow stretch if the runs were timed one after another. A round
gives every run one *turn*, in an order that changes between rounds
(``alternating``, ``shuffled``) or not (``fixed``), so the samples of all runs
are spread over the same stretch of time.

A turn is: an untimed call when the protocol asks for one (``Settle``: the first
call after another run's pays for the caches and allocations that run left
behind, while training runs one program step after step), then timed calls, one,
or as many as fit in ``turn_seconds`` (at most ``turn_calls``), whose mean is
the turn's sample. Each run stays in the rounds until it has ``rounds``
samples, and longer while its samples add up to less than ``min_seconds`` (up
to ``max_samples``: a short program's median then is not of a few noisy
samples), or while the rounds have run less than ``budget_s`` (up to
``max_rounds`` rounds). With a ``QuietGate`` every turn waits until other
processes are quiet, the background load during it is recorded, and runs whose
fastest sample was contended get up to ``rounds`` extra turns while the gate's
budget lasts.

The clock (``clock``, default ``time.perf_counter``) and what counts as a call's
seconds (``measure``: e.g. the run's own reported seconds) are parameters, so the
protocol can be tested without depending on the machine's speed.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import platform
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

# ----------------------------------------------------------------------------- orders


def fixed(r: int, names: Sequence) -> list:
    """Every round in the given order."""
    return list(names)


def alternating(r: int, names: Sequence) -> list:
    """The given order in even rounds, reversed in odd ones."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def shuffled(r: int, names: Sequence) -> list:
    """A random permutation per round, seeded by the round's index."""
    return [names[i] for i in np.random.RandomState(r).permutation(len(names))]


class Settle(enum.Enum):
    """When a turn starts with an untimed call."""

    NEVER = "never"  # timed calls only (the caller warmed every run up)
    ON_SWITCH = "on_switch"  # when the previous call was another run's
    ALWAYS = "always"  # at the start of every turn


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rounds:
    """The protocol of ``interleaved_rounds`` (module docstring).

    rounds: samples (turns) every run gets at least.
    order: (round index, run names) -> the names in this round's order.
    warmup: one untimed call of every run before the rounds (compilation).
    settle: when a turn starts with an untimed call.
    turn_seconds / turn_calls: a turn times calls until they add up to
      ``turn_seconds`` (at least one call, at most ``turn_calls``); its sample is
      their mean.
    min_seconds / max_samples: a run whose samples add up to less than
      ``min_seconds`` stays in the rounds, up to ``max_samples`` samples.
    budget_s / max_rounds: more rounds of every run while the rounds have run
      less than ``budget_s`` seconds, up to ``max_rounds`` rounds (0: off).
    """

    rounds: int = 3
    order: Callable[[int, Sequence], list] = fixed
    warmup: bool = False
    settle: Settle = Settle.NEVER
    turn_seconds: float = 0.0
    turn_calls: int = 1
    min_seconds: float = 0.0
    max_samples: int = 50
    budget_s: float = 0.0
    max_rounds: int = 0

    def __post_init__(self):
        for name in ("rounds", "turn_calls", "max_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"Rounds.{name}={getattr(self, name)}: must be >= 1")
        for name in ("turn_seconds", "min_seconds", "budget_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Rounds.{name}={getattr(self, name)}: must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimedRuns:
    """Seconds of every sample (turn) of one run and the background cores during each
    (None without a gate)."""

    seconds: tuple[float, ...]
    background: tuple[float | None, ...]

    @property
    def best(self) -> int:
        """Index of the fastest sample."""
        return int(np.argmin(self.seconds))

    @property
    def min(self) -> float:
        return float(min(self.seconds))

    @property
    def median(self) -> float:
        return float(np.median(self.seconds))


# ----------------------------------------------------------------------------- the quiet gate


def proc_busy_s() -> float | None:
    """CPU seconds spent busy by all processes (all CPUs) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    """CPU seconds (user + system) of this process."""
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
        return proc_busy_s(), self_cpu_s(), time.perf_counter()

    @staticmethod
    def between(a, b) -> float | None:
        """Background cores between two snapshots (None off Linux)."""
        if a[0] is None or b[0] is None or b[2] <= a[2]:
            return None
        return max(((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2]), 0.0)

    def wait(self) -> float | None:
        """Blocks until background < cores (or the budget is spent); the last reading."""
        if self.cores is None or proc_busy_s() is None:
            return None
        while True:
            a = self.snapshot()
            time.sleep(self.window_s)
            bg = self.between(a, self.snapshot())
            if bg is None or bg < self.cores or self.waited_s >= self.budget_s:
                return bg
            self.waited_s += self.window_s


# ----------------------------------------------------------------------------- the harness


def wall_seconds(out: Any, elapsed: float) -> float:
    """``measure`` default: a call's seconds are the clock's."""
    return elapsed


def self_timed(out: Any, elapsed: float) -> float:
    """``measure`` for runs that return their own measured seconds."""
    return float(out)


def interleaved_rounds(
    runs: Mapping[Hashable, Callable[[], Any]],
    rounds: Rounds | None = None,
    *,
    gate: QuietGate | None = None,
    clock: Callable[[], float] | None = None,
    block: Callable[[Any], Any] | None = None,
    measure: Callable[[Any, float], float] = wall_seconds,
) -> dict[Hashable, TimedRuns]:
    """Times the zero-argument callables ``runs`` (name -> run) side by side.

    ``rounds``: the protocol (default ``Rounds()``: 3 rounds in a fixed order, one
    timed call per turn); module docstring. ``gate``: every turn waits for
    ``gate.wait()`` and records the background; contended minima are re-run.
    ``clock``: seconds now (default ``time.perf_counter``). ``block``: applied to
    every call's result before the clock is read (e.g. ``jax.block_until_ready``).
    ``measure(result, clock seconds)``: a call's seconds (default: the clock's).
    Returns name -> ``TimedRuns`` (one sample per turn, in round order).
    """
    if not runs:
        raise ValueError("interleaved_rounds: runs is empty (need at least one name -> run())")
    spec = Rounds() if rounds is None else rounds
    clock = time.perf_counter if clock is None else clock
    names = list(runs)
    secs: dict[Hashable, list[float]] = {k: [] for k in names}
    bgs: dict[Hashable, list[float | None]] = {k: [] for k in names}
    spent = dict.fromkeys(names, 0.0)
    last: list[Hashable | None] = [None]

    def call(k) -> Any:
        out = runs[k]()
        return out if block is None else block(out)

    def timed_call(k) -> float:
        t0 = clock()
        out = call(k)
        return measure(out, clock() - t0)

    def turn(k) -> None:
        if spec.settle is Settle.ALWAYS or (spec.settle is Settle.ON_SWITCH and k != last[0]):
            call(k)
        last[0] = k
        a = None
        if gate is not None:
            gate.wait()
            a = gate.snapshot()
        total, n = 0.0, 0
        while n == 0 or (total < spec.turn_seconds and n < spec.turn_calls):
            total += timed_call(k)
            n += 1
        secs[k].append(total / n)
        spent[k] += total / n
        bgs[k].append(gate.between(a, gate.snapshot()) if gate is not None else None)

    def wanted(k) -> bool:
        n = len(secs[k])
        return n < spec.rounds or (spent[k] < spec.min_seconds and n < spec.max_samples)

    if spec.warmup:
        for k in names:
            call(k)
            last[0] = k
    t_start = clock() if spec.budget_s > 0 else 0.0
    r = 0
    while True:
        more = spec.budget_s > 0 and r < spec.max_rounds and clock() - t_start < spec.budget_s
        live = [k for k in spec.order(r, names) if more or wanted(k)]
        if not live:
            break
        for k in live:
            turn(k)
        r += 1
    if gate is not None and gate.cores is not None:
        for _ in range(spec.rounds):
            loud = []
            for k in names:
                b = bgs[k][int(np.argmin(secs[k]))]
                if b is not None and b >= gate.cores:
                    loud.append(k)
            if not loud or gate.waited_s >= gate.budget_s:
                break
            for k in loud:
                turn(k)
    return {k: TimedRuns(seconds=tuple(secs[k]), background=tuple(bgs[k])) for k in names}


# ----------------------------------------------------------------------------- auto's tuner


def time_programs(
    runs: dict[str, Callable[[], object]],
    *,
    repeats: int = 3,
    min_seconds: float = 0.25,
    max_calls: int = 50,
) -> dict[str, float]:
    """Seconds of one call of each ``run()`` in ``runs`` (name -> a call of a
    compiled program, or a whole training step), timed side by side.

    Each program gets one warm-up call (compilation excluded); then rounds time
    every program once, blocked, in an order that alternates from round to round.
    A program whose turn follows another program's first gets one untimed call:
    the first call after a switch pays for the caches and allocations the other
    one left, while training runs one engine step after step. Each program's
    time is the median of its timed calls (what a step typically costs: the host
    part of a short step has a long tail that a minimum would hide). Rounds go on
    until every program has had ``repeats`` timed calls; a program with less than
    ``min_seconds`` timed so far stays in the rounds (up to ``max_calls`` timed
    calls), so a short program's median is not of a few noisy samples.
    Interleaving is what lets a close pick stand: this machine's speed moves by
    10-30% over seconds, which would land on whichever program ran in the slow
    stretch if they were timed one after another.
    """
    if not runs:
        raise ValueError("time_programs: runs is empty (need at least one name -> run())")
    protocol = Rounds(
        rounds=max(repeats, 1),
        order=alternating,
        warmup=True,
        settle=Settle.ON_SWITCH,
        min_seconds=min_seconds,
        max_samples=max(max_calls, 1),
    )
    timed = interleaved_rounds(runs, protocol, block=jax.block_until_ready)
    return {k: t.median for k, t in timed.items()}


def time_program(
    kind: str, run: Callable[[], object], *, repeats: int = 3, min_seconds: float = 0.25
) -> float:
    """``time_programs`` of one program: one warm-up call, then the median of at
    least ``repeats`` calls, repeated (up to 50 calls) until ``min_seconds`` have
    been timed."""
    return time_programs({kind: run}, repeats=repeats, min_seconds=min_seconds)[kind]


# ----------------------------------------------------------------------------- the machine


def load_avg() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    """What a measurement ran on: JAX's first device, CPU count, host, load."""
    dev = jax.devices()[0]
    return dict(
        platform=dev.platform,
        device=str(getattr(dev, "device_kind", dev.platform)),
        jax=jax.__version__,
        cpu_count=os.cpu_count(),
        host=platform.node(),
        python=platform.python_version(),
        load_avg_1m=load_avg(),
    )


# ----------------------------------------------------------------------------- compile time

# jax.monitoring's duration events of one jit cache miss: tracing to a jaxpr,
# lowering it to StableHLO, and XLA's compile (they run one after another, so
# their sum is the miss's cost; a persistent-cache hit skips the last).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile = {"seconds": 0.0, "listening": False}


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in COMPILE_EVENTS:
        _compile["seconds"] += float(duration)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling jitted programs
    (``COMPILE_EVENTS``, reported by JAX itself through ``jax.monitoring``), counted
    from the first call of this function, which installs the listener. Differences
    of two calls time the compiles in between, on whatever thread they ran."""
    if not _compile["listening"]:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _compile["listening"] = True
    return _compile["seconds"]


__all__ = [
    "COMPILE_EVENTS",
    "QuietGate",
    "Rounds",
    "Settle",
    "TimedRuns",
    "alternating",
    "compile_seconds",
    "fixed",
    "interleaved_rounds",
    "load_avg",
    "machine_info",
    "proc_busy_s",
    "self_cpu_s",
    "self_timed",
    "shuffled",
    "time_program",
    "time_programs",
    "wall_seconds",
]
