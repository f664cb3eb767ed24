"""Fitting the cost models: non-negative least squares with relative weights, the
fitted coefficients per engine / auto's choice / the rollout, and the saved profile."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.bench.replay import model_config_from_dict, model_config_to_dict
from dtarl.bench.report import write_json
from dtarl.bench.simulate.features import (
    AUTO,
    FEATURE_NAMES,
    ROLLOUT_FEATURE_NAMES,
    RolloutFeatures,
    WorkFeatures,
    engine_default,
)
from dtarl.engines.cost import nnls
from dtarl.model.config import ModelConfig

PROFILE_KIND = "dtarl.trace.cost_profile"


PROFILE_VERSION = 2


def fit_relative(x: np.ndarray, y: Sequence[float]) -> tuple[np.ndarray, float, float]:
    """NNLS of ``x c = y`` with rows weighted by 1 / y (relative error).

    Returns (c, mean |error| %, max |error| %) on the fitted points.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64).reshape(-1)
    if x.ndim != 2 or x.shape[0] != y.shape[0] or y.shape[0] < 1:
        raise ValueError(f"fit: {x.shape[0]} feature rows vs {y.shape[0]} timings")
    if not np.all(y > 0):
        raise ValueError("fit: every measured time must be > 0")
    w = 1.0 / y
    c = nnls(x * w[:, None], y * w)
    ape = np.abs(x @ c - y) / y * 100.0
    return c, float(np.mean(ape)), float(np.max(ape))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineCost:
    """Fitted coefficients of (1) for one engine kind (all >= 0).

    lin_s_per_flop, attn_s_per_flop: seconds per linear / attention FLOP;
    step_s: seconds per engine step (scan iteration); const_s: per call.
    fit_mape / fit_max_ape: mean / max |error| % on the calibration points.
    """

    kind: str
    lin_s_per_flop: float
    attn_s_per_flop: float
    step_s: float
    const_s: float
    fit_mape: float = float("nan")
    fit_max_ape: float = float("nan")

    def __post_init__(self):
        for f in ("lin_s_per_flop", "attn_s_per_flop", "step_s", "const_s"):
            v = getattr(self, f)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"EngineCost({self.kind}).{f}={v}: must be finite and >= 0")

    @property
    def coef(self) -> np.ndarray:
        return np.array([self.lin_s_per_flop, self.attn_s_per_flop, self.step_s, self.const_s])

    def predict(self, f: WorkFeatures, *, flop_divisor: float = 1.0) -> float:
        """Seconds for features ``f``; FLOP terms divided by ``flop_divisor`` (tp x scale)."""
        return (
            (self.lin_s_per_flop * f.lin_flops + self.attn_s_per_flop * f.attn_flops) / flop_divisor
            + self.step_s * f.steps
            + self.const_s
        )

    @classmethod
    def fit(cls, kind: str, features: Sequence[WorkFeatures], seconds: Sequence[float]):
        """Non-negative least squares of (1), relative error (``fit_relative``)."""
        c, mape, mx = fit_relative(np.stack([f.row() for f in features]), seconds)
        return cls(
            kind=kind,
            lin_s_per_flop=float(c[0]),
            attn_s_per_flop=float(c[1]),
            step_s=float(c[2]),
            const_s=float(c[3]),
            fit_mape=mape,
            fit_max_ape=mx,
        )


def _split_known(
    f: WorkFeatures, costs: Mapping[str, EngineCost], flop_divisor: float = 1.0
) -> tuple[WorkFeatures, float]:
    """(f without the sub-programs ``costs`` can price, seconds of those sub-programs).

    A sub-program of a kind in ``costs`` (other than f's own) is priced with its
    own coefficients minus its per-call constant; any other is merged into f.
    """
    rest, keep = 0.0, []
    for x in f.sub:
        if x.program in costs and x.program != f.program:
            c = costs[x.program]
            rest += price(costs, x, flop_divisor=flop_divisor) - c.const_s
        else:
            keep.append(x)
    return dataclasses.replace(f, sub=tuple(keep)).merged(), rest


