"""Pallas kernels for dtarl, each with a plain-jnp reference twin (STYLE #7)."""

from pallas_kernels.chunk_attention import (
    chunk_attention,
    chunk_attention_reference,
    chunk_attention_sharded,
)
from pallas_kernels.chunk_attention_tpu import chunk_attention_tpu
from pallas_kernels.dispatch import chunk_attention_for_platform

__all__ = [
    "chunk_attention",
    "chunk_attention_for_platform",
    "chunk_attention_reference",
    "chunk_attention_sharded",
    "chunk_attention_tpu",
]
