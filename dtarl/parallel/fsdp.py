"""ZeRO-3 inside the sharded step: the parameters enter each data rank split over
'fsdp', are all-gathered where the step uses them, and their gradients leave
reduce-scattered back to the same split.

    theta_r            = the rank's 1/fsdp slice of theta along its fsdp dim (``mesh.fsdp_dim``)
    theta              = all_gather_fsdp(theta_r)                 (in ``gather_dtype``)
    g_r                = grad of the rank's loss wrt theta       (fp32 like the master)
    grad_shard         = psum_dp(psum_scatter_fsdp(g_r))          = slice of sum_r g_r

Used inside ``jax.shard_map`` manual over {'dp', 'fsdp'} ('tp' stays automatic:
the in/out specs name only the manual axes; the jit's in/out shardings carry tp).
A parameter replicated over fsdp (no dim fsdp divides) has its gradient psum-ed
over fsdp instead.

``gather_dtype`` (e.g. bfloat16 with fp32 master weights and bf16 compute, FSDP's
mixed precision) gathers the rounded weight and casts it back to the master dtype:
the model rounds every weight to its compute dtype where it uses it (``cast_einsum``,
``cast_scale``, the embedding), so the forward is unchanged, the wire and the
gathered copy are half the bytes, and the gradient (taken wrt the fp32-typed gathered
weight, so accumulated in fp32, ``dtarl.model.decoder``) is never rounded to bf16.
None gathers in the parameters' own dtype.

Where the gathers happen: before the engine's program, the whole model at once
(every engine runs the whole stack per step, and the DFS and prefix-reuse engines
per tree node inside their ``lax.scan``, so a per-layer gather there would repeat
per node). The scheduler may sink a gather to its first use; see
``dtarl bench scale`` (``dtarl.bench.scale_memory``) for the resulting peak.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dtarl.parallel.mesh import DP, FSDP, fsdp_dims

__all__ = ["gather", "manual_specs", "reduce_grads"]


def manual_specs(param_specs) -> list[P]:
    """Per parameter leaf: its spec over the manual axes only ('fsdp' where split)."""
    out = []
    for dim, s in zip(fsdp_dims(param_specs), _leaves(param_specs), strict=True):
        n = len(tuple(s.spec if hasattr(s, "spec") else s))
        out.append(P(*(FSDP if i == dim else None for i in range(n))))
    return out


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, P))


def gather(leaves: Sequence[jax.Array], dims: Sequence[int | None], gather_dtype=None):
    """Each rank's shards all-gathered over 'fsdp' (tiled along their fsdp dim)."""
    out = []
    for x, d in zip(leaves, dims, strict=True):
        if d is None:
            out.append(x)
            continue
        cast = gather_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        y = x.astype(gather_dtype) if cast else x
        y = jax.lax.all_gather(y, FSDP, axis=d, tiled=True)
        out.append(y.astype(x.dtype) if cast else y)
    return out


def reduce_grads(leaves: Sequence[jax.Array], dims: Sequence[int | None], *, dp: bool = True):
    """Full per-rank gradients -> the sum over every data rank, split like the params."""
    out = []
    for g, d in zip(leaves, dims, strict=True):
        if d is None:
            g = jax.lax.psum(g, FSDP)
        else:
            g = jax.lax.psum_scatter(g, FSDP, scatter_dimension=d, tiled=True)
        out.append(jax.lax.psum(g, DP) if dp else g)
    return out
