"""Per-device bytes of a training run's state with and without LoRA (from the config
alone: no weights are built).

    rows = memory_table(ModelConfig.qwen3_8b(), LoraConfig(rank=16), kl=True)

What each side holds (b = the model's param dtype bytes, P = parameters, T = the
adapted weights' parameters, N = adapter parameters, S = ``shards``, the devices the
sharded state is split over; adapters are replicated):

=================  =========================  ==================================
                   full fine-tuning           LoRA
=================  =========================  ==================================
weights            P b / S                    P b / S (the frozen base)
merged weights     -                          T b / S (W + (alpha/r) A@B, per step)
engine gradient    4 P / S (fp32 accumulator) 4 P / S (the engine's program is the
                                              full model's: dL/dW' feeds (2))
adapters           -                          4 N (fp32) + 4 N (their gradient)
AdamW moments      2 P b / S (optax: params'  8 N (fp32)
                   dtype)
KL reference       P b / S (a second copy)    0 (the base, adapters off)
=================  =========================  ==================================

Activations and K/V are the engine's and the same on both sides (``dtarl bench
memory`` measures them); they are not in this table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dtarl.lora.adapters import LoraConfig
from dtarl.model.config import ModelConfig


def target_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """(I, O) of each target of one layer."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    io = {
        "q_proj": (e, hq * d),
        "k_proj": (e, hk * d),
        "v_proj": (e, hk * d),
        "o_proj": (hq * d, e),
        "gate_proj": (e, f),
        "up_proj": (e, f),
        "down_proj": (f, e),
    }
    return {t: io[t] for t in lora.targets}


def adapter_params(cfg: ModelConfig, lora: LoraConfig) -> int:
    """N: adapter parameters (A and B of every target of every layer)."""
    return cfg.num_layers * sum(lora.rank * (i + o) for i, o in target_shapes(cfg, lora).values())


def adapted_params(cfg: ModelConfig, lora: LoraConfig) -> int:
    """T: parameters of the adapted base weights."""
    return cfg.num_layers * sum(i * o for i, o in target_shapes(cfg, lora).values())


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-device bytes of one side (see the module docstring)."""

    weights: int
    merged: int
    grads: int
    adapters: int
    optimizer: int
    reference: int

    @property
    def total(self) -> int:
        return sum(dataclasses.asdict(self).values())


def state_bytes(
    cfg: ModelConfig, lora: LoraConfig | None, *, kl: bool = True, shards: int = 1
) -> StateBytes:
    """Per-device bytes of the training state of ``cfg`` (``lora`` None: full
    fine-tuning) with a KL reference when ``kl``, the sharded parts over ``shards``."""
    p = cfg.num_params()
    b = int(np.dtype(cfg.param_dtype).itemsize)

    def sh(n):
        return -(-n // shards)

    if lora is None:
        return StateBytes(
            weights=sh(p * b),
            merged=0,
            grads=sh(4 * p),
            adapters=0,
            optimizer=sh(2 * p * b),
            reference=sh(p * b) if kl else 0,
        )
    n = adapter_params(cfg, lora)
    return StateBytes(
        weights=sh(p * b),
        merged=sh(adapted_params(cfg, lora) * b),
        grads=sh(4 * p),
        adapters=8 * n,
        optimizer=8 * n,
        reference=0,
    )


PRESETS = ("qwen3_0p6b", "qwen3_1p7b", "qwen3_4b", "qwen3_8b")


def memory_table(
    lora: LoraConfig, *, kl: bool = True, shards: int = 1, presets=PRESETS, dtype="bfloat16"
) -> list[dict]:
    """One row per Qwen3 preset (params in ``dtype``): per-device GiB of the full and
    the LoRA state, what LoRA saves, and the KL reference's share of it."""
    rows = []
    for name in presets:
        cfg = ModelConfig.preset(name).replace(param_dtype=dtype)
        full = state_bytes(cfg, None, kl=kl, shards=shards)
        lo = state_bytes(cfg, lora, kl=kl, shards=shards)
        rows.append(
            dict(
                preset=name,
                params=cfg.num_params(),
                adapter_params=adapter_params(cfg, lora),
                full_bytes=full.total,
                lora_bytes=lo.total,
                saved_bytes=full.total - lo.total,
                reference_saved_bytes=full.reference - lo.reference,
                full=dataclasses.asdict(full),
                lora=dataclasses.asdict(lo),
            )
        )
    return rows


__all__ = [
    "PRESETS",
    "StateBytes",
    "adapted_params",
    "adapter_params",
    "memory_table",
    "state_bytes",
    "target_shapes",
]
