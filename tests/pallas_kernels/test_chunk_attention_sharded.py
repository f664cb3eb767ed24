"""chunk_attention inside jax.shard_map over a ('dp', 'tp') mesh of CPU devices.

Needs 8 devices: tests/conftest.py sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported.
Batch rows split over dp (2), heads over tp (4); the result and the gradients
must equal the unsharded kernel's (same kernel per shard, so equality is up to
fp32 rounding only; held to the 1e-5 fp32 bound of test_chunk_attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_kernels.chunk_attention import chunk_attention, chunk_attention_sharded

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "before jax is imported (tests/conftest.py does)",
)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_sharded_matches_unsharded(axis_type):
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), (axis_type, axis_type), devices=jax.devices()[:8])
    B, C, S, Hq, Hkv, D = 2, 32, 80, 8, 4, 16
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (B, C, Hq, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.float32)
    do = jax.random.normal(ks[3], q.shape, jnp.float32)
    start, kv_len = jnp.array([20, 45], jnp.int32), jnp.array([52, 77], jnp.int32)
    kw = dict(block_q=16, block_k=16)

    sharded = chunk_attention_sharded(mesh, return_lse=True, **kw)
    unsharded = lambda q, k, v, s, n: chunk_attention(q, k, v, s, n, return_lse=True, **kw)

    def fwd_and_grads(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v, start, kv_len)
            return jnp.sum(out * do), (out, lse)

        grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, lse, *grads

    got, want = fwd_and_grads(sharded), fwd_and_grads(unsharded)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want, strict=True):
        assert a.shape == b.shape, name
        assert _rel_err(a, b) <= 1e-5, name
    # The work really was spread over the mesh.
    assert len(got[0].sharding.device_set) == 8


def test_sharded_rejects_indivisible_heads():
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
    f = chunk_attention_sharded(mesh)
    q = jnp.zeros((2, 16, 6, 16))
    k = jnp.zeros((2, 32, 2, 16))
    with pytest.raises(ValueError, match=r"Hq=6"):
        f(q, k, k, jnp.zeros((2,), jnp.int32), jnp.full((2,), 32, jnp.int32))
