"""The contract of chunk-over-prefix attention, shared by its kernels: input checks,
segment ids, batching, and the reference twin every kernel is tested against.

``chunk_attention`` (GPU, Pallas Triton) and ``chunk_attention_tpu`` (Pallas
Mosaic) implement the same contract; its mask, LSE and supported shapes are in
``pallas_kernels.chunk_attention``'s docstring. ``chunk_attention_reference`` is
that contract in plain jnp with an explicit mask (STYLE #7: every kernel has a
reference twin), re-exported from ``pallas_kernels.chunk_attention``.

Letter legend: B = batch rows, C = chunk (query) tokens, S = key tokens,
Hq = query heads, Hkv = key/value heads, G = Hq // Hkv, D = head dim.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "batched_inputs",
    "check_inputs",
    "chunk_attention_reference",
    "key_segments",
    "segment_ids_BxC",
    "unbatched",
]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_inputs(q, k, v, start, kv_len, sm_scale, window, block_q=None, block_k=None):
    """Shape/dtype checks at trace time (the block sizes only when given: the GPU kernel's
    rule, powers of two >= 16); returns (batched, B, C, S, Hq, Hkv, D)."""
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [C, Hq, D] or batched [B, C, Hq, D]; got q.shape={q.shape}.")
    batched = q.ndim == 4
    if k.ndim != q.ndim or v.ndim != q.ndim:
        form = "[B, S, Hkv, D]" if batched else "[S, Hkv, D]"
        raise ValueError(
            f"k and v must have the same rank as q ({form} for q.shape={q.shape}); "
            f"got k.shape={k.shape}, v.shape={v.shape}."
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got k.shape={k.shape}, v.shape={v.shape}."
        )
    if batched:
        B, C, Hq, D = q.shape
        Bk, S, Hkv, Dk = k.shape
        if Bk != B:
            raise ValueError(
                f"batch mismatch: q.shape={q.shape} has B={B} but k.shape={k.shape} has B={Bk}."
            )
    else:
        B = 1
        C, Hq, D = q.shape
        S, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(
            f"head dim mismatch: q.shape={q.shape} has D={D} but k.shape={k.shape} has D={Dk}."
        )
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dim D={D} (q.shape={q.shape}) is not supported; "
            f"D must be one of {SUPPORTED_HEAD_DIMS}."
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"GQA needs Hq to be a multiple of Hkv; got Hq={Hq} "
            f"(q.shape={q.shape}) and Hkv={Hkv} (k.shape={k.shape})."
        )
    if C == 0 or S == 0:
        raise ValueError(f"empty chunk or key axis: q.shape={q.shape}, k.shape={k.shape}.")
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k.dtype), jnp.dtype(v.dtype)}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k, v must share one dtype; got q.dtype={q.dtype}, "
            f"k.dtype={k.dtype}, v.dtype={v.dtype}."
        )
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype {q.dtype} not supported; use one of {[str(d) for d in _SUPPORTED_DTYPES]}."
        )
    want = (B,) if batched else ()
    for name, x in (("start", start), ("kv_len", kv_len)):
        shape = tuple(np.shape(x))
        if shape != want:
            raise ValueError(
                f"{name} must have shape {want} ({'[B] vector' if batched else 'scalar'} "
                f"for q.shape={q.shape}); got {name}.shape={shape}."
            )
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(
                f"{name} must be an integer (int32) array; got dtype {jnp.result_type(x)}."
            )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int; got window={window!r}.")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is None:
            continue
        if not isinstance(b, int) or not _is_pow2(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16; got {name}={b!r}.")
    if sm_scale is not None and not isinstance(sm_scale, (int, float)):
        raise ValueError(f"sm_scale must be a static Python float; got {type(sm_scale)}.")
    return batched, B, C, S, Hq, Hkv, D


def segment_ids_BxC(segment_ids, batched: bool, B: int, C: int, q_shape):
    """Validated segment ids as int32 [B, C] (zeros when None)."""
    if segment_ids is None:
        return jnp.zeros((B, C), jnp.int32)
    want = (B, C) if batched else (C,)
    shape = tuple(np.shape(segment_ids))
    if shape != want:
        raise ValueError(
            f"segment_ids must have shape {want} (one id per chunk token for "
            f"q.shape={q_shape}); got segment_ids.shape={shape}."
        )
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
        raise ValueError(
            f"segment_ids must be an integer array; got dtype {jnp.result_type(segment_ids)}."
        )
    return jnp.asarray(segment_ids, jnp.int32).reshape(B, C)


def key_segments(seg_BxC, start_B, num_keys: int):
    """Segment id of every key position: chunk key ``j`` (``start <= j``) is chunk
    token ``j - start``; positions outside the chunk get the nearest chunk
    token's id, which never matters (prefix keys ``j < start`` are visible to
    every row, keys past the chunk are causally masked). [B, num_keys] int32."""
    C = seg_BxC.shape[1]
    idx_BxS = jnp.clip(jnp.arange(num_keys)[None, :] - start_B[:, None], 0, C - 1)
    return jnp.take_along_axis(seg_BxC, idx_BxS, axis=1)


def batched_inputs(q, k, v, start, kv_len, segment_ids, *, batched: bool, B: int, C: int):
    """The checked inputs in batched form: (q, k, v with a leading B axis, start_B,
    kv_len_B int32 [B], segment ids int32 [B, C], zeros when None)."""
    seg_BxC = segment_ids_BxC(segment_ids, batched, B, C, q.shape)
    start_B = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (B,))
    kv_len_B = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B,))
    if not batched:
        q, k, v = q[None], k[None], v[None]
    return q, k, v, start_B, kv_len_B, seg_BxC


def unbatched(out_BxCxHqxD, lse_BxCxHq, *, batched: bool, return_lse: bool):
    """A kernel's batched result in the caller's form: ``out`` (or ``(out, lse)``),
    without the B axis when the inputs had none."""
    if not batched:
        out_BxCxHqxD, lse_BxCxHq = out_BxCxHqxD[0], lse_BxCxHq[0]
    return (out_BxCxHqxD, lse_BxCxHq) if return_lse else out_BxCxHqxD


def chunk_attention_reference(
    q,
    k,
    v,
    start,
    kv_len,
    *,
    sm_scale=None,
    window=None,
    block_q=None,
    block_k=None,
    interpret=None,
    return_lse=False,
    segment_ids=None,
):
    """Reference twin of :func:`chunk_attention`: plain jnp, explicit [C, S] mask.

    Same signature and semantics; ``block_q``, ``block_k`` and ``interpret`` are
    accepted and ignored. Logits, softmax and the P.V product are computed in
    fp32 (inputs upcast), so for bf16 inputs this is *more* accurate than the
    kernel, which feeds P to the P.V matmul in the input dtype.
    """
    del block_q, block_k, interpret
    batched, B, C, S, Hq, Hkv, D = check_inputs(q, k, v, start, kv_len, sm_scale, window)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    G = Hq // Hkv
    q, k, v, start_B, kv_len_B, seg_BxC = batched_inputs(
        q, k, v, start, kv_len, segment_ids, batched=batched, B=B, C=C
    )
    q_BxCxKxGxD = q.reshape(B, C, Hkv, G, D).astype(jnp.float32)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    s_BxKxGxCxS = (
        jnp.einsum("bckgd,bskd->bkgcs", q_BxCxKxGxD, k32, precision=lax.Precision.HIGHEST) * scale
    )

    pos_BxC = start_B[:, None] + jnp.arange(C)[None, :]
    j_S = jnp.arange(S)
    mask_BxCxS = (j_S[None, None, :] <= pos_BxC[:, :, None]) & (
        j_S[None, None, :] < kv_len_B[:, None, None]
    )
    if window is not None:
        mask_BxCxS = mask_BxCxS & (j_S[None, None, :] > pos_BxC[:, :, None] - window)
    if segment_ids is not None:
        kseg_BxS = key_segments(seg_BxC, start_B, S)
        same_BxCxS = seg_BxC[:, :, None] == kseg_BxS[:, None, :]
        prefix_S = j_S[None, None, :] < start_B[:, None, None]
        mask_BxCxS = mask_BxCxS & (prefix_S | same_BxCxS)
    mask = mask_BxCxS[:, None, None]  # [B, 1, 1, C, S]

    s_masked = jnp.where(mask, s_BxKxGxCxS, -jnp.inf)
    m = jnp.max(s_masked, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, jnp.exp(s_BxKxGxCxS - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    p = p / jnp.where(empty, 1.0, l)
    o_BxKxGxCxD = jnp.einsum("bkgcs,bskd->bkgcd", p, v32, precision=lax.Precision.HIGHEST)
    out = jnp.transpose(o_BxKxGxCxD, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D).astype(q.dtype)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
    lse_BxCxHq = jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, C, Hq)
    return unbatched(out, lse_BxCxHq, batched=batched, return_lse=return_lse)
