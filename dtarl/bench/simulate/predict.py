"""Prediction: a workload's step (rollout + tool + reward + inference + train per engine)
on a described cluster, from a ``CostProfile``; nothing runs on the device."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtarl.batch import RolloutBatch
from dtarl.bench.replay import (
    ToolClock,
    WorkloadSpec,
    default_tool_sampler,
    model_turns,
    reward_phase,
    reward_sampler_for,
    rollout_calls,
    tool_phase,
)
from dtarl.bench.simulate.features import (
    AUTO,
    RolloutFeatures,
    WorkFeatures,
    check_kind,
    engine_features,
    rollout_call_features,
    rollout_features,
)
from dtarl.bench.simulate.fit import CostProfile, price
from dtarl.model.config import ModelConfig
from dtarl.parallel.partition import PartitionMethod, partition_batch
from dtarl.traces.workload import Workload
from dtarl.tree.plan import bucket


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
    features: tuple[WorkFeatures, ...]  # per dp rank
    program: str = ""  # the engine whose program runs (auto: its pick)
    choose_s: float = 0.0  # auto: the choice's host time (3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Predicted step: rollout (when modelled) + tool stage (simulated clock) + training.

    tool_in_step_units: whether ``tool_s`` and ``reward_s`` are in the same seconds
    as the other stages (False: the trace's production seconds, and ``step_s`` is None).
    rollout_step_s: with them, the rollout on per-trajectory timelines (each
    trajectory's turns, priced per call, plus its own tool calls; the slowest
    trajectory), as the replay's ``WorkloadReplay.rollout_step_s``; the step is
    then rollout_step_s + reward + inference + train.
    """

    cluster: ClusterSpec
    tool_s: float
    engines: dict[str, EnginePrediction]
    rollout_s: float | None = None
    rollout_features: RolloutFeatures | None = None
    tool_in_step_units: bool = True
    reward_s: float = 0.0  # sampled like the replay; production seconds unless scaled
    inference_s: float | None = None  # forward-only passes (predict_inference)
    rollout_step_s: float | None = None

    def step_s(self, kind: str) -> float | None:
        if (self.tool_s > 0 or self.reward_s > 0) and not self.tool_in_step_units:
            return None
        roll = self.rollout_step_s
        if roll is None:
            roll = (self.rollout_s or 0.0) + self.tool_s
        return roll + self.reward_s + (self.inference_s or 0.0) + self.engines[kind].train_s

    def to_dict(self) -> dict[str, Any]:
        return dict(
            cluster=self.cluster.to_dict(),
            tool_s=self.tool_s,
            reward_s=self.reward_s,
            inference_s=self.inference_s,
            rollout_step_s=self.rollout_step_s,
            production_stages_in_step=self.tool_in_step_units,
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
    kinds = profile.kinds if engines is None else [check_kind(k) for k in engines]
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


def inference_features(batch: RolloutBatch, cfg: ModelConfig) -> WorkFeatures:
    """The forward-only scorer's program (the trainer's ``Scorer``): one dense forward over
    [bucket(N), bucket(T, 8)] tokens, full T x T attention, no backward:
    F_lin = N T f0, F_attn = N T^2 fa, one step."""
    n = bucket(batch.num_sequences)
    t = bucket(int(batch.lengths.max()), 8)
    f0 = cfg.flops_per_token(0)
    fa = cfg.flops_per_token(1) - f0
    return WorkFeatures(
        lin_flops=float(n * t * f0),
        attn_flops=float(n * t * t * fa),
        steps=1.0,
        tokens=float(n * t),
        program="dense",
    )


def predict_inference(
    workload: Workload | RolloutBatch,
    profile: CostProfile,
    cluster: ClusterSpec | None = None,
    *,
    passes: int = 1,
    model: ModelConfig | None = None,
) -> float | None:
    """Seconds of ``passes`` forward-only logprob passes: the dense training coefficients
    (seconds per FLOP, per step, per call) applied to ``inference_features`` of each dp
    rank's sequences (slowest rank). None without a dense cost model in the profile."""
    if passes == 0 or "dense" not in profile.engines:
        return None if passes else 0.0
    cluster = ClusterSpec.single() if cluster is None else cluster
    cfg = profile.model if model is None else model
    batch = workload.batch if isinstance(workload, Workload) else workload
    div = cluster.tp * cluster.throughput_scale
    times = [
        profile.engines["dense"].predict(inference_features(b, cfg), flop_divisor=div)
        for b in _rank_batches(batch, cluster)
    ]
    return passes * float(max(times))


def predict_workload(
    spec: WorkloadSpec,
    profile: CostProfile,
    cluster: ClusterSpec | None = None,
    *,
    engines: Sequence[str] | None = None,
    model: ModelConfig | None = None,
    tool_time_scale: float | None = None,
    inference_passes: int = 1,
    reward: bool = True,
) -> StepPrediction:
    """``predict_step`` of a spec's workload, with its rollout (2), its tool and reward
    stages sampled like the replay's (times ``tool_time_scale``; None keeps production
    seconds and the prediction then has no step total) and ``inference_passes``
    forward-only passes (``predict_inference``)."""
    cfg = profile.model if model is None else model
    w = spec.build(vocab_size=cfg.vocab_size)
    tool = tool_phase(
        w,
        default_tool_sampler(spec.source, w.info.step),
        clock=ToolClock.SIMULATED,
        time_scale=tool_time_scale,
        seed=spec.seed,
    )
    pred = predict_step(w, profile, cluster, engines=engines, model=cfg, tool_s=tool.seconds)
    rew = None
    if reward:
        sampler, where = reward_sampler_for(spec.source, w.info.step)
        rew = reward_phase(
            w, sampler, time_scale=tool_time_scale, seed=spec.seed, missing=where, source=where
        )
    pred = dataclasses.replace(
        pred,
        tool_in_step_units=tool_time_scale is not None,
        reward_s=rew.seconds if rew is not None else 0.0,
        inference_s=predict_inference(w, profile, cluster, passes=inference_passes, model=cfg),
    )
    roll = predict_rollout(w, profile, cluster, model=cfg)
    if roll is None:
        return pred
    pred = dataclasses.replace(pred, rollout_s=roll[0], rollout_features=roll[1])
    if tool_time_scale is None:
        return pred
    cl = ClusterSpec.single() if cluster is None else cluster
    div = cl.tp * cl.throughput_scale
    turn_s = np.cumsum(
        [0.0]
        + [
            profile.rollout.predict(f, flop_divisor=div)
            for f in rollout_call_features(rollout_calls(w), cfg, dp=cl.dp)
        ]
    )
    turns = model_turns(w)
    counts = [len(turns[t][1]) for t in sorted(turns)]
    tools = tool.per_trajectory_s or (0.0,) * len(counts)
    timeline = max(
        float(turn_s[min(k, len(turn_s) - 1)] + tool_time_scale * t)
        for k, t in zip(counts, tools, strict=True)
    )
    return dataclasses.replace(pred, rollout_step_s=timeline)
