"""Chunk-over-prefix attention: a Pallas TPU (Mosaic) kernel, forward and backward.

Same contract as :func:`pallas_kernels.chunk_attention.chunk_attention` (the
GPU/Triton kernel) and its reference twin ``chunk_attention_reference``: C
chunk queries at absolute positions ``start + i`` over K/V holding the valid
prefix followed by the chunk (``kv_len`` valid keys), bottom-right causal mask,
optional ``segment_ids`` (chunk keys visible only within a row's segment, the
prefix visible to every row), GQA (``Hq`` a multiple of ``Hkv``), natural-log
LSE. The sliding ``window`` of the GPU kernel is not implemented here (a
``window`` argument is rejected with an error).

Letter legend (STYLE #5): B batch rows, C chunk tokens, S keys, Hq / Hkv query /
KV heads, G = Hq // Hkv, D head dim; ``Cp``, ``Sp``, ``Dp`` are C, S, D padded.

Layout and Mosaic-legal blocks. Every block's last two dims are either
multiples of (8 sublanes, 128 lanes) or the full array dim:

* q, dO: ``[B, Hq, Cp, Dp]``, blocks ``(bq, Dp)``; k, v: ``[B, Hkv, Sp, Dp]``,
  blocks ``(bk, Dp)`` (the wrapper transposes heads in front of tokens).
* ``Dp = D`` rounded up to a multiple of 128 with zero columns: zero q/k
  columns add nothing to q.k, zero v columns give zero output columns, which
  are sliced off (so D = 64 costs a 128-wide tile; D in 16..256 accepted).
* ``bq`` (default 128) is a multiple of 8, ``bk`` (default 128) a multiple of
  128 (it is the lane dim of the ``[bq, bk]`` logits); C is zero-padded to a
  multiple of bq (a chunk of 1 becomes 8 rows) and S to a multiple of bk.
  Padded keys are masked (``j >= kv_len``); padded rows are computed and
  dropped, and their zero dO makes them add nothing to dK/dV.
* Per-row statistics (LSE, delta) are ``[B, Hq, Cp, 128]``, replicated over the
  128 lanes (as in JAX's TPU flash attention), so they are plain 2-D VMEM
  tiles; the kernels read lane 0 as a ``[bq, 1]`` column.
* Segment ids: rows ``[B, Cp, 1]`` (block ``(bq, 1)``, full last dim) and
  keys ``[B, 1, Sp]`` (block ``(1, bk)``, full second-to-last dim).
* ``start`` and ``kv_len`` are scalar-prefetched into SMEM; the index maps use
  them to clamp K/V (forward, dQ) and Q/dO (dK/dV) block indices to blocks
  that can be visible, so skipped blocks repeat the previous block index and
  their DMA is elided; ``pl.when`` skips their compute.

Grids: forward and dQ ``(B, Hq, Cp/bq, Sp/bk)`` reducing over key blocks in
VMEM scratch (online softmax); dK/dV ``(B, Hkv, Sp/bk, G, Cp/bq)`` reducing
over the G query heads of the KV head and the query blocks, so GQA gradients
are summed in-kernel. Reduction axes are "arbitrary", the rest "parallel".

Precision and the bf16 bound. All matmuls accumulate in fp32
(``preferred_element_type``; fp32 operands at ``Precision.HIGHEST``), softmax
statistics are fp32. With bf16 inputs the kernel, like every flash kernel,
rounds P to bf16 before P.V and dS to bf16 before dS.K and dS^T.Q (unit
roundoff u = 2**-8 each, independent-sign errors that partly cancel in the
sums), and rounds its outputs to bf16 (<= u relative to the element, so
<= u of the array max); the fp32 reference rounds its outputs to bf16 too
(<= u). Relative to the array's max-abs this is at most about 3u = 1.5 bf16
ulps; the tests use 2**-6 = 4u (2 bf16 ulps); observed at most 7.6e-3 (about
1 ulp, dQ) over the test shapes. A mask or scale bug gives O(1).
fp32: both sides are fp32 with full-precision dots and differ only in
summation order and online rescaling: the tests use 1e-5 max-abs over max.

Interpret mode. Off-TPU (CPU tests) the kernels run in Pallas's TPU interpret
mode (``interpret=pltpu.InterpretParams()``), which executes the same grid,
BlockSpecs, scalar prefetch and VMEM scratch on the CPU (uninitialised memory
filled with NaN, out-of-bounds reads raising). It does not run the Mosaic
compiler. The tests also export the compiled forward + backward for platform
"tpu" on the CPU (``jax.export``), which runs the Pallas TPU lowering: every
BlockSpec passes its (8, 128) tiling check and every kernel op lowers to
Mosaic. What only a TPU can check -- the Mosaic compiler's layout passes, VMEM
fit, numerics of compiled code, speed -- is **not verified**: no TPU was
available when this was written.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.chunk_attention_contract import (
    batched_inputs,
    check_inputs,
    key_segments,
    unbatched,
)

__all__ = ["chunk_attention_tpu"]

LANES = 128
SUBLANES = 8
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
    """Static (hashable) kernel configuration."""

    sm_scale: float
    block_q: int
    block_k: int
    seq_q: int  # real C
    seq_k: int  # real S
    head_dim: int  # real D
    segmented: bool
    interpret: bool


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# --------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------


def _dot_nt(a, b):
    """a [m, d] . b [n, d]^T -> [m, n] fp32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )


