"""Validation: the simulator's predictions against a saved replay, per workload,
stage and engine (relative error vs the replay's minimum and median)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.bench.replay import (
    ToolClock,
    WorkloadSpec,
    default_tool_sampler,
    model_config_from_dict,
    tool_phase,
)
from dtarl.bench.report import save_figure
from dtarl.bench.simulate.features import AUTO
from dtarl.bench.simulate.fit import CostProfile
from dtarl.bench.simulate.predict import predict_inference, predict_rollout, predict_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationRow:
    """One predicted number against the replay's minimum and median.

    stage: "train" (per engine), "rollout", "tool" or "step" (rollout + tool +
    train, per engine). note: e.g. auto's predicted vs replayed pick.
    """

    workload: str
    stage: str
    engine: str
    measured_s: float  # the replay's minimum over its timed runs
    measured_median_s: float
    predicted_s: float
    note: str = ""
    background_cores: float | None = None  # other processes during the fastest replay call

    @property
    def rel_error(self) -> float:
        """|pred - measured| / measured, against the minimum."""
        return abs(self.predicted_s - self.measured_s) / self.measured_s

    @property
    def rel_error_median(self) -> float:
        return abs(self.predicted_s - self.measured_median_s) / self.measured_median_s

    @property
    def abs_pct_error(self) -> float:
        return self.rel_error * 100.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationReport:
    """Predicted vs measured stage times (single device, this machine)."""

    rows: tuple[ValidationRow, ...]
    target: float = 0.10
    quiet_cores: float = 0.3  # background above this marks a contended measurement
    profile_contended: int = 0  # calibration points timed with background >= quiet_cores
    profile_points: int = 0

    @property
    def contended_rows(self) -> list[ValidationRow]:
        """Train/rollout rows whose fastest replay call ran with background >= quiet_cores."""
        return [
            r
            for r in self._rows_for(("train", "rollout"))
            if r.background_cores is not None and r.background_cores >= self.quiet_cores
        ]

    def warnings(self) -> list[str]:
        """Why the errors may include the machine's drift rather than the model's."""
        out = []
        n = len(self.contended_rows)
        if n:
            out.append(
                f"{n} of {len(self._rows_for(('train', 'rollout')))} replay measurements ran "
                f"with other processes on >= {self.quiet_cores} cores (bg column): a busy "
                "neighbouring core slows calls up to 2x; replay on a quiet machine or use --joint"
            )
        if self.profile_contended:
            out.append(
                f"{self.profile_contended} of {self.profile_points} calibration points ran with "
                f"other processes on >= {self.quiet_cores} cores: re-calibrate when quiet or use "
                "--joint"
            )
        return out

    def _groups(self) -> dict[str, list[ValidationRow]]:
        out: dict[str, list[ValidationRow]] = {}
        for r in self.rows:
            out.setdefault(f"{r.stage}/{r.engine}" if r.engine else r.stage, []).append(r)
        return out

    def _rows_for(self, stages: Sequence[str]) -> list[ValidationRow]:
        return [r for r in self.rows if r.stage in stages]

    @property
    def mean_abs_pct_error(self) -> float:
        """Mean |error| % of the train and rollout rows against the replay's minimum."""
        rs = self._rows_for(("train", "rollout"))
        return float(np.mean([r.abs_pct_error for r in rs])) if rs else float("nan")

    def summary(self) -> dict[str, dict[str, float]]:
        """Per stage/engine: mean and max |error| % (vs min and vs median), count."""
        out = {}
        for key, rs in self._groups().items():
            e = np.array([r.rel_error for r in rs]) * 100.0
            em = np.array([r.rel_error_median for r in rs]) * 100.0
            out[key] = dict(
                n=len(rs),
                mean_pct=float(e.mean()),
                max_pct=float(e.max()),
                mean_pct_vs_median=float(em.mean()),
                max_pct_vs_median=float(em.max()),
            )
        return out

    def per_engine(self) -> dict[str, float]:
        """Mean |error| % of the train rows per engine (vs the minimum)."""
        return {
            k.split("/", 1)[1]: v["mean_pct"]
            for k, v in self.summary().items()
            if k.startswith("train/")
        }

    def within_target(self) -> bool:
        """Every train and rollout row within ``target`` (vs the minimum)."""
        return all(r.rel_error <= self.target for r in self._rows_for(("train", "rollout")))

    def to_dict(self) -> dict[str, Any]:
        return dict(
            kind="dtarl.trace.simulate.validation",
            metric=(
                "rel_error = |predicted - measured| / measured, measured = the replay's minimum "
                "over its interleaved timed rounds (rel_error_median: against the median); "
                "train = host prepare + device per engine; rollout = generate calls; tool = "
                "simulated clock (same sampled latencies: a consistency check, not a model test)"
            ),
            target=self.target,
            within_target=self.within_target(),
            warnings=self.warnings(),
            rows=[
                dict(
                    dataclasses.asdict(r),
                    rel_error=r.rel_error,
                    rel_error_median=r.rel_error_median,
                )
                for r in self.rows
            ],
            summary=self.summary(),
            mean_abs_pct_error=self.mean_abs_pct_error,
            per_engine_mean_abs_pct_error=self.per_engine(),
        )

    def table(self) -> str:
        lines = [
            f"{'workload':<14}{'stage':<9}{'engine':<14}{'min_s':>9}{'median_s':>10}"
            f"{'pred_s':>9}{'err%':>7}{'err%med':>8}{'bg':>6}  note"
        ]
        for r in self.rows:
            bg = "-" if r.background_cores is None else f"{r.background_cores:.2f}"
            lines.append(
                f"{r.workload:<14}{r.stage:<9}{r.engine:<14}{r.measured_s:>9.4f}"
                f"{r.measured_median_s:>10.4f}{r.predicted_s:>9.4f}{r.abs_pct_error:>7.1f}"
                f"{r.rel_error_median * 100:>8.1f}{bg:>6}  {r.note}"
            )
        lines.append("")
        lines.append(f"{'stage/engine':<24}{'n':>3}{'mean%':>8}{'max%':>8}{'mean%med':>10}")
        for k, v in self.summary().items():
            lines.append(
                f"{k:<24}{v['n']:>3}{v['mean_pct']:>8.1f}{v['max_pct']:>8.1f}"
                f"{v['mean_pct_vs_median']:>10.1f}"
            )
        ok = "yes" if self.within_target() else "NO"
        lines.append(
            f"train+rollout mean |error| {self.mean_abs_pct_error:.1f}% (vs min); every row "
            f"within {self.target:.0%}: {ok}"
        )
        lines += [f"WARNING: {w}" for w in self.warnings()]
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self._rows_for(("train", "rollout"))
        fig, ax = plt.subplots(figsize=(5, 4.5))
        for k, rs in self._groups().items():
            if rs[0].stage not in ("train", "rollout"):
                continue
            ax.scatter([r.measured_s for r in rs], [r.predicted_s for r in rs], label=k)
        hi = max(max(r.measured_s, r.predicted_s) for r in rows) * 1.1
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.fill_between(
            [0, hi], [0, hi * (1 - self.target)], [0, hi * (1 + self.target)], alpha=0.1
        )
        ax.set_xlabel("measured (s, min over replay rounds)")
        ax.set_ylabel("predicted (s)")
        ax.set_title(f"simulator vs replay: mean |err| {self.mean_abs_pct_error:.1f}%")
        ax.legend(fontsize=7)
        return save_figure(fig, path, dpi=110)


