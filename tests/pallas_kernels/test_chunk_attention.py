"""chunk_attention (Pallas, interpret mode on CPU) vs its reference twin.

Letters: B batch, C chunk, P prefix, S keys (prefix + chunk + padding), Hq/Hkv
heads, G = Hq // Hkv, D head dim.

Tolerances, as max |kernel - reference| / max |reference| per array:

* fp32: 1e-5 (STYLE #6 "simple" bound). Both sides compute in fp32 with
  full-precision dots; they differ only in summation order and online-softmax
  rescaling, a few ulps (observed ~5e-7).
* bf16: 2 ** -6 = 0.0156, i.e. 2 bf16 ulps at the array's max (bf16 spacing
  is 2 ** -7 relative to a value). Both sides read the same bf16 inputs; the
  reference then works in fp32, while the kernel, like every flash kernel,
  (a) rounds P to bf16 before the P.V matmul and, in the backward, dS to bf16
  before the dS.K / dS^T.Q matmuls (unit roundoff 2 ** -8 per element, errors
  of random sign that partly average out in the sums), and (b) rounds its
  result to bf16 (<= 0.5 ulp), as does the reference (<= 0.5 ulp). Worst case
  ~1.5 ulps; observed <= 0.8 ulp (6e-3) over the grid below. A mask or scale
  bug gives O(1) relative errors, far above this bound.
* LSE is fp32 in both dtypes; for bf16 inputs the logits are exact products of
  bf16 values accumulated in fp32 on both sides, so LSE keeps the fp32 bound.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.chunk_attention import chunk_attention, chunk_attention_reference

FP32_TOL = 1e-5
BF16_TOL = 2.0**-6


def _rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape
    scale = np.max(np.abs(want[np.isfinite(want)]), initial=0.0)
    # -inf LSE entries (rows with no visible key) must match exactly.
    inf = ~np.isfinite(want)
    assert np.array_equal(got[inf], want[inf]), "non-finite entries differ"
    diff = np.abs(got[~inf] - want[~inf])
    return float(np.max(diff, initial=0.0) / max(scale, 1e-30))


def _inputs(seed, B, C, S, Hq, Hkv, D, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    lead = (B,) if B else ()
    q = jax.random.normal(ks[0], (*lead, C, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (*lead, S, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (*lead, S, Hkv, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], q.shape, jnp.float32).astype(dtype)
    dlse = jax.random.normal(ks[4], q.shape[:-1], jnp.float32)
    return q, k, v, do, dlse


def _fwd_and_grads(fn, q, k, v, start, kv_len, do, dlse, **kw):
    """Output, LSE and d/d(q, k, v) of <out, do> + <lse, dlse> (LSE cotangent tested)."""

    def loss(q, k, v):
        out, lse = fn(q, k, v, start, kv_len, return_lse=True, **kw)
        val = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
        if dlse is not None:
            val = val + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)
        return val, (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, grads


# (name, B or 0 for the unbatched form, C, prefix P per row, kv_len per row, S, Hq, Hkv,
#  block_q, block_k, window)
CASES = [
    # prefix 0, G = 1, unbatched, blocks == C
    ("p0_g1", 0, 16, [0], [16], 16, 2, 2, 16, 16, None),
    # prefix shorter than a block, G = 2, S padded past kv_len, kv_len unaligned
    ("short_prefix_g2", 0, 64, [10], [74], 83, 4, 2, 16, 16, None),
    # several prefix blocks, G = 4 (MQA-like), kv_len = 228 not a multiple of 32
    ("long_prefix_g4", 0, 128, [100], [228], 228, 4, 1, 32, 32, None),
    # batched, per-row start/kv_len: prefix 0, unaligned prefix, chunk cut short
    # by kv_len (padded tail of the chunk), and a long prefix
    ("batched_rows", 4, 64, [0, 37, 20, 90], [64, 101, 61, 154], 160, 4, 2, 16, 32, None),
    # sliding window (skips leading key blocks)
    ("window", 0, 64, [70], [134], 140, 4, 2, 16, 16, 40),
]
IDS = [c[0] for c in CASES]


def _run_case(case, dtype, use_dlse=True):
    name, B, C, starts, kv_lens, S, Hq, Hkv, bq, bk, window = case
    D = 32 if dtype == jnp.float32 else 16
    q, k, v, do, dlse = _inputs(zlib.crc32(name.encode()) % 1000, B, C, S, Hq, Hkv, D, dtype)
    if B:
        start, kv_len = jnp.array(starts, jnp.int32), jnp.array(kv_lens, jnp.int32)
    else:
        start, kv_len = jnp.int32(starts[0]), jnp.int32(kv_lens[0])
    dlse = dlse if use_dlse else None
    got = _fwd_and_grads(
        chunk_attention, q, k, v, start, kv_len, do, dlse, block_q=bq, block_k=bk, window=window
    )
    want = _fwd_and_grads(
        chunk_attention_reference, q, k, v, start, kv_len, do, dlse, window=window
    )
    return got, want


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_reference_fp32(case):
    (out, lse, grads), (out_r, lse_r, grads_r) = _run_case(case, jnp.float32)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert _rel_err(out, out_r) <= FP32_TOL
    assert _rel_err(lse, lse_r) <= FP32_TOL
    for name, g, g_r in zip("qkv", grads, grads_r, strict=True):
        assert g.dtype == jnp.float32
        assert _rel_err(g, g_r) <= FP32_TOL, f"d{name}"
    # Guard against passing on vanishing gradients: the prefix part of dK/dV
    # (keys before the first row's start) carries signal.
    P = min(case[3])
    if P > 0:
        dk, dv = grads[1], grads[2]
        for g in (dk, dv):
            assert float(jnp.max(jnp.abs(g[..., :P, :, :]))) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiled_gpu_kernel_matches_reference_fp32(case):
    """The Triton kernel compiled for the GPU (``interpret=None`` is False there), not
    the interpreter the CPU runs: fp32 bound. The reference's products at "highest"
    (the kernel's fp32 dots are full fp32), not the GPU's default TF32."""
    assert jax.default_backend() == "gpu"
    with jax.default_matmul_precision("highest"):
        (out, lse, grads), (out_r, lse_r, grads_r) = _run_case(case, jnp.float32)
    assert _rel_err(out, out_r) <= FP32_TOL
    assert _rel_err(lse, lse_r) <= FP32_TOL
    for name, g, g_r in zip("qkv", grads, grads_r, strict=True):
        assert _rel_err(g, g_r) <= FP32_TOL, f"d{name}"


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_matches_reference_bf16(case):
    (out, lse, grads), (out_r, lse_r, grads_r) = _run_case(case, jnp.bfloat16, use_dlse=False)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert _rel_err(out, out_r) <= BF16_TOL
    assert _rel_err(lse, lse_r) <= FP32_TOL
    for name, g, g_r in zip("qkv", grads, grads_r, strict=True):
        assert g.dtype == jnp.bfloat16
        assert _rel_err(g, g_r) <= BF16_TOL, f"d{name}"


@pytest.mark.parametrize("window", [None, 20])
def test_block_boundary_sweep(window):
    # start/kv_len are runtime values, so one compiled kernel covers every
    # alignment of the causal diagonal and of kv_len against the 16-wide
    # blocks: one batch row per (start, kv_len). This is what pins down the
    # loop bounds used to skip blocks (an off-by-one there only shows at
    # particular values of start mod block).
    C, S, Hq, Hkv, D = 32, 96, 2, 1, 16
    starts = list(range(-2, 50)) + [3, 17, 30, 45]
    kv_lens = [s + C for s in range(-2, 50)] + [5, 20, 33, 60]
    B = len(starts)
    q, k, v, do, dlse = _inputs(8, B, C, S, Hq, Hkv, D, jnp.float32)
    start, kv_len = jnp.array(starts, jnp.int32), jnp.array(kv_lens, jnp.int32)
    out, lse, grads = _fwd_and_grads(
        chunk_attention, q, k, v, start, kv_len, do, dlse, block_q=16, block_k=16, window=window
    )
    out_r, lse_r, grads_r = _fwd_and_grads(
        chunk_attention_reference, q, k, v, start, kv_len, do, dlse, window=window
    )
    assert _rel_err(out, out_r) <= FP32_TOL
    assert _rel_err(lse, lse_r) <= FP32_TOL
    for name, g, g_r in zip("qkv", grads, grads_r, strict=True):
        assert _rel_err(g, g_r) <= FP32_TOL, f"d{name}"


def test_segments_match_reference_fp32():
    # Packed chunks: per-row start/kv_len (prefix 0, ragged, chunk cut by kv_len),
    # segments of uneven lengths crossing block boundaries, G = 2, LSE cotangent.
    B, C, S, Hq, Hkv, D = 3, 40, 96, 4, 2, 16
    q, k, v, do, dlse = _inputs(11, B, C, S, Hq, Hkv, D, jnp.float32)
    start, kv_len = jnp.array([0, 23, 50], jnp.int32), jnp.array([40, 63, 85], jnp.int32)
    bounds = [[0, 7, 7, 30], [0, 1, 16, 17], [0, 20, 33, 40]]  # per row: segment starts
    seg = jnp.array([np.searchsorted(b, np.arange(C), side="right") for b in bounds], jnp.int32)
    kw = dict(segment_ids=seg)
    got = _fwd_and_grads(
        chunk_attention, q, k, v, start, kv_len, do, dlse, **kw, block_q=16, block_k=16
    )
    want = _fwd_and_grads(chunk_attention_reference, q, k, v, start, kv_len, do, dlse, **kw)
    for name, a, b in zip(
        ["out", "lse", "dq", "dk", "dv"], [*got[:2], *got[2]], [*want[:2], *want[2]], strict=True
    ):
        assert _rel_err(a, b) <= FP32_TOL, name
    # The segments change the result (a mask that ignored them would fail above).
    plain = chunk_attention_reference(q, k, v, start, kv_len)
    assert _rel_err(plain, want[0]) > 1e-2
    # Row 1's query 16 starts a segment: it sees the 23 prefix keys and itself.
    vis = chunk_attention_reference(
        jnp.zeros_like(q),
        k,
        jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32)[None, :, None, None], k.shape),
        start,
        kv_len,
        segment_ids=seg,
    )
    np.testing.assert_allclose(vis[1, 16, 0, 0], (sum(range(23)) + 39) / 24, rtol=1e-6)


def test_hand_computed_uniform_attention():
    # q = 0 makes every visible logit 0, so out_i = mean of the visible v_j and
    # lse_i = log(#visible). start=3, kv_len=6, C=4, S=8: query i sees keys
    # j <= 3 + i and j < 6, i.e. 4, 5, 6, 6 keys.
    C, S, D = 4, 8, 16
    q = jnp.zeros((C, 1, D), jnp.float32)
    k = jax.random.normal(jax.random.PRNGKey(1), (S, 1, D), jnp.float32)
    v = jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32)[:, None, None], (S, 1, D))
    out, lse = chunk_attention(q, k, v, 3, 6, block_q=16, block_k=16, return_lse=True)
    n_vis = np.array([4, 5, 6, 6])
    want_out = np.array([np.arange(n).mean() for n in n_vis])
    np.testing.assert_allclose(out[:, 0, :], np.broadcast_to(want_out[:, None], (C, D)), rtol=1e-6)
    np.testing.assert_allclose(lse[:, 0], np.log(n_vis), rtol=1e-6)


def test_rows_without_visible_keys_are_zero():
    # start = -3: rows 0..2 see no key (start + i < 0); kv_len = 0 in the second
    # batch row hides every key. Those rows give out 0, LSE -inf, no NaN anywhere,
    # and gradients still match the reference.
    B, C, S, Hq, Hkv, D = 2, 16, 24, 2, 1, 16
    q, k, v, do, _ = _inputs(3, B, C, S, Hq, Hkv, D, jnp.float32)
    start, kv_len = jnp.array([-3, 5], jnp.int32), jnp.array([20, 0], jnp.int32)
    out, lse, grads = _fwd_and_grads(
        chunk_attention, q, k, v, start, kv_len, do, None, block_q=16, block_k=16
    )
    out_r, lse_r, grads_r = _fwd_and_grads(
        chunk_attention_reference, q, k, v, start, kv_len, do, None
    )
    assert np.all(np.asarray(out[0, :3]) == 0.0) and np.all(np.asarray(out[1]) == 0.0)
    assert np.all(np.isneginf(lse[0, :3])) and np.all(np.isneginf(lse[1]))
    assert np.all(np.isfinite(lse[0, 3:]))
    for g in (out, *grads):
        assert not np.any(np.isnan(np.asarray(g)))
    assert np.all(np.asarray(grads[0][1]) == 0.0)  # dq of the all-masked row
    assert np.all(np.asarray(grads[1][1]) == 0.0) and np.all(np.asarray(grads[2][1]) == 0.0)
    assert _rel_err(out, out_r) <= FP32_TOL
    assert _rel_err(lse, lse_r) <= FP32_TOL
    for g, g_r in zip(grads, grads_r, strict=True):
        assert _rel_err(g, g_r) <= FP32_TOL


def test_kv_len_beyond_keys_is_clamped():
    C, S, Hq, Hkv, D = 16, 40, 2, 2, 16
    q, k, v, _, _ = _inputs(4, 0, C, S, Hq, Hkv, D, jnp.float32)
    big = chunk_attention(q, k, v, 30, S + 100, block_q=16, block_k=16)
    exact = chunk_attention(q, k, v, 30, S, block_q=16, block_k=16)
    np.testing.assert_array_equal(big, exact)
    assert _rel_err(big, chunk_attention_reference(q, k, v, 30, S + 100)) <= FP32_TOL


def test_masked_key_blocks_are_skipped():
    # Poison whole key blocks that no query may see with NaN: past kv_len, and
    # (with a window) before the first row's window. A kernel that loaded them
    # would produce NaN (0 * NaN = NaN in P.V), so finite, unchanged results
    # prove the blocks were skipped in the forward and in dQ; dK/dV of the
    # skipped blocks must be exactly 0.
    C, S, Hq, Hkv, D, bq, bk = 32, 128, 2, 1, 16, 16, 16
    start, kv_len, window = 40, 72, 24  # row 0 sees keys 17..40 -> blocks 1..
    q, k, v, do, _ = _inputs(5, 0, C, S, Hq, Hkv, D, jnp.float32)
    kw = dict(block_q=bq, block_k=bk, window=window)
    clean = _fwd_and_grads(chunk_attention, q, k, v, start, kv_len, do, None, **kw)
    hi = math.ceil(kv_len / bk) * bk  # 80: keys >= 80 are in fully masked blocks
    lo = (start + 1 - window) // bk * bk  # 16: keys < 16 are in fully masked blocks
    poison = jnp.zeros((S, 1, 1)).at[hi:].set(jnp.nan).at[:lo].set(jnp.nan)
    out, lse, (dq, dk, dv) = _fwd_and_grads(
        chunk_attention, q, k + poison, v + poison, start, kv_len, do, None, **kw
    )
    np.testing.assert_array_equal(out, clean[0])
    np.testing.assert_array_equal(lse, clean[1])
    np.testing.assert_array_equal(dq, clean[2][0])
    for g in (dk, dv):
        assert np.all(np.asarray(g[hi:]) == 0.0) and np.all(np.asarray(g[:lo]) == 0.0)
        assert not np.any(np.isnan(np.asarray(g)))


def test_jit_matches_eager():
    C, S, Hq, Hkv, D = 32, 50, 4, 2, 16
    q, k, v, _, _ = _inputs(6, 0, C, S, Hq, Hkv, D, jnp.float32)
    kw = dict(block_q=16, block_k=16, return_lse=True)
    eager = chunk_attention(q, k, v, 18, 50, **kw)
    jitted = jax.jit(lambda q, k, v, s, n: chunk_attention(q, k, v, s, n, **kw))(
        q, k, v, jnp.int32(18), jnp.int32(50)
    )
    for a, b in zip(eager, jitted, strict=True):
        assert _rel_err(a, b) <= FP32_TOL


def test_default_scale_and_blocks():
    # sm_scale defaults to 1/sqrt(D); default block sizes work on odd shapes.
    C, S, Hq, Hkv, D = 20, 45, 2, 1, 32
    q, k, v, _, _ = _inputs(7, 0, C, S, Hq, Hkv, D, jnp.float32)
    got = chunk_attention(q, k, v, 25, 45)
    want = chunk_attention_reference(q, k, v, 25, 45, sm_scale=1 / math.sqrt(D))
    assert _rel_err(got, want) <= FP32_TOL
    got2 = chunk_attention(q, k, v, 25, 45, sm_scale=0.3)
    assert _rel_err(got2, chunk_attention_reference(q, k, v, 25, 45, sm_scale=0.3)) <= FP32_TOL


_f32 = jnp.float32


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, dtypes, start, kv_len, kw, match",
    [
        ((16, 3, 16), (32, 2, 16), (32, 2, 16), None, 0, 32, {}, r"Hq=3.*Hkv=2"),
        ((16, 2, 24), (32, 2, 24), (32, 2, 24), None, 0, 32, {}, r"D=24"),
        ((16, 2, 512), (32, 2, 512), (32, 2, 512), None, 0, 32, {}, r"D=512"),
        ((16, 2, 16), (32, 2, 32), (32, 2, 32), None, 0, 32, {}, r"k.shape=\(32, 2, 32\)"),
        ((16, 2, 16), (32, 2, 16), (31, 2, 16), None, 0, 32, {}, r"v.shape=\(31, 2, 16\)"),
        ((2, 16, 2, 16), (3, 32, 2, 16), (3, 32, 2, 16), None, [0, 0], [32, 32], {}, r"B=3"),
        ((16, 2, 16), (1, 32, 2, 16), (1, 32, 2, 16), None, 0, 32, {}, r"same rank"),
        (
            (16, 2, 16),
            (32, 2, 16),
            (32, 2, 16),
            (_f32, jnp.bfloat16, _f32),
            0,
            32,
            {},
            r"k.dtype=bfloat16",
        ),
        (
            (2, 16, 2, 16),
            (2, 32, 2, 16),
            (2, 32, 2, 16),
            None,
            0,
            [32, 32],
            {},
            r"start.shape=\(\)",
        ),
        ((16, 2, 16), (32, 2, 16), (32, 2, 16), None, 0, 32, {"block_q": 24}, r"block_q=24"),
        ((16, 2, 16), (32, 2, 16), (32, 2, 16), None, 0, 32, {"window": 0}, r"window=0"),
    ],
)
def test_bad_input_raises(q_shape, k_shape, v_shape, dtypes, start, kv_len, kw, match):
    dq, dk, dv = dtypes or (_f32, _f32, _f32)
    q, k, v = jnp.zeros(q_shape, dq), jnp.zeros(k_shape, dk), jnp.zeros(v_shape, dv)
    start, kv_len = jnp.asarray(start, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    # The reference accepts and ignores the block sizes.
    fns = (chunk_attention,) if "block_q" in kw else (chunk_attention, chunk_attention_reference)
    for fn in fns:
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, start, kv_len, **kw)


def test_float_start_raises():
    q = jnp.zeros((16, 2, 16))
    k = jnp.zeros((32, 2, 16))
    with pytest.raises(ValueError, match="start must be an integer"):
        chunk_attention(q, k, k, 1.5, 32)


def test_bench_runs_in_interpret_mode():
    from pallas_kernels.bench import bench

    res = bench(
        16,
        16,
        Hq=2,
        Hkv=1,
        D=16,
        dtype=jnp.float32,
        interpret=True,
        impls=("pallas", "xla"),
        iters=1,
        warmup=0,
        verbose=False,
    )
    for impl in ("pallas", "xla"):
        assert "error" not in res[impl], res[impl]
        assert res[impl]["fwd_tflops"] > 0 and res[impl]["fwdbwd_tflops"] > 0


def test_lowers_to_triton_for_cuda():
    # Compiled (not interpreted) forward + backward with segments, lowered for
    # platform "cuda" on this CPU: the Pallas Triton lowering runs for all three
    # kernels in fp32 and bf16 (Triton's own compile, on a GPU, is not run).
    B, C, S, Hq, Hkv, D = 2, 20, 300, 4, 2, 64

    def grads(q, k, v, start, kv_len, seg, do):
        def loss(q, k, v):
            out, lse = chunk_attention(
                q, k, v, start, kv_len, segment_ids=seg, interpret=False, block_q=16,
                block_k=32, return_lse=True,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(lse)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    sds = jax.ShapeDtypeStruct
    for dtype in (jnp.float32, jnp.bfloat16):
        args = (
            sds((B, C, Hq, D), dtype),
            sds((B, S, Hkv, D), dtype),
            sds((B, S, Hkv, D), dtype),
            sds((B,), jnp.int32),
            sds((B,), jnp.int32),
            sds((B, C), jnp.int32),
            sds((B, C, Hq, D), jnp.float32),
        )
        text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        for name in ("chunk_attention_fwd", "chunk_attention_bwd_dq", "chunk_attention_bwd_dkv"):
            assert f'name = "{name}"' in text, (dtype, name)
