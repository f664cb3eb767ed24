"""Step-time simulator: predict a workload's RL step on a described cluster, without running it.

Cost model. For engine e the training step time of a batch is

    t_e = a_e F_lin + b_e F_attn + c_e n_steps + d_e                         (1)

with features taken from the structure the engine actually computes, padding
included (``engine_features``, host-side numpy only):

  dense      every sequence padded to T = bucket(max_len), rows to bucket(N) in
             microbatches of m:  F_lin = 3 R T f0,  F_attn = 3 R T f_att(T),
             n_steps = R / m (scan iterations)
  dfs        the segment plan of the prefix tree (``compile_plan``), chunks of C
             against a path buffer S + C:  F_lin = C (n_push + 3 n_pop) f0,
             F_attn = C (n_push + 3 n_pop) f_att(S + C),  n_steps = padded steps
  otherwise  (prefix_reuse, auto, ...) the prefix tree itself: F_lin = 3 |T| f0,
             F_attn = 3 sum_tree-tokens f_att(depth), n_steps = tree nodes

where f0 = ``cfg.flops_per_token(0)`` (linear layers + LM head, forward) and
f_att(ctx) = ``cfg.flops_per_token(ctx) - f0``; backward = 2 x forward. The
coefficients (seconds per FLOP, seconds per step, seconds) are fitted per engine
by non-negative least squares on a short profiling run of synthetic batches on
this machine (``profile_engines``) and stored as JSON (``CostProfile``).

Cluster (``ClusterSpec``). The batch is partitioned over ``dp`` ranks
(``dtarl.parallel.partition``); a rank's compute time is (1) with the FLOP terms
divided by tp x throughput_scale; tensor parallelism adds 4 L all-reduces of
the [tokens, hidden] activations per step (2 forward, 2 backward); the step adds
one ring all-reduce of the fp32 gradient (2 (dp-1)/dp x bytes / bandwidth +
2 (dp-1) latency). Predicted train time = max over ranks + all-reduce.

Validation (``validate``) regenerates the workloads of a ``replay`` JSON, predicts
them with a profile, and reports per-workload and mean absolute % error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.engines.batch import RolloutBatch
from dtarl.model.config import ModelConfig
from dtarl.traces.replay import (
    ToolClock,
    WorkloadSpec,
    default_tool_sampler,
    machine_info,
    model_config_from_dict,
    model_config_to_dict,
    time_engine,
    tool_phase,
)
from dtarl.traces.workload import Workload

PROFILE_KIND = "dtarl.trace.cost_profile"
FEATURE_NAMES = ("lin_flops", "attn_flops", "steps", "const")


# ----------------------------------------------------------------------------- features


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepFeatures:
    """The structure of one engine call that the cost model prices (see module doc).

    tokens: token positions computed per pass (padding included), for TP traffic.
    """

    lin_flops: float
    attn_flops: float
    steps: float
    tokens: float

    def row(self) -> np.ndarray:
        """[4] regressors of (1): (F_lin, F_attn, n_steps, 1)."""
        return np.array([self.lin_flops, self.attn_flops, self.steps, 1.0])


def _f0_fatt(cfg: ModelConfig) -> tuple[float, float]:
    """(forward FLOPs of a token at context 0, attention FLOPs per context token)."""
    f0 = cfg.flops_per_token(0.0)
    return f0, cfg.flops_per_token(1.0) - f0


def engine_default(kind: str, field: str):
    """The default of an engine dataclass field (``chunk_len`` of dfs, ``microbatch``...)."""
    from dtarl.engines import DenseEngine, DFSEngine

    cls = DFSEngine if kind == "dfs" else DenseEngine
    for f in dataclasses.fields(cls):
        if f.name == field:
            return f.default
    raise KeyError(f"{cls.__name__} has no field {field!r}")


def engine_features(
    kind: str,
    batch: RolloutBatch,
    cfg: ModelConfig,
    *,
    chunk_len: int | None = None,
    microbatch: int | None = None,
) -> StepFeatures:
    """Features of ``batch`` for a fresh engine of ``kind`` (mirrors its shape buckets).

    ``chunk_len`` / ``microbatch`` default to the engines' own defaults.
    """
    from dtarl.model.config import AttentionBackend
    from dtarl.tree.plan import Op, bucket, compile_plan
    from dtarl.tree.trie import build_tree

    chunk_len = engine_default("dfs", "chunk_len") if chunk_len is None else chunk_len
    microbatch = engine_default("dense", "microbatch") if microbatch is None else microbatch

    f0, fa = _f0_fatt(cfg)
    kind = str(getattr(kind, "value", kind))
    lengths = batch.lengths
    if kind in ("dense", "dense_remat"):
        t = bucket(int(lengths.max()), 8)
        rows = bucket(batch.num_sequences)
        mb = min(microbatch, rows)
        rows = -(-rows // mb) * mb
        tok = float(rows * t)
        return StepFeatures(
            lin_flops=3.0 * tok * f0, attn_flops=3.0 * tok * fa * t, steps=rows / mb, tokens=tok
        )
    tree = build_tree(batch.tokens)
    if kind == "dfs":
        # The engine packs leaves unless the Pallas kernel (no segment mask) runs.
        pack = engine_default("dfs", "pack_leaves") and (
            cfg.attention_backend is not AttentionBackend.PALLAS
        )
        plan = compile_plan(
            tree,
            chunk_len=chunk_len,
            pack_leaves=pack,
            prefix_levels=engine_default("dfs", "prefix_levels"),
        )
        n_push = int((plan.op == Op.PUSH).sum())
        n_pop = int((plan.op == Op.POP).sum())
        work = float(chunk_len * (n_push + 3 * n_pop))
        ctx = plan.path_len + chunk_len
        return StepFeatures(
            lin_flops=work * f0,
            attn_flops=work * fa * ctx,
            steps=float(plan.op.shape[0]),
            tokens=float(chunk_len * (n_push + n_pop)),
        )
    # Generic tree engine: every tree token once forward and once backward.
    ln = tree.length.astype(np.float64)
    st = tree.start.astype(np.float64)
    depth_sum = float(np.sum(ln * st + ln * (ln - 1) / 2.0))
    tt = float(tree.stats.tree_tokens)
    return StepFeatures(
        lin_flops=3.0 * tt * f0,
        attn_flops=3.0 * depth_sum * fa,
        steps=float(tree.num_nodes - 1),
        tokens=tt,
    )


# ----------------------------------------------------------------------------- cost model


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineCost:
    """Fitted coefficients of (1) for one engine kind (all >= 0).

    lin_s_per_flop, attn_s_per_flop: seconds per linear / attention FLOP;
    step_s: seconds per engine step (scan iteration); const_s: per call.
    fit_mape: mean absolute % error on the calibration points.
    """

    kind: str
    lin_s_per_flop: float
    attn_s_per_flop: float
    step_s: float
    const_s: float
    fit_mape: float = float("nan")

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
        """Non-negative least squares of (1) on measured (features, seconds) points.

        Relative errors matter (small and large batches alike), so each point's
        row is weighted by 1 / seconds.
        """
        x = np.stack([f.row() for f in features])
        y = np.asarray(seconds, np.float64)
        if x.shape[0] != y.shape[0] or y.shape[0] < 1:
            raise ValueError(f"fit: {x.shape[0]} feature rows vs {y.shape[0]} timings")
        if not np.all(y > 0):
            raise ValueError("fit: every measured time must be > 0")
        w = 1.0 / y
        c = nnls(x * w[:, None], y * w)
        pred = x @ c
        mape = float(np.mean(np.abs(pred - y) / y) * 100.0)
        return cls(
            kind=kind,
            lin_s_per_flop=float(c[0]),
            attn_s_per_flop=float(c[1]),
            step_s=float(c[2]),
            const_s=float(c[3]),
            fit_mape=mape,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationPoint:
    kind: str
    name: str
    features: StepFeatures
    measured_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostProfile:
    """Per-engine cost models calibrated on one machine, with how they were obtained.

    model: the config the calibration ran (FLOPs are computed with the config
    passed to ``predict_step``, which defaults to this one).
    chunk_len / microbatch: engine settings the features mirror (replay runs the
    engines' defaults, so calibrate with those).
    """

    engines: dict[str, EngineCost]
    model: ModelConfig
    chunk_len: int = dataclasses.field(default_factory=lambda: engine_default("dfs", "chunk_len"))
    microbatch: int = dataclasses.field(
        default_factory=lambda: engine_default("dense", "microbatch")
    )
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    points: tuple[CalibrationPoint, ...] = ()

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
            model=model_config_to_dict(self.model),
            chunk_len=self.chunk_len,
            microbatch=self.microbatch,
            machine=self.machine,
            feature_names=list(FEATURE_NAMES),
            engines={k: dataclasses.asdict(c) for k, c in self.engines.items()},
            points=[
                dict(
                    kind=p.kind,
                    name=p.name,
                    features=dataclasses.asdict(p.features),
                    measured_s=p.measured_s,
                )
                for p in self.points
            ],
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostProfile:
        if d.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a cost profile (kind={d.get('kind')!r}, want {PROFILE_KIND!r})")
        return cls(
            engines={k: EngineCost(**c) for k, c in d["engines"].items()},
            model=model_config_from_dict(d["model"]),
            chunk_len=int(d["chunk_len"]),
            microbatch=int(d["microbatch"]),
            machine=dict(d.get("machine", {})),
            points=tuple(
                CalibrationPoint(
                    kind=p["kind"],
                    name=p["name"],
                    features=StepFeatures(**p["features"]),
                    measured_s=float(p["measured_s"]),
                )
                for p in d.get("points", ())
            ),
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
        return cls.from_dict(json.loads(p.read_text()))


def calibration_batches(*, seed: int = 0, size: str = "default") -> list[tuple[str, RolloutBatch]]:
    """Synthetic GRPO batches spanning short/long, shared/unshared shapes.

    They are deliberately *not* trace workloads, so validating on traces tests
    generalisation. ``size="tiny"`` gives three very small batches (tests).
    """
    from dtarl.testing import grpo_groups

    if size == "tiny":
        shapes = [(1, 2, 4, (3, 6)), (2, 2, 6, (8, 20)), (2, 3, 3, (20, 40))]
    elif size == "default":
        shapes = [
            # (groups, group size, prompt, response range)
            (4, 8, 16, (8, 100)),
            (2, 8, 48, (40, 200)),
            (4, 8, 160, (4, 40)),
            (8, 4, 24, (16, 200)),
            (2, 4, 96, (80, 220)),
            (1, 8, 8, (150, 240)),
            (3, 6, 60, (30, 180)),
            (1, 16, 4, (150, 250)),
        ]
    else:
        raise ValueError(f"size={size!r}: expected 'default' or 'tiny'")
    out = []
    for i, (g, n, p, r) in enumerate(shapes):
        b = grpo_groups(num_groups=g, group_size=n, prompt_len=p, response_len=r, seed=seed + i)
        out.append((f"synth{i}_g{g}x{n}_p{p}_r{r[0]}-{r[1]}", b))
    return out


def profile_engines(
    kinds: Sequence[str] = ("dense", "dfs"),
    *,
    model: ModelConfig | None = None,
    batches: Sequence[tuple[str, RolloutBatch]] | None = None,
    repeats: int = 3,
    chunk_len: int | None = None,
    microbatch: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> CostProfile:
    """Times every engine on the calibration batches and fits (1) per engine.

    Each (engine, batch) runs on a fresh engine: warm-up (compile), then the
    median of ``repeats`` timed calls (``time_engine``).
    """
    from dtarl.engines.base import split_model
    from dtarl.model import init_model
    from dtarl.rl.losses import ClippedSurrogateLoss

    cfg = ModelConfig.tiny() if model is None else model
    chunk_len = engine_default("dfs", "chunk_len") if chunk_len is None else chunk_len
    microbatch = engine_default("dense", "microbatch") if microbatch is None else microbatch
    batches = calibration_batches(seed=seed) if batches is None else list(batches)
    if not batches:
        raise ValueError("batches: empty; the calibration needs at least one batch")
    m = init_model(cfg, seed)
    _, params = split_model(m)
    loss = ClippedSurrogateLoss.grpo()
    points, costs = [], {}
    for kind in kinds:
        kw = _engine_kwargs(kind, chunk_len=chunk_len, microbatch=microbatch)
        feats, secs = [], []
        for name, b in batches:
            t = time_engine(kind, m, params, b, loss, repeats=repeats, engine_kwargs=kw)
            f = engine_features(kind, b, cfg, chunk_len=chunk_len, microbatch=microbatch)
            feats.append(f)
            secs.append(t.step_s)
            points.append(CalibrationPoint(kind=kind, name=name, features=f, measured_s=t.step_s))
            if log is not None:
                log(f"profile {kind} {name}: {t.step_s:.4f}s (compile {t.compile_s:.1f}s)")
        costs[kind] = EngineCost.fit(kind, feats, secs)
    return CostProfile(
        engines=costs,
        model=cfg,
        chunk_len=chunk_len,
        microbatch=microbatch,
        machine=dict(machine_info(), profiled_at=time.strftime("%Y-%m-%dT%H:%M:%S")),
        points=tuple(points),
    )


def _engine_kwargs(kind: str, *, chunk_len: int, microbatch: int) -> dict[str, Any]:
    if kind == "dfs":
        return dict(chunk_len=chunk_len)
    if kind in ("dense", "dense_remat"):
        return dict(microbatch=microbatch)
    return {}


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Predicted step: tool stage (simulated clock) + training per engine."""

    cluster: ClusterSpec
    tool_s: float
    engines: dict[str, EnginePrediction]

    def step_s(self, kind: str) -> float:
        return self.tool_s + self.engines[kind].train_s

    def to_dict(self) -> dict[str, Any]:
        return dict(
            cluster=self.cluster.to_dict(),
            tool_s=self.tool_s,
            rollout="not modelled (no sampler cost model yet)",
            engines={
                k: dict(
                    train_s=p.train_s,
                    step_s=self.step_s(k),
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
    stage's time (``predict_workload`` computes it from sampled latencies).
    """
    cluster = ClusterSpec.single() if cluster is None else cluster
    cfg = profile.model if model is None else model
    batch = workload.batch if isinstance(workload, Workload) else workload
    kinds = list(profile.engines) if engines is None else [str(k) for k in engines]
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
        cost = profile.cost(kind)
        feats, times, tps = [], [], []
        for b in ranks:
            f = engine_features(
                kind, b, cfg, chunk_len=profile.chunk_len, microbatch=profile.microbatch
            )
            tp_s = 0.0
            if cluster.tp > 1:
                n_ar = 4 * cfg.num_layers
                tp_s = n_ar * (
                    tp_frac * f.tokens * cfg.hidden_size * act_bytes / bw + f.steps * lat
                )
            feats.append(f)
            tps.append(tp_s)
            times.append(cost.predict(f, flop_divisor=div) + tp_s)
        j = int(np.argmax(times))
        out[kind] = EnginePrediction(
            kind=kind,
            train_s=float(times[j] + allreduce),
            rank_s=tuple(float(t) for t in times),
            tp_comm_s=float(tps[j]),
            allreduce_s=float(allreduce),
            features=tuple(feats),
        )
    return StepPrediction(cluster=cluster, tool_s=float(tool_s), engines=out)


def predict_workload(
    spec: WorkloadSpec,
    profile: CostProfile,
    cluster: ClusterSpec | None = None,
    *,
    engines: Sequence[str] | None = None,
    model: ModelConfig | None = None,
) -> StepPrediction:
    """``predict_step`` of a spec's workload, with its tool stage on a simulated clock."""
    cfg = profile.model if model is None else model
    w = spec.build(vocab_size=cfg.vocab_size)
    tool = tool_phase(
        w, default_tool_sampler(spec.source), clock=ToolClock.SIMULATED, seed=spec.seed
    )
    return predict_step(w, profile, cluster, engines=engines, model=cfg, tool_s=tool.seconds)


# ----------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationRow:
    workload: str
    engine: str
    measured_s: float
    predicted_s: float

    @property
    def abs_pct_error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s * 100.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationReport:
    """Predicted vs measured training step times (single device, this machine)."""

    rows: tuple[ValidationRow, ...]

    @property
    def mean_abs_pct_error(self) -> float:
        return float(np.mean([r.abs_pct_error for r in self.rows])) if self.rows else float("nan")

    def per_engine(self) -> dict[str, float]:
        kinds = sorted({r.engine for r in self.rows})
        return {
            k: float(np.mean([r.abs_pct_error for r in self.rows if r.engine == k])) for k in kinds
        }

    def to_dict(self) -> dict[str, Any]:
        return dict(
            kind="dtarl.trace.simulate.validation",
            metric="training step time (host prepare + device), median of replay repeats",
            rows=[dict(dataclasses.asdict(r), abs_pct_error=r.abs_pct_error) for r in self.rows],
            mean_abs_pct_error=self.mean_abs_pct_error,
            per_engine_mean_abs_pct_error=self.per_engine(),
        )

    def table(self) -> str:
        lines = [f"{'workload':<14}{'engine':<14}{'measured_s':>11}{'predicted_s':>12}{'err%':>7}"]
        for r in self.rows:
            lines.append(
                f"{r.workload:<14}{r.engine:<14}{r.measured_s:>11.4f}{r.predicted_s:>12.4f}"
                f"{r.abs_pct_error:>7.1f}"
            )
        per = ", ".join(f"{k} {v:.1f}%" for k, v in self.per_engine().items())
        lines.append(f"mean |error| {self.mean_abs_pct_error:.1f}% ({per})")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 4.5))
        for k in sorted({r.engine for r in self.rows}):
            rs = [r for r in self.rows if r.engine == k]
            ax.scatter([r.measured_s for r in rs], [r.predicted_s for r in rs], label=k)
        hi = max(max(r.measured_s, r.predicted_s) for r in self.rows) * 1.1
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.set_xlabel("measured step time (s)")
        ax.set_ylabel("predicted step time (s)")
        ax.set_title(f"simulator vs replay: mean |err| {self.mean_abs_pct_error:.1f}%")
        ax.legend()
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
) -> ValidationReport:
    """Predicts every (workload, engine) of a replay JSON and compares with its medians.

    The workloads are regenerated from their specs (deterministic per seed); the
    replay must have used the profile's model config for the comparison to mean
    anything, which is checked.
    """
    rcfg = model_config_from_dict(replay_json["config"]["model"])
    if rcfg != profile.model:
        raise ValueError(
            "the replay ran a different model than the profile calibrated; re-run one of them "
            "with the same model config"
        )
    rows = []
    for w in replay_json["workloads"]:
        spec = WorkloadSpec.from_dict(w["spec"])
        kinds = [k for k in w["engines"] if engines is None or k in engines]
        kinds = [k for k in kinds if k in profile.engines]
        if not kinds:
            continue
        pred = predict_step(spec.build(vocab_size=rcfg.vocab_size), profile, engines=kinds)
        for k in kinds:
            rows.append(
                ValidationRow(
                    workload=spec.name,
                    engine=k,
                    measured_s=float(w["engines"][k]["step_s"]),
                    predicted_s=pred.engines[k].train_s,
                )
            )
    if not rows:
        raise ValueError("no (workload, engine) pair of the replay is in the profile")
    return ValidationReport(rows=tuple(rows))


__all__ = [
    "CalibrationPoint",
    "ClusterSpec",
    "CostProfile",
    "EngineCost",
    "EnginePrediction",
    "StepFeatures",
    "StepPrediction",
    "ValidationReport",
    "ValidationRow",
    "calibration_batches",
    "engine_features",
    "nnls",
    "predict_step",
    "predict_workload",
    "profile_engines",
    "validate",
]
