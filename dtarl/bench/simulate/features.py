"""Features of the simulator's cost models (package docstring: (1) and (2)).

Train: ``prepared_features`` reads the padded arrays an engine's own host-side
``prepare`` hands to the device (shape-only model, no weights). Rollout:
``rollout_features`` mirrors the sampler's buckets over the generate calls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from dtarl.batch import RolloutBatch
from dtarl.bench.replay import RolloutCall, find_forced_length_sampler
from dtarl.engines import AutoEngine, DenseEngine, DFSEngine, PrefixReuseEngine, make_engine
from dtarl.engines.config import (
    AutoConfig,
    DenseConfig,
    DFSConfig,
    PrefixActivations,
    PrefixReuseConfig,
)
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import init_model
from dtarl.model.config import ModelConfig
from dtarl.tree.plan import Op, bucket

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


# ----------------------------------------------------------------------------- train features


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
def shape_model(cfg: ModelConfig):
    """The decoder with abstract (shape-only) parameters: engines can ``prepare``."""
    return nnx.eval_shape(lambda: init_model(cfg, 0))


@functools.lru_cache(maxsize=1)
def calibration_loss():
    """The loss every feature engine prepares and every calibration times (GRPO)."""
    return ClippedSurrogateLoss.grpo()


def engine_default(kind: str, field: str):
    """The default of an engine setting (``chunk_len`` of dfs, ``microbatch``...);
    auto's dfs ``chunk_len`` is the dfs default (its candidates share EngineConfig)."""
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


def check_kind(kind: str) -> str:
    """``kind`` (an ``EngineKind`` or its value) as a string the simulator prices."""
    kind = str(getattr(kind, "value", kind))
    if kind not in (*TRAIN_KINDS, AUTO):
        raise ValueError(f"engine {kind!r} is not known; accepted: {[*TRAIN_KINDS, AUTO]}")
    return kind


def prepared_features(engine, prepared, cfg: ModelConfig) -> StepFeatures:
    """Features (1) of a ``Prepared`` batch of ``engine`` (``dtarl.bench.simulate``'s docstring)."""
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
    kind = check_kind(kind)
    return make_engine(
        kind, shape_model(cfg), **engine_kwargs(kind, chunk_len=chunk_len, microbatch=microbatch)
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
    return prepared_features(engine, engine.prepare(batch, calibration_loss()), cfg)


# ----------------------------------------------------------------------------- rollout features


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutFeatures:
    """Features (2) of a rollout: sums over its generate calls (``dtarl.bench.simulate``).

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
    found = find_forced_length_sampler()
    if found is None:
        return dict(prompts=1, rows=1, prompt_len=8, response=8)
    sampler_cls, params_cls = found
    s = sampler_cls(shape_model(ModelConfig.tiny()), params_cls())
    return dict(getattr(s, "_min", dict(prompts=1, rows=1, prompt_len=8, response=8)))


def rollout_features(calls: Sequence[RolloutCall], cfg: ModelConfig, *, dp: int = 1):
    """Features (2) of a replayed rollout (``replay.rollout_calls``) on one sampler.

    The timed rollout runs after a warm-up, so every call uses the largest
    buckets (powers of two, ``Sampler.init``) over all calls. With ``dp`` > 1 each
    rank generates ceil(1/dp) of every call's prompts and rows.
    """
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