def _fastest_background(timed: dict) -> float | None:
    """The background cores measured during the fastest of ``timed``'s runs (None: not
    recorded)."""
    if timed.get("background_cores") and timed.get("runs_s"):
        return timed["background_cores"][int(np.argmin(timed["runs_s"]))]
    return None


def validate(
    profile: CostProfile,
    replay_json: dict[str, Any],
    *,
    engines: Sequence[str] | None = None,
    target: float = 0.10,
    quiet_cores: float = 0.3,
) -> ValidationReport:
    """Predicts every stage of every workload of a replay JSON and compares.

    Train rows: every (workload, engine) the replay ran and the profile prices.
    Rollout rows: when the replay ran the rollout and the profile has (2).
    Tool rows: the simulated clock (when it ran with latencies). Step rows:
    rollout + tool + train per engine, when the rollout row exists. Measurements
    (replay or calibration) whose fastest call ran with other processes on >=
    ``quiet_cores`` cores are counted in ``ValidationReport.warnings``.
    The replay must have used the profile's model config, which is checked.
    """
    try:
        rcfg = model_config_from_dict(replay_json["config"]["model"])
        workloads = replay_json["workloads"]
    except KeyError as e:
        raise ValueError(
            f"replay JSON: missing field {e}; pass a `dtarl trace replay` JSON"
        ) from None
    if rcfg != profile.model:
        raise ValueError(
            "the replay ran a different model than the profile calibrated; re-run one of them "
            "with the same model config"
        )
    scale = replay_json["config"].get("tool_time_scale")  # None: production seconds
    scale = None if scale is None else float(scale)
    rows = []
    for w in workloads:
        spec = WorkloadSpec.from_dict(w["spec"])
        kinds = [k for k in w["engines"] if engines is None or k in engines]
        kinds = [k for k in kinds if k in profile.kinds]
        wl = spec.build(vocab_size=rcfg.vocab_size)
        pred = predict_step(wl, profile, engines=kinds)
        for k in kinds:
            e = w["engines"][k]
            note = ""
            if k == AUTO:
                ran = (e.get("stats") or {}).get("chosen_engine")
                note = f"picks {pred.engines[k].program} (replay: {ran})"
            bg = _fastest_background(e)
            rows.append(
                ValidationRow(
                    workload=spec.name,
                    stage="train",
                    engine=k,
                    measured_s=float(e.get("step_min_s", e["step_s"])),
                    measured_median_s=float(e["step_s"]),
                    predicted_s=pred.engines[k].train_s,
                    note=note,
                    background_cores=bg,
                )
            )
        stages = w.get("stages", {})
        tool = stages.get("tool", {})
        tool_pred = None
        if tool.get("status") == "ok":
            t = tool_phase(
                wl,
                default_tool_sampler(
                    replay_json["config"].get("tool_latency_source") or spec.source, wl.info.step
                ),
                clock=ToolClock.SIMULATED,
                time_scale=scale,
                seed=spec.seed,
            )
            tool_pred = t.seconds
            rows.append(
                ValidationRow(
                    workload=spec.name,
                    stage="tool",
                    engine="",
                    measured_s=float(tool["seconds"]),
                    measured_median_s=float(tool["seconds"]),
                    predicted_s=tool_pred,
                    note=f"{tool.get('clock')} clock; same sampled latencies",
                )
            )
        inf = stages.get("inference") or {}
        if inf.get("seconds") is not None and "dense" in profile.kinds:
            ip = predict_inference(wl, profile, passes=int(inf["passes"]), model=rcfg)
            rows.append(
                ValidationRow(
                    workload=spec.name,
                    stage="inference",
                    engine="",
                    measured_s=float(inf.get("min_seconds") or inf["seconds"]),
                    measured_median_s=float(inf["seconds"]),
                    predicted_s=ip,
                    note=f"{inf['passes']} forward pass(es), dense coefficients",
                )
            )
        roll = stages.get("rollout", {})
        rp = predict_rollout(wl, profile, model=rcfg)
        if (roll.get("detail") or {}).get("engine") == "continuous":
            rp = None  # (2) models the static sampler's calls, not the continuous engine
        if roll.get("seconds") is not None and rp is not None:  # rollout row; step rows below
            mn = float(roll.get("min_seconds") or roll["seconds"])
            detail = roll.get("detail") or {}
            bg = _fastest_background(detail)
            rows.append(
                ValidationRow(
                    workload=spec.name,
                    stage="rollout",
                    engine="",
                    measured_s=mn,
                    measured_median_s=float(roll["seconds"]),
                    predicted_s=rp[0],
                    note=f"{int(rp[1].calls)} calls",
                    background_cores=bg,
                )
            )
            t_meas = float(tool.get("seconds", 0.0)) if tool_pred is not None else 0.0
            # A step total only in one unit system (tool seconds scaled into the replay's);
            # both sides compose rollout + tool critical path + train (a serial bound).
            for k in kinds if scale is not None or tool_pred is None else ():
                e = w["engines"][k]
                rows.append(
                    ValidationRow(
                        workload=spec.name,
                        stage="step",
                        engine=k,
                        measured_s=mn + t_meas + float(e.get("step_min_s", e["step_s"])),
                        measured_median_s=float(roll["seconds"]) + t_meas + float(e["step_s"]),
                        predicted_s=rp[0] + (tool_pred or 0.0) + pred.engines[k].train_s,
                        note="rollout + tool critical path + train",
                    )
                )
    if not any(r.stage == "train" for r in rows):
        raise ValueError(
            f"no (workload, engine) pair of the replay is in the profile (profiled: "
            f"{profile.kinds}); calibrate the replay's engines"
        )
    timed = [p for p in profile.points if p.background_cores is not None]
    return ValidationReport(
        rows=tuple(rows),
        target=target,
        quiet_cores=quiet_cores,
        profile_contended=sum(p.background_cores >= quiet_cores for p in timed),
        profile_points=len(timed),
    )
