"""Chunk-over-prefix attention: a Pallas kernel (fwd + bwd) and its reference twin.

The tree engines' hot loop: a chunk of C query tokens sitting at offset ``start``
of a root-to-node path attends to the path's prefix K/V and causally to itself.
K/V hold the prefix followed by the chunk (``kv_len`` valid keys, the rest is
padding of a bucketed buffer).

Letter legend (STYLE #5):
  B = batch rows, C = chunk (query) tokens, S = key tokens (prefix + chunk,
  possibly padded), Hq = query heads, Hkv = key/value heads, G = Hq // Hkv
  (GQA group size), D = head dim. ``Cp``/``Sp`` are C/S padded up to a
  multiple of the block size.

Mask (bottom-right aligned causal, optional sliding window, optional segments)::

    visible(i, j) = (j <= start + i) and (j < kv_len) and (0 <= j < S)
                    and (window is None or j > start + i - window)
                    and (segment_ids is None or j < start
                         or segment_ids[i] == segment_ids[j - start])

Segments pack several continuations of one prefix into a chunk (the DFS
engine's packed sibling leaves): every row sees the whole prefix, and chunk
tokens only of its own segment -- the contract of ``dtarl.model.decoder.
attend_xla`` with ``segment_ids``.

so with ``window=w`` a query sees at most ``w`` keys (itself included).

Out-of-range ``start``/``kv_len`` follow this formula literally and never give
NaN: ``kv_len > S`` behaves as ``kv_len = S``; a query row with no visible key
(e.g. ``kv_len <= 0`` or ``start + i < 0``) has output 0 and LSE ``-inf``, and
contributes nothing to any gradient.

LSE: ``log(sum_j exp(sm_scale * q_i . k_j))`` over visible keys, **natural
log**, fp32, shape ``[C, Hq]`` (``[B, C, Hq]`` batched). (JAX's reference GPU
kernel returns base 2; we keep base 2 only inside the kernel, where ``exp2`` is
cheaper, and convert at the boundary.)

Supported: D a power of two in [16, 256]; Hq a multiple of Hkv; fp32, bf16 or
fp16 inputs (q, k, v all the same dtype; fp16 is accepted but not covered by the
tests); fp32 accumulation everywhere.

Backward is a ``jax.custom_vjp`` with the FlashAttention-2 recipe from the saved
output and LSE (``delta = rowsum(dO * O)``, minus the LSE cotangent when the
LSE is returned and used). Two Pallas kernels: dQ (grid over query blocks) and
dK/dV (grid over key blocks, looping over the G query heads that share a KV
head, so GQA gradients are summed in-kernel).

Masked-block skipping: every kernel derives its loop bounds at runtime from the
traced ``start``/``kv_len`` (and the static window), so key blocks beyond
``min(start + last_row + 1, kv_len)`` (and, with a window, before the first
visible key) are never loaded or computed; in dK/dV, query blocks that cannot
see the key block are skipped and key blocks at or past ``kv_len`` run an empty
loop and write zeros.

The kernels use the Pallas Triton backend (GPU). Off-GPU (CPU tests) they run
with ``interpret=True``; the tests also lower the compiled forward + backward for
platform "cuda" on the CPU (Pallas Triton lowering only; Triton's compile needs
a GPU). The TPU kernel for the same contract is ``chunk_attention_tpu``.
Default block sizes are a guess for Hopper (H100),
**not measured here** (no GPU was available when this was written); see
``pallas_kernels/bench.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.chunk_attention_contract import (
    SUPPORTED_HEAD_DIMS,
    batched_inputs,
    check_inputs,
    chunk_attention_reference,
    key_segments,
    unbatched,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "chunk_attention",
    "chunk_attention_reference",
    "chunk_attention_sharded",
    "key_segments",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

# Unmeasured Hopper guesses (Triton backend, D <= 128): 64x64 tiles fit the
# fp32 accumulators of all three kernels in registers with num_warps=4/8.
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
    """Static (hashable) kernel configuration, resolved from the public kwargs."""

    sm_scale: float
    window: int | None
    block_q: int
    block_k: int
    seq_q: int  # real C (before padding)
    seq_k: int  # real S (before padding)
    interpret: bool
    segmented: bool = False  # segment ids given (else the segment refs are unread)


# --------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------


def _resolve_interpret(interpret):
    if interpret is not None:
        return bool(interpret)
    backend = jax.default_backend()
    if backend == "gpu":
        return False
    if backend == "cpu":
        return True
    raise NotImplementedError(
        f"chunk_attention's Pallas kernel targets GPU (Triton); on backend "
        f"{backend!r} use chunk_attention_reference or pass interpret=True."
    )


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


def _visible(q_idx, k_idx, start, kv_len, window, qseg=None, kseg=None):
    """[bq, bk] bool mask; q_idx: [bq] chunk rows, k_idx: [bk] key positions;
    with ``qseg`` [bq] / ``kseg`` [bk] (segment of each row / key), chunk keys
    (``k >= start``) are visible only within the row's segment."""
    pos = start + q_idx[:, None]
    mask = (k_idx[None, :] <= pos) & (k_idx[None, :] < kv_len)
    if window is not None:
        mask = mask & (k_idx[None, :] > pos - window)
    if qseg is not None:
        mask = mask & ((k_idx[None, :] < start) | (qseg[:, None] == kseg[None, :]))
    return mask


