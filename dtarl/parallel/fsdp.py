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

Where the gathers happen (``mesh.fsdp_gather``, ``FsdpGather``):

    step   every leaf gathered before the engine's program: the whole model (in
           ``gather_dtype``, held fp32-typed) and its full per-rank gradients live
           at once; one all-gather per parameter leaf per step.
    layer  the embedding, final norm and lm_head gathered before the program; the
           stacked [L, ...] layer leaves stay split and ``Decoder.scan_layers``
           gathers layer i inside its scan step (``layer_hook`` through
           ``dtarl.model.scan_hook``). The gather is a ``jax.custom_vjp`` whose
           backward is the fp32 ``psum_scatter``, so a layer's gradient leaves the
           scan already reduce-scattered ([L, ...] split like the params; only the
           psum over dp remains) and is never rounded to ``gather_dtype``.

In layer mode the gathered layer is not a residual of the step when the layer is
checkpointed (``cfg.remat`` full / dots / offload): the checkpointed scan step
recomputes its gather in the backward pass (two all-gathers per layer leaf per
model call). With ``remat = none`` nothing is recomputed: the layer's products keep
their compute-dtype operands (``cast_einsum``'s residuals), i.e. a ``gather_dtype``
copy of every layer's weights, until the backward pass reaches that layer.

A collective must run on every rank of the fsdp group. The DFS engine picks each
plan step's op with ``lax.switch`` on the rank's own plan, so per-layer gathers
under its branches would diverge across ranks; ``branch_collectives`` finds them in
the traced program and ``ShardedEngine`` then runs that program in step mode (the
dfs engine, prefix_reuse with deep groups in dfs). Dense, dense_remat and
prefix_reuse's rows scan the same trip counts on every rank and run layer mode; the
model is called per microbatch / per tree node there, so the layers are gathered
again per call (more all-gathers, at most one gathered layer live).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dtarl.model.scan_hook import layer_state_hook
from dtarl.parallel.mesh import DP, FSDP, FsdpGather, fsdp_dims

__all__ = [
    "FsdpGather",
    "branch_collectives",
    "gather",
    "gather_leaf",
    "layer_hook",
    "manual_specs",
    "reduce_grads",
    "safe_mode",
    "sharded_call",
]

LAYERS_KEY = "layers"  # ``Decoder.layers``: the stacked [L, ...] parameters


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


def reduce_grads(
    leaves: Sequence[jax.Array],
    dims: Sequence[int | None],
    *,
    dp: bool = True,
    scattered: Sequence[bool] | None = None,
):
    """Full per-rank gradients -> the sum over every data rank, split like the params.

    ``scattered[i]``: leaf i's gradient came out of a per-layer gather's backward
    already summed over fsdp and split (only the psum over dp is left)."""
    scattered = [False] * len(dims) if scattered is None else scattered
    out = []
    for g, d, done in zip(leaves, dims, scattered, strict=True):
        dtype, g = g.dtype, _wide(g)
        if d is None:
            g = jax.lax.psum(g, FSDP)
        elif not done:
            g = jax.lax.psum_scatter(g, FSDP, scatter_dimension=d, tiled=True)
        out.append((jax.lax.psum(g, DP) if dp else g).astype(dtype))
    return out


def _wide(g: jax.Array) -> jax.Array:
    """A low-precision (bf16) gradient as fp32 for its sums: rounded once at the end,
    and XLA's CPU all-reduce promotion aborts on bf16 reduce-scatters."""
    low = jnp.issubdtype(g.dtype, jnp.floating) and jnp.finfo(g.dtype).bits < 32
    return g.astype(jnp.float32) if low else g


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_leaf(x: jax.Array, dim: int, gather_dtype=None) -> jax.Array:
    """``x``'s shards all-gathered over 'fsdp' along ``dim`` (through ``gather_dtype``,
    back to x's dtype). The backward is the reduce-scatter of the cotangent in its
    own dtype (fp32 for fp32 master weights), never rounded to ``gather_dtype``."""
    return gather([x], [dim], gather_dtype)[0]


def _gather_leaf_fwd(x, dim, gather_dtype):
    return gather([x], [dim], gather_dtype)[0], None


def _gather_leaf_bwd(dim, gather_dtype, _, g):
    h = jax.lax.psum_scatter(_wide(g), FSDP, scatter_dimension=dim, tiled=True)
    return (h.astype(g.dtype),)


gather_leaf.defvjp(_gather_leaf_fwd, _gather_leaf_bwd)


def _path(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def _is_layer(path) -> bool:
    return bool(path) and getattr(path[0], "key", None) == LAYERS_KEY


def layer_hook(params, dims: Sequence[int | None], gather_dtype=None) -> Callable:
    """The ``scan_hook`` function that gathers one layer: each leaf of the sliced
    layer state (``Decoder.scan_layers``) all-gathered along its fsdp dim (the stacked
    leaf's, less the removed layer axis). Leaves are matched by path below
    ``layers``; a leaf the params do not name is an error."""
    want = {}
    for (path, _), d in zip(jax.tree_util.tree_leaves_with_path(params), dims, strict=True):
        if _is_layer(path):
            if d == 0:
                raise ValueError(f"{_path(path)}: split over fsdp along the layer axis")
            want[_path(path[1:])] = None if d is None else d - 1

    def hook(state):
        def one(path, x):
            key = _path(path)
            if key not in want:
                raise ValueError(
                    f"layer state leaf {key} is not a parameter under {LAYERS_KEY!r}; "
                    f"the per-layer FSDP gather knows {sorted(want)}"
                )
            d = want[key]
            return x if d is None else gather_leaf(x, d, gather_dtype)

        return jax.tree_util.tree_map_with_path(one, state)

    return hook


def sharded_call(fn, params, dims: Sequence[int | None], mode: FsdpGather, gather_dtype=None):
    """``f(params_r, *args) -> (total, grads, out)``: ``fn`` (an engine's device fn)
    on one rank's fsdp-split ``params_r`` with the gathers of ``mode``; ``grads``
    summed over every data rank and split like the params (``reduce_grads``)."""
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    per_layer = [FsdpGather(mode) is FsdpGather.LAYER and _is_layer(p) for p in paths]
    first = [None if lay else d for d, lay in zip(dims, per_layer, strict=True)]
    hook = layer_hook(params, dims, gather_dtype) if any(per_layer) else None
    treedef = jax.tree.structure(params)

    def call(params_r, *args):
        leaves = gather(jax.tree.leaves(params_r), first, gather_dtype)
        with layer_state_hook(hook):
            total, grads, out = fn(jax.tree.unflatten(treedef, leaves), *args)
        scattered = [lay and d is not None for d, lay in zip(dims, per_layer, strict=True)]
        g = reduce_grads(jax.tree.leaves(grads), dims, scattered=scattered)
        return total, jax.tree.unflatten(treedef, g), out

    return call


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(x, "jaxpr", x)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def _over_fsdp(eqn) -> bool:
    for key in ("axis_name", "axes"):
        names = eqn.params.get(key)
        names = names if isinstance(names, (tuple, list)) else (names,)
        if FSDP in names:
            return True
    return False


def safe_mode(mode: FsdpGather, mapped: Callable, *args) -> FsdpGather:
    """``mode``, or STEP when ``mapped(LAYER)(*args)`` (traced, not run) would run
    per-layer gathers inside a ``cond`` / ``switch`` branch (``branch_collectives``):
    the dfs engine's rank-dependent op choice would make the fsdp group diverge."""
    if mode is not FsdpGather.LAYER:
        return mode
    jaxpr = jax.make_jaxpr(mapped(mode))(*args).jaxpr
    return FsdpGather.STEP if branch_collectives(jaxpr) else mode


def branch_collectives(jaxpr, *, under: str | None = None) -> list[str]:
    """The collectives over 'fsdp' that ``jaxpr`` runs inside a ``cond`` / ``switch``
    branch ("<primitive> under cond"): ranks that pick different branches would
    diverge on them. [] when every fsdp collective runs unconditionally."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if under is not None and _over_fsdp(eqn):
            found.append(f"{name} under {under}")
        inner = name if name == "cond" else under
        for sub in _sub_jaxprs(eqn):
            found += branch_collectives(sub, under=inner)
    return found