def _dot_nn(a, b):
    """a [m, k] . b [k, n] -> [m, n] fp32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )


def _dot_tn(a, b):
    """a [k, m]^T . b [k, n] -> [m, n] fp32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )


def _mask(qi, kj, start, kv_len, qseg_ref, kseg_ref, cfg: _Config):
    """[bq, bk] visibility of query block qi against key block kj."""
    bq, bk = cfg.block_q, cfg.block_k
    rows = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    keys = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = (keys <= start + rows) & (keys < kv_len)
    if cfg.segmented:
        same = qseg_ref[...] == kseg_ref[...]  # [bq, 1] == [1, bk]
        mask = mask & ((keys < start) | same)
    return mask


def _block_visible(qi, kj, start, kv_len, cfg: _Config):
    """Whether any (row, key) of blocks (qi, kj) can be visible (causal, kv_len)."""
    k_first = kj * cfg.block_k
    return (k_first < kv_len) & (k_first <= start + qi * cfg.block_q + cfg.block_q - 1)


def _last_key_block(b, qi, start_ref, kv_len_ref, cfg: _Config, num_k: int):
    """Index of the last key block query block qi may see (clamped to [0, num_k))."""
    key_end = jnp.minimum(start_ref[b] + (qi + 1) * cfg.block_q, kv_len_ref[b])
    last = lax.div(jnp.maximum(key_end, 1) + cfg.block_k - 1, cfg.block_k) - 1
    return jnp.clip(last, 0, num_k - 1)


def _first_query_block(b, kj, start_ref, cfg: _Config, num_q: int):
    """Index of the first query block that may see key block kj."""
    first_row = jnp.maximum(kj * cfg.block_k - start_ref[b], 0)
    return jnp.clip(lax.div(first_row, cfg.block_q), 0, num_q - 1)


def _compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _interpret(cfg: _Config):
    return pltpu.InterpretParams() if cfg.interpret else False


# --------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------


def _fwd_kernel(
    start_ref, kv_len_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
    m_sc, l_sc, acc_sc, *, cfg: _Config,
):  # fmt: skip
    # q_ref, o_ref: [bq, Dp]; k_ref, v_ref: [bk, Dp]; lse_ref: [bq, 128];
    # qseg_ref: [bq, 1]; kseg_ref: [1, bk]; scratch m, l: [bq, 128], acc: [bq, Dp]
    b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    start, kv_len = start_ref[b], jnp.minimum(kv_len_ref[b], cfg.seq_k)

    @pl.when(kj == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_block_visible(qi, kj, start, kv_len, cfg))
    def _compute():
        s = _dot_nt(q_ref[...], k_ref[...]) * cfg.sm_scale  # [bq, bk]
        mask = _mask(qi, kj, start, kv_len, qseg_ref, kseg_ref, cfg)
        s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_sc[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # Rows with nothing visible yet keep m = -inf: shift by 0 there (no NaN).
        shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        corr = jnp.exp(m_prev - shift)  # [bq, 128]
        p = jnp.exp(s - shift[:, :1])  # [bq, bk]
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = _dot_nn(p.astype(v_ref.dtype), v_ref[...])
        acc_sc[...] = corr[:, :1] * acc_sc[...] + pv
        m_sc[...] = m_next

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        l = l_sc[...]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m_sc[...] + jnp.log(l_safe))