def _dot(a, b, *, trans_a=False, trans_b=False):
    """fp32-accumulating tile matmul; full fp32 (no TF32) for fp32 operands."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return plgpu.dot(
        a, b, trans_a=trans_a, trans_b=trans_b, precision=lax.Precision.HIGHEST if exact else None
    )


def _cdiv_nonneg(a, b: int):
    """ceil(a / b) for traced a >= 0 (lax.div, since `//` lowers badly on Triton)."""
    return lax.div(a + (b - 1), b)


def _key_block_range(q_first, q_rows: int, start, kv_len, cfg: _Config):
    """[lo, hi) key blocks that rows q_first .. q_first+q_rows-1 may see."""
    num_k_blocks = pl.cdiv(cfg.seq_k, cfg.block_k)
    key_end = jnp.minimum(start + q_first + q_rows, kv_len)  # exclusive
    hi = jnp.clip(_cdiv_nonneg(jnp.maximum(key_end, 0), cfg.block_k), 0, num_k_blocks)
    if cfg.window is None:
        lo = jnp.zeros_like(hi)
    else:
        key_begin = jnp.maximum(start + q_first + 1 - cfg.window, 0)
        lo = lax.div(key_begin, cfg.block_k)
    return jnp.minimum(lo, hi), hi


def _fwd_kernel(
    start_ref, kv_len_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Config
):
    # q_ref: [bq, D]; k_ref, v_ref: [Sp, D]; o_ref: [bq, D]; lse_ref: [bq] (base 2)
    # qseg_ref: [bq], kseg_ref: [Sp] segment ids (read only when cfg.segmented)
    bq, bk = cfg.block_q, cfg.block_k
    start = start_ref[()]
    kv_len = jnp.minimum(kv_len_ref[()], cfg.seq_k)
    q_first = pl.program_id(2) * bq
    q_idx = q_first + jnp.arange(bq)
    q_bxD = q_ref[...]
    qseg_b = qseg_ref[...] if cfg.segmented else None
    scale2 = cfg.sm_scale * _LOG2E

    def body(kb, carry):
        acc_bxD, m_b, l_b = carry
        k_first = kb * bk
        k_bkxD = k_ref[pl.ds(k_first, bk), :]
        v_bkxD = v_ref[pl.ds(k_first, bk), :]
        s_bxbk = _dot(q_bxD, k_bkxD, trans_b=True) * scale2  # fp32
        kseg_bk = kseg_ref[pl.ds(k_first, bk)] if cfg.segmented else None
        mask = _visible(q_idx, k_first + jnp.arange(bk), start, kv_len, cfg.window, qseg_b, kseg_bk)
        s_bxbk = jnp.where(mask, s_bxbk, -jnp.inf)
        m_new = jnp.maximum(m_b, jnp.max(s_bxbk, axis=1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 there so that
        # exp2(-inf - shift) = 0 instead of NaN.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        corr = jnp.exp2(m_b - shift)
        p_bxbk = jnp.exp2(s_bxbk - shift[:, None])
        l_new = corr * l_b + jnp.sum(p_bxbk, axis=1)
        acc_bxD = corr[:, None] * acc_bxD + _dot(p_bxbk.astype(v_bkxD.dtype), v_bkxD)
        return acc_bxD, m_new, l_new

    lo, hi = _key_block_range(q_first, bq, start, kv_len, cfg)
    acc_bxD = jnp.zeros((bq, q_bxD.shape[-1]), jnp.float32)
    m_b = jnp.full((bq,), -jnp.inf, jnp.float32)
    l_b = jnp.zeros((bq,), jnp.float32)
    acc_bxD, m_b, l_b = lax.fori_loop(lo, hi, body, (acc_bxD, m_b, l_b))
    empty = l_b == 0.0
    o_ref[...] = (acc_bxD / jnp.where(empty, 1.0, l_b)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m_b + jnp.log2(jnp.where(empty, 1.0, l_b)))


def _dq_kernel(
    start_ref,
    kv_len_ref,
    qseg_ref,
    kseg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    cfg: _Config,
):
    # q_ref, do_ref, dq_ref: [bq, D]; k_ref, v_ref: [Sp, D]; lse_ref, delta_ref: [bq]
    bq, bk = cfg.block_q, cfg.block_k
    start = start_ref[()]
    kv_len = jnp.minimum(kv_len_ref[()], cfg.seq_k)
    q_first = pl.program_id(2) * bq
    q_idx = q_first + jnp.arange(bq)
    q_bxD = q_ref[...]
    do_bxD = do_ref[...]
    lse_b = lse_ref[...]
    delta_b = delta_ref[...]
    qseg_b = qseg_ref[...] if cfg.segmented else None
    scale2 = cfg.sm_scale * _LOG2E

    def body(kb, dq_bxD):
        k_first = kb * bk
        k_bkxD = k_ref[pl.ds(k_first, bk), :]
        v_bkxD = v_ref[pl.ds(k_first, bk), :]
        s_bxbk = _dot(q_bxD, k_bkxD, trans_b=True) * scale2
        kseg_bk = kseg_ref[pl.ds(k_first, bk)] if cfg.segmented else None
        mask = _visible(q_idx, k_first + jnp.arange(bk), start, kv_len, cfg.window, qseg_b, kseg_bk)
        p_bxbk = jnp.where(mask, jnp.exp2(s_bxbk - lse_b[:, None]), 0.0)
        dp_bxbk = _dot(do_bxD, v_bkxD, trans_b=True)
        ds_bxbk = p_bxbk * (dp_bxbk - delta_b[:, None])
        return dq_bxD + _dot(ds_bxbk.astype(k_bkxD.dtype), k_bkxD)

    lo, hi = _key_block_range(q_first, bq, start, kv_len, cfg)
    dq_bxD = jnp.zeros((bq, q_bxD.shape[-1]), jnp.float32)
    dq_bxD = lax.fori_loop(lo, hi, body, dq_bxD)
    dq_ref[...] = (dq_bxD * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(
    start_ref,
    kv_len_ref,
    qseg_ref,
    kseg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    cfg: _Config,
    group: int,
):
    # q_ref, do_ref: [Cp, G, D]; k_ref, v_ref, dk_ref, dv_ref: [bk, D];
    # lse_ref, delta_ref: [G, Cp]; qseg_ref: [Cp]; kseg_ref: [bk]
    bq, bk = cfg.block_q, cfg.block_k
    start = start_ref[()]
    kv_len = jnp.minimum(kv_len_ref[()], cfg.seq_k)
    k_first = pl.program_id(2) * bk
    k_idx = k_first + jnp.arange(bk)
    k_bkxD = k_ref[...]
    v_bkxD = v_ref[...]
    kseg_bk = kseg_ref[...] if cfg.segmented else None
    scale2 = cfg.sm_scale * _LOG2E
    num_q_blocks = pl.cdiv(q_ref.shape[0], bq)

    # Rows that can see a key of this block: i >= k_first - start (causal) and,
    # with a window, i < k_first + bk - 1 - start + window. Blocks at or past
    # kv_len are seen by no row.
    lo = lax.div(jnp.clip(k_first - start, 0, num_q_blocks * bq), bq)
    if cfg.window is None:
        hi = jnp.full_like(lo, num_q_blocks)
    else:
        row_end = jnp.clip(k_first + bk - 1 - start + cfg.window, 0, num_q_blocks * bq)
        hi = _cdiv_nonneg(row_end, bq)
    hi = jnp.where(k_first < kv_len, hi, 0)
    lo = jnp.minimum(lo, hi)

    def body(qb, carry):
        dk_bkxD, dv_bkxD = carry
        q_first = qb * bq
        q_idx = q_first + jnp.arange(bq)
        qseg_b = qseg_ref[pl.ds(q_first, bq)] if cfg.segmented else None
        mask = _visible(q_idx, k_idx, start, kv_len, cfg.window, qseg_b, kseg_bk)
        for g in range(group):  # static: the G query heads sharing this KV head
            q_bxD = q_ref[pl.ds(q_first, bq), g, :]
            do_bxD = do_ref[pl.ds(q_first, bq), g, :]
            lse_b = lse_ref[g, pl.ds(q_first, bq)]
            delta_b = delta_ref[g, pl.ds(q_first, bq)]
            s_bxbk = _dot(q_bxD, k_bkxD, trans_b=True) * scale2
            p_bxbk = jnp.where(mask, jnp.exp2(s_bxbk - lse_b[:, None]), 0.0)
            dv_bkxD = dv_bkxD + _dot(p_bxbk.astype(do_bxD.dtype), do_bxD, trans_a=True)
            dp_bxbk = _dot(do_bxD, v_bkxD, trans_b=True)
            ds_bxbk = p_bxbk * (dp_bxbk - delta_b[:, None])
            dk_bkxD = dk_bkxD + _dot(ds_bxbk.astype(q_bxD.dtype), q_bxD, trans_a=True)
        return dk_bkxD, dv_bkxD

    zeros = jnp.zeros(k_bkxD.shape, jnp.float32)
    dk_bkxD, dv_bkxD = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = (dk_bkxD * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_bkxD.astype(dv_ref.dtype)


# --------------------------------------------------------------------------
# pallas_call wrappers (all on batched, padded arrays)
# --------------------------------------------------------------------------


def _compiler_params(D: int):
    return plgpu.CompilerParams(num_warps=4 if D <= 64 else 8, num_stages=2)


def _scalar_spec():
    return pl.BlockSpec((None,), lambda b, h, i: (b,))


def _seg_specs(bq_or_cp: int, sp_or_bk: int, q_tiled: bool):
    """BlockSpecs of the [B, Cp] query and [B, Sp] key segment ids."""
    if q_tiled:  # grid (b, h, query block): a row tile and every key
        return (
            pl.BlockSpec((None, bq_or_cp), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, sp_or_bk), lambda b, h, i: (b, 0)),
        )
    # grid (b, kv head, key block): every row and a key tile
    return (
        pl.BlockSpec((None, bq_or_cp), lambda b, h, j: (b, 0)),
        pl.BlockSpec((None, sp_or_bk), lambda b, h, j: (b, j)),
    )


def _fwd_call(
    q_BxCpxHqxD, k_BxSpxHkvxD, v_BxSpxHkvxD, start_B, kv_len_B, qseg_BxCp, kseg_BxSp, cfg: _Config
):
    B, Cp, Hq, D = q_BxCpxHqxD.shape
    Sp, Hkv = k_BxSpxHkvxD.shape[1:3]
    G = Hq // Hkv
    bq = cfg.block_q
    q_spec = pl.BlockSpec((None, bq, None, D), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, D), lambda b, h, i: (b, 0, h // G, 0))
    o_BxCpxHqxD, lse2_BxHqxCp = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(B, Hq, Cp // bq),
        in_specs=[
            _scalar_spec(),
            _scalar_spec(),
            *_seg_specs(bq, Sp, True),
            q_spec,
            kv_spec,
            kv_spec,
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q_BxCpxHqxD.shape, q_BxCpxHqxD.dtype),
            jax.ShapeDtypeStruct((B, Hq, Cp), jnp.float32),
        ],
        compiler_params=_compiler_params(D),
        interpret=cfg.interpret,
        name="chunk_attention_fwd",
    )(start_B, kv_len_B, qseg_BxCp, kseg_BxSp, q_BxCpxHqxD, k_BxSpxHkvxD, v_BxSpxHkvxD)
    return o_BxCpxHqxD, lse2_BxHqxCp


def _bwd_call(
    q_BxCpxHqxD,
    k_BxSpxHkvxD,
    v_BxSpxHkvxD,
    start_B,
    kv_len_B,
    qseg_BxCp,
    kseg_BxSp,
    do_BxCpxHqxD,
    lse2_BxHqxCp,
    delta2_BxHqxCp,
    cfg: _Config,
):
    B, Cp, Hq, D = q_BxCpxHqxD.shape
    Sp, Hkv = k_BxSpxHkvxD.shape[1:3]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k

    q_spec = pl.BlockSpec((None, bq, None, D), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, D), lambda b, h, i: (b, 0, h // G, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    dq_BxCpxHqxD = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(B, Hq, Cp // bq),
        in_specs=[
            _scalar_spec(),
            _scalar_spec(),
            *_seg_specs(bq, Sp, True),
            q_spec,
            kv_spec,
            kv_spec,
            q_spec,
            row_spec,
            row_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_BxCpxHqxD.shape, q_BxCpxHqxD.dtype),
        compiler_params=_compiler_params(D),
        interpret=cfg.interpret,
        name="chunk_attention_bwd_dq",
    )(
        start_B,
        kv_len_B,
        qseg_BxCp,
        kseg_BxSp,
        q_BxCpxHqxD,
        k_BxSpxHkvxD,
        v_BxSpxHkvxD,
        do_BxCpxHqxD,
        lse2_BxHqxCp,
        delta2_BxHqxCp,
    )

    # dK/dV: one program per (batch row, KV head, key block); the G query heads
    # of the group are the contiguous block [h * G, (h + 1) * G) of Hq.
    qg_spec = pl.BlockSpec((None, Cp, G, D), lambda b, h, j: (b, 0, h, 0))
    kb_spec = pl.BlockSpec((None, bk, None, D), lambda b, h, j: (b, j, h, 0))
    rowg_spec = pl.BlockSpec((None, G, Cp), lambda b, h, j: (b, h, 0))
    dk_BxSpxHkvxD, dv_BxSpxHkvxD = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, group=G),
        grid=(B, Hkv, Sp // bk),
        in_specs=[
            _scalar_spec(),
            _scalar_spec(),
            *_seg_specs(Cp, bk, False),
            qg_spec,
            kb_spec,
            kb_spec,
            qg_spec,
            rowg_spec,
            rowg_spec,
        ],
        out_specs=[kb_spec, kb_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_BxSpxHkvxD.shape, k_BxSpxHkvxD.dtype),
            jax.ShapeDtypeStruct(v_BxSpxHkvxD.shape, v_BxSpxHkvxD.dtype),
        ],
        compiler_params=_compiler_params(D),
        interpret=cfg.interpret,
        name="chunk_attention_bwd_dkv",
    )(
        start_B,
        kv_len_B,
        qseg_BxCp,
        kseg_BxSp,
        q_BxCpxHqxD,
        k_BxSpxHkvxD,
        v_BxSpxHkvxD,
        do_BxCpxHqxD,
        lse2_BxHqxCp,
        delta2_BxHqxCp,
    )
    return dq_BxCpxHqxD, dk_BxSpxHkvxD, dv_BxSpxHkvxD


# --------------------------------------------------------------------------
# custom_vjp core: batched, unpadded in/out; natural-log LSE [B, C, Hq]
# --------------------------------------------------------------------------


def _pad_axis1(x, multiple: int):
    n = x.shape[1]
    pad = -n % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths)


def _segments_padded(seg_BxC, start_B, cfg):
    """Row and key segment ids padded to the kernel's Cp / Sp."""
    qseg_p = _pad_axis1(seg_BxC, cfg.block_q)
    kseg_p = key_segments(seg_BxC, start_B, cfg.seq_k)
    return qseg_p, _pad_axis1(kseg_p, cfg.block_k)


