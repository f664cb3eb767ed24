"""A Flax NNX decoder for Qwen3, Qwen2.5 and Llama 3 with explicit prefix K/V.

Contract::

    model(tokens_BxT, positions_BxT, kv_prefix=None, prefix_len_B=None)
        -> (logits_BxTxV fp32 | hidden_BxTxE, kv_new)

``kv_prefix`` is a differentiable ``KVCache`` with K/V of the P tokens before the
chunk (post-RoPE keys); only its first ``prefix_len[b]`` rows are valid. A
``kv_prefix`` with batch 1 is shared by all B rows (B continuations of one
prefix, e.g. sibling leaves of a prefix tree) without being copied. The
chunk's mask is bottom-right aligned: chunk query i sees every valid prefix key
and chunk keys 0..i. ``kv_new`` holds the chunk's own K/V only ([L, B, T, ...]),
in the wider of the activation dtype and ``kv_prefix``'s (an fp32 prefix makes
their cotangents fp32, which the tree engines carry); callers place it into
whatever buffer they keep (stack, paged cache, ...). K/V enter only the
attention's products, whose operands are cast to the compute dtype, so a buffer
in the compute dtype holds them exactly as they are used.

Precision policies (``ModelConfig``): ``compute_dtype`` alone keeps the
activations between ops in that dtype (and so their cotangents; norms, RoPE and
softmax compute in fp32 inside);
``activation_dtype="float32"`` with bf16 compute keeps activations and
cotangents in fp32 and casts only the operands of each weight or attention
product to bf16 (``cast_matmul``, ``attend_xla``'s ``compute_dtype``).

Letters: B batch, T chunk (query) tokens, P prefix tokens, S = P + T keys,
E hidden, H query heads, K kv heads, G = H / K, D head dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl import axes
from dtarl.model.config import AttentionBackend, ModelConfig, Remat
from dtarl.model.scan_hook import current_layer_hook

_NEG = -1e30


# ------------------------------------------------------------------ mixed precision
# With bf16 compute and fp32 master weights a parameter is cast to bf16 where it
# is used. Plain autodiff then rounds each parameter's gradient to bf16 before it
# reaches the fp32 master (the transpose of a bf16 op produces bf16): a partial
# weight gradient per microbatch or chunk, rounded where programs differ. The
# helpers below keep the forward of the plain op exactly and give the backward an
# fp32 gradient for every operand held in fp32: the gradient product accumulates
# in fp32 and is never rounded to the compute dtype. An operand already in the
# compute dtype gets plain autodiff's cotangent. In fp32 compute they are the
# plain ops. With fp32 activations (``activation_dtype``) the operand x itself is
# fp32: the product takes both operands as bf16, accumulates and returns fp32, and
# x's cotangent is formed in fp32 (the fp32 cotangent times the bf16-valued
# weight), so no activation cotangent is ever rounded. The attention uses the
# same for its Q/K/V (fp32-typed, compute-dtype values): a key's cotangent is
# summed over the prefix and chunk parts, and over the chunks of a tree engine's
# carry, in fp32 and rounded once (with fp32 activations: never).


def _einsum_transposes(spec: str) -> tuple[str, str]:
    """For "x,w->y": the specs of dx ("y,w->x") and dw ("x,y->w")."""
    ins, y = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


def _pet(wide: bool):
    return jnp.float32 if wide else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _cast_einsum(spec, wide, cd, x_dtype, w_dtype, x, w):
    return jnp.einsum(spec, x.astype(cd), w.astype(cd), preferred_element_type=_pet(wide))


def _cast_einsum_fwd(spec, wide, cd, x_dtype, w_dtype, x, w):
    xc, wc = x.astype(cd), w.astype(cd)
    return jnp.einsum(spec, xc, wc, preferred_element_type=_pet(wide)), (xc, wc)


def _cast_einsum_bwd(spec, wide, cd, x_dtype, w_dtype, res, g):
    xc, wc = res
    dx_spec, dw_spec = _einsum_transposes(spec)
    dx = jnp.einsum(dx_spec, g, wc, preferred_element_type=_pet(wide or x_dtype != cd))
    dw = jnp.einsum(dw_spec, xc, g, preferred_element_type=_pet(wide or w_dtype != cd))
    return dx.astype(x_dtype), dw.astype(w_dtype)


_cast_einsum.defvjp(_cast_einsum_fwd, _cast_einsum_bwd)


def cast_einsum(spec: str, x, w, *, wide: bool = False, dtype=None):
    """``einsum(spec, x.astype(dtype), w.astype(dtype))`` (``dtype``: x's by
    default), fp32 output when ``wide``. Each operand's gradient comes back in the
    operand's own dtype; for an operand not in ``dtype`` (an fp32 master weight,
    fp32-typed K/V) it is accumulated in fp32 and never rounded to ``dtype``.

    ``spec`` is "x,w->y" with every index of x in w or y and every index of w in
    x or y ("..." allowed in x and y).
    """
    name = lambda a: jnp.dtype(a).name  # noqa: E731
    cd = name(dtype or x.dtype)
    return _cast_einsum(spec, wide, cd, name(x.dtype), name(w.dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _cast_broadcast(op, w_dtype, cd, x, w):
    wc = w.astype(cd).astype(x.dtype)
    return x * wc if op == "mul" else x + wc


def _cast_broadcast_fwd(op, w_dtype, cd, x, w):
    return _cast_broadcast(op, w_dtype, cd, x, w), (x, w.astype(cd).astype(x.dtype))


def _cast_broadcast_bwd(op, w_dtype, cd, res, g):
    x, wc = res
    lead = tuple(range(g.ndim - wc.ndim))
    if op == "mul":
        dx = g * wc
        dw = jnp.sum(g.astype(jnp.float32) * x.astype(jnp.float32), axis=lead)
    else:
        dx = g
        dw = jnp.sum(g.astype(jnp.float32), axis=lead)
    return dx, dw.astype(w_dtype)


_cast_broadcast.defvjp(_cast_broadcast_fwd, _cast_broadcast_bwd)


def cast_scale(x, w, dtype=None):
    """``x * w.astype(dtype).astype(x.dtype)`` (w over x's trailing axes; ``dtype``:
    x's by default, so w takes that dtype's values), w's gradient summed in fp32."""
    cd = jnp.dtype(dtype or x.dtype).name
    return _cast_broadcast("mul", jnp.dtype(w.dtype).name, cd, x, w)