def _seg_specs_q_major(bq, bk):
    """Segment specs for grids (b, h, qi, kj, *prefetch)."""
    return (
        pl.BlockSpec((None, bq, 1), lambda b, h, i, j, s, n: (b, i, 0)),
        pl.BlockSpec((None, 1, bk), lambda b, h, i, j, s, n: (b, 0, j)),
    )


def _fwd_call(q, k, v, start_B, kv_len_B, qseg, kseg, cfg: _Config):
    # q: [B, Hq, Cp, Dp]; k, v: [B, Hkv, Sp, Dp]; qseg: [B, Cp, 1]; kseg: [B, 1, Sp]
    B, Hq, Cp, Dp = q.shape
    Hkv, Sp = k.shape[1:3]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = Cp // bq, Sp // bk

    def kv_map(b, h, i, j, s, n):
        return (b, h // G, jnp.minimum(j, _last_key_block(b, i, s, n, cfg, nk)), 0)

    q_spec = pl.BlockSpec((None, None, bq, Dp), lambda b, h, i, j, s, n: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, Dp), kv_map)
    row_spec = pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, j, s, n: (b, h, i, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, Hq, nq, nk),
        in_specs=[*_seg_specs_q_major(bq, bk), q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, row_spec],
        scratch_shapes=[
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, Dp), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((B, Hq, Cp, LANES), jnp.float32),
        ],
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret(cfg),
        name="chunk_attention_tpu_fwd",
    )(start_B, kv_len_B, qseg, kseg, q, k, v)


# --------------------------------------------------------------------------
# Backward: dQ and dK/dV
# --------------------------------------------------------------------------


