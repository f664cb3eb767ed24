"""Tiny random Hugging Face checkpoints for tests (needs the ``hf`` extra).

``make_tiny_hf_checkpoint`` builds a Qwen3 / Qwen2 / Llama 3 model with
``transformers`` at the shapes of ``ModelConfig.tiny`` (hidden 64, 2 layers,
4 heads, 2 KV heads, head_dim 16, mlp 128, vocab 256), re-draws every weight so
that nothing is left at a trivial init (norm weights are ``1 + 0.1 N(0, 1)``,
biases ``0.1 N(0, 1)``, matrices ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``;
logits are O(1)), and saves it as safetensors with ``save_pretrained``.
"""

from __future__ import annotations

import math
import os

from dtarl.model.config import ModelFamily

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


def _import_hf():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(
            f"dtarl.testing.hf needs torch and transformers ({e}); install the `hf` extra: "
            "pip install 'dtarl[hf]' (torch==2.13.0 CPU wheel first)"
        ) from e
    return torch, transformers


def _family(family: ModelFamily | str) -> ModelFamily:
    if isinstance(family, ModelFamily):
        return family
    try:
        return ModelFamily(family)
    except ValueError:
        accepted = [f.value for f in ModelFamily]
        raise ValueError(f"family={family!r} is not supported; accepted: {accepted}") from None


def make_tiny_hf_model(
    family: ModelFamily | str,
    *,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
):
    """The tiny random ``transformers`` model (fp32, eager attention, eval mode)."""
    torch, transformers = _import_hf()
    family = _family(family)
    if tie_word_embeddings is None:
        tie_word_embeddings = family is not ModelFamily.LLAMA3  # as ModelConfig.tiny
    common = dict(_TINY, tie_word_embeddings=tie_word_embeddings, attn_implementation="eager")
    if family is ModelFamily.QWEN3:
        config = transformers.Qwen3Config(rope_theta=10_000.0, rms_norm_eps=1e-6, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family is ModelFamily.QWEN2:
        config = transformers.Qwen2Config(rope_theta=10_000.0, rms_norm_eps=1e-6, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(
            rope_theta=10_000.0,
            rms_norm_eps=1e-5,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
            **common,
        )
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # nn.Linear weight [out, in]
                p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def make_tiny_hf_checkpoint(
    out_dir: str | os.PathLike,
    family: ModelFamily | str,
    *,
    seed: int = 0,
    sharded: bool = False,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
) -> str:
    """Saves a tiny random HF checkpoint to ``out_dir`` and returns the path.

    ``sharded=True`` splits the weights into several ``model-0000k-of-0000n``
    files (32 KB each at most) with a ``model.safetensors.index.json``.
    ``dtype`` is the stored dtype: ``"float32"`` or ``"bfloat16"``.
    ``tie_word_embeddings`` defaults to ``ModelConfig.tiny``'s choice (tied for
    the Qwen families, untied for Llama).
    """
    torch, _ = _import_hf()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted: {sorted(dtypes)}")
    model = make_tiny_hf_model(family, seed=seed, tie_word_embeddings=tie_word_embeddings)
    model = model.to(dtypes[dtype])
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    kwargs = {"max_shard_size": "32KB"} if sharded else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out
