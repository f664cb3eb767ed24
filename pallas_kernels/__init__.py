"""Pallas kernels for dtarl, each with a plain-jnp reference twin (STYLE #7)."""

from pallas_kernels.chunk_attention import (
    chunk_attention,
    chunk_attention_reference,
    chunk_attention_sharded,
)

__all__ = ["chunk_attention", "chunk_attention_reference", "chunk_attention_sharded"]
