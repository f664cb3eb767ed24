"""The backward pass of one chunk from the layer outputs its forward saved.

A tree engine that runs a chunk forward at one step and its backward at a later
one (DFS: push, then pop once the chunk's descendants are done) would, under
``jax.vjp``, run the whole forward again at the later step, and under
``cfg.remat = full`` once more inside the backward (each layer is recomputed
from its input there): 1 + 1 + 1 forward passes and a backward (2) for a token
that dense training, also rematerialised, runs 1 + 1 + 2. Keeping each layer's
output from the first forward (``Decoder(..., layer_outputs=True)``: [L, B, T, E],
bounded by the path, not the batch) leaves the later step only the backward::

    outs  = saved layer outputs             # layer l's input is outs[l - 1]
    d_h   = VJP of head(norm(outs[-1]))     # the head and the final norm
    for l = L-1 .. 0 (a reverse scan over the stacked layers):
        recompute layer l from its input, VJP -> d layer l, d input, d prefix K/V
    d embedding from d input of layer 0

so the token costs 1 (first forward) + 1 (recompute) + 2 (backward), as in dense.
Each layer's VJP holds only that layer's residuals. The layer state hook
(``dtarl.model.scan_hook``, FSDP's per-layer gather) is applied inside each
layer's VJP, so the gradient comes back in the hook's input sharding.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dtarl.model.decoder import Decoder, KVCache, cast_embed, rope_inv_freq
from dtarl.model.scan_hook import current_layer_hook

__all__ = ["vjp_from_layer_outputs"]


def vjp_from_layer_outputs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    kv_prefix: KVCache,
    prefix_len_B: jax.Array,
    outs_LxBxTxE: jax.Array,
    head: Callable[[Decoder, jax.Array], object],
    d_head,
    d_kv: KVCache,
    *,
    segment_ids_BxT=None,
    prefix_sizes: tuple[int, ...] | None = None,
) -> tuple[nnx.State, KVCache]:
    """The cotangents w.r.t. (params, ``kv_prefix``) of a chunk's outputs, given the
    cotangent ``d_head`` of ``head(model, normed_hidden)`` and ``d_kv`` of the chunk's
    own K/V ([L, B, T, K, D], in the dtype the forward returned them in).

    ``outs_LxBxTxE`` are the layer outputs of the same forward
    (``model(tokens, positions, kv_prefix, prefix_len, layer_outputs=True, ...)``);
    the result equals ``jax.vjp`` of that whole forward (and ``head``) at the same
    point, up to the order of fp32 sums. Returns (d params, params-shaped, in the
    params' dtypes; d kv_prefix).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    inv_freq = rope_inv_freq(cfg)

    def head_of(p, h):
        m = nnx.merge(graphdef, p)
        return head(m, m.norm(h))

    _, head_vjp = jax.vjp(head_of, params, outs_LxBxTxE[-1])
    d_params_head, d_top = head_vjp(d_head)

    def embed_of(p):
        table = nnx.merge(graphdef, p).embed_tokens[...]
        return cast_embed(table, tokens_BxT, cfg.compute_dtype, cfg.act_dtype)

    x0, embed_vjp = jax.vjp(embed_of, params)
    layer_graphdef, layer_state = nnx.split(model.layers)
    hook = current_layer_hook()
    inputs = jnp.concatenate([x0[None], outs_LxBxTxE[:-1]], axis=0)

    def step(d_out, sliced):
        state, x, k_prefix, v_prefix, d_k, d_v = sliced

        def layer_of(s, x, k_prefix, v_prefix):
            layer = nnx.merge(layer_graphdef, hook(s) if hook is not None else s)
            return layer(
                x,
                positions_BxT,
                k_prefix,
                v_prefix,
                prefix_len_B,
                segment_ids_BxT,
                inv_freq,
                prefix_sizes,
            )

        _, layer_vjp = jax.vjp(layer_of, state, x, k_prefix, v_prefix)
        d_state, d_x, d_kp, d_vp = layer_vjp((d_out.astype(x.dtype), d_k, d_v))
        return d_x, (d_state, d_kp, d_vp)

    xs = (layer_state, inputs, kv_prefix.k, kv_prefix.v, d_kv.k, d_kv.v)
    d_x0, (d_layers, d_kp, d_vp) = jax.lax.scan(step, d_top, xs, reverse=True)
    (d_params_embed,) = embed_vjp(d_x0)
    d_params = jax.tree.map(jnp.add, d_params_head, d_params_embed)
    # Every leaf but the layers' got its cotangent above (the layers' are zeros there).
    d_params["layers"] = jax.tree.map(jnp.add, d_params["layers"], d_layers)
    return d_params, KVCache(d_kp, d_vp)
