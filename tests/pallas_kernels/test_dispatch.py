"""AttentionBackend.PALLAS: kernel selection by platform (on CPU: interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.dispatch as dispatch
from dtarl.model import AttentionBackend, ModelConfig
from dtarl.model.decoder import attend_pallas, attend_xla
from pallas_kernels.chunk_attention import chunk_attention
from pallas_kernels.chunk_attention_tpu import chunk_attention_tpu
from pallas_kernels.dispatch import chunk_attention_for_platform


def test_selection_on_cpu():
    assert jax.default_backend() == "cpu"
    assert ModelConfig.tiny().attention_backend is AttentionBackend.XLA  # the default
    for platform, kernel in (
        (None, chunk_attention),
        ("gpu", chunk_attention),
        ("tpu", chunk_attention_tpu),
    ):
        fn = chunk_attention_for_platform(platform)
        assert fn.func is kernel and fn.keywords == {"interpret": True}, platform
    with pytest.raises(NotImplementedError, match=r"platform 'metal'"):
        chunk_attention_for_platform("metal")


def test_attend_pallas_tpu_kernel_packed_rows_match_xla(monkeypatch):
    # The decoder's contract, through the TPU kernel (the GPU kernel's path is
    # tests/engines/test_engine_pallas.py): rows over one shared (batch-1)
    # prefix of valid length 5 in a 7-slot buffer, packed segments per row.
    chosen = chunk_attention_for_platform("tpu")
    monkeypatch.setattr(dispatch, "chunk_attention_for_platform", lambda platform=None: chosen)
    B, T, P, H, K, D = 2, 6, 7, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (B, T, H, D))
    kp, vp = jax.random.normal(ks[1], (1, P, K, D)), jax.random.normal(ks[2], (1, P, K, D))
    kn, vn = jax.random.normal(ks[3], (B, T, K, D)), jax.random.normal(ks[4], (B, T, K, D))
    prefix_len = jnp.array([5, 5], jnp.int32)
    seg = jnp.array([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2]], jnp.int32)
    got = attend_pallas(q, kp, vp, prefix_len, kn, vn, seg)
    want = attend_xla(q, kp, vp, prefix_len, kn, vn, seg)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err <= 1e-5, err
    unpacked = attend_xla(q, kp, vp, prefix_len, kn, vn, None)
    assert not np.allclose(got, unpacked, atol=1e-3)  # the segments matter