def cast_bias(x, w, dtype=None):
    """``x + w.astype(dtype).astype(x.dtype)`` (as ``cast_scale``), w's gradient
    summed in fp32."""
    cd = jnp.dtype(dtype or x.dtype).name
    return _cast_broadcast("add", jnp.dtype(w.dtype).name, cd, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _cast_embed(cd, ad, w_dtype, shape, table, tokens):
    return table.astype(cd)[tokens].astype(ad)


def _cast_embed_fwd(cd, ad, w_dtype, shape, table, tokens):
    return _cast_embed(cd, ad, w_dtype, shape, table, tokens), tokens


def _cast_embed_bwd(cd, ad, w_dtype, shape, tokens, g):
    dtable = jnp.zeros(shape, jnp.float32).at[tokens].add(g.astype(jnp.float32))
    return dtable.astype(w_dtype), None


_cast_embed.defvjp(_cast_embed_fwd, _cast_embed_bwd)


def cast_embed(table, tokens, cd, ad=None):
    """``table.astype(cd)[tokens].astype(ad)`` (``ad``: ``cd`` by default), the
    table's gradient scatter-added in fp32."""
    names = [jnp.dtype(x).name for x in (cd, ad or cd, table.dtype)]
    return _cast_embed(*names, tuple(table.shape), table, tokens)


def cast_matmul(cfg: ModelConfig, spec: str, x, w):
    """A weight product under the config's precision policy: ``cast_einsum`` in
    the compute dtype; with wider activations (``cfg.activation_dtype``) its
    operands are cast to the compute dtype and the product, accumulated in fp32,
    is returned in fp32 unrounded (its input cotangent, too, stays fp32)."""
    if cfg.act_dtype == cfg.compute_dtype:
        return cast_einsum(spec, x, w)
    return cast_einsum(spec, x, w, wide=True, dtype=cfg.compute_dtype)


class KVCache(NamedTuple):
    """Per-layer keys and values: k, v are [L, B, S, K, D] (keys after RoPE)."""

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
        dtype = dtype or jnp.dtype(cfg.compute_dtype)
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _param(rngs: nnx.Rngs, shape, names, dtype, scale: float | None = None) -> nnx.Param:
    if scale is None:
        scale = 1.0 / np.sqrt(shape[0])
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, names=(axes.EMBED,), compute_dtype=None):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=names)
        self.eps = eps
        # The weight is read as this dtype's values (None: the input's).
        self.compute_dtype = compute_dtype

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # HF order: normalise in fp32, cast to the input dtype, then scale.
        return cast_scale(xf.astype(x.dtype), self.weight[...], self.compute_dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [D/2], with Llama 3 frequency scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None:
        old = rs.original_max_position_embeddings
        low_wl = old / rs.low_freq_factor
        high_wl = old / rs.high_freq_factor
        wl = 2 * np.pi / inv
        smooth = (old / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        mid = (1 - smooth) * inv / rs.factor + smooth * inv
        inv = np.where(wl < high_wl, inv, np.where(wl > low_wl, inv / rs.factor, mid))
    return inv.astype(np.float32)


def apply_rope(x_BxTxHxD, positions_BxT, inv_freq):
    """Rotate-half RoPE (the HF convention), computed in fp32."""
    ang = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxD.dtype)


def attend_xla(
    q_BxTxHxD,
    k_prefix,
    v_prefix,
    prefix_len_B,
    k_new,
    v_new,
    segment_ids_BxT=None,
    compute_dtype=None,
    prefix_sizes=None,
):
    """Reference attention of a chunk over [valid prefix, causal chunk].

    k_prefix/v_prefix: [B, P, K, D] or [1, P, K, D] (P may be 0); k_new/v_new:
    [B, T, K, D]. A prefix with batch 1 is *shared* by all B rows (each row is an
    independent continuation of it): its scores are computed as one [B*T, P]
    product against the single copy, never broadcast to B copies, and its
    cotangent sums over the rows. With ``segment_ids`` a row packs several
    independent continuations of the same prefix: chunk key c is visible to
    query i only if both share a segment. Scores and softmax in fp32.

    ``compute_dtype`` (default: q's dtype, the activations'): the dtype of the
    products' operands. Narrower than q (fp32 activations): q, K, V and the
    probabilities are cast to it inside each product, the products accumulate in
    fp32 and are not rounded, the probabilities and output stay in q's dtype.

    ``prefix_sizes`` (static, ascending): attend only the first n prefix rows, n the
    smallest size >= max(prefix_len_B) (one ``lax.switch`` branch per size; the rows
    past n are masked anyway, so the result is the same); None: all P rows.
    """
    if prefix_sizes is not None and len(prefix_sizes) > 1:
        p = k_prefix.shape[1]
        sizes = sorted({min(int(n), p) for n in prefix_sizes} | {p})
        index = jnp.sum(jnp.asarray(sizes[:-1]) < jnp.max(prefix_len_B))
        branches = [
            functools.partial(_attend_rows, n, segment_ids_BxT, compute_dtype) for n in sizes
        ]
        args = (q_BxTxHxD, k_prefix, v_prefix, prefix_len_B, k_new, v_new)
        return jax.lax.switch(index, branches, *args)
    return _attend(
        q_BxTxHxD, k_prefix, v_prefix, prefix_len_B, k_new, v_new, segment_ids_BxT, compute_dtype
    )


def _attend_rows(n, segment_ids_BxT, compute_dtype, q, k_prefix, v_prefix, prefix_len_B, k, v):
    """``attend_xla`` over the prefix's first n rows only."""
    kp, vp = k_prefix[:, :n], v_prefix[:, :n]
    return _attend(q, kp, vp, prefix_len_B, k, v, segment_ids_BxT, compute_dtype)


def _attend(
    q_BxTxHxD, k_prefix, v_prefix, prefix_len_B, k_new, v_new, segment_ids_BxT, compute_dtype
):
    b, t, h, d = q_BxTxHxD.shape
    kh = k_new.shape[2]
    g = h // kh
    p = k_prefix.shape[1]
    scale = 1.0 / np.sqrt(d)
    ad = q_BxTxHxD.dtype
    cd = jnp.dtype(compute_dtype or ad)
    # K/V (chunk and prefix) may come fp32-typed: the products cast them to
    # ``cd``, their cotangents stay fp32. q is made so here, so its cotangent
    # (prefix plus chunk parts) is summed in fp32 and rounded once, by the cast's
    # transpose (with fp32 activations: never rounded).
    q_BxTxKxGxD = q_BxTxHxD.reshape(b, t, kh, g, d).astype(jnp.float32)
    ein = functools.partial(cast_einsum, wide=True, dtype=cd)
    shared = k_prefix.shape[0] == 1 and b > 1
    if shared:
        s_pre = ein("btkgd,pkd->bkgtp", q_BxTxKxGxD, k_prefix[0])
    else:
        s_pre = ein("btkgd,bpkd->bkgtp", q_BxTxKxGxD, k_prefix)
    s_new = ein("btkgd,bskd->bkgts", q_BxTxKxGxD, k_new)
    att_BxKxGxTxS = jnp.concatenate([s_pre, s_new], axis=-1) * scale
    key_pos = jnp.arange(p + t)
    prefix_ok_BxS = (key_pos[None, :] < prefix_len_B[:, None]) & (key_pos[None, :] < p)
    chunk_ok_TxS = (key_pos[None, :] >= p) & (key_pos[None, :] - p <= jnp.arange(t)[:, None])
    chunk_ok_BxTxS = chunk_ok_TxS[None]
    if segment_ids_BxT is not None:
        seg_keys_BxS = jnp.concatenate(
            [jnp.full((b, p), -1, segment_ids_BxT.dtype), segment_ids_BxT], axis=1
        )
        chunk_ok_BxTxS = chunk_ok_BxTxS & (segment_ids_BxT[:, :, None] == seg_keys_BxS[:, None, :])
    mask_BxTxS = prefix_ok_BxS[:, None, :] | chunk_ok_BxTxS
    att_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], att_BxKxGxTxS, _NEG)
    probs = jax.nn.softmax(att_BxKxGxTxS, axis=-1).astype(ad)
    p_pre, p_new = probs[..., :p], probs[..., p:]
    if shared:
        out_pre = ein("bkgtp,pkd->btkgd", p_pre, v_prefix[0])
    else:
        out_pre = ein("bkgtp,bpkd->btkgd", p_pre, v_prefix)
    out_BxTxKxGxD = out_pre + ein("bkgts,bskd->btkgd", p_new, v_new)
    return out_BxTxKxGxD.reshape(b, t, h, d).astype(ad)


