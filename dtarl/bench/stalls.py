"""``dtarl bench stalls CONFIG``: where a training run's compile and tuning seconds go.

Runs the trainer on a config (``--steps`` RL steps, ``--set`` overrides) and records
every compile JAX reports (``jax.monitoring``'s trace, lowering and XLA compile
events, the ones ``compile_seconds`` sums; each names its program) against the
global step it happened in. Printed:

* per phase (SFT, RL): steps, the seconds of its steps, compile and autotune
  seconds of its first step and of the later ones, and which later steps compiled
  a program (an XLA compile; none is the goal: every engine, sampler and scorer is
  reserved from the config's maxima before the first step). A step whose only
  compile events are jaxpr-cache hits (the first call of a program compiled ahead
  of time traces nothing but still reports a trace event of a few microseconds,
  which ``compile_seconds`` counts) is listed apart;
* the whole run: wall seconds (``Trainer.run``, the trainer's construction
  apart), ``compile_seconds_total``, ``autotune_seconds_total`` and their share of
  the wall time. auto's tuning compiles the candidates it times, so the two overlap:
  their sum over the wall is an upper bound of the share, and the compile share
  alone a lower bound;
* the programs compiled: per program (the jitted function's name; an engine's
  program is named after the engine), how many compiles, their seconds (trace +
  lowering + XLA), and the steps they happened in. A program compiled after the
  first step of its phase is marked;
* with ``--set compile_cache_dir=DIR`` (JAX's persistent compilation cache): how many
  programs were read back from it and how many compiled and written (a second run of
  the same config reads every one back; it still traces and lowers them).
"""

from __future__ import annotations

import collections
import dataclasses
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dtarl.rl.config import TrainerConfig, load_config
from dtarl.rl.hooks import StepInfo
from dtarl.rl.trainer import Trainer
from dtarl.timing import COMPILE_EVENTS, load_avg

XLA_EVENT = "/jax/core/compile/backend_compile_duration"
# JAX's persistent compilation cache (``compile_cache_dir``): an executable read back
# from it (its backend compile event then times the read), and one compiled and
# written to it.
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileEvent:
    step: int  # the global step (1-based) it happened in; 0: building the trainer
    program: str  # the jitted function's name, without "jit(...)"
    event: str  # one of ``COMPILE_EVENTS``
    seconds: float


class CompileRecorder:
    """A ``jax.monitoring`` listener that keeps every compile event with the step it
    happened in (``step``, set by the caller). Use as a context manager."""

    def __init__(self):
        self.step = 0
        self.events: list[CompileEvent] = []
        self.cache = collections.Counter()  # persistent-cache hits / misses

    def on_event(self, event: str, **kwargs) -> None:
        if event in (CACHE_HIT, CACHE_MISS):
            self.cache["hits" if event == CACHE_HIT else "misses"] += 1

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            name = str(kwargs.get("fun_name", "?"))
            if name.startswith("jit(") and name.endswith(")"):
                name = name[4:-1]
            self.events.append(
                CompileEvent(step=self.step, program=name, event=event, seconds=float(duration))
            )

    def __enter__(self) -> CompileRecorder:
        jax.monitoring.register_event_duration_secs_listener(self)
        jax.monitoring.register_event_listener(self.on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)
        jax.monitoring.unregister_event_listener(self.on_event)


