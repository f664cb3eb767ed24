"""Flax NNX decoder family (Qwen3, Qwen2.5, Llama 3) with explicit prefix K/V."""

from dtarl.model.config import (
    AttentionBackend,
    ConfigError,
    ModelConfig,
    ModelFamily,
    Remat,
    RopeScaling,
)
from dtarl.model.decoder import Decoder, KVCache, init_model, token_logprobs

__all__ = [
    "Remat",
    "AttentionBackend",
    "ConfigError",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelFamily",
    "RopeScaling",
    "init_model",
    "token_logprobs",
]

from dtarl.model.hf import CheckpointError, load_hf, save_hf  # noqa: E402

__all__ += ["CheckpointError", "load_hf", "save_hf"]