def attend_pallas(q_BxTxHxD, k_prefix, v_prefix, prefix_len_B, k_new, v_new, segment_ids_BxT=None):
    """The same attention through the platform's Pallas chunk-attention kernel
    (``pallas_kernels.dispatch``: GPU or TPU; interpret mode on CPU).

    The chunk's K/V are written right after the valid prefix so the kernel sees
    one contiguous [prefix, chunk] K/V with ``start = prefix_len``; packed
    chunks pass their ``segment_ids`` (the prefix stays visible to every segment).
    """
    from pallas_kernels.dispatch import chunk_attention_for_platform

    chunk_attention = chunk_attention_for_platform()

    b, t = q_BxTxHxD.shape[:2]
    p = k_prefix.shape[1]
    if k_prefix.shape[0] != b:  # a shared prefix: the kernel wants one K/V per row
        k_prefix = jnp.broadcast_to(k_prefix, (b,) + k_prefix.shape[1:])
        v_prefix = jnp.broadcast_to(v_prefix, (b,) + v_prefix.shape[1:])
    cd = q_BxTxHxD.dtype
    k_new, v_new = k_new.astype(cd), v_new.astype(cd)
    pad = jnp.zeros((b, t) + k_new.shape[2:], cd)
    k_all = jnp.concatenate([k_prefix.astype(cd), pad], axis=1)
    v_all = jnp.concatenate([v_prefix.astype(cd), pad], axis=1)
    start_B = jnp.minimum(prefix_len_B, p).astype(jnp.int32)
    put = jax.vmap(lambda buf, x, s: jax.lax.dynamic_update_slice_in_dim(buf, x, s, axis=0))
    k_all = put(k_all, k_new, start_B)
    v_all = put(v_all, v_new, start_B)
    return chunk_attention(
        q_BxTxHxD, k_all, v_all, start_B, start_B + t, segment_ids=segment_ids_BxT
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.q_proj = _param(rngs, (e, h, d), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pd)
        self.k_proj = _param(rngs, (e, k, d), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd)
        self.v_proj = _param(rngs, (e, k, d), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd)
        self.o_proj = _param(
            rngs, (h, d, e), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pd, 1.0 / np.sqrt(h * d)
        )
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, d), pd), axes=(axes.HEADS, axes.HEAD_DIM))
            self.k_bias = nnx.Param(jnp.zeros((k, d), pd), axes=(axes.KV_HEADS, axes.HEAD_DIM))
            self.v_bias = nnx.Param(jnp.zeros((k, d), pd), axes=(axes.KV_HEADS, axes.HEAD_DIM))
        if cfg.qk_norm:
            cd, names = cfg.compute_dtype, (axes.HEAD_DIM,)
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, pd, names=names, compute_dtype=cd)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, pd, names=names, compute_dtype=cd)

    def qkv(self, x_BxTxE, positions_BxT, inv_freq):
        """Projections with bias, q/k norm and RoPE: q [B,T,H,D], k and v [B,T,K,D]."""
        cfg = self.cfg
        q = cast_matmul(cfg, "bte,ehd->bthd", x_BxTxE, self.q_proj[...])
        k = cast_matmul(cfg, "bte,ekd->btkd", x_BxTxE, self.k_proj[...])
        v = cast_matmul(cfg, "bte,ekd->btkd", x_BxTxE, self.v_proj[...])
        if cfg.attention_bias:
            q = cast_bias(q, self.q_bias[...], cfg.compute_dtype)
            k = cast_bias(k, self.k_bias[...], cfg.compute_dtype)
            v = cast_bias(v, self.v_bias[...], cfg.compute_dtype)
        if cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, positions_BxT, inv_freq)
        k = apply_rope(k, positions_BxT, inv_freq)
        return q, k, v

    def out(self, out_BxTxHxD):
        """The output projection of the attention result."""
        return cast_matmul(self.cfg, "bthd,hde->bte", out_BxTxHxD, self.o_proj[...])

    def __call__(
        self, x_BxTxE, positions_BxT, k_prefix, v_prefix, prefix_len_B, inv_freq, seg, sizes=None
    ):
        q, k, v = self.qkv(x_BxTxE, positions_BxT, inv_freq)
        # The chunk's K/V leave in the wider of the activation and prefix dtypes
        # (same values): given an fp32 prefix (a tree engine's carry), a key's
        # cotangent from this chunk and from its descendants meets in fp32 and is
        # rounded to the compute dtype once, by this cast's transpose (with fp32
        # activations: never).
        kv_dtype = jnp.promote_types(k.dtype, k_prefix.dtype)
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
        if self.cfg.attention_backend is AttentionBackend.PALLAS:
            # The kernel takes the compute dtype (fp32 activations: q is cast to it).
            cd = jnp.dtype(self.cfg.compute_dtype)
            o = attend_pallas(q.astype(cd), k_prefix, v_prefix, prefix_len_B, k, v, seg)
        else:
            cd = self.cfg.compute_dtype
            o = attend_xla(
                q, k_prefix, v_prefix, prefix_len_B, k, v, seg, compute_dtype=cd, prefix_sizes=sizes
            )
        return self.out(o), k, v


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.gate_proj = _param(rngs, (e, f), (axes.EMBED, axes.MLP), pd)
        self.up_proj = _param(rngs, (e, f), (axes.EMBED, axes.MLP), pd)
        self.down_proj = _param(rngs, (f, e), (axes.MLP, axes.EMBED), pd)

    def __call__(self, x):
        cfg = self.cfg
        gate = cast_matmul(cfg, "...e,ef->...f", x, self.gate_proj[...])
        up = cast_matmul(cfg, "...e,ef->...f", x, self.up_proj[...])
        return cast_matmul(cfg, "...f,fe->...e", jax.nn.silu(gate) * up, self.down_proj[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd, cd = jnp.dtype(cfg.param_dtype), cfg.compute_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, compute_dtype=cd)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, pd, compute_dtype=cd
        )
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, k_prefix, v_prefix, prefix_len, seg, inv_freq, sizes=None):
        h, k, v = self.self_attn(
            self.input_layernorm(x), positions, k_prefix, v_prefix, prefix_len, inv_freq, seg, sizes
        )
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


