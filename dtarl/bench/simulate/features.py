"""Features of the simulator's cost models (package docstring: (1) and (2)).

Train: ``engine.features(prepared)`` counts the padded arrays an engine's own host-side
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
from dtarl.engines import make_engine
from dtarl.engines.base import WorkFeatures
from dtarl.engines.config import (
    AutoConfig,
    DenseConfig,
    DFSConfig,
    PrefixReuseConfig,
)
from dtarl.engines.cost import token_flops
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import init_model
from dtarl.model.config import ModelConfig
from dtarl.tree.plan import bucket

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
) -> WorkFeatures:
    """Features (1) of ``batch`` for a fresh engine of ``kind``: its own ``prepare``, no device.

    ``chunk_len`` / ``microbatch`` default to the engines' own defaults (auto
    always uses its own, like ``make_engine("auto")`` in the replay).
    """
    engine = feature_engine(kind, cfg, chunk_len=chunk_len, microbatch=microbatch)
    return engine.features(engine.prepare(batch, calibration_loss()))


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
    parts = rollout_call_features(calls, cfg, dp=dp)
    return RolloutFeatures(
        prefill_flops=sum(f.prefill_flops for f in parts),
        decode_lin_flops=sum(f.decode_lin_flops for f in parts),
        decode_attn_flops=sum(f.decode_attn_flops for f in parts),
        decode_steps=sum(f.decode_steps for f in parts),
        calls=float(len(calls)),
        generated=sum(f.generated for f in parts),
    )


def rollout_call_features(
    calls: Sequence[RolloutCall], cfg: ModelConfig, *, dp: int = 1
) -> list[RolloutFeatures]:
    """``rollout_features`` of each call (turn) alone, at the buckets of the whole rollout;
    they add up to ``rollout_features(calls)`` (the model is linear in them)."""
    if dp < 1:
        raise ValueError(f"dp={dp}: must be >= 1")
    if not calls:
        return []
    mins = _sampler_minimums()
    q = bucket(max(-(-len(c.prompts) // dp) for c in calls), mins["prompts"])
    rows = bucket(max(-(-len(c.forced) // dp) for c in calls), mins["rows"])
    p = bucket(max(len(x) for c in calls for x in c.prompts), mins["prompt_len"])
    r = bucket(max(max(c.forced) for c in calls), mins["response"])
    f0, fa = token_flops(cfg)
    out = []
    for c in calls:
        steps = float(max(c.forced) - 1)
        out.append(
            RolloutFeatures(
                prefill_flops=float(q * p * (f0 + fa * p)),
                decode_lin_flops=float(rows * steps * f0),
                decode_attn_flops=float(rows * steps * fa * (p + r)),
                decode_steps=steps,
                calls=1.0,
                generated=float(sum(c.forced)),
            )
        )
    return out
