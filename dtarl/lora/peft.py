"""Adapters as a PEFT LoRA adapter directory: ``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, path)``
loads onto the HF base model.

    save_peft(adapters, lora_cfg, "out/adapter", base_model="Qwen/Qwen3-0.6B")

PEFT's LoRA of ``nn.Linear`` W [O, I] is W + (lora_alpha / r) B_pt @ A_pt with
``lora_A.weight`` [r, I] and ``lora_B.weight`` [O, r]; dtarl's adapter of the same
weight is A [I, r], B [r, O] over the input and output features in the order the
HF layout flattens them (``dtarl.model.hf``: q_proj [E, H, D] = W.T.reshape), so
``lora_A.weight = A.T`` and ``lora_B.weight = B.T``. A stacked adapter [L, I, r]
(layers under a scan) is written one layer at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np

from dtarl.errors import CheckpointError
from dtarl.lora.adapters import Adapter, LoraConfig

HF_MODULE = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
PREFIX = "base_model.model.model.layers"


def _per_layer(key: str, ad: Adapter):
    """(layer index, a [I, r], b [r, O]) of an adapter keyed ``key``: its layer index is
    the path's integer part, or, for a stacked adapter, the leading axis."""
    a, b = np.asarray(jax.device_get(ad.a)), np.asarray(jax.device_get(ad.b))
    ints = [int(p) for p in key.split("/") if p.isdigit()]
    if a.ndim == 2:
        if len(ints) != 1:
            raise CheckpointError(f"adapter {key}: no layer index in its path")
        yield ints[0], a, b
    elif a.ndim == 3 and not ints:
        for i in range(a.shape[0]):
            yield i, a[i], b[i]
    else:
        raise CheckpointError(f"adapter {key}: shape {a.shape} is not [I, r] or [L, I, r]")


def peft_tensors(adapters: dict[str, Adapter]) -> dict[str, np.ndarray]:
    """The adapter file's tensors (fp32), PEFT's names."""
    out = {}
    for key, ad in sorted(adapters.items()):
        target = key.rsplit("/", 1)[-1]
        for layer, a, b in _per_layer(key, ad):
            name = f"{PREFIX}.{layer}.{HF_MODULE[target]}.{target}"
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.T.astype(np.float32))
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.T.astype(np.float32))
    return out


def adapter_config(cfg: LoraConfig, base_model: str | None) -> dict:
    """``adapter_config.json``: a plain LoRA of the targets, no bias, no dropout."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft(
    adapters: dict[str, Adapter], cfg: LoraConfig, path: str, *, base_model: str | None = None
) -> str:
    """Writes the PEFT adapter directory ``path`` (atomic: a temporary directory renamed
    into place; an existing ``path`` is replaced). Returns ``path``."""
    from safetensors.numpy import save_file

    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".dtarl-peft-", dir=parent)
    try:
        save_file(peft_tensors(adapters), os.path.join(tmp, "adapter_model.safetensors"))
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(adapter_config(cfg, base_model), f, indent=2)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


__all__ = ["HF_MODULE", "adapter_config", "peft_tensors", "save_peft"]