def remat_policy(remat: Remat):
    """``jax.checkpoint``'s (enabled, policy) for a layer under ``remat``: NONE saves
    everything (no checkpoint); FULL saves nothing (the layer is recomputed in the
    backward pass); DOTS_SAVEABLE saves the outputs of matmuls without batch
    dimensions (the weight products) and recomputes the rest; OFFLOAD saves the same
    products in the ``pinned_host`` memory kind where the backend has one and is
    not a CPU (there host memory is device memory), DOTS_SAVEABLE otherwise."""
    if remat is Remat.NONE:
        return False, None
    if remat is Remat.FULL:
        return True, None
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if remat is Remat.OFFLOAD and _pinned_host():
        return True, jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return True, saveable


def _pinned_host() -> bool:
    dev = jax.devices()[0]
    try:
        kinds = dev.addressable_memories()
    except Exception:  # backends without memory kinds
        return False
    return dev.platform != "cpu" and any(m.kind == "pinned_host" for m in kinds)


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One ``DecoderLayer`` whose parameters hold ``layers``' stacked along a new
    leading axis (logical axis ``layers``): [L, ...] each. The stack is what
    ``Decoder`` runs under ``jax.lax.scan``, so every program holds one layer's
    body whatever the depth."""
    first = layers[0]
    states = [nnx.state(layer, nnx.Param) for layer in layers]
    stacked = dict(nnx.to_flat_state(jax.tree.map(lambda *xs: jnp.stack(xs), *states)))
    for path, var in nnx.iter_graph(first):
        if isinstance(var, nnx.Param):
            names = var.get_metadata().get("axes")
            var.set_value(stacked[tuple(path)][...])
            var.set_metadata(axes=(axes.LAYERS,) + tuple(names))
    return first


class Decoder(nnx.Module):
    """The decoder-only LM. See the module docstring for the call contract.

    ``layers`` is one ``DecoderLayer`` whose parameters are stacked over the L
    layers ([L, ...], logical axis ``layers``); ``__call__`` runs them with
    ``jax.lax.scan``, so a program's size does not grow with the depth. Each layer
    is rematerialised as ``cfg.remat`` says (``remat_policy``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, seed: int = 0):
        rngs = rngs if rngs is not None else nnx.Rngs(seed)
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed_tokens = _param(
            rngs, (cfg.vocab_size, cfg.hidden_size), (axes.VOCAB, axes.EMBED), pd, 0.02
        )
        # Built one by one (the same random draws as unstacked layers), then stacked.
        self.layers = stack_layers([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, compute_dtype=cfg.compute_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), (axes.EMBED, axes.VOCAB), pd
            )

    def lm_head_weight(self) -> jax.Array:
        """The output projection [E, V] (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens[...].T
        return self.lm_head[...]

    def scan_layers(self, body, x, xs=None, *, remat: Remat | None = None):
        """``jax.lax.scan`` of ``body(layer, x, xs_i) -> (x, ys_i)`` over the stacked
        layers (``layer``: layer i as a ``DecoderLayer``; ``xs``: a pytree of
        [L, ...] arrays sliced per layer, or None): (x, ys stacked [L, ...]).
        ``remat`` (default ``cfg.remat``) rematerialises each layer's body. A hook set
        with ``dtarl.model.scan_hook.layer_state_hook`` maps each layer's sliced state
        first, inside the rematerialised step."""
        graphdef, state = nnx.split(self.layers)
        enabled, policy = remat_policy(self.cfg.remat if remat is None else remat)
        hook = current_layer_hook()  # FSDP's per-layer gather (``dtarl.model.scan_hook``)

        def step(carry, sliced):
            layer_state, xs_i = sliced
            if hook is not None:  # inside the checkpoint: recomputed in the backward pass
                layer_state = hook(layer_state)
            return body(nnx.merge(graphdef, layer_state), carry, xs_i)

        if enabled:
            step = jax.checkpoint(step, policy=policy)
        return jax.lax.scan(step, x, (state, xs))

    def __call__(
        self,
        tokens_BxT,
        positions_BxT,
        kv_prefix: KVCache | None = None,
        prefix_len_B=None,
        *,
        return_hidden: bool = False,
        remat: bool | Remat | None = None,
        segment_ids_BxT=None,
        prefix_sizes: tuple[int, ...] | None = None,
        layer_outputs: bool = False,
    ):
        """``remat``: True = ``Remat.FULL`` (the dense_remat engine), a ``Remat``, or
        None / False = ``cfg.remat``. ``prefix_sizes``: the xla attention reads only the
        smallest of these many ``kv_prefix`` rows that holds every row's
        ``prefix_len`` (``attend_xla``). ``layer_outputs``: also return every layer's
        output [L, B, T, E] (before the final norm; what ``dtarl.model.reverse`` runs
        the backward pass from)."""
        cfg = self.cfg
        cd = jnp.dtype(cfg.compute_dtype)
        tokens_BxT = jnp.asarray(tokens_BxT)
        positions_BxT = jnp.asarray(positions_BxT)
        if tokens_BxT.ndim != 2 or positions_BxT.shape != tokens_BxT.shape:
            raise ValueError(
                f"tokens {tokens_BxT.shape} and positions {positions_BxT.shape} must both be [B, T]"
            )
        b, t = tokens_BxT.shape
        if kv_prefix is None:
            kv_prefix = KVCache.zeros(cfg, b, 0, cd)
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        got = (kv_prefix.k.shape[0],) + kv_prefix.k.shape[3:]
        ok_batch = kv_prefix.k.ndim == 5 and kv_prefix.k.shape[1] in (1, b)
        if not ok_batch or got != want or kv_prefix.v.shape != kv_prefix.k.shape:
            raise ValueError(
                f"kv_prefix.k/v must be [L={want[0]}, B={b} (or 1: shared by all rows), P, "
                f"K={want[1]}, D={want[2]}], got k {kv_prefix.k.shape}, v {kv_prefix.v.shape}"
            )
        p = kv_prefix.k.shape[2]
        if prefix_len_B is None:
            prefix_len_B = jnp.full((b,), p, jnp.int32)
        prefix_len_B = jnp.broadcast_to(jnp.asarray(prefix_len_B, jnp.int32), (b,))
        inv_freq = rope_inv_freq(cfg)
        x = cast_embed(self.embed_tokens[...], tokens_BxT, cd, cfg.act_dtype)

        def body(layer, x, kv_i):
            x, k, v = layer(
                x,
                positions_BxT,
                kv_i[0],
                kv_i[1],
                prefix_len_B,
                segment_ids_BxT,
                inv_freq,
                prefix_sizes,
            )
            return x, (k, v, x) if layer_outputs else (k, v)

        policy = Remat.FULL if remat is True else None
        x, ys = self.scan_layers(body, x, (kv_prefix.k, kv_prefix.v), remat=policy)
        x = self.norm(x)
        kv_new = KVCache(ys[0], ys[1])
        if not return_hidden:
            x = cast_einsum("bte,ev->btv", x, self.lm_head_weight(), wide=True, dtype=cd)
        return (x, kv_new, ys[2]) if layer_outputs else (x, kv_new)


def token_logprobs(
    lm_head_ExV,
    hidden_BxTxE,
    targets_BxT,
    *,
    chunk: int = 0,
    entropy: bool = False,
    temperature: float = 1.0,
    dtype=None,
):
    """log p(target) (and optionally the entropy) per position, in fp32, under
    p = softmax(logits / temperature): the sampling temperature's distribution
    without top-k/top-p truncation (verl, TRL). ``temperature`` is static; 1.0
    leaves the logits untouched (the same program as without it).

    With ``chunk > 0`` the [T, V] logits are built ``chunk`` positions at a time
    under ``jax.checkpoint``, so neither the forward nor the backward holds the
    full [B, T, V] logits. ``dtype`` (default: the hidden state's) is the head
    product's operand dtype: the model's ``compute_dtype``, which differs from the
    hidden state's with fp32 activations.
    """

    def one(h_BxCxE, tgt_BxC):
        logits = cast_einsum("bce,ev->bcv", h_BxCxE, lm_head_ExV, wide=True, dtype=dtype)
        if temperature != 1.0:
            logits = logits / temperature
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tgt_BxC[..., None], axis=-1)[..., 0]
        lp = picked - logz
        if not entropy:
            return lp, jnp.zeros_like(lp)
        probs = jax.nn.softmax(logits, axis=-1)
        ent = logz - jnp.sum(probs * logits, axis=-1)
        return lp, ent

    b, t, e = hidden_BxTxE.shape
    if chunk <= 0 or t <= chunk:
        return one(hidden_BxTxE, targets_BxT)
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden_BxTxE, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, e)
    tg = jnp.pad(targets_BxT, ((0, 0), (0, pad))).reshape(b, n, chunk)
    lp, ent = jax.lax.map(
        jax.checkpoint(lambda xs: one(*xs)), (h.transpose(1, 0, 2, 3), tg.transpose(1, 0, 2))
    )
    lp = lp.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    ent = ent.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    return lp, ent


def init_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    return Decoder(cfg, rngs=nnx.Rngs(seed))
