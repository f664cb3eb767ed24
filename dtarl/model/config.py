"""Model configuration: one frozen dataclass for the Qwen3 / Qwen2.5 / Llama 3 family."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any

from dtarl.errors import ConfigError


class ModelFamily(enum.Enum):
    QWEN3 = "qwen3"  # q/k RMSNorm per head, no q/k/v bias
    QWEN2 = "qwen2"  # q/k/v biases (Qwen2 and Qwen2.5)
    LLAMA3 = "llama"  # llama3 rope scaling, no biases


class AttentionBackend(enum.Enum):
    XLA = "xla"  # einsum + explicit mask: the reference
    PALLAS = "pallas"  # pallas_kernels: GPU or TPU kernel by platform (dispatch.py)


class Remat(enum.Enum):
    """What each decoder layer keeps for the backward pass (``decoder.remat_policy``)."""

    NONE = "none"  # every activation (no rematerialisation)
    FULL = "full"  # nothing: the layer is recomputed in the backward pass
    DOTS_SAVEABLE = "dots_saveable"  # the weight products' outputs; the rest recomputed
    OFFLOAD = "offload"  # those products in pinned host memory (GPU/TPU; else dots_saveable)


_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (``rope_type: llama3`` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor >= 1:
            raise ConfigError(f"rope_scaling.factor={self.factor} must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor}, {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: ModelFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    # The dtype of the activations between ops (residual stream, norms, RoPE,
    # softmax, the SiLU gate) and of their cotangents; None: ``compute_dtype``.
    # "float32" with ``compute_dtype="bfloat16"`` is the fp32-activation policy:
    # every parameter is read as a bf16 value and every matmul/einsum casts its
    # operands to bf16 and accumulates in fp32 (its product is never rounded),
    # while everything between the matmuls, forward and backward, stays fp32.
    # The only bf16 roundings are then the operand casts, which every engine
    # applies to the same values up to fp32 reassociation; the backward's products multiply the fp32
    # cotangent by the bf16-valued operand in fp32 (README, "Precision"). With
    # the Pallas attention backend the kernel takes bf16 q/K/V and returns bf16
    # (its cotangents are rounded there).
    activation_dtype: str | None = None
    attention_backend: AttentionBackend = AttentionBackend.XLA
    # Logits/logprobs are computed over the vocabulary in chunks of this many
    # tokens (0 = all at once) so [T, vocab] is never materialised in full.
    logits_chunk: int = 0
    # Per-layer rematerialisation of the scanned decoder layers (``Remat``).
    remat: Remat = Remat.NONE

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be > 0")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r}; accepted: {_DTYPES}")
        accepted = (None, self.compute_dtype)
        if self.compute_dtype == "bfloat16":
            accepted += ("float32",)
        if self.activation_dtype not in accepted:
            raise ConfigError(
                f"activation_dtype={self.activation_dtype!r} with "
                f"compute_dtype={self.compute_dtype!r}; accepted: {accepted} "
                "('float32' only with compute_dtype='bfloat16')"
            )
        if self.logits_chunk < 0:
            raise ConfigError(f"logits_chunk={self.logits_chunk} must be >= 0")
        if not isinstance(self.family, ModelFamily):
            raise ConfigError(f"family={self.family!r} must be a ModelFamily")
        if isinstance(self.remat, str):
            try:
                object.__setattr__(self, "remat", Remat(self.remat))
            except ValueError:
                raise ConfigError(
                    f"remat={self.remat!r}; accepted: {[r.value for r in Remat]}"
                ) from None
        if not isinstance(self.remat, Remat):
            raise ConfigError(f"remat={self.remat!r} must be a Remat")
        if not isinstance(self.attention_backend, AttentionBackend):
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} must be an AttentionBackend"
            )

    @property
    def act_dtype(self) -> str:
        """The activations' dtype: ``activation_dtype``, else ``compute_dtype``."""
        return self.activation_dtype or self.compute_dtype

    @property
    def qk_norm(self) -> bool:
        return self.family is ModelFamily.QWEN3

    @property
    def attention_bias(self) -> bool:
        return self.family is ModelFamily.QWEN2

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        attn = e * d * (2 * hq + 2 * hk)
        if self.attention_bias:
            attn += d * (hq + 2 * hk)
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else e * v
        return self.num_layers * layer + v * e + e + head

    def flops_per_token(self, context: float = 0.0) -> float:
        """Forward FLOPs of one token at a given context length (2 per MAC)."""
        e, f = self.hidden_size, self.intermediate_size
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        dense = 2 * (e * d * (2 * hq + 2 * hk) + 3 * e * f)
        attn = 2 * 2 * hq * d * context
        return self.num_layers * (dense + attn) + 2 * e * self.vocab_size

    # ----------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, family: ModelFamily = ModelFamily.QWEN3, **overrides) -> ModelConfig:
        """The embedded test model: 2 layers, hidden 64, vocab 256 (byte tokenizer)."""
        base = dict(
            family=family,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10_000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=family is not ModelFamily.LLAMA3,
        )
        if family is ModelFamily.LLAMA3:
            base["rope_scaling"] = RopeScaling(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            )
            base["rms_norm_eps"] = 1e-5
        base.update(overrides)
        return cls(**base)

    @classmethod
    def _qwen3(cls, hidden, inter, layers, heads, tie) -> ModelConfig:
        return cls(
            family=ModelFamily.QWEN3,
            vocab_size=151936,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=1_000_000.0,
            tie_word_embeddings=tie,
            max_position_embeddings=40960,
        )

    @classmethod
    def qwen3_0p6b(cls) -> ModelConfig:
        return cls._qwen3(1024, 3072, 28, 16, True)

    @classmethod
    def qwen3_1p7b(cls) -> ModelConfig:
        return cls._qwen3(2048, 6144, 28, 16, True)

    @classmethod
    def qwen3_4b(cls) -> ModelConfig:
        return cls._qwen3(2560, 9728, 36, 32, True)

    @classmethod
    def qwen3_8b(cls) -> ModelConfig:
        return cls._qwen3(4096, 12288, 36, 32, False)

    @classmethod
    def _qwen2p5(cls, vocab, hidden, inter, layers, heads, kv, head_dim, tie) -> ModelConfig:
        return cls(
            family=ModelFamily.QWEN2,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rope_theta=1_000_000.0,
            tie_word_embeddings=tie,
            max_position_embeddings=32768,
        )

    @classmethod
    def qwen2p5_0p5b(cls) -> ModelConfig:
        return cls._qwen2p5(151936, 896, 4864, 24, 14, 2, 64, True)

    @classmethod
    def qwen2p5_1p5b(cls) -> ModelConfig:
        return cls._qwen2p5(151936, 1536, 8960, 28, 12, 2, 128, True)

    @classmethod
    def qwen2p5_7b(cls) -> ModelConfig:
        return cls._qwen2p5(152064, 3584, 18944, 28, 28, 4, 128, False)

    @classmethod
    def _llama3(cls, hidden, inter, layers, head_dim, factor, tie) -> ModelConfig:
        return cls(
            family=ModelFamily.LLAMA3,
            vocab_size=128256,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=32,
            num_kv_heads=8,
            head_dim=head_dim,
            rms_norm_eps=1e-5,
            rope_theta=500_000.0,
            rope_scaling=RopeScaling(
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_word_embeddings=tie,
            max_position_embeddings=131072,
        )

    @classmethod
    def llama3p2_1b(cls) -> ModelConfig:
        return cls._llama3(2048, 8192, 16, 64, 32.0, True)

    @classmethod
    def llama3p1_8b(cls) -> ModelConfig:
        return cls._llama3(4096, 14336, 32, 128, 8.0, False)

    PRESETS = (
        "tiny",
        "qwen3_0p6b",
        "qwen3_1p7b",
        "qwen3_4b",
        "qwen3_8b",
        "qwen2p5_0p5b",
        "qwen2p5_1p5b",
        "qwen2p5_7b",
        "llama3p2_1b",
        "llama3p1_8b",
    )

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in cls.PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; accepted: {cls.PRESETS}")
        return getattr(cls, name)()

    # ---------------------------------------------------------------- HF config

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any], **overrides):
        """Builds a config from a HF ``config.json`` (a path, a directory, or a dict)."""
        if isinstance(path_or_dict, dict):
            hf, where = path_or_dict, "config"
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            where = p
            try:
                with open(p) as f:
                    hf = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"{p}: no such file (expected a HF config.json)") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{p}: cannot be read as a HF config.json ({e})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{where}: expected a JSON object of fields, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        families = {
            "qwen3": ModelFamily.QWEN3,
            "qwen2": ModelFamily.QWEN2,
            "llama": ModelFamily.LLAMA3,
        }
        if model_type not in families:
            raise ConfigError(
                f"{where}: model_type={model_type!r} is not supported; accepted: {sorted(families)}"
            )
        family = families[model_type]

        def need(key):
            if key not in hf:
                raise ConfigError(f"{where}: missing field {key!r} for model_type {model_type!r}")
            value = hf[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {key}={value!r} must be an integer >= 1")
            return value

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = hf.get("head_dim")
        if not head_dim:
            if hidden % heads:
                raise ConfigError(
                    f"{where}: no head_dim and hidden_size={hidden} is not a multiple of "
                    f"num_attention_heads={heads}"
                )
            head_dim = hidden // heads
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r} is not supported; accepted: 'silu'")
        if family is ModelFamily.QWEN2 and hf.get("use_sliding_window", False):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported for qwen2")
        if family is ModelFamily.QWEN3 and hf.get("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported for qwen3")
        rope_scaling = None
        rs = hf.get("rope_scaling") or None
        if rs is None and isinstance(hf.get("rope_parameters"), dict):
            rp = hf["rope_parameters"]
            if rp.get("rope_type", "default") != "default":
                rs = rp
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype == "llama3":
                try:
                    rope_scaling = RopeScaling(
                        factor=float(rs["factor"]),
                        low_freq_factor=float(rs["low_freq_factor"]),
                        high_freq_factor=float(rs["high_freq_factor"]),
                        original_max_position_embeddings=int(
                            rs["original_max_position_embeddings"]
                        ),
                    )
                except KeyError as e:
                    raise ConfigError(f"{where}: rope_scaling is missing {e}") from None
            elif rtype not in (None, "default"):
                raise ConfigError(
                    f"{where}: rope_scaling type {rtype!r} is not supported; accepted: "
                    "'llama3' or none"
                )
        theta = hf.get("rope_theta")
        if theta is None and isinstance(hf.get("rope_parameters"), dict):
            theta = hf["rope_parameters"].get("rope_theta")
        if theta is None:
            theta = 10000.0
        if family is ModelFamily.LLAMA3 and hf.get("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported for llama")
        if family is ModelFamily.LLAMA3 and hf.get("mlp_bias", False):
            raise ConfigError(f"{where}: mlp_bias=true is not supported for llama")
        try:  # a field of the wrong type (a string, a list) names the file
            kwargs = dict(
                family=family,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: a field has the wrong type ({e})") from None
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (used by ``save_hf``)."""
        arch = {
            ModelFamily.QWEN3: "Qwen3ForCausalLM",
            ModelFamily.QWEN2: "Qwen2ForCausalLM",
            ModelFamily.LLAMA3: "LlamaForCausalLM",
        }[self.family]
        hf: dict[str, Any] = dict(
            architectures=[arch],
            model_type=self.family.value,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            torch_dtype=self.param_dtype,
            dtype=self.param_dtype,
        )
        if self.family is ModelFamily.LLAMA3:
            hf["attention_bias"] = False
            hf["mlp_bias"] = False
        if self.family is ModelFamily.QWEN3:
            hf["attention_bias"] = False
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            hf["rope_scaling"] = dict(
                rope_type="llama3",
                factor=rs.factor,
                low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
            )
        return hf