def _dq_kernel(
    start_ref, kv_len_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    dq_ref, dq_sc, *, cfg: _Config,
):  # fmt: skip
    b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    start, kv_len = start_ref[b], jnp.minimum(kv_len_ref[b], cfg.seq_k)

    @pl.when(kj == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_block_visible(qi, kj, start, kv_len, cfg))
    def _compute():
        k = k_ref[...]
        s = _dot_nt(q_ref[...], k) * cfg.sm_scale
        mask = _mask(qi, kj, start, kv_len, qseg_ref, kseg_ref, cfg)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
        dp = _dot_nt(do_ref[...], v_ref[...])
        ds = p * (dp - delta_ref[...][:, :1])
        dq_sc[...] = dq_sc[...] + _dot_nn(ds.astype(k.dtype), k)

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(
    start_ref, kv_len_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    dk_ref, dv_ref, dk_sc, dv_sc, *, cfg: _Config,
):  # fmt: skip
    b, kj, g, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    start, kv_len = start_ref[b], jnp.minimum(kv_len_ref[b], cfg.seq_k)
    first = (g == 0) & (qi == 0)
    last = (g == pl.num_programs(3) - 1) & (qi == pl.num_programs(4) - 1)

    @pl.when(first)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_block_visible(qi, kj, start, kv_len, cfg))
    def _compute():
        q, do = q_ref[...], do_ref[...]
        s = _dot_nt(q, k_ref[...]) * cfg.sm_scale  # [bq, bk]
        mask = _mask(qi, kj, start, kv_len, qseg_ref, kseg_ref, cfg)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
        dv_sc[...] = dv_sc[...] + _dot_tn(p.astype(do.dtype), do)
        dp = _dot_nt(do, v_ref[...])
        ds = p * (dp - delta_ref[...][:, :1])
        dk_sc[...] = dk_sc[...] + _dot_tn(ds.astype(q.dtype), q)

    @pl.when(last)
    def _finish():
        dk_ref[...] = (dk_sc[...] * cfg.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _bwd_call(q, k, v, start_B, kv_len_B, qseg, kseg, do, lse, delta, cfg: _Config):
    B, Hq, Cp, Dp = q.shape
    Hkv, Sp = k.shape[1:3]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = Cp // bq, Sp // bk
    semantics = ("parallel", "parallel", "parallel", "arbitrary")

    def kv_map(b, h, i, j, s, n):
        return (b, h // G, jnp.minimum(j, _last_key_block(b, i, s, n, cfg, nk)), 0)

    q_spec = pl.BlockSpec((None, None, bq, Dp), lambda b, h, i, j, s, n: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, Dp), kv_map)
    row_spec = pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, j, s, n: (b, h, i, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hq, nq, nk),
            in_specs=[
                *_seg_specs_q_major(bq, bk),
                q_spec,
                kv_spec,
                kv_spec,
                q_spec,
                row_spec,
                row_spec,
            ],  # fmt: skip
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, Dp), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(semantics),
        interpret=_interpret(cfg),
        name="chunk_attention_tpu_bwd_dq",
    )(start_B, kv_len_B, qseg, kseg, q, k, v, do, lse, delta)

    # dK/dV: grid (b, KV head h, key block j, group member g, query block i);
    # query head h * G + g. Query blocks before the first that can see key
    # block j are clamped to it (DMA elided, compute skipped).
    def qh_map(b, h, j, g, i, s, n):
        return (b, h * G + g, jnp.maximum(i, _first_query_block(b, j, s, cfg, nq)), 0)

    qg_spec = pl.BlockSpec((None, None, bq, Dp), qh_map)
    rowg_spec = pl.BlockSpec((None, None, bq, LANES), qh_map)
    kb_spec = pl.BlockSpec((None, None, bk, Dp), lambda b, h, j, g, i, s, n: (b, h, j, 0))
    qseg_spec = pl.BlockSpec(
        (None, bq, 1),
        lambda b, h, j, g, i, s, n: (b, jnp.maximum(i, _first_query_block(b, j, s, cfg, nq)), 0),
    )
    kseg_spec = pl.BlockSpec((None, 1, bk), lambda b, h, j, g, i, s, n: (b, 0, j))

    # The kernel's program ids are (b, h, kj, g, qi); the query block it holds
    # is the clamped one, which differs from qi only where compute is skipped.
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hkv, nk, G, nq),
            in_specs=[
                qseg_spec,
                kseg_spec,
                qg_spec,
                kb_spec,
                kb_spec,
                qg_spec,
                rowg_spec,
                rowg_spec,
            ],  # fmt: skip
            out_specs=[kb_spec, kb_spec],
            scratch_shapes=[pltpu.VMEM((bk, Dp), jnp.float32), pltpu.VMEM((bk, Dp), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(semantics + ("arbitrary",)),
        interpret=_interpret(cfg),
        name="chunk_attention_tpu_bwd_dkv",
    )(start_B, kv_len_B, qseg, kseg, q, k, v, do, lse, delta)
    return dq, dk, dv


# --------------------------------------------------------------------------
# custom_vjp core on the [B, C, H, D] layout
# --------------------------------------------------------------------------


def _to_kernel(x, rows: int, cols: int):
    """[B, T, H, D] -> [B, H, rows, cols], zero-padded."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, cols - x.shape[3])))


def _from_kernel(x, rows: int, cols: int):
    """[B, H, Tp, Dp] -> [B, rows, H, cols]."""
    return jnp.swapaxes(x[:, :, :rows, :cols], 1, 2)


def _prepare(q, k, v, start_B, seg_BxC, cfg: _Config):
    C, S, D = cfg.seq_q, cfg.seq_k, cfg.head_dim
    Cp, Sp, Dp = _round_up(C, cfg.block_q), _round_up(S, cfg.block_k), _round_up(D, LANES)
    qseg = jnp.pad(seg_BxC, ((0, 0), (0, Cp - C)))[:, :, None]
    kseg = jnp.pad(key_segments(seg_BxC, start_B, S), ((0, 0), (0, Sp - S)))[:, None, :]
    return (
        _to_kernel(q, Cp, Dp),
        _to_kernel(k, Sp, Dp),
        _to_kernel(v, Sp, Dp),
        qseg,
        kseg,
    )


def _forward(q, k, v, start_B, kv_len_B, seg_BxC, cfg: _Config):
    qk, kk, vk, qseg, kseg = _prepare(q, k, v, start_B, seg_BxC, cfg)
    o, lse = _fwd_call(qk, kk, vk, start_B, kv_len_B, qseg, kseg, cfg)
    out = _from_kernel(o, cfg.seq_q, cfg.head_dim)
    lse_BxCxHq = jnp.swapaxes(lse[:, :, : cfg.seq_q, 0], 1, 2)
    return (out, lse_BxCxHq), (qk, kk, vk, qseg, kseg, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _core(q, k, v, start_B, kv_len_B, seg_BxC, cfg: _Config):
    return _forward(q, k, v, start_B, kv_len_B, seg_BxC, cfg)[0]


def _core_fwd(q, k, v, start_B, kv_len_B, seg_BxC, cfg: _Config):
    outs, saved = _forward(q, k, v, start_B, kv_len_B, seg_BxC, cfg)
    return outs, (saved, start_B, kv_len_B)


def _core_bwd(cfg: _Config, res, cts):
    (qk, kk, vk, qseg, kseg, o, lse), start_B, kv_len_B = res
    do_BxCxHqxD, dlse_BxCxHq = cts
    Cp, Dp = qk.shape[2:]
    do = _to_kernel(do_BxCxHqxD.astype(qk.dtype), Cp, Dp)
    # delta_i = rowsum(dO_i * O_i) - dLSE_i, lane-replicated like the LSE.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    dlse = jnp.pad(
        jnp.swapaxes(dlse_BxCxHq.astype(jnp.float32), 1, 2), ((0, 0), (0, 0), (0, Cp - cfg.seq_q))
    )
    delta = jnp.broadcast_to((delta - dlse)[..., None], delta.shape + (LANES,))
    dq, dk, dv = _bwd_call(qk, kk, vk, start_B, kv_len_B, qseg, kseg, do, lse, delta, cfg)
    C, S, D = cfg.seq_q, cfg.seq_k, cfg.head_dim
    return (
        _from_kernel(dq, C, D),
        _from_kernel(dk, S, D),
        _from_kernel(dv, S, D),
        None,
        None,
        None,
    )


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _resolve_interpret(interpret):
    if interpret is not None:
        return bool(interpret)
    backend = jax.default_backend()
    if backend == "tpu":
        return False
    if backend == "cpu":
        return True
    raise NotImplementedError(
        f"chunk_attention_tpu is a Pallas TPU (Mosaic) kernel; on backend {backend!r} "
        f"use pallas_kernels.chunk_attention (GPU) or pass interpret=True."
    )


def chunk_attention_tpu(
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
    """Chunk-over-prefix attention, Pallas TPU kernel (differentiable in q, k, v).

    Arguments and results as :func:`pallas_kernels.chunk_attention.chunk_attention`
    (shapes ``[C, Hq, D]`` / ``[S, Hkv, D]`` or batched, runtime ``start``,
    ``kv_len`` and ``segment_ids``), except: ``window`` must be None;
    ``block_q`` is a positive multiple of 8 and ``block_k`` of 128 (both shrunk
    to the padded problem when it is smaller); ``interpret=None`` means
    compiled on TPU and TPU interpret mode on CPU.
    """
    if window is not None:
        raise ValueError(
            f"window={window!r}: the TPU kernel has no sliding window; use window=None "
            "(or the GPU kernel / the reference)."
        )
    if not isinstance(block_q, int) or block_q < SUBLANES or block_q % SUBLANES:
        raise ValueError(f"block_q must be a positive multiple of 8; got block_q={block_q!r}.")
    if not isinstance(block_k, int) or block_k < LANES or block_k % LANES:
        raise ValueError(f"block_k must be a positive multiple of 128; got block_k={block_k!r}.")
    batched, B, C, S, Hq, Hkv, D = check_inputs(q, k, v, start, kv_len, sm_scale, None)
    cfg = _Config(
        sm_scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
        block_q=min(block_q, _round_up(C, SUBLANES)),
        block_k=min(block_k, _round_up(S, LANES)),
        seq_q=C,
        seq_k=S,
        head_dim=D,
        segmented=segment_ids is not None,
        interpret=_resolve_interpret(interpret),
    )
    q, k, v, start_B, kv_len_B, seg_BxC = batched_inputs(
        q, k, v, start, kv_len, segment_ids, batched=batched, B=B, C=C
    )
    out, lse = _core(q, k, v, start_B, kv_len_B, seg_BxC, cfg)
    return unbatched(out, lse, batched=batched, return_lse=return_lse)
