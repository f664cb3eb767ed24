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
    grads: nnx.State,
    *,
    segment_ids_BxT=None,
    prefix_sizes: tuple[int, ...] | None = None,
) -> tuple[nnx.State, KVCache]:
    """Adds to ``grads`` the cotangent w.r.t. params of a chunk's outputs, given the
    cotangent ``d_head`` of ``head(model, normed_hidden)`` and ``d_kv`` of the chunk's
    own K/V ([L, B, T, K, D], in the dtype the forward returned them in); returns
    (``grads``, d ``kv_prefix``).

    ``outs_LxBxTxE`` are the layer outputs of the same forward
    (``model(tokens, positions, kv_prefix, prefix_len, layer_outputs=True, ...)``).
    ``grads`` is a params-shaped fp32 accumulator; what is added equals ``jax.vjp`` of
    that whole forward (and ``head``) at the same point, up to the order of fp32
    sums. It is added where it arises: each layer's into its slice of the stacked
    layer gradients (the reverse scan carries them), the embedding's scattered into
    the rows of the chunk's tokens, so no params-sized cotangent is formed besides
    the head's own weight product.
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    want = (cfg.num_layers, *tokens_BxT.shape, cfg.hidden_size)
    if tokens_BxT.ndim != 2 or tuple(outs_LxBxTxE.shape) != want:
        raise ValueError(
            f"outs_LxBxTxE {tuple(outs_LxBxTxE.shape)} must be the layer outputs [L, B, T, E] "
            f"= {want} of tokens_BxT {tuple(tokens_BxT.shape)}"
        )
    inv_freq = rope_inv_freq(cfg)
    layers = params["layers"]
    rest = nnx.State({k: v for k, v in params.items() if k != "layers"})
    grads = jax.tree.map(lambda a: a, grads)  # a new tree: the caller's stays as it is
    add = lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)  # noqa: E731

    def head_of(rest, h):
        m = nnx.merge(graphdef, nnx.State({**rest, "layers": layers}))
        return head(m, m.norm(h))

    _, head_vjp = jax.vjp(head_of, rest, outs_LxBxTxE[-1])
    d_rest, d_top = head_vjp(d_head)
    for name in d_rest:
        grads[name] = add(grads[name], d_rest[name])

    x0 = cast_embed(model.embed_tokens[...], tokens_BxT, cfg.compute_dtype, cfg.act_dtype)
    layer_graphdef, layer_state = nnx.split(model.layers)
    hook = current_layer_hook()
    inputs = jnp.concatenate([x0[None], outs_LxBxTxE[:-1]], axis=0)

    def step(carry, sliced):
        d_out, acc = carry
        i, state, x, k_prefix, v_prefix, d_k, d_v = sliced

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
        acc = jax.tree.map(lambda a, g: a.at[i].add(g.astype(a.dtype)), acc, d_state)
        return (d_x, acc), (d_kp, d_vp)

    index = jnp.arange(cfg.num_layers)
    xs = (index, layer_state, inputs, kv_prefix.k, kv_prefix.v, d_kv.k, d_kv.v)
    (d_x0, grads["layers"]), (d_kp, d_vp) = jax.lax.scan(
        step, (d_top, grads["layers"]), xs, reverse=True
    )
    # The embedding's cotangent (``cast_embed``'s transpose), added in place.
    grads["embed_tokens"] = jax.tree.map(
        lambda a: a.at[tokens_BxT].add(d_x0.astype(a.dtype)), grads["embed_tokens"]
    )
    return grads, KVCache(d_kp, d_vp)