def run(
    config: str | None,
    *,
    steps: int | None = None,
    sft_steps: int | None = None,
    overrides: Sequence[str] = (),
    out_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains ``config`` (with ``overrides``; ``steps`` RL steps and ``sft_steps`` SFT
    steps when given) into ``out_dir`` (default: a temporary folder, removed after)
    and returns the report (``format_report`` prints it)."""
    over = list(overrides)
    if steps is not None:
        over.append(f"steps={steps}")
    if sft_steps is not None:
        over.append(f"sft.steps={sft_steps}")
    with tempfile.TemporaryDirectory(prefix="dtarl-stalls-") as tmp:
        over += [f"out_dir={out_dir or tmp}", "console=false"]
        cfg = load_config(config, over)
        return _run(cfg, log)


def _run(cfg: TrainerConfig, log: Callable[[str], None]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with CompileRecorder() as rec:
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        build_s = time.perf_counter() - t0

        def hook(info: StepInfo) -> None:
            m = info.metrics
            rows.append(
                dict(
                    step=info.step,
                    phase=info.phase.value,
                    phase_step=info.phase_step,
                    step_seconds=float(m.get("step_seconds", 0.0)),
                    compile_seconds=float(m.get("compile_seconds", 0.0)),
                    autotune_seconds=float(m.get("autotune_seconds", 0.0)),
                    chosen_engine=m.get("chosen_engine"),
                )
            )
            rec.step = info.step + 1
            if info.step % 20 == 0:
                log(f"  step {info.step}/{cfg.total_steps}")

        trainer.add_hook(hook)
        rec.step = 1
        result = trainer.run()
    res = report(cfg, rows, rec.events, wall=result.seconds, build_seconds=build_s)
    res["persistent_cache"] = dict(dir=cfg.compile_cache_dir, **rec.cache)
    return res


def report(
    cfg: TrainerConfig,
    rows: list[dict[str, Any]],
    events: list[CompileEvent],
    *,
    wall: float,
    build_seconds: float,
) -> dict[str, Any]:
    """The per-phase table, the run's totals and the programs compiled (a dict)."""
    first_of: dict[str, int] = {}  # phase -> its first global step
    phase_of: dict[int, str] = {}
    for r in rows:
        first_of.setdefault(r["phase"], r["step"])
        phase_of[r["step"]] = r["phase"]
    xla_steps = {e.step for e in events if e.event == XLA_EVENT}
    phases = []
    for phase, first in first_of.items():
        rs = [r for r in rows if r["phase"] == phase]
        later = [r for r in rs if r["step"] != first]
        phases.append(
            dict(
                phase=phase,
                steps=len(rs),
                step_seconds=sum(r["step_seconds"] for r in rs),
                first_compile_seconds=rs[0]["compile_seconds"],
                first_autotune_seconds=rs[0]["autotune_seconds"],
                later_compile_seconds=sum(r["compile_seconds"] for r in later),
                later_autotune_seconds=sum(r["autotune_seconds"] for r in later),
                # An XLA compile (a program built); a step whose only events are
                # jaxpr-cache hits (a program compiled ahead of time, called for the
                # first time: microseconds) is listed apart.
                later_steps_compiling=[r["step"] for r in later if r["step"] in xla_steps],
                later_steps_trace_only=[
                    r["step"]
                    for r in later
                    if r["compile_seconds"] > 0 and r["step"] not in xla_steps
                ],
                later_steps_tuning=[r["step"] for r in later if r["autotune_seconds"] > 0],
                engines=dict(collections.Counter(str(r["chosen_engine"]) for r in rs)),
            )
        )
    compile_total = sum(r["compile_seconds"] for r in rows)
    tune_total = sum(r["autotune_seconds"] for r in rows)
    programs: dict[str, dict[str, Any]] = {}
    for e in events:
        p = programs.setdefault(e.program, dict(compiles=0, seconds=0.0, steps=[], late=[]))
        p["seconds"] += e.seconds
        if e.event == XLA_EVENT:
            p["compiles"] += 1
            p["steps"].append(e.step)
        phase = phase_of.get(e.step)
        if phase is not None and e.step != first_of[phase] and e.step not in p["late"]:
            p["late"].append(e.step)
    listed = sorted(programs.items(), key=lambda kv: -kv[1]["seconds"])
    late_events = [
        dataclasses.asdict(e)
        for e in events
        if e.step in phase_of and e.step != first_of[phase_of[e.step]]
    ]
    return dict(
        config=dict(
            steps=cfg.steps,
            sft_steps=cfg.sft.steps,
            engine=cfg.algo.engine.value,
            prompts_per_step=cfg.rollout.prompts_per_step,
            group_size=cfg.rollout.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
        ),
        load_avg_1m=load_avg(),
        build_seconds=build_seconds,
        build_compile_seconds=sum(e.seconds for e in events if e.step == 0),
        wall_seconds=wall,
        compile_seconds_total=compile_total,
        autotune_seconds_total=tune_total,
        compile_share=compile_total / wall if wall > 0 else None,
        compile_tune_share_bound=(compile_total + tune_total) / wall if wall > 0 else None,
        phases=phases,
        programs=[dict(program=k, **v) for k, v in listed],
        late_events=late_events,
    )


def format_report(res: dict[str, Any], top: int = 15) -> str:
    c = res["config"]
    lines = [
        f"config: engine {c['engine']}, {c['sft_steps']} SFT + {c['steps']} RL steps, "
        f"{c['prompts_per_step']} prompts x G={c['group_size']}, max_new_tokens "
        f"{c['max_new_tokens']} (1-min load average at the end: {res['load_avg_1m']})",
        "",
        f"{'phase':<6}{'steps':>6}{'step s':>9}{'first: compile s':>18}{'tune s':>8}"
        f"{'later: compile s':>18}{'tune s':>8}  later steps that compiled (XLA) / tuned; "
        "picks",
    ]
    for p in res["phases"]:
        trace_only = (
            f" (jaxpr-cache events only: {p['later_steps_trace_only']})"
            if p["later_steps_trace_only"]
            else ""
        )
        lines.append(
            f"{p['phase']:<6}{p['steps']:>6}{p['step_seconds']:>9.1f}"
            f"{p['first_compile_seconds']:>18.1f}{p['first_autotune_seconds']:>8.1f}"
            f"{p['later_compile_seconds']:>18.4f}{p['later_autotune_seconds']:>8.2f}  "
            f"{p['later_steps_compiling'] or 'none'}{trace_only} / "
            f"{p['later_steps_tuning'] or 'none'}; "
            + ", ".join(f"{k} {v}" for k, v in p["engines"].items())
        )
    wall = res["wall_seconds"]
    lines += [
        "",
        f"run: {wall:.1f} s wall (building the trainer: {res['build_seconds']:.1f} s more, "
        f"{res['build_compile_seconds']:.1f} s of it compiling); compile_seconds_total "
        f"{res['compile_seconds_total']:.1f} s ({100 * res['compile_share']:.1f}% of wall), "
        f"autotune_seconds_total {res['autotune_seconds_total']:.1f} s; compile + tune "
        f"<= {100 * res['compile_tune_share_bound']:.1f}% of wall (they overlap: tuning "
        "compiles the candidates it times)",
        "",
        f"{'program':<40}{'compiles':>9}{'seconds':>9}  steps",
    ]
    progs = res["programs"]
    for p in progs[:top]:
        late = f"  (after the first step of its phase: {p['late']})" if p["late"] else ""
        steps = sorted(set(p["steps"]))
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        name = p["program"][:39]
        lines.append(f"{name:<40}{p['compiles']:>9}{p['seconds']:>9.2f}  {shown}{late}")
    rest = progs[top:]
    if rest:
        lines.append(
            f"{len(rest)} more programs: {sum(p['compiles'] for p in rest)} compiles, "
            f"{sum(p['seconds'] for p in rest):.2f} s"
        )
    pc = res.get("persistent_cache")
    if pc and pc.get("dir"):
        lines += [
            "",
            f"persistent compilation cache {pc['dir']}: {pc.get('hits', 0)} programs read "
            f"back, {pc.get('misses', 0)} compiled and written",
        ]
    late = res["late_events"]
    if late:
        lines += ["", f"compile events after the first step of their phase ({len(late)}):"]
        lines += [
            f"  step {e['step']}: {e['program']} {e['event'].rsplit('/', 1)[-1]} "
            f"{e['seconds'] * 1e3:.1f} ms"
            for e in late[:top]
        ]
    return "\n".join(lines)


__all__ = ["CompileEvent", "CompileRecorder", "format_report", "report", "run"]
