"""Device meshes and the logical-axis rule table.

A training mesh has two axes::

    dp   data parallel: every dp rank runs its own tree engine on its partition
         of the batch (``dtarl.parallel.partition``); gradients are summed over dp.
    tp   tensor parallel: parameters are split along the axes the rule table maps
         to 'tp'; the compiler (GSPMD / Shardy) inserts the collectives.

Every parameter carries its logical axis names (``dtarl.axes``) in its nnx
metadata key ``axes``; a rule table maps each logical name to a mesh axis or to
``None`` (replicated). ``DEFAULT_RULES`` is Megatron-style TP: query heads,
kv heads and the MLP hidden width are split over 'tp'; the embedding, the
vocabulary, norms and head_dim are replicated.

A dimension whose size the mesh axis does not divide is replicated instead
(e.g. ``kv_heads = 2`` on ``tp = 4``: k/v projections are replicated while
q/o/MLP stay split); ``param_specs`` reports it in ``ShardingPlan.replicated``.
The numbers are unchanged either way; only memory and communication differ.
A mesh axis is used at most once per parameter (first logical axis wins).

Multi-host: ``make_mesh`` uses ``jax.devices()``, which after
``jax.distributed.initialize`` lists every process's devices, so the same code
builds the global mesh on every host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl import axes

DP = "dp"
TP = "tp"
MESH_AXES = (DP, TP)

__all__ = [
    "DEFAULT_RULES",
    "DP",
    "MESH_AXES",
    "TP",
    "MeshConfig",
    "MeshError",
    "Rules",
    "ShardingPlan",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "shard_params",
]


class MeshError(ValueError):
    """A mesh shape that does not fit the devices, or a bad rule table."""


Rules = Mapping[str, str | None]
"""Logical axis name -> mesh axis name (or None = replicated)."""

DEFAULT_RULES: Rules = {
    axes.BATCH: DP,
    axes.SEQ: None,
    axes.KV_SEQ: None,
    axes.EMBED: None,
    axes.HEADS: TP,
    axes.KV_HEADS: TP,
    axes.HEAD_DIM: None,
    axes.MLP: TP,
    axes.VOCAB: None,
    axes.LAYERS: None,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """A ('dp', 'tp') mesh shape. ``dp=None`` means "all devices not used by tp"."""

    dp: int | None = None
    tp: int = 1

    def __post_init__(self):
        for name in ("dp", "tp"):
            v = getattr(self, name)
            if v is None and name == "dp":
                continue
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise MeshError(f"{name}={v!r}: must be an int >= 1")

    def resolve(self, num_devices: int) -> tuple[int, int]:
        """(dp, tp) for ``num_devices`` devices; raises unless dp * tp == num_devices."""
        tp = int(self.tp)
        if self.dp is None:
            if num_devices % tp:
                raise MeshError(
                    f"tp={tp} does not divide the {num_devices} available devices; "
                    f"choose tp in {_divisors(num_devices)}"
                )
            return num_devices // tp, tp
        dp = int(self.dp)
        if dp * tp != num_devices:
            raise MeshError(
                f"dp={dp} x tp={tp} = {dp * tp} devices, but {num_devices} are available; "
                f"dp * tp must equal the device count (tp in {_divisors(num_devices)}, "
                "or leave dp unset)"
            )
        return dp, tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(
    dp: int | None = None, tp: int = 1, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ('dp', 'tp') mesh over ``devices`` (default: every device of every process).

    Both axes are ``AxisType.Auto``: shardings are propagated by the compiler, and
    ``jax.shard_map(..., axis_names={'dp'})`` takes manual control of 'dp' only.
    tp is the minor (fastest-varying) axis, so a tp group sits on one host when
    the per-host device count is a multiple of tp.
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise MeshError("devices: empty device list")
    dp, tp = MeshConfig(dp=dp, tp=tp).resolve(len(devs))
    return jax.make_mesh(
        (dp, tp), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devs
    )


def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    *,
    exclude: Sequence[str] = (DP,),
) -> tuple[P, tuple[str, ...]]:
    """PartitionSpec of one array from its logical axes.

    Returns (spec, fallbacks): ``fallbacks`` names the logical axes that a rule
    mapped to a mesh axis but were replicated because that axis does not divide
    the dimension (or was already used). Mesh axes in ``exclude`` are never used
    (parameters are replicated over dp).
    """
    if len(logical) != len(shape):
        raise MeshError(f"axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[str | None] = []
    fallbacks: list[str] = []
    for name, size in zip(logical, shape, strict=True):
        if name is not None and name not in rules:
            raise MeshError(
                f"logical axis {name!r} has no rule; add it to the rule table "
                f"(known: {sorted(rules)})"
            )
        target = None if name is None else rules[name]
        if target is None or target in exclude or target not in mesh.shape:
            spec.append(None)
            continue
        n = mesh.shape[target]
        if n == 1:
            spec.append(None)
        elif target in used or size % n:
            spec.append(None)
            fallbacks.append(name)
        else:
            spec.append(target)
            used.add(target)
    return P(*spec), tuple(fallbacks)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ShardingPlan:
    """Per-parameter specs (an ``nnx.State`` of ``P``) and what had to be replicated."""

    specs: nnx.State
    replicated: tuple[tuple[str, str], ...]  # (parameter path, logical axis) fallbacks


def param_specs(params: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> ShardingPlan:
    """PartitionSpecs for every ``nnx.Param`` from its ``axes`` metadata."""
    fallbacks: list[tuple[str, str]] = []

    def one(path, var):
        meta = var.get_metadata() if _is_var(var) else {}
        logical = meta.get("axes")
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        shape = np.shape(var.get_value() if _is_var(var) else var)
        if logical is None:
            raise MeshError(f"parameter {name}: no 'axes' metadata; cannot map it to the mesh")
        spec, fb = logical_to_spec(logical, shape, mesh, rules)
        fallbacks.extend((name, a) for a in fb)
        return var.replace(spec) if _is_var(var) else spec

    specs = jax.tree.map_with_path(one, params, is_leaf=_is_var)
    return ShardingPlan(specs=specs, replicated=tuple(fallbacks))


def param_shardings(params: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """``NamedSharding`` per parameter (same tree structure as ``params``)."""
    specs = param_specs(params, mesh, rules).specs
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def shard_params(params: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """Places ``params`` on the mesh (tp-split by the rules, replicated over dp).

    Works in multi-process runs too: every process must hold the same host values
    (same seed or checkpoint); each fills only its addressable shards.
    """
    shardings = param_shardings(params, mesh, rules)
    return jax.tree.map(global_array, params, shardings)


def global_array(x, sharding: NamedSharding) -> jax.Array:
    """A global ``jax.Array`` from a host value every process holds in full."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