def _fwd_padded(q, k, v, start_B, kv_len_B, seg_BxC, cfg):
    q_p = _pad_axis1(q, cfg.block_q)
    k_p = _pad_axis1(k, cfg.block_k)
    v_p = _pad_axis1(v, cfg.block_k)
    qseg_p, kseg_p = _segments_padded(seg_BxC, start_B, cfg)
    o_p, lse2_p = _fwd_call(q_p, k_p, v_p, start_B, kv_len_B, qseg_p, kseg_p, cfg)
    return o_p, lse2_p, (q_p, k_p, v_p, qseg_p, kseg_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunk_attention_core(q, k, v, start_B, kv_len_B, seg_BxC, cfg: _Config):
    o_p, lse2_p, _ = _fwd_padded(q, k, v, start_B, kv_len_B, seg_BxC, cfg)
    C = cfg.seq_q
    lse_BxCxHq = jnp.swapaxes(lse2_p[:, :, :C], 1, 2) * _LN2
    return o_p[:, :C], lse_BxCxHq


def _core_fwd(q, k, v, start_B, kv_len_B, seg_BxC, cfg: _Config):
    o_p, lse2_p, (q_p, k_p, v_p, qseg_p, kseg_p) = _fwd_padded(
        q, k, v, start_B, kv_len_B, seg_BxC, cfg
    )
    C = cfg.seq_q
    lse_BxCxHq = jnp.swapaxes(lse2_p[:, :, :C], 1, 2) * _LN2
    res = (q_p, k_p, v_p, start_B, kv_len_B, qseg_p, kseg_p, o_p, lse2_p)
    return (o_p[:, :C], lse_BxCxHq), res


def _core_bwd(cfg: _Config, res, cts):
    q_p, k_p, v_p, start_B, kv_len_B, qseg_p, kseg_p, o_p, lse2_p = res
    do_BxCxHqxD, dlse_BxCxHq = cts
    C, S = cfg.seq_q, cfg.seq_k
    do_p = _pad_axis1(do_BxCxHqxD.astype(q_p.dtype), cfg.block_q)
    # delta_i = rowsum(dO_i * O_i) - dLSE_i  (the LSE cotangent enters dS like -delta).
    delta_BxCpxHq = jnp.einsum("bchd,bchd->bch", do_p.astype(jnp.float32), o_p.astype(jnp.float32))
    delta_BxCpxHq = delta_BxCpxHq - _pad_axis1(dlse_BxCxHq.astype(jnp.float32), cfg.block_q)
    delta_BxHqxCp = jnp.swapaxes(delta_BxCpxHq, 1, 2)
    dq_p, dk_p, dv_p = _bwd_call(
        q_p, k_p, v_p, start_B, kv_len_B, qseg_p, kseg_p, do_p, lse2_p, delta_BxHqxCp, cfg
    )
    return dq_p[:, :C], dk_p[:, :S], dv_p[:, :S], None, None, None


_chunk_attention_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def chunk_attention(
    q,
    k,
    v,
    start,
    kv_len,
    *,
    sm_scale=None,
    window=None,
    block_q=DEFAULT_BLOCK_Q,
    block_k=DEFAULT_BLOCK_K,
    interpret=None,
    return_lse=False,
    segment_ids=None,
):
    """Chunk-over-prefix attention (Pallas kernel, differentiable in q, k, v).

    ``out[i, h] = sum_j softmax_j(sm_scale * q[i, h] . k[j, h // G]) v[j, h // G]``
    over the visible keys ``j`` (module docstring: bottom-right aligned causal,
    ``j < kv_len``, optional sliding ``window``).

    Args:
      q: ``[C, Hq, D]`` or batched ``[B, C, Hq, D]``.
      k, v: ``[S, Hkv, D]`` or ``[B, S, Hkv, D]``: the prefix followed by the
        chunk (and optional padding). Same dtype as q (fp32/bf16/fp16).
      start: int32 scalar (``[B]`` batched), runtime: the chunk's offset in the
        path, i.e. query i is at absolute position ``start + i``.
      kv_len: int32 scalar (``[B]`` batched), runtime: number of valid keys.
      sm_scale: static float, default ``1/sqrt(D)``.
      window: static sliding-window size (keys visible per query, itself
        included) or None (off).
      block_q, block_k: tile sizes (powers of two >= 16). C and S need not be
        multiples: inputs are zero-padded (padding is masked).
      interpret: run Pallas in interpret mode; None = True on CPU, False on GPU.
      return_lse: also return the natural-log LSE, fp32 ``[C, Hq]``
        (``[B, C, Hq]``); ``-inf`` for rows with no visible key.
      segment_ids: optional int ``[C]`` (``[B, C]``), runtime: packed chunks.
        Chunk key ``j >= start`` is chunk token ``j - start`` and is visible to
        row ``i`` only if ``segment_ids[i] == segment_ids[j - start]``; prefix
        keys ``j < start`` stay visible to every row (packed continuations of
        one shared prefix).

    Returns:
      ``out`` in q's dtype and q's shape, or ``(out, lse)``. Rows with no
      visible key give 0.
    """
    batched, B, C, S, Hq, Hkv, D = check_inputs(
        q, k, v, start, kv_len, sm_scale, window, block_q, block_k
    )
    cfg = _Config(
        sm_scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
        window=window,
        # Tiles no larger than the padded problem: saves work on tiny chunks.
        block_q=min(block_q, max(16, pl.next_power_of_2(C))),
        block_k=min(block_k, max(16, pl.next_power_of_2(S))),
        seq_q=C,
        seq_k=S,
        interpret=_resolve_interpret(interpret),
        segmented=segment_ids is not None,
    )
    q, k, v, start_B, kv_len_B, seg_BxC = batched_inputs(
        q, k, v, start, kv_len, segment_ids, batched=batched, B=B, C=C
    )
    out_BxCxHqxD, lse_BxCxHq = _chunk_attention_core(q, k, v, start_B, kv_len_B, seg_BxC, cfg)
    return unbatched(out_BxCxHqxD, lse_BxCxHq, batched=batched, return_lse=return_lse)


def chunk_attention_sharded(mesh, *, dp_axis="dp", tp_axis="tp", impl=None, **kwargs):
    """Wrap batched chunk attention in ``jax.shard_map`` over a (dp, tp) mesh.

    Batch rows (and ``start``/``kv_len``) are split over ``dp_axis``, heads
    (both Hq and Hkv, which must be divisible by the tp size) over ``tp_axis``;
    attention is independent per (row, KV-head group), so no collectives are
    needed. ``impl`` defaults to :func:`chunk_attention` (pass
    ``chunk_attention_reference`` for the twin); ``kwargs`` are forwarded.

    Returns ``f(q [B,C,Hq,D], k [B,S,Hkv,D], v, start [B], kv_len [B])``.
    """
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    impl = chunk_attention if impl is None else impl
    tp = mesh.shape[tp_axis]
    qkv_spec = P(dp_axis, None, tp_axis, None)
    row_spec = P(dp_axis)
    out_specs = (qkv_spec, P(dp_axis, None, tp_axis)) if kwargs.get("return_lse") else qkv_spec

    def local(q, k, v, start, kv_len):
        return impl(q, k, v, start, kv_len, **kwargs)

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec, row_spec, row_spec),
        out_specs=out_specs,
        check_vma=False,  # pallas_call has no varying-manual-axes rule
    )

    def f(q, k, v, start, kv_len):
        Hq, Hkv = q.shape[2], k.shape[2]
        if Hq % tp or Hkv % tp:
            raise ValueError(
                f"heads must divide the '{tp_axis}' mesh axis (size {tp}); got "
                f"Hq={Hq} (q.shape={q.shape}), Hkv={Hkv} (k.shape={k.shape})."
            )
        args = (q, k, v, start, kv_len)
        if AxisType.Explicit in tuple(mesh.axis_types):
            # Explicit-axis meshes (jax.make_mesh's default) need inputs already
            # laid out as in_specs; Auto meshes let shard_map reshard itself.
            specs = (qkv_spec, qkv_spec, qkv_spec, row_spec, row_spec)
            args = jax.reshard(args, tuple(NamedSharding(mesh, s) for s in specs))
        return sharded(*args)

    return f
