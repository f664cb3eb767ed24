"""Device meshes and the logical-axis rule table.

A mesh has two axes, ('dp', 'tp') (``make_mesh``: the rollout's and the default
training mesh), or three, ('dp', 'fsdp', 'tp') (``make_train_mesh``, when fsdp > 1)::

    dp    data parallel: every data rank runs its own tree engine on its partition
          of the batch (``dtarl.parallel.partition``); gradients are summed over dp.
    fsdp  data parallel too (the batch is cut over dp x fsdp ranks), and the
          parameters, gradients and optimiser moments are split over it (ZeRO-3,
          ``FSDP_ORDER``): each parameter is all-gathered where the step uses it
          and its gradient reduce-scattered (``dtarl.parallel.sharded``): before
          the step, or layer by layer inside the layer scan (``FsdpGather``).
    tp    tensor parallel: parameters are split along the axes the rule table maps
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

FSDP is keyed on names too: a parameter is split over 'fsdp' along the first of
its logical axes in ``FSDP_ORDER`` (embed, then vocab, mlp, heads, kv_heads,
head_dim) that 'tp' does not already split and that fsdp divides. The stacked
``layers`` axis is never split (a scan over layers slices it), so the same rule
holds for per-layer and stacked parameters; a parameter with no such axis (a
tiny norm whose width fsdp does not divide) stays replicated over fsdp and is
reported in ``ShardingPlan.replicated`` as (path, "fsdp").

Multi-host: ``make_mesh`` uses ``jax.devices()``, which after
``jax.distributed.initialize`` lists every process's devices, so the same code
builds the global mesh on every host.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl import axes

DP = "dp"
FSDP = "fsdp"
TP = "tp"
MESH_AXES = (DP, TP)
TRAIN_AXES = (DP, FSDP, TP)

FSDP_ORDER: tuple[str, ...] = (
    axes.EMBED,
    axes.VOCAB,
    axes.MLP,
    axes.HEADS,
    axes.KV_HEADS,
    axes.HEAD_DIM,
)
"""Logical axes a parameter may be split over 'fsdp' along, in order of preference
(never ``layers``, ``batch`` or the sequence axes)."""

__all__ = [
    "DEFAULT_RULES",
    "DP",
    "FSDP",
    "FsdpGather",
    "FSDP_ORDER",
    "MESH_AXES",
    "TP",
    "TRAIN_AXES",
    "MeshConfig",
    "MeshError",
    "Rules",
    "ShardingPlan",
    "data_ranks",
    "fsdp_dim",
    "fsdp_dims",
    "logical_to_spec",
    "make_mesh",
    "make_train_mesh",
    "mesh_size",
    "rollout_view",
    "param_shardings",
    "param_specs",
    "shard_params",
]


class MeshError(ValueError):
    """A mesh shape that does not fit the devices, or a bad rule table."""


class FsdpGather(enum.Enum):
    """Where FSDP all-gathers the weights (``mesh.fsdp_gather``; ``dtarl.parallel.fsdp``).

    STEP:  the whole model before the engine's program, once per step.
    LAYER: each stacked decoder layer inside the layer scan's step, one at a time
           (the embedding, final norm and lm_head before the program)."""

    STEP = "step"
    LAYER = "layer"

    @classmethod
    def parse(cls, value, field: str = "mesh.fsdp_gather") -> FsdpGather:
        """``value`` (a member or its name) as a member; MeshError naming ``field``."""
        try:
            return cls(value)
        except ValueError:
            accepted = [g.value for g in cls]
            raise MeshError(f"{field}={value!r}; accepted: {accepted}") from None


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


def make_train_mesh(
    dp: int, fsdp: int, tp: int = 1, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ('dp', 'fsdp', 'tp') mesh over ``devices`` (default: every device of every
    process); dp x fsdp x tp must equal their count. All axes ``AxisType.Auto``; tp is
    the minor axis, then fsdp (an fsdp group sits on one host when it can)."""
    devs = list(jax.devices() if devices is None else devices)
    for name, v in (("dp", dp), ("fsdp", fsdp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise MeshError(f"{name}={v!r}: must be an int >= 1")
    n = len(devs)
    if dp * fsdp * tp != n:
        raise MeshError(
            f"dp={dp} x fsdp={fsdp} x tp={tp} = {dp * fsdp * tp} devices, but {n} are "
            f"available; dp x fsdp x tp must equal the device count (each in {_divisors(n)})"
        )
    return jax.make_mesh((dp, fsdp, tp), TRAIN_AXES, axis_types=(AxisType.Auto,) * 3, devices=devs)


def mesh_size(mesh: Mesh, axis: str) -> int:
    """The size of ``axis`` on ``mesh`` (1 when the mesh has no such axis)."""
    return int(mesh.shape[axis]) if axis in mesh.shape else 1


def data_ranks(mesh: Mesh) -> int:
    """The data-parallel ranks of a training mesh: dp x fsdp."""
    return mesh_size(mesh, DP) * mesh_size(mesh, FSDP)


def rollout_view(mesh: Mesh) -> Mesh:
    """The ('dp', 'tp') mesh over the same devices in the same order with dp x fsdp
    data ranks: where the rollout decodes and where its weights are gathered to
    once per step (as is for a mesh without 'fsdp')."""
    if FSDP not in mesh.shape:
        return mesh
    return make_mesh(data_ranks(mesh), mesh_size(mesh, TP), devices=list(mesh.devices.flat))


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
        if mesh_size(mesh, FSDP) > 1:
            dim = fsdp_dim(logical, shape, spec, mesh_size(mesh, FSDP))
            if dim is None:
                fallbacks.append((name, FSDP))
            else:
                spec = P(*(FSDP if i == dim else s for i, s in enumerate(spec)))
        return var.replace(spec) if _is_var(var) else spec

    specs = jax.tree.map_with_path(one, params, is_leaf=_is_var)
    return ShardingPlan(specs=specs, replicated=tuple(fallbacks))


def fsdp_dim(logical: Sequence[str | None], shape: Sequence[int], spec: P, fsdp: int) -> int | None:
    """The dimension a parameter is split along over 'fsdp': the first logical axis in
    ``FSDP_ORDER`` that ``spec`` leaves unsplit and ``fsdp`` divides (None: none)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    for want in FSDP_ORDER:
        for i, (name, size) in enumerate(zip(logical, shape, strict=True)):
            if name == want and entries[i] is None and size % fsdp == 0:
                return i
    return None


def fsdp_dims(specs) -> list[int | None]:
    """Per leaf of a tree of ``P`` (``ShardingPlan.specs`` or shardings): the dimension
    split over 'fsdp', or None."""

    def one(s):
        s = s.spec if isinstance(s, NamedSharding) else s
        hits = [i for i, e in enumerate(s) if e == FSDP or (isinstance(e, tuple) and FSDP in e)]
        return hits[0] if hits else None

    return [one(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))]


def param_shardings(params: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """``NamedSharding`` per parameter (same tree structure as ``params``)."""
    specs = param_specs(params, mesh, rules).specs
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def shard_params(params: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """Places ``params`` on the mesh (tp- and fsdp-split by the rules, replicated over dp).

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
