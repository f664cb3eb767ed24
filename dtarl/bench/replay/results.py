"""What a replay returns: its config, per-workload stages, the result's JSON,
table and plot, and reading a saved replay back."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.bench.replay.stages import (
    InferencePhase,
    RewardPhase,
    RolloutPhase,
    ToolClock,
    ToolPhase,
)
from dtarl.bench.replay.suite import WorkloadSpec, jsonable, model_config_to_dict
from dtarl.bench.replay.train_stage import EngineTiming
from dtarl.bench.report import save_figure, write_json
from dtarl.model.config import ModelConfig
from dtarl.timing import TimedRuns

ROLLOUT_ENGINES = ("continuous", "static")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """How to replay: engines, timing protocol, tool clock and the model.

    engines: engine kinds (``make_engine``); "dense" is the speedup baseline.
    repeats / warmup: timed and untimed (compile) calls per engine.
    tool_clock: see ``ToolClock``. tool_time_scale: the factor from the trace's
    production tool seconds to the replay's (tiny model, CPU) seconds, e.g. the
    ratio of the replayed to the production generation time. None (default):
    tool seconds stay production seconds, are reported apart and no end-to-end
    step total is formed (it would add real search latency to tiny-model time).
    tool_latency_source: a multi-turn trace for latencies (None: the default).
    model: the policy (the tiny test model by default); model_seed: its init.
    rollout / rollout_repeats: run the rollout stage (when a sampler exists) and
    how many timed rollouts (min, median) follow its untimed warm-up.
    quiet_cores / quiet_budget_s: time calls when other processes use less than
    this many cores, waiting at most this long in all (``QuietGate``; None: off).
    inference_passes: forward-only logprob passes per step (old / reference
    policy; 0 skips the stage). reward: sample the reward stage from the reward
    timings of the workload's own run (``reward_sampler_for``: production seconds;
    ``tool_time_scale`` converts them too); reward_source: another run to draw them
    from (None: the workload's own; a workload without timings reports none).
    rollout_engine: "continuous" (``RolloutEngine``: each trajectory continues after its
    own tool wait, ``dtarl.bench.replay.engine_rollout``) or "static" (the reference
    ``Sampler``, one generate call per turn: what the simulator's rollout model (2)
    describes, so ``dtarl trace simulate --joint`` replays with it).
    """

    engines: tuple[str, ...] = ("dense", "dfs")
    repeats: int = 5
    warmup: int = 1
    tool_clock: ToolClock = ToolClock.SIMULATED
    tool_time_scale: float | None = None
    tool_latency_source: str | None = None
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    model_seed: int = 0
    rollout: bool = True
    rollout_repeats: int = 3
    quiet_cores: float | None = 0.3
    quiet_budget_s: float = 120.0
    inference_passes: int = 1
    reward: bool = True
    reward_source: str | None = None
    rollout_engine: str = "continuous"

    def __post_init__(self):
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"ReplayConfig.rollout_engine={self.rollout_engine!r}; accepted: "
                f"{list(ROLLOUT_ENGINES)}"
            )
        if self.inference_passes not in (0, 1, 2):
            raise ValueError(
                f"ReplayConfig.inference_passes={self.inference_passes}: must be 0, 1 (old or "
                "reference logprobs) or 2 (both)"
            )
        if self.rollout_repeats < 1:
            raise ValueError(f"ReplayConfig.rollout_repeats={self.rollout_repeats}: must be >= 1")
        if not self.engines:
            raise ValueError("ReplayConfig.engines: empty; give at least one engine kind")
        if self.repeats < 1:
            raise ValueError(f"ReplayConfig.repeats={self.repeats}: must be >= 1")
        if self.warmup < 1:
            raise ValueError(f"ReplayConfig.warmup={self.warmup}: must be >= 1 (it compiles)")
        if self.tool_time_scale is not None and not self.tool_time_scale >= 0:
            raise ValueError(
                f"ReplayConfig.tool_time_scale={self.tool_time_scale}: must be >= 0 or None"
            )
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
    turns_per_trajectory: tuple[int, ...] = ()  # model turns, trajectory order (as tool's)
    inference: InferencePhase = InferencePhase(status="skipped")
    reward: RewardPhase = RewardPhase(status="skipped")

    def speedup(self, kind: str, baseline: str = "dense") -> float | None:
        """Training step-time speedup of ``kind`` over ``baseline`` (None if not run)."""
        if baseline not in self.engines or kind not in self.engines:
            return None
        return self.engines[baseline].step_s / self.engines[kind].step_s

    def trajectory_timelines_s(self) -> tuple[float, ...] | None:
        """Each trajectory's rollout timeline in replay seconds. On the continuous engine:
        its measured finish on the replay clock (``RolloutPhase.trajectory_seconds``: its
        turns interleaved with the other trajectories', its own tool waits between them).
        On the static sampler: its turns' generate calls (the fastest timed rollout's
        seconds of turn k, for k < its turns) plus its own tool calls x
        ``tool.time_scale``, between its turns.

        None unless the rollout ran and the tool stage is in replay seconds.
        """
        if self.rollout.trajectory_seconds and self.tool.time_scale is not None:
            return tuple(self.rollout.trajectory_seconds)
        turn_s = self.rollout.turn_seconds
        if not turn_s or self.tool.time_scale is None or not self.turns_per_trajectory:
            return None
        tools = self.tool.per_trajectory_s or (0.0,) * len(self.turns_per_trajectory)
        if len(tools) != len(self.turns_per_trajectory):
            raise ValueError(
                f"tool.per_trajectory_s has {len(tools)} trajectories but the rollout "
                f"{len(self.turns_per_trajectory)}"
            )
        cum = np.concatenate([[0.0], np.cumsum(turn_s)])
        return tuple(
            float(cum[min(k, len(turn_s))] + self.tool.time_scale * t)
            for k, t in zip(self.turns_per_trajectory, tools, strict=True)
        )

    def rollout_step_s(self) -> float | None:
        """The rollout stage with its tool calls: the slowest trajectory's timeline."""
        tl = self.trajectory_timelines_s()
        return None if tl is None else max(tl)

    def step_s(self, kind: str) -> float | None:
        """End-to-end step in replay seconds: the rollout stage on per-trajectory timelines
        (tools between turns; the scaled tool critical path alone when the rollout did not
        run) + reward + forward-only inference + training. None when the tool or reward
        seconds are production seconds (no ``tool_time_scale``): stages in two unit systems
        are never added."""
        if self.tool.time_scale is None or (
            self.reward.status == "ok" and self.reward.time_scale is None
        ):
            return None
        roll = self.rollout_step_s()
        if roll is None:
            roll = self.tool.seconds
        return (
            roll + self.reward.seconds + (self.inference.seconds or 0.0) + self.engines[kind].step_s
        )

    def stage_seconds(self, kind: str) -> dict[str, tuple[float, str]]:
        """{stage: (seconds, units)} of the stages that ran (train: ``kind``'s median).

        With tools in replay seconds, rollout and tools are one stage, "rollout+tool"
        (the slowest trajectory's timeline); in replay seconds the stages then add up
        to ``step_s``."""
        out = {}
        timeline = self.rollout_step_s()
        if timeline is not None:  # tools overlap other trajectories' turns: one stage
            out["rollout+tool"] = (timeline, "replay s")
        else:
            if self.rollout.seconds is not None:
                out["rollout"] = (self.rollout.seconds, "replay s")
            if self.tool.calls:
                out["tool"] = (self.tool.seconds, self.tool.units)
        if self.reward.status == "ok":
            out["reward"] = (self.reward.seconds, self.reward.units)
        if self.inference.seconds is not None:
            out["inference"] = (self.inference.seconds, "replay s")
        out["train"] = (self.engines[kind].step_s, "replay s")
        return out

    def to_dict(self) -> dict[str, Any]:
        engines = {}
        for k, t in self.engines.items():
            d = dataclasses.asdict(t)
            d["runs_s"] = list(t.runs_s)
            d["tokens_per_s"] = t.tokens_per_s
            d["tree_tokens_per_s"] = self.tree_tokens / t.step_s if t.step_s > 0 else float("nan")
            d["speedup_vs_dense"] = self.speedup(k)
            d["end_to_end_step_s"] = self.step_s(k)  # None: tool in production seconds
            engines[k] = d
        return dict(
            spec=self.spec.to_dict(),
            num_sequences=self.num_sequences,
            dense_tokens=self.dense_tokens,
            tree_tokens=self.tree_tokens,
            ideal_speedup=self.dense_tokens / max(self.tree_tokens, 1),
            max_len=self.max_len,
            stages=dict(
                rollout=dataclasses.asdict(self.rollout),
                tool=dict(dataclasses.asdict(self.tool), units=self.tool.units),
                reward=dict(dataclasses.asdict(self.reward), units=self.reward.units),
                inference=dataclasses.asdict(self.inference),
                rollout_step_s=self.rollout_step_s(),
            ),
            turns_per_trajectory=list(self.turns_per_trajectory),
            engines=engines,
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
            config=jsonable(cfg),
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
        return write_json(path, self.to_dict())

    def table(self) -> str:
        """A plain-text summary: one row per (workload, engine)."""
        wn = max([14] + [len(w.spec.name) + 2 for w in self.workloads])
        head = (
            f"{'workload':<{wn}}{'engine':<14}{'seqs':>5}{'dense':>7}{'tree':>7}"
            f"{'compile_s':>10}{'min_s':>8}{'median_s':>9}{'tok/s':>9}{'speedup':>9}"
            f"{'tool_s':>8}"
        )
        lines = [head]
        for w in self.workloads:
            for k, t in w.engines.items():
                sp = w.speedup(k)
                lines.append(
                    f"{w.spec.name:<{wn}}{k:<14}{w.num_sequences:>5}{w.dense_tokens:>7}"
                    f"{w.tree_tokens:>7}{t.compile_s:>10.2f}{t.step_min_s:>8.3f}{t.step_s:>9.3f}"
                    f"{t.tokens_per_s:>9.0f}{'-' if sp is None else f'{sp:.2f}x':>9}"
                    f"{w.tool.seconds:>8.2f}"
                )
        units = {w.tool.units for w in self.workloads}
        if "production s" in units:
            lines.append(
                "tool_s: production seconds of the trace's search calls (no tool_time_scale), "
                "reported apart: no end-to-end step total"
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
        return save_figure(fig, path, dpi=110)


def plot_stages(results: list[ReplayResult] | ReplayResult, path, *, kind: str = "dense"):
    """PNG of each replayed workload's per-stage time share (the paper's stage-share figure).

    One stacked bar per workload (every workload of every result, e.g. a sweep):
    rollout, inference and train (replay seconds); tool and reward join the bar
    only when scaled into replay seconds, else they get their own panel in
    production seconds (never stacked with the tiny model's stages).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [results] if isinstance(results, ReplayResult) else list(results)
    ws = [w for r in res for w in r.workloads if kind in w.engines]
    if not ws:
        raise ValueError(f"plot_stages: no replayed workload has engine {kind!r}")
    order = ("rollout+tool", "rollout", "tool", "reward", "inference", "train")
    stages = [w.stage_seconds(kind) for w in ws]
    same = [{k: v for k, (v, u) in st.items() if u == "replay s"} for st in stages]
    prod = [{k: v for k, (v, u) in st.items() if u == "production s"} for st in stages]
    has_prod = any(prod)
    fig, axes = plt.subplots(1, 2 if has_prod else 1, figsize=(12 if has_prod else 7, 4.5))
    axes = np.atleast_1d(axes)
    x = np.arange(len(ws))
    names = [f"{w.spec.name} b{w.spec.batch_size}" for w in ws]
    bottom = np.zeros(len(ws))
    for st in order:
        v = np.array([s.get(st, 0.0) for s in same])
        tot = np.array([max(sum(s.values()), 1e-12) for s in same])
        if v.any():
            axes[0].bar(x, v / tot, bottom=bottom, label=st)
            bottom += v / tot
    axes[0].set_ylabel("share of the step (replay seconds)")
    axes[0].set_title(f"replay stage shares ({kind})")
    if has_prod:
        for j, st in enumerate(("tool", "reward")):
            v = [p.get(st, np.nan) for p in prod]
            axes[1].bar(x + 0.4 * j, v, 0.4, label=f"{st} (production s)")
        axes[1].set_ylabel("seconds (production: the trace's real latencies)")
        axes[1].set_title("stages replayed from production timings")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


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
