"""chunk_attention_tpu (Pallas TPU kernel, TPU interpret mode on CPU) vs the reference twin.

Tolerances (max |kernel - reference| / max |reference| per array), derived in
the pallas_kernels/chunk_attention_tpu.py docstring: fp32 1e-5; bf16 2 ** -6
(2 bf16 ulps at the array max); the LSE is fp32 in both dtypes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.pallas.mosaic import tpu_info

from pallas_kernels.chunk_attention import chunk_attention_reference
from pallas_kernels.chunk_attention_tpu import chunk_attention_tpu
from tests.pallas_kernels.test_chunk_attention import _fwd_and_grads, _inputs, _rel_err

FP32_TOL = 1e-5
BF16_TOL = 2.0**-6

# (name, B or 0 (unbatched), C, start per row, kv_len per row, S, Hq, Hkv, D,
#  segment starts per row or None, block_q)
CASES = [
    # ragged prefixes incl. 0 and one spanning two 128-key blocks (the other rows'
    # second key block is skipped), a row whose chunk is cut short by kv_len,
    # packed segments, GQA 2, several query blocks
    (
        "ragged_seg_g2",
        3,
        20,
        [0, 37, 150],
        [20, 57, 162],
        200,
        4,
        2,
        32,
        [[0, 7], [0, 1, 12], [0, 10, 11]],
        8,
    ),  # fmt: skip
    # chunk of one token (padded to 8 rows), GQA 4, prefix 0 and 130
    ("chunk1_g4", 2, 1, [0, 130], [1, 131], 140, 4, 1, 64, None, 128),
    # unbatched, GQA 1, head dim 16 padded to 128 lanes
    ("unbatched_g1", 0, 12, [5], [17], 17, 2, 2, 16, None, 128),
]
IDS = [c[0] for c in CASES]


def _run(case, dtype, use_dlse=True):
    name, B, C, starts, kv_lens, S, Hq, Hkv, D, seg_starts, bq = case
    q, k, v, do, dlse = _inputs(len(name), B, C, S, Hq, Hkv, D, dtype)
    if B:
        start, kv_len = jnp.array(starts, jnp.int32), jnp.array(kv_lens, jnp.int32)
    else:
        start, kv_len = jnp.int32(starts[0]), jnp.int32(kv_lens[0])
    kw = {}
    if seg_starts is not None:
        seg = [np.searchsorted(b, np.arange(C), side="right") for b in seg_starts]
        kw["segment_ids"] = jnp.array(seg if B else seg[0], jnp.int32)
    dlse = dlse if use_dlse else None
    got = _fwd_and_grads(chunk_attention_tpu, q, k, v, start, kv_len, do, dlse, block_q=bq, **kw)
    want = _fwd_and_grads(chunk_attention_reference, q, k, v, start, kv_len, do, dlse, **kw)
    return got, want


def _names_arrays(res):
    out, lse, (dq, dk, dv) = res
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tpu_kernel_matches_reference_fp32(case):
    got, want = _run(case, jnp.float32)
    got, want = _names_arrays(got), _names_arrays(want)
    for name in got:
        assert got[name].dtype == jnp.float32
        assert got[name].shape == want[name].shape
        assert _rel_err(got[name], want[name]) <= FP32_TOL, name
    # The prefix part of dK/dV carries signal (no pass on vanishing gradients).
    P = max(case[3])
    if P > 0:
        for name in ("dk", "dv"):
            assert float(jnp.max(jnp.abs(got[name][..., :P, :, :]))) > 1e-3, name


def test_tpu_kernel_matches_reference_bf16():
    got, want = _run(CASES[0], jnp.bfloat16, use_dlse=False)
    got, want = _names_arrays(got), _names_arrays(want)
    for name in got:
        assert got[name].dtype == (jnp.float32 if name == "lse" else jnp.bfloat16)
        tol = FP32_TOL if name == "lse" else BF16_TOL
        assert _rel_err(got[name], want[name]) <= tol, name


def test_tpu_kernel_empty_rows_and_skipped_blocks():
    # Row 0: start = -3 (rows 0..2 see nothing); row 1: kv_len = 0. Keys from 128
    # on lie in a block no row may see: NaN there must neither reach the outputs
    # (the block is never computed) nor its dK/dV (exactly 0).
    B, C, S, Hq, Hkv, D = 2, 8, 256, 2, 1, 16
    q, k, v, do, _ = _inputs(3, B, C, S, Hq, Hkv, D, jnp.float32)
    poison = jnp.zeros((S, 1, 1)).at[128:].set(jnp.nan)
    start, kv_len = jnp.array([-3, 5], jnp.int32), jnp.array([5, 0], jnp.int32)
    out, lse, (dq, dk, dv) = _fwd_and_grads(
        chunk_attention_tpu, q, k + poison, v + poison, start, kv_len, do, None
    )
    out_r, lse_r, grads_r = _fwd_and_grads(
        chunk_attention_reference, q, k, v, start, kv_len, do, None
    )
    assert np.all(np.asarray(out[0, :3]) == 0.0) and np.all(np.asarray(out[1]) == 0.0)
    assert np.all(np.isneginf(lse[0, :3])) and np.all(np.isneginf(lse[1]))
    assert np.all(np.asarray(dk[:, 128:]) == 0.0) and np.all(np.asarray(dv[:, 128:]) == 0.0)
    assert _rel_err(out, out_r) <= FP32_TOL and _rel_err(lse, lse_r) <= FP32_TOL
    for g, g_r in zip(
        (dq, dk[:, :128], dv[:, :128]),
        (grads_r[0], grads_r[1][:, :128], grads_r[2][:, :128]),
        strict=True,
    ):
        assert _rel_err(g, g_r) <= FP32_TOL


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"window": 4}, r"window=4"),
        ({"block_k": 64}, r"block_k=64"),
        ({"block_q": 12}, r"block_q=12"),
    ],
)
def test_tpu_kernel_bad_input_raises(kw, match):
    q, k = jnp.zeros((8, 2, 16)), jnp.zeros((16, 2, 16))
    with pytest.raises(ValueError, match=match):
        chunk_attention_tpu(q, k, k, 0, 8, **kw)
    with pytest.raises(ValueError, match=r"segment_ids.shape=\(7,\)"):
        chunk_attention_tpu(q, k, k, 0, 8, segment_ids=jnp.zeros(7, jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_kernel_lowers_to_mosaic(dtype, monkeypatch):
    # Compiled (not interpreted) forward + backward exported for platform "tpu"
    # on this CPU: the Pallas TPU lowering runs, which checks every BlockSpec
    # against the (8, 128) tiling rule and lowers each kernel op to Mosaic. The
    # lowering of a few ops asks for the TPU generation, which a CPU host
    # cannot report: pin it to v5e (private jax API; the Mosaic compiler itself,
    # which runs on the TPU, is not exercised).
    info = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setattr(tpu_info, "get_tpu_info", lambda *a, **k: info)
    B, C, S, Hq, Hkv, D = 2, 20, 300, 4, 2, 64

    def grads(q, k, v, start, kv_len, seg, do):
        def loss(q, k, v):
            out, lse = chunk_attention_tpu(
                q, k, v, start, kv_len, segment_ids=seg, interpret=False, block_q=16,
                return_lse=True,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(lse)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    sds = jax.ShapeDtypeStruct
    args = (
        sds((B, C, Hq, D), dtype),
        sds((B, S, Hkv, D), dtype),
        sds((B, S, Hkv, D), dtype),
        sds((B,), jnp.int32),
        sds((B,), jnp.int32),
        sds((B, C), jnp.int32),
        sds((B, C, Hq, D), jnp.float32),
    )
    text = export.export(jax.jit(grads), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") == 3  # forward, dQ, dK/dV