def price(costs: Mapping[str, EngineCost], f: WorkFeatures, *, flop_divisor: float = 1.0) -> float:
    """Seconds of one engine call with features ``f``: (1) with the coefficients of
    ``f.program``, plus its sub-programs (``WorkFeatures.sub``) at their own."""
    if f.program not in costs:
        raise KeyError(
            f"engine {f.program!r} is not in the cost profile (profiled: {sorted(costs)}); "
            "re-run the calibration with it"
        )
    main, rest = _split_known(f, costs, flop_divisor)
    return costs[f.program].predict(main, flop_divisor=flop_divisor) + rest


def fit_engine_costs(
    points: Mapping[str, Sequence[tuple[WorkFeatures, float]]],
) -> dict[str, EngineCost]:
    """Fits (1) per engine kind from (features, seconds) points.

    Kinds whose points have no sub-programs are fitted first; a point with a
    sub-program of an already fitted kind has that sub-program's predicted time
    subtracted before the fit (``price``). fit_mape / fit_max_ape are relative
    to the whole measured time.
    """
    costs: dict[str, EngineCost] = {}
    order = sorted(points, key=lambda k: any(f.sub for f, _ in points[k]))
    for kind in order:
        pts = list(points[kind])
        split = [_split_known(f, costs) for f, _ in pts]
        ys = np.array([y for _, y in pts], np.float64)
        rest = np.array([r for _, r in split])
        if np.all(ys - rest > 0):
            c = EngineCost.fit(kind, [m for m, _ in split], ys - rest)
        else:  # the sub-programs' prices exceed a measurement: fit everything merged
            split = [(f.merged(), 0.0) for f, _ in pts]
            c = EngineCost.fit(kind, [m for m, _ in split], ys)
        pred = np.array([c.predict(m) + r for m, r in split])
        ape = np.abs(pred - ys) / ys * 100.0
        costs[kind] = dataclasses.replace(
            c, fit_mape=float(ape.mean()), fit_max_ape=float(ape.max())
        )
    return costs


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoCost:
    """(3): auto's extra host time (``AutoEngine.choose`` beyond its pick's own
    ``prepare``): s_per_token x batch tokens + const_s."""

    s_per_token: float
    const_s: float
    fit_mape: float = float("nan")  # mean |error| % (relative to max(extra, 0.1 ms))

    def __post_init__(self):
        for f in ("s_per_token", "const_s"):
            v = getattr(self, f)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"AutoCost.{f}={v}: must be finite and >= 0")

    def predict(self, num_tokens: float) -> float:
        return self.s_per_token * num_tokens + self.const_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCost:
    """Fitted coefficients of (2) (all >= 0): seconds per prefill / decode linear /
    decode attention FLOP, per decode step and per generate call."""

    prefill_s_per_flop: float
    decode_lin_s_per_flop: float
    decode_attn_s_per_flop: float
    decode_step_s: float
    call_s: float
    fit_mape: float = float("nan")
    fit_max_ape: float = float("nan")

    @property
    def coef(self) -> np.ndarray:
        return np.array(
            [
                self.prefill_s_per_flop,
                self.decode_lin_s_per_flop,
                self.decode_attn_s_per_flop,
                self.decode_step_s,
                self.call_s,
            ]
        )

    def __post_init__(self):
        for f in (
            "prefill_s_per_flop",
            "decode_lin_s_per_flop",
            "decode_attn_s_per_flop",
            "decode_step_s",
            "call_s",
        ):
            v = getattr(self, f)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"RolloutCost.{f}={v}: must be finite and >= 0")

    def predict(self, f: RolloutFeatures, *, flop_divisor: float = 1.0) -> float:
        flops = (
            self.prefill_s_per_flop * f.prefill_flops
            + self.decode_lin_s_per_flop * f.decode_lin_flops
            + self.decode_attn_s_per_flop * f.decode_attn_flops
        )
        return flops / flop_divisor + self.decode_step_s * f.decode_steps + self.call_s * f.calls

    @classmethod
    def fit(cls, features: Sequence[RolloutFeatures], seconds: Sequence[float]) -> RolloutCost:
        c, mape, mx = fit_relative(np.stack([f.row() for f in features]), seconds)
        return cls(
            prefill_s_per_flop=float(c[0]),
            decode_lin_s_per_flop=float(c[1]),
            decode_attn_s_per_flop=float(c[2]),
            decode_step_s=float(c[3]),
            call_s=float(c[4]),
            fit_mape=mape,
            fit_max_ape=mx,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationPoint:
    """One timed calibration run: min (fitted) and median of the interleaved rounds."""

    kind: str  # engine kind, "auto_choose" or "rollout"
    name: str
    features: WorkFeatures | RolloutFeatures | None
    measured_s: float
    median_s: float
    background_cores: float | None = None  # other processes during the fastest call
    runs_s: tuple[float, ...] = ()  # every timed call, in round order

    def to_dict(self) -> dict[str, Any]:
        return dict(
            kind=self.kind,
            name=self.name,
            features=None if self.features is None else dataclasses.asdict(self.features),
            measured_s=self.measured_s,
            median_s=self.median_s,
            background_cores=self.background_cores,
            runs_s=list(self.runs_s),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationPoint:
        f = d.get("features")
        if f is not None:
            f = RolloutFeatures(**f) if d["kind"] == "rollout" else WorkFeatures.from_dict(f)
        return cls(
            kind=d["kind"],
            name=d["name"],
            features=f,
            measured_s=float(d["measured_s"]),
            median_s=float(d.get("median_s", d["measured_s"])),
            background_cores=d.get("background_cores"),
            runs_s=tuple(float(x) for x in d.get("runs_s", ())),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostProfile:
    """Per-engine (and rollout) cost models calibrated on one machine.

    model: the config the calibration ran (FLOPs are computed with the config
    passed to ``predict_step``, which defaults to this one).
    chunk_len / microbatch: engine settings the features follow (replay runs the
    engines' defaults, so calibrate with those).
    auto: the choice overhead (3), present when auto was calibrated.
    rollout: (2), present when a sampler was calibrated.
    """

    engines: dict[str, EngineCost]
    model: ModelConfig
    chunk_len: int = dataclasses.field(default_factory=lambda: engine_default("dfs", "chunk_len"))
    microbatch: int = dataclasses.field(
        default_factory=lambda: engine_default("dense", "microbatch")
    )
    auto: AutoCost | None = None
    rollout: RolloutCost | None = None
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    points: tuple[CalibrationPoint, ...] = ()

    @property
    def kinds(self) -> list[str]:
        """Engine kinds this profile can predict (auto when it and its picks are in)."""
        return list(self.engines) + ([AUTO] if self.auto is not None else [])

    def cost(self, kind: str) -> EngineCost:
        if kind not in self.engines:
            raise KeyError(
                f"engine {kind!r} is not in the cost profile (profiled: {sorted(self.engines)}); "
                "re-run the calibration with it"
            )
        return self.engines[kind]

    def to_dict(self) -> dict[str, Any]:
        return dict(
            kind=PROFILE_KIND,
            version=PROFILE_VERSION,
            model=model_config_to_dict(self.model),
            chunk_len=self.chunk_len,
            microbatch=self.microbatch,
            machine=self.machine,
            feature_names=list(FEATURE_NAMES),
            rollout_feature_names=list(ROLLOUT_FEATURE_NAMES),
            engines={k: dataclasses.asdict(c) for k, c in self.engines.items()},
            auto=None if self.auto is None else dataclasses.asdict(self.auto),
            rollout=None if self.rollout is None else dataclasses.asdict(self.rollout),
            points=[p.to_dict() for p in self.points],
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostProfile:
        if d.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a cost profile (kind={d.get('kind')!r}, want {PROFILE_KIND!r})")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"cost profile version {d.get('version')!r}, this dtarl reads {PROFILE_VERSION}; "
                "re-run `dtarl trace simulate --calibrate`"
            )
        return cls(
            engines={k: EngineCost(**c) for k, c in d["engines"].items()},
            model=model_config_from_dict(d["model"]),
            chunk_len=int(d["chunk_len"]),
            microbatch=int(d["microbatch"]),
            auto=None if d.get("auto") is None else AutoCost(**d["auto"]),
            rollout=None if d.get("rollout") is None else RolloutCost(**d["rollout"]),
            machine=dict(d.get("machine", {})),
            points=tuple(CalibrationPoint.from_dict(p) for p in d.get("points", ())),
        )

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostProfile:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"{p}: no cost profile; create one with `dtarl trace simulate --calibrate "
                f"--profile {p}`"
            )
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
