"""Step-time simulator: predict a workload's RL step on a described cluster, without running it.

A replayed step (``dtarl.bench.replay``) has three stages; each has a model here:

  train    per engine, the linear cost model (1) over the features of the program
           the engine would compile for the batch;
  rollout  the linear cost model (2) over the sampler's generate calls (one per turn);
  tool     the critical path of the workload's sampled tool latencies on the
           simulated clock (seeded like the replay; nothing is fitted).

Train cost model. For engine e the training step time of a batch is

    t_e = a_e F_lin + b_e F_attn + c_e n_steps + d_e                         (1)

The features are read off the engine's own host-side preparation: a fresh engine
of kind e on a shape-only model (``nnx.eval_shape``, no weights) runs
``prepare(batch)`` (prefix tree, plan, padding to its shape buckets) and the
padded arrays it would hand to the device are counted, so the features follow
the engines' bucketing and planning as they change; nothing is mirrored here.
With f0 = ``cfg.flops_per_token(0)`` (linear layers + LM head, forward) and
fa = FLOPs per attended key (``cfg.flops_per_token(1) - f0``); backward = 2x:

  dense         M microbatches of B rows of T tokens (static (M, B, T)):
                F_lin = k M B T f0, F_attn = k M B T^2 fa, n_steps = M
                (k = 3; 4 for dense_remat)
  dfs           plan steps t (chunk C) with op in {PUSH, POP, POP_ROWS, NOOP},
                each running r_t rows of C (r = 1; the plan's rows for POP_ROWS;
                0 for NOOP) against the stack prefix bucket p_t plus the chunk:
                F_lin = C f0 sum_t w_t r_t, F_attn = C fa sum_t w_t r_t (p_t + C),
                w = 1 (PUSH), 3 (POP*: recompute + backward); n_steps = padded steps
  prefix_reuse  G groups of a P-token prefix and M x B suffix rows of C tokens:
                F_lin = f0 (k_p G P + 3 G M B C),
                F_attn = fa (k_p G P^2 + 3 G M B C (P + C)), n_steps = G (M + 1)
                (k_p = 4 with ``PrefixActivations.REMAT``, else 3); groups with
                forks below the top level go to a DFS program inside the same
                call, a sub-program priced with the dfs coefficients minus their
                per-call constant (``StepFeatures.sub``, ``price``)
  auto          the program of the engine ``AutoEngine.choose`` picks (with auto's
                own settings), priced with *that* engine's coefficients, plus the
                host time of the choice beyond the pick's own ``prepare`` (auto
                prepares every candidate to choose): t_choose = h_tok N + h_0  (3)

Rollout cost model. The replay's rollout runs one ``Sampler.generate`` per turn
on one sampler whose buckets only grow, so after its warm-up every timed call
runs the largest buckets of the rollout: Q prompts padded to P tokens, R rows
with a cache of S = P + R_len positions. A call whose longest forced length is
n runs the prefill once and n - 1 decode steps:

    t_roll = sum_calls a F_prefill + b F_dec_lin + c F_dec_attn + e n_decode + g   (2)

with F_prefill = Q P (f0 + fa P), F_dec_lin = R (n - 1) f0 (every row runs every
step, finished or not), F_dec_attn = R (n - 1) S fa (each step reads the whole
cache) and n_decode = n - 1 (``rollout_features`` mirrors ``Sampler.init``'s
buckets).

Fitting. Every coefficient is >= 0, fitted by non-negative least squares with
each row weighted by 1 / t (relative error), on synthetic calibration batches
(``calibration_batches``, ``calibration_rollouts``) that are *not* trace
workloads but span the replay suite's regime: 4-48 sequences up to ~256 tokens,
GRPO groups with short and long prompts, and per-turn multi-turn trees; when
auto is calibrated, dfs is also timed at auto's chunk length on every other
batch, so its one fit covers both programs. Kinds without sub-programs are
fitted first, so a sub-program's time can be taken
out of its host's measurements (``fit_engine_costs``). Timing follows the
replay's protocol, which is what makes the two comparable on a shared machine:
every (engine, batch) is compiled first, then timed in interleaved rounds, each
call held until other processes are quiet (``replay.QuietGate``,
``replay.interleaved_rounds``), and the minimum is fitted (the median and the
background load of the fastest call are kept alongside).

Cluster (``ClusterSpec``). The batch is partitioned over ``dp`` ranks
(``dtarl.parallel.partition``); a rank's compute time is (1) with the FLOP terms
divided by tp x throughput_scale; tensor parallelism adds 4 L all-reduces of
the [tokens, hidden] activations per step (2 forward, 2 backward); the step adds
one ring all-reduce of the fp32 gradient (2 (dp-1)/dp x bytes / bandwidth +
2 (dp-1) latency). Predicted train time = max over ranks + all-reduce. The
rollout's samples are split evenly over the dp ranks (its FLOP terms divided
by tp x throughput_scale; no tp traffic is modelled for generation).

Validation (``validate``) regenerates the workloads of a ``replay`` JSON,
predicts every stage with a profile, and reports |pred - measured| / measured
per (workload, stage, engine) against both the replay's minimum and median.
A profile made minutes before the replay carries the machine's drift in
between (on a small shared machine: tens of percent) into that error;
``calibrate_and_replay`` (``dtarl trace simulate --joint``) times the
calibration inside the replay's own rounds, so the error it reports is the
model's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.batch import RolloutBatch
from dtarl.bench.replay import (
    RolloutCall,
    TimingJob,
    ToolClock,
    WorkloadSpec,
    default_tool_sampler,
    machine_info,
    model_config_from_dict,
    model_config_to_dict,
    rollout_calls,
    time_engines,
    tool_phase,
)
from dtarl.model.config import ModelConfig
from dtarl.traces.workload import Workload

PROFILE_KIND = "dtarl.trace.cost_profile"
PROFILE_VERSION = 2
FEATURE_NAMES = ("lin_flops", "attn_flops", "steps", "const")
ROLLOUT_FEATURE_NAMES = (
    "prefill_flops",
    "decode_lin_flops",
    "decode_attn_flops",
    "decode_steps",
    "calls",
)
TRAIN_KINDS = ("dense", "dense_remat", "dfs", "prefix_reuse")
AUTO = "auto"


# ----------------------------------------------------------------------------- features


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepFeatures:
    """The structure of one engine call that the cost model prices (see module doc).

    tokens: token positions computed per pass (padding included), for TP traffic.
    program: the engine kind whose program runs ("dfs" ... ; for auto, its pick).
    sub: programs of other kinds run inside the same call (prefix_reuse hands
    deep groups to a DFS program); each is priced with its own kind's
    coefficients, without their per-call constant (``price``).
    """

    lin_flops: float
    attn_flops: float
    steps: float
    tokens: float
    program: str = ""
    sub: tuple[StepFeatures, ...] = ()

    def row(self) -> np.ndarray:
        """[4] regressors of (1): (F_lin, F_attn, n_steps, 1)."""
        return np.array([self.lin_flops, self.attn_flops, self.steps, 1.0])

    @property
    def total_tokens(self) -> float:
        return self.tokens + sum(x.total_tokens for x in self.sub)

    @property
    def total_steps(self) -> float:
        return self.steps + sum(x.total_steps for x in self.sub)

    def merged(self) -> StepFeatures:
        """One row with every sub-program's features added in (no sub left)."""
        if not self.sub:
            return self
        subs = [x.merged() for x in self.sub]
        return StepFeatures(
            lin_flops=self.lin_flops + sum(x.lin_flops for x in subs),
            attn_flops=self.attn_flops + sum(x.attn_flops for x in subs),
            steps=self.steps + sum(x.steps for x in subs),
            tokens=self.tokens + sum(x.tokens for x in subs),
            program=self.program,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepFeatures:
        d = dict(d)
        d["sub"] = tuple(cls.from_dict(x) for x in d.get("sub", ()))
        return cls(**d)


def _f0_fatt(cfg: ModelConfig) -> tuple[float, float]:
    """(forward FLOPs of a token at context 0, attention FLOPs per context token)."""
    f0 = cfg.flops_per_token(0.0)
    return f0, cfg.flops_per_token(1.0) - f0


@functools.lru_cache(maxsize=8)
def _shape_model(cfg: ModelConfig):
    """The decoder with abstract (shape-only) parameters: engines can ``prepare``."""
    from flax import nnx

    from dtarl.model import init_model

    return nnx.eval_shape(lambda: init_model(cfg, 0))


@functools.lru_cache(maxsize=1)
def _loss():
    from dtarl.losses import ClippedSurrogateLoss

    return ClippedSurrogateLoss.grpo()


def engine_default(kind: str, field: str):
    """The default of an engine setting (``chunk_len`` of dfs, ``microbatch``...);
    auto's dfs ``chunk_len`` is the dfs default (its candidates share EngineConfig)."""
    from dtarl.engines.config import AutoConfig, DenseConfig, DFSConfig, PrefixReuseConfig

    cls = {"dfs": DFSConfig, "prefix_reuse": PrefixReuseConfig, AUTO: AutoConfig}.get(
        kind, DenseConfig
    )
    if kind == AUTO and field == "chunk_len":
        cls = DFSConfig
    for f in dataclasses.fields(cls):
        if f.name == field:
            return f.default
    raise KeyError(f"{cls.__name__} has no field {field!r}")


def engine_kwargs(kind: str, *, chunk_len: int | None, microbatch: int | None) -> dict[str, Any]:
    """``make_engine`` keywords for ``kind`` (auto keeps its own defaults, as in replay)."""
    kw: dict[str, Any] = {}
    if kind == "dfs" and chunk_len is not None:
        kw["chunk_len"] = chunk_len
    if kind in ("dense", "dense_remat", "prefix_reuse") and microbatch is not None:
        kw["microbatch"] = microbatch
    return kw


def _check_kind(kind: str) -> str:
    kind = str(getattr(kind, "value", kind))
    if kind not in (*TRAIN_KINDS, AUTO):
        raise ValueError(f"engine {kind!r} is not known; accepted: {[*TRAIN_KINDS, AUTO]}")
    return kind


def prepared_features(engine, prepared, cfg: ModelConfig) -> StepFeatures:
    """Features (1) of a ``Prepared`` batch of ``engine`` (module docstring)."""
    from dtarl.engines import AutoEngine, DenseEngine, DFSEngine, PrefixReuseEngine
    from dtarl.engines.config import PrefixActivations
    from dtarl.tree.plan import Op

    f0, fa = _f0_fatt(cfg)
    if isinstance(engine, AutoEngine):
        kind, _ = prepared.static
        _, inner = prepared.host
        return prepared_features(engine.engines[kind], inner, cfg)
    if isinstance(engine, DenseEngine):
        n_mb = int(prepared.static[0])
        rows, t = np.asarray(prepared.args[0]).shape  # tokens [M B, T]
        tok = float(rows * t)
        k = 4.0 if engine.config.remat else 3.0
        return StepFeatures(
            lin_flops=k * tok * f0,
            attn_flops=k * tok * t * fa,
            steps=float(n_mb),
            tokens=tok,
            program=engine.name,
        )
    if isinstance(engine, DFSEngine):
        # static = (path_len, tree_size, prefix_sizes[, rows[, wide]]); a step's
        # entries are rows * max(wide, 1) chunks of C: POP_ROWS steps run ``rows``
        # chunks, POP_WIDE steps ``rows * wide`` chunks, PUSH/POP the first chunk.
        steps, static = prepared.args[0], prepared.static
        sizes = np.asarray(static[2], np.float64)
        n_rows = int(static[3]) if len(static) > 3 else 1
        n_wide = int(static[4]) if len(static) > 4 else 0
        op = np.asarray(steps.op)
        c = int(np.asarray(steps.inputs).shape[1]) // (n_rows * max(n_wide, 1))
        width = np.where(op == Op.NOOP, 0.0, 1.0)
        width = np.where(op == Op.POP_ROWS, float(n_rows), width)
        width = np.where(op == Op.POP_WIDE, float(n_rows * n_wide), width)
        w = np.where(op == Op.PUSH, 1.0, 3.0) * width  # forward / recompute + backward
        # Every entry attends its prefix bucket and its whole row (W chunks wide).
        ctx = sizes[np.asarray(steps.pbucket)] + np.where(op == Op.POP_WIDE, c * n_wide, c)
        return StepFeatures(
            lin_flops=float(c * f0 * w.sum()),
            attn_flops=float(c * fa * (w * ctx).sum()),
            steps=float(op.shape[0]),
            tokens=float(c * width.sum()),
            program="dfs",
        )
    if isinstance(engine, PrefixReuseEngine):
        if prepared.static and prepared.static[0] == "split":
            # Shallow groups as rows, deep groups through the engine's DFS program:
            # host = ("split", n, ix_rows, rows Prepared, ix_dfs, dfs Prepared).
            p_rows, p_dfs = prepared.host[3], prepared.host[5]
            rows_f = prepared_features(engine, p_rows, cfg)
            dfs_f = prepared_features(engine.dfs, p_dfs, cfg)
            return dataclasses.replace(rows_f, sub=(dfs_f,))
        groups, rows = prepared.args[0], prepared.args[1]
        g, p = np.asarray(groups.inputs).shape  # [G, P]
        _, n_mb, mb, c = np.asarray(rows.inputs).shape  # [G, M, B, C]
        kp = 4.0 if engine.config.prefix_activations is PrefixActivations.REMAT else 3.0
        pre, suf = float(g * p), float(g * n_mb * mb * c)
        return StepFeatures(
            lin_flops=f0 * (kp * pre + 3.0 * suf),
            attn_flops=fa * (kp * pre * p + 3.0 * suf * (p + c)),
            steps=float(g * (n_mb + 1)),
            tokens=pre + suf,
            program="prefix_reuse",
        )
    raise TypeError(f"no feature rule for {type(engine).__name__}; known: {TRAIN_KINDS}, auto")


def feature_engine(kind: str, cfg: ModelConfig, *, chunk_len=None, microbatch=None):
    """A fresh engine of ``kind`` on the shape-only model (host-side ``prepare`` only)."""
    from dtarl.engines import make_engine

    kind = _check_kind(kind)
    return make_engine(
        kind, _shape_model(cfg), **engine_kwargs(kind, chunk_len=chunk_len, microbatch=microbatch)
    )


def engine_features(
    kind: str,
    batch: RolloutBatch,
    cfg: ModelConfig,
    *,
    chunk_len: int | None = None,
    microbatch: int | None = None,
) -> StepFeatures:
    """Features (1) of ``batch`` for a fresh engine of ``kind``: its own ``prepare``, no device.

    ``chunk_len`` / ``microbatch`` default to the engines' own defaults (auto
    always uses its own, like ``make_engine("auto")`` in the replay).
    """
    engine = feature_engine(kind, cfg, chunk_len=chunk_len, microbatch=microbatch)
    return prepared_features(engine, engine.prepare(batch, _loss()), cfg)


# ----------------------------------------------------------------------------- rollout features


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutFeatures:
    """Features (2) of a rollout: sums over its generate calls (module docstring).

    generated: tokens generated (for reporting).
    """

    prefill_flops: float
    decode_lin_flops: float
    decode_attn_flops: float
    decode_steps: float
    calls: float
    generated: float = 0.0

    def row(self) -> np.ndarray:
        """[5] regressors of (2)."""
        return np.array(
            [
                self.prefill_flops,
                self.decode_lin_flops,
                self.decode_attn_flops,
                self.decode_steps,
                self.calls,
            ]
        )


def _sampler_minimums() -> dict[str, int]:
    """The sampler's initial bucket minimums (read from a shape-only instance)."""
    from dtarl.bench.replay import find_forced_length_sampler

    found = find_forced_length_sampler()
    if found is None:
        return dict(prompts=1, rows=1, prompt_len=8, response=8)
    sampler_cls, params_cls = found
    s = sampler_cls(_shape_model(ModelConfig.tiny()), params_cls())
    return dict(getattr(s, "_min", dict(prompts=1, rows=1, prompt_len=8, response=8)))


def rollout_features(calls: Sequence[RolloutCall], cfg: ModelConfig, *, dp: int = 1):
    """Features (2) of a replayed rollout (``replay.rollout_calls``) on one sampler.

    The timed rollout runs after a warm-up, so every call uses the largest
    buckets (powers of two, ``Sampler.init``) over all calls. With ``dp`` > 1 each
    rank generates ceil(1/dp) of every call's prompts and rows.
    """
    from dtarl.tree.plan import bucket

    if not calls:
        return RolloutFeatures(
            prefill_flops=0.0,
            decode_lin_flops=0.0,
            decode_attn_flops=0.0,
            decode_steps=0.0,
            calls=0.0,
        )
    if dp < 1:
        raise ValueError(f"dp={dp}: must be >= 1")
    mins = _sampler_minimums()
    q = bucket(max(-(-len(c.prompts) // dp) for c in calls), mins["prompts"])
    rows = bucket(max(-(-len(c.forced) // dp) for c in calls), mins["rows"])
    p = bucket(max(len(x) for c in calls for x in c.prompts), mins["prompt_len"])
    r = bucket(max(max(c.forced) for c in calls), mins["response"])
    f0, fa = _f0_fatt(cfg)
    steps = np.array([max(c.forced) - 1 for c in calls], np.float64)
    return RolloutFeatures(
        prefill_flops=float(len(calls) * q * p * (f0 + fa * p)),
        decode_lin_flops=float(rows * steps.sum() * f0),
        decode_attn_flops=float(rows * steps.sum() * fa * (p + r)),
        decode_steps=float(steps.sum()),
        calls=float(len(calls)),
        generated=float(sum(sum(c.forced) for c in calls)),
    )


# ----------------------------------------------------------------------------- fitting


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||x c - y||_2 subject to c >= 0, exactly, by enumerating active sets (<= 6 cols).

    Columns are scaled to unit norm first so FLOP-sized and O(1) regressors mix.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64).reshape(-1)
    m, k = x.shape
    if k > 6:
        raise ValueError(f"nnls: {k} columns; this exact solver handles at most 6")
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_r = np.zeros(k), float(y @ y)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        c, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if np.any(c < 0):
            continue
        r = float(np.sum((xs[:, cols] @ c - y) ** 2))
        if r < best_r - 1e-15 * max(best_r, 1e-300):
            best_r = r
            best = np.zeros(k)
            best[cols] = c
    return best / scale


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

    def predict(self, f: StepFeatures, *, flop_divisor: float = 1.0) -> float:
        """Seconds for features ``f``; FLOP terms divided by ``flop_divisor`` (tp x scale)."""
        return (
            (self.lin_s_per_flop * f.lin_flops + self.attn_s_per_flop * f.attn_flops) / flop_divisor
            + self.step_s * f.steps
            + self.const_s
        )

    @classmethod
    def fit(cls, kind: str, features: Sequence[StepFeatures], seconds: Sequence[float]):
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
    f: StepFeatures, costs: Mapping[str, EngineCost], flop_divisor: float = 1.0
) -> tuple[StepFeatures, float]:
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


def price(costs: Mapping[str, EngineCost], f: StepFeatures, *, flop_divisor: float = 1.0) -> float:
    """Seconds of one engine call with features ``f``: (1) with the coefficients of
    ``f.program``, plus its sub-programs (``StepFeatures.sub``) at their own."""
    if f.program not in costs:
        raise KeyError(
            f"engine {f.program!r} is not in the cost profile (profiled: {sorted(costs)}); "
            "re-run the calibration with it"
        )
    main, rest = _split_known(f, costs, flop_divisor)
    return costs[f.program].predict(main, flop_divisor=flop_divisor) + rest


def fit_engine_costs(
    points: Mapping[str, Sequence[tuple[StepFeatures, float]]],
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
    features: StepFeatures | RolloutFeatures | None
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
            f = RolloutFeatures(**f) if d["kind"] == "rollout" else StepFeatures.from_dict(f)
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
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1))
        return p

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


# ----------------------------------------------------------------------------- calibration


def multi_turn_batch(
    *,
    num_groups: int,
    group_size: int,
    turns: int,
    prompt_len: int,
    turn_len: tuple[int, int],
    tool_len: tuple[int, int],
    vocab_size: int = 256,
    seed: int = 0,
) -> RolloutBatch:
    """Per-turn multi-turn batch: each sample's turns k = 1..turns are sequences.

    A sample is prompt, then per turn a tool output (from turn 2 on) and a model
    response; the sequence of turn k is its path through response k, so the
    prefix tree is a chain per sample with sequences ending at internal nodes.
    """
    rs = np.random.RandomState(seed)
    toks, gids, plens = [], [], []
    for g in range(num_groups):
        prompt = rs.randint(3, vocab_size, prompt_len)
        for _ in range(group_size):
            path = [prompt]
            for k in range(turns):
                if k > 0:
                    path.append(rs.randint(3, vocab_size, rs.randint(tool_len[0], tool_len[1] + 1)))
                path.append(rs.randint(3, vocab_size, rs.randint(turn_len[0], turn_len[1] + 1)))
                toks.append(np.concatenate(path))
                gids.append(g)
                plens.append(prompt_len)
    return RolloutBatch.create(
        tokens=toks,
        prompt_lens=plens,
        advantages=rs.randn(len(toks)).astype(np.float32),
        group_ids=np.array(gids),
    )


def calibration_batches(*, seed: int = 0, size: str = "default") -> list[tuple[str, RolloutBatch]]:
    """Synthetic training batches spanning the replay suite's regime (module docstring).

    Deliberately *not* trace workloads, so validating on traces tests
    generalisation. ``size="tiny"`` gives three very small batches (tests).
    """
    from dtarl.testing import grpo_groups

    if size == "tiny":
        shapes = [(1, 2, 4, (3, 6)), (2, 2, 6, (8, 20)), (2, 3, 3, (20, 40))]
        return [
            (
                f"tiny{i}",
                grpo_groups(
                    num_groups=g, group_size=n, prompt_len=p, response_len=r, seed=seed + i
                ),
            )
            for i, (g, n, p, r) in enumerate(shapes)
        ]
    if size != "default":
        raise ValueError(f"size={size!r}: expected 'default' or 'tiny'")
    grpo = [
        # (groups, group size, prompt, response range): small; medium; long responses;
        # long prompts with short and very short responses; long responses (suffix
        # rows of 256, as math/code traces); many groups
        (1, 4, 8, (20, 60)),
        (4, 8, 16, (8, 100)),
        (2, 8, 48, (40, 200)),
        (4, 8, 200, (4, 56)),
        (4, 8, 250, (4, 16)),
        (4, 8, 56, (150, 250)),
        (6, 8, 40, (30, 200)),
    ]
    out = [
        (
            f"g{g}x{n}_p{p}_r{r[0]}-{r[1]}",
            grpo_groups(num_groups=g, group_size=n, prompt_len=p, response_len=r, seed=seed + i),
        )
        for i, (g, n, p, r) in enumerate(grpo)
    ]
    out.append(
        (
            "multiturn_g2x4_t3",
            multi_turn_batch(
                num_groups=2,
                group_size=4,
                turns=3,
                prompt_len=40,
                turn_len=(10, 40),
                tool_len=(20, 50),
                seed=seed + 100,
            ),
        )
    )
    return out


def _grpo_calls(
    *, num_groups: int, group_size: int, prompt_len: int, response_len: tuple[int, int], seed: int
) -> list[RolloutCall]:
    """One generate call: every group's prompt once, its responses forced (a GRPO rollout)."""
    rs = np.random.RandomState(seed)
    prompts = tuple(rs.randint(3, 256, prompt_len) for _ in range(num_groups))
    lo, hi = response_len
    forced = tuple(int(rs.randint(lo, hi + 1)) for _ in range(num_groups * group_size))
    return [RolloutCall(prompts=prompts, counts=(group_size,) * num_groups, forced=forced)]


def _multi_turn_calls(
    *, num_groups: int, group_size: int, turns: int, prompt_len: int, turn_len, tool_len, seed
) -> list[RolloutCall]:
    """The per-turn calls of a multi-turn rollout (turn 0 shares each group's prompt)."""
    rs = np.random.RandomState(seed)
    ctx = []
    prompts0 = []
    for _ in range(num_groups):
        p = rs.randint(3, 256, prompt_len)
        prompts0.append(p)
        ctx += [p] * group_size
    calls = []
    for k in range(turns):
        forced = [int(rs.randint(turn_len[0], turn_len[1] + 1)) for _ in ctx]
        if k == 0:
            calls.append(
                RolloutCall(
                    prompts=tuple(prompts0),
                    counts=(group_size,) * num_groups,
                    forced=tuple(forced),
                )
            )
        else:
            calls.append(
                RolloutCall(prompts=tuple(ctx), counts=(1,) * len(ctx), forced=tuple(forced))
            )
        ctx = [
            np.concatenate(
                [c, rs.randint(3, 256, n), rs.randint(3, 256, rs.randint(tool_len[0], tool_len[1]))]
            )
            for c, n in zip(ctx, forced, strict=True)
        ]
    return calls


def calibration_rollouts(*, seed: int = 0, size: str = "default") -> list[tuple[str, list]]:
    """Synthetic rollouts (lists of ``RolloutCall``) spanning the replay suite's regime."""
    if size == "tiny":
        return [
            (
                "tiny_grpo",
                _grpo_calls(
                    num_groups=2, group_size=2, prompt_len=4, response_len=(3, 9), seed=seed
                ),
            )
        ]
    if size != "default":
        raise ValueError(f"size={size!r}: expected 'default' or 'tiny'")
    grpo = [
        # (groups, group size, prompt, response range)
        (1, 4, 8, (20, 60)),
        (4, 8, 16, (8, 100)),
        (2, 8, 48, (40, 250)),
        (4, 8, 200, (4, 56)),
        (8, 4, 24, (100, 240)),
    ]
    out = [
        (
            f"roll_g{g}x{n}_p{p}_r{r[0]}-{r[1]}",
            _grpo_calls(num_groups=g, group_size=n, prompt_len=p, response_len=r, seed=seed + i),
        )
        for i, (g, n, p, r) in enumerate(grpo)
    ]
    out.append(
        (
            "roll_multiturn_g2x4_t3",
            _multi_turn_calls(
                num_groups=2,
                group_size=4,
                turns=3,
                prompt_len=40,
                turn_len=(10, 40),
                tool_len=(20, 50),
                seed=seed + 100,
            ),
        )
    )
    return out


def _time_rollouts(model, params, rollouts, *, repeats: int, seed: int, gate, log=None):
    """Interleaved timing of calibration rollouts: warm-up each, then
    ``interleaved_rounds`` behind ``gate``.

    Returns [(min_s, median_s, background cores of the fastest run, every run)] per
    rollout, or None without a forced-length sampler.
    """
    import statistics

    from dtarl.bench.replay import interleaved_rounds, rollout_sampler, run_rollout_calls

    samplers = []
    for name, calls in rollouts:
        s = rollout_sampler(model, calls)
        if s is None:
            return None
        t0 = time.perf_counter()
        run_rollout_calls(s, params, calls, seed)
        samplers.append(s)
        if log is not None:
            log(f"compiled rollout {name}: first run {time.perf_counter() - t0:.2f}s")

    def caller(calls, s):
        return lambda: run_rollout_calls(s, params, calls, seed)[0]

    fns = [caller(calls, s) for (_, calls), s in zip(rollouts, samplers, strict=True)]
    timed = interleaved_rounds(fns, repeats=repeats, gate=gate)
    return [
        (min(t.seconds), statistics.median(t.seconds), t.background[t.best], t.seconds)
        for t in timed
    ]


def _time_auto_choice(cfg, batches, *, repeats: int, gate=None) -> list[tuple[float, float]]:
    """Auto's extra host time per batch (3): ``choose`` minus its pick's own ``prepare``
    (which the pick's calibrated cost already contains), each the minimum of
    ``repeats`` calls behind ``gate``; returns (extra from minima, from medians)."""
    import statistics

    from dtarl.bench.replay import interleaved_rounds

    engine = feature_engine(AUTO, cfg)
    loss = _loss()
    out = []
    for _, b in batches:
        inner = engine.engines[engine.choose(b, loss)[0]]

        def timed(fn, b=b):
            def call() -> float:
                t0 = time.perf_counter()
                fn(b, loss)
                return time.perf_counter() - t0

            return call

        t_choose, t_prep = interleaved_rounds(
            [timed(engine.choose), timed(inner.prepare)], repeats=max(repeats, 3), gate=gate
        )
        mn = min(t_choose.seconds) - min(t_prep.seconds)
        med = statistics.median(t_choose.seconds) - statistics.median(t_prep.seconds)
        out.append((max(mn, 1e-7), max(med, 1e-7)))
    return out


def calibration_kinds(kinds: Sequence[str]) -> tuple[list[str], bool]:
    """(engine kinds to time, whether auto is priced): auto adds its candidates."""
    from dtarl.engines.cost import ENGINES

    want = [_check_kind(k) for k in kinds]
    if not want:
        raise ValueError("engines: empty; give at least one engine kind")
    auto = AUTO in want
    out = [k for k in want if k != AUTO]
    if auto:
        out += [k for k in engine_default(AUTO, "candidates") or ENGINES if k not in out]
    return list(dict.fromkeys(out)), auto


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CalibrationPlan:
    """What a calibration times: engine jobs (with their features) and rollouts."""

    model: ModelConfig
    chunk_len: int
    microbatch: int
    train_kinds: tuple[str, ...]
    with_auto: bool
    batches: tuple[tuple[str, RolloutBatch], ...]
    jobs: tuple[TimingJob, ...]
    features: tuple[StepFeatures, ...]
    rollouts: tuple[tuple[str, list], ...]


def calibration_plan(
    kinds: Sequence[str] = ("dense", "dfs"),
    *,
    model: ModelConfig | None = None,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    rollouts: Sequence[tuple[str, list]] | None = None,
    rollout: bool = True,
    chunk_len: int | None = None,
    microbatch: int | None = None,
    seed: int = 0,
) -> CalibrationPlan:
    """The jobs of a calibration: every engine kind (auto adds its candidates) on
    every batch (default ``calibration_batches``), and the rollouts (default
    ``calibration_rollouts``; none when ``rollout`` is False)."""
    cfg = ModelConfig.tiny() if model is None else model
    chunk_len = engine_default("dfs", "chunk_len") if chunk_len is None else chunk_len
    microbatch = engine_default("dense", "microbatch") if microbatch is None else microbatch
    batches = calibration_batches(seed=seed) if batches is None else list(batches)
    if not batches:
        raise ValueError("batches: empty; the calibration needs at least one batch")
    train_kinds, with_auto = calibration_kinds(kinds)
    jobs, feats = [], []
    for kind in train_kinds:
        kw = engine_kwargs(kind, chunk_len=chunk_len, microbatch=microbatch)
        for name, b in batches:
            jobs.append(TimingJob(kind=kind, batch=b, engine_kwargs=kw, label=name))
            feats.append(engine_features(kind, b, cfg, chunk_len=chunk_len, microbatch=microbatch))
    auto_chunk = engine_default(AUTO, "chunk_len")
    if with_auto and "dfs" in train_kinds and auto_chunk != chunk_len:
        # Auto runs dfs with its own chunk: every other batch at that chunk too, so the
        # dfs fit separates per-step from per-token cost and covers both programs.
        for name, b in batches[::2]:
            kw = dict(chunk_len=auto_chunk)
            jobs.append(
                TimingJob(kind="dfs", batch=b, engine_kwargs=kw, label=f"{name}@c{auto_chunk}")
            )
            feats.append(engine_features("dfs", b, cfg, chunk_len=auto_chunk))
    if rollout:
        rollouts = calibration_rollouts(seed=seed) if rollouts is None else list(rollouts)
    return CalibrationPlan(
        model=cfg,
        chunk_len=chunk_len,
        microbatch=microbatch,
        train_kinds=tuple(train_kinds),
        with_auto=with_auto,
        batches=tuple(batches),
        jobs=tuple(jobs),
        features=tuple(feats),
        rollouts=tuple(rollouts or ()) if rollout else (),
    )


def fit_profile(
    plan: CalibrationPlan,
    timings: Sequence,
    rollout_timings: Sequence[tuple] | None,
    auto_choice: Sequence[tuple[float, float]] | None,
    *,
    machine: dict[str, Any],
) -> CostProfile:
    """A ``CostProfile`` from measured calibration jobs (minima are fitted).

    timings: ``EngineTiming`` per ``plan.jobs``; rollout_timings: (min, median,
    background of the fastest, every run) per ``plan.rollouts`` (None: no
    sampler); auto_choice: (extra from
    minima, from medians) per batch (``plan.with_auto``).
    """
    points = [
        CalibrationPoint(
            kind=job.kind,
            name=job.label,
            features=f,
            measured_s=t.step_min_s,
            median_s=t.step_s,
            background_cores=t.min_background_cores,
            runs_s=tuple(t.runs_s),
        )
        for job, f, t in zip(plan.jobs, plan.features, timings, strict=True)
    ]
    costs = fit_engine_costs(
        {
            kind: [(p.features, p.measured_s) for p in points if p.kind == kind]
            for kind in plan.train_kinds
        }
    )
    auto = None
    if plan.with_auto and auto_choice is not None:
        # Absolute least squares: the extras are small differences of two timings, so
        # relative weights would let a near-zero (noisy) difference dominate the fit.
        x = np.array([[float(b.num_tokens), 1.0] for _, b in plan.batches])
        y = np.array([t for t, _ in auto_choice])
        c = nnls(x, y)
        mape = float(np.mean(np.abs(x @ c - y) / np.maximum(y, 1e-4)) * 100.0)
        auto = AutoCost(s_per_token=float(c[0]), const_s=float(c[1]), fit_mape=mape)
        for (name, _), (mn, med) in zip(plan.batches, auto_choice, strict=True):
            points.append(
                CalibrationPoint(
                    kind="auto_choose", name=name, features=None, measured_s=mn, median_s=med
                )
            )
    roll = None
    if plan.rollouts and rollout_timings is not None:
        rf = [rollout_features(calls, plan.model) for _, calls in plan.rollouts]
        roll = RolloutCost.fit(rf, [t[0] for t in rollout_timings])
        for (name, _), f, (mn, med, bg, runs) in zip(
            plan.rollouts, rf, rollout_timings, strict=True
        ):
            points.append(
                CalibrationPoint(
                    kind="rollout",
                    name=name,
                    features=f,
                    measured_s=mn,
                    median_s=med,
                    background_cores=bg,
                    runs_s=tuple(runs),
                )
            )
    return CostProfile(
        engines=costs,
        model=plan.model,
        chunk_len=plan.chunk_len,
        microbatch=plan.microbatch,
        auto=auto,
        rollout=roll,
        machine=machine,
        points=tuple(points),
    )


def _machine(load_start, gate) -> dict[str, Any]:
    return dict(
        machine_info(),
        load_avg_1m_start=load_start,
        quiet_wait_s=gate.waited_s,
        profiled_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def profile_engines(
    kinds: Sequence[str] = ("dense", "dfs"),
    *,
    model: ModelConfig | None = None,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    rollouts: Sequence[tuple[str, list]] | None = None,
    rollout: bool = True,
    repeats: int = 5,
    gate=None,
    chunk_len: int | None = None,
    microbatch: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> CostProfile:
    """Times every engine on the calibration batches and fits (1) per engine.

    Every (engine, batch) of ``calibration_plan`` is compiled on a fresh engine,
    then all are timed in ``repeats`` interleaved rounds (``replay.time_engines``);
    the minimum is fitted. "auto" adds its candidate engines and times its choice
    (3). ``gate`` (default ``replay.QuietGate()``, shared by every timing here)
    holds each timed call until other processes are quiet. ``rollout``: also
    calibrate (2) when ``dtarl.rollout`` has a forced-length sampler.
    """
    from dtarl.bench.replay import QuietGate
    from dtarl.engines.base import split_model
    from dtarl.model import init_model

    gate = QuietGate(budget_s=120.0) if gate is None else gate
    plan = calibration_plan(
        kinds,
        model=model,
        batches=batches,
        rollouts=rollouts,
        rollout=rollout,
        chunk_len=chunk_len,
        microbatch=microbatch,
        seed=seed,
    )
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    m = init_model(plan.model, seed)
    _, params = split_model(m)
    timings = time_engines(list(plan.jobs), m, params, _loss(), repeats=repeats, gate=gate, log=log)
    choice = (
        _time_auto_choice(plan.model, plan.batches, repeats=repeats, gate=gate)
        if plan.with_auto
        else None
    )
    measured = None
    if plan.rollouts:
        measured = _time_rollouts(
            m, params, plan.rollouts, repeats=repeats, seed=seed, gate=gate, log=log
        )
        if measured is None and log is not None:
            log("rollout: no forced-length sampler in dtarl.rollout; not calibrated")
    return fit_profile(plan, timings, measured, choice, machine=_machine(load_start, gate))


def calibrate_and_replay(
    specs: Sequence[WorkloadSpec],
    kinds: Sequence[str],
    config=None,
    *,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    rollouts: Sequence[tuple[str, list]] | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
):
    """Calibration and replay timed in the *same* interleaved rounds; (profile, replay).

    On a shared machine the speed drifts by tens of percent within minutes
    (other processes, the neighbouring core); a profile made earlier than the
    replay then carries that drift into the validation. Here every calibration
    job joins the replay's rounds (``replay(extra_jobs=..., extra_rollouts=...)``),
    so both see the same machine and ``validate`` measures the model's error.
    ``config``: the ``ReplayConfig`` (its ``engines`` become ``kinds``).
    """
    from dtarl.bench.replay import ReplayConfig, replay

    config = ReplayConfig() if config is None else config
    config = dataclasses.replace(config, engines=tuple(_check_kind(k) for k in kinds))
    plan = calibration_plan(
        kinds,
        model=config.model,
        batches=batches,
        rollouts=rollouts,
        rollout=config.rollout,
        seed=seed,
    )
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    res = replay(
        specs,
        config,
        log=log,
        extra_jobs=plan.jobs,
        extra_rollouts=[calls for _, calls in plan.rollouts],
    )
    from dtarl.bench.replay import QuietGate

    gate = QuietGate(cores=config.quiet_cores, budget_s=config.quiet_budget_s)
    choice = (
        _time_auto_choice(plan.model, plan.batches, repeats=config.repeats, gate=gate)
        if plan.with_auto
        else None
    )
    measured = None
    if plan.rollouts and all(t is not None for t in res.extra_rollouts):
        import statistics

        measured = [
            (min(t.seconds), statistics.median(t.seconds), t.background[t.best], t.seconds)
            for t in res.extra_rollouts
        ]
    machine = dict(_machine(load_start, gate), joint_with_replay=True)
    return fit_profile(plan, res.extra_engines, measured, choice, machine=machine), res


# ----------------------------------------------------------------------------- cluster


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A described cluster for the simulator.

    devices = dp x tp. throughput_scale: per-device FLOP rate relative to the
    profiled machine (2.0 = twice as fast). interconnect_bytes_per_s /
    interconnect_latency_s: the link used by the gradient all-reduce (dp) and
    the activation all-reduces (tp). grad_bytes: bytes per gradient element.
    partition: ``PartitionMethod`` value used to split the batch over dp ranks.
    """

    devices: int = 1
    dp: int = 1
    tp: int = 1
    throughput_scale: float = 1.0
    interconnect_bytes_per_s: float = 50e9
    interconnect_latency_s: float = 10e-6
    grad_bytes: int = 4
    partition: str = "balanced"

    def __post_init__(self):
        for f in ("devices", "dp", "tp", "grad_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ClusterSpec.{f}={v!r}: must be an int >= 1")
        if self.devices != self.dp * self.tp:
            raise ValueError(
                f"ClusterSpec.devices={self.devices} != dp x tp = {self.dp} x {self.tp}"
            )
        if not self.throughput_scale > 0:
            raise ValueError(f"ClusterSpec.throughput_scale={self.throughput_scale}: must be > 0")
        if not self.interconnect_bytes_per_s > 0:
            raise ValueError(
                f"ClusterSpec.interconnect_bytes_per_s={self.interconnect_bytes_per_s}: must be > 0"
            )
        if not self.interconnect_latency_s >= 0:
            raise ValueError(
                f"ClusterSpec.interconnect_latency_s={self.interconnect_latency_s}: must be >= 0"
            )
        from dtarl.parallel.partition import PartitionMethod

        PartitionMethod(self.partition)  # raises with the accepted values

    @classmethod
    def single(cls) -> ClusterSpec:
        """This machine as profiled: one device, no communication."""
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnginePrediction:
    kind: str
    train_s: float  # max over ranks of compute + tp traffic, plus the gradient all-reduce
    rank_s: tuple[float, ...]
    tp_comm_s: float
    allreduce_s: float
    features: tuple[StepFeatures, ...]  # per dp rank
    program: str = ""  # the engine whose program runs (auto: its pick)
    choose_s: float = 0.0  # auto: the choice's host time (3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Predicted step: rollout (when modelled) + tool stage (simulated clock) + training."""

    cluster: ClusterSpec
    tool_s: float
    engines: dict[str, EnginePrediction]
    rollout_s: float | None = None
    rollout_features: RolloutFeatures | None = None

    def step_s(self, kind: str) -> float:
        return (self.rollout_s or 0.0) + self.tool_s + self.engines[kind].train_s

    def to_dict(self) -> dict[str, Any]:
        return dict(
            cluster=self.cluster.to_dict(),
            tool_s=self.tool_s,
            rollout_s=(
                self.rollout_s
                if self.rollout_s is not None
                else "not modelled (profile has no rollout cost model)"
            ),
            engines={
                k: dict(
                    train_s=p.train_s,
                    step_s=self.step_s(k),
                    program=p.program,
                    choose_s=p.choose_s,
                    rank_s=list(p.rank_s),
                    tp_comm_s=p.tp_comm_s,
                    allreduce_s=p.allreduce_s,
                )
                for k, p in self.engines.items()
            },
        )


def _rank_batches(batch: RolloutBatch, cluster: ClusterSpec) -> tuple[RolloutBatch, ...]:
    if cluster.dp == 1:
        return (batch,)
    from dtarl.parallel.partition import partition_batch

    if batch.num_sequences < cluster.dp:
        raise ValueError(
            f"cluster.dp={cluster.dp} > {batch.num_sequences} sequences; use dp <= sequences"
        )
    part = partition_batch(batch, cluster.dp, method=cluster.partition)
    return tuple(b for b in part.split(batch) if b.num_sequences > 0)


def predict_step(
    workload: Workload | RolloutBatch,
    profile: CostProfile,
    cluster: ClusterSpec | None = None,
    *,
    engines: Sequence[str] | None = None,
    model: ModelConfig | None = None,
    tool_s: float = 0.0,
) -> StepPrediction:
    """Predicts the training time of ``workload`` per engine on ``cluster`` (nothing runs).

    ``model`` (default: the profile's) sets the FLOPs; ``tool_s`` is the tool
    stage's time (``predict_workload`` adds it and the rollout).
    """
    cluster = ClusterSpec.single() if cluster is None else cluster
    cfg = profile.model if model is None else model
    batch = workload.batch if isinstance(workload, Workload) else workload
    kinds = profile.kinds if engines is None else [_check_kind(k) for k in engines]
    ranks = _rank_batches(batch, cluster)
    div = cluster.tp * cluster.throughput_scale
    bw, lat = cluster.interconnect_bytes_per_s, cluster.interconnect_latency_s
    act_bytes = np.dtype(cfg.compute_dtype).itemsize
    tp_frac = 2.0 * (cluster.tp - 1) / cluster.tp
    dp = cluster.dp
    grad = cfg.num_params() * cluster.grad_bytes / cluster.tp
    allreduce = 0.0 if dp == 1 else 2.0 * (dp - 1) / dp * grad / bw + 2.0 * (dp - 1) * lat
    out = {}
    for kind in kinds:
        if kind == AUTO and profile.auto is None:
            raise KeyError(
                "engine 'auto' is not in the cost profile; re-run the calibration with auto"
            )
        feats, times, tps, choose = [], [], [], []
        for b in ranks:
            f = engine_features(
                kind, b, cfg, chunk_len=profile.chunk_len, microbatch=profile.microbatch
            )
            extra = profile.auto.predict(b.num_tokens) if kind == AUTO else 0.0
            tp_s = 0.0
            if cluster.tp > 1:
                n_ar = 4 * cfg.num_layers
                tp_s = n_ar * (
                    tp_frac * f.total_tokens * cfg.hidden_size * act_bytes / bw
                    + f.total_steps * lat
                )
            feats.append(f)
            tps.append(tp_s)
            choose.append(extra)
            times.append(price(profile.engines, f, flop_divisor=div) + tp_s + extra)
        j = int(np.argmax(times))
        out[kind] = EnginePrediction(
            kind=kind,
            train_s=float(times[j] + allreduce),
            rank_s=tuple(float(t) for t in times),
            tp_comm_s=float(tps[j]),
            allreduce_s=float(allreduce),
            features=tuple(feats),
            program=feats[j].program,
            choose_s=float(choose[j]),
        )
    return StepPrediction(cluster=cluster, tool_s=float(tool_s), engines=out)


def predict_rollout(
    workload: Workload,
    profile: CostProfile,
    cluster: ClusterSpec | None = None,
    *,
    model: ModelConfig | None = None,
) -> tuple[float, RolloutFeatures] | None:
    """(seconds, features) of the replayed rollout (2), or None if the profile has no (2)."""
    if profile.rollout is None:
        return None
    cluster = ClusterSpec.single() if cluster is None else cluster
    cfg = profile.model if model is None else model
    f = rollout_features(rollout_calls(workload), cfg, dp=cluster.dp)
    div = cluster.tp * cluster.throughput_scale
    return profile.rollout.predict(f, flop_divisor=div), f


def predict_workload(
    spec: WorkloadSpec,
    profile: CostProfile,
    cluster: ClusterSpec | None = None,
    *,
    engines: Sequence[str] | None = None,
    model: ModelConfig | None = None,
    tool_time_scale: float = 1.0,
) -> StepPrediction:
    """``predict_step`` of a spec's workload, with its rollout (2) and its tool stage on a
    simulated clock (the replay's sampled latencies, times ``tool_time_scale``)."""
    cfg = profile.model if model is None else model
    w = spec.build(vocab_size=cfg.vocab_size)
    tool = tool_phase(
        w,
        default_tool_sampler(spec.source),
        clock=ToolClock.SIMULATED,
        time_scale=tool_time_scale,
        seed=spec.seed,
    )
    pred = predict_step(w, profile, cluster, engines=engines, model=cfg, tool_s=tool.seconds)
    roll = predict_rollout(w, profile, cluster, model=cfg)
    if roll is None:
        return pred
    return dataclasses.replace(pred, rollout_s=roll[0], rollout_features=roll[1])


# ----------------------------------------------------------------------------- validation


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
        fig.tight_layout()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        return p


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
    scale = float(replay_json["config"].get("tool_time_scale", 1.0))
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
            bg = None
            if e.get("background_cores") and e.get("runs_s"):
                bg = e["background_cores"][int(np.argmin(e["runs_s"]))]
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
                    replay_json["config"].get("tool_latency_source") or spec.source
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
        roll = stages.get("rollout", {})
        rp = predict_rollout(wl, profile, model=rcfg)
        if roll.get("seconds") is not None and rp is not None:
            mn = float(roll.get("min_seconds") or roll["seconds"])
            detail = roll.get("detail") or {}
            bg = None
            if detail.get("background_cores") and detail.get("runs_s"):
                bg = detail["background_cores"][int(np.argmin(detail["runs_s"]))]
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
            for k in kinds:
                e = w["engines"][k]
                rows.append(
                    ValidationRow(
                        workload=spec.name,
                        stage="step",
                        engine=k,
                        measured_s=mn + t_meas + float(e.get("step_min_s", e["step_s"])),
                        measured_median_s=float(roll["seconds"]) + t_meas + float(e["step_s"]),
                        predicted_s=rp[0] + (tool_pred or 0.0) + pred.engines[k].train_s,
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


__all__ = [
    "AutoCost",
    "CalibrationPoint",
    "ClusterSpec",
    "CostProfile",
    "EngineCost",
    "EnginePrediction",
    "RolloutCost",
    "RolloutFeatures",
    "StepFeatures",
    "StepPrediction",
    "ValidationReport",
    "ValidationRow",
    "CalibrationPlan",
    "calibrate_and_replay",
    "calibration_batches",
    "calibration_kinds",
    "calibration_rollouts",
    "engine_features",
    "feature_engine",
    "fit_engine_costs",
    "fit_profile",
    "calibration_plan",
    "fit_relative",
    "multi_turn_batch",
    "nnls",
    "predict_rollout",
    "price",
    "predict_step",
    "predict_workload",
    "prepared_features",
    "profile_engines",
    "rollout_features",
    "validate",
]
