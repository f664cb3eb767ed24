"""The continuous engine's K/V pool: its arrays (``kernels.Pool``: a prompt pool of
Q rows and a response pool of one row per slot, one array per layer), their placement
on a ('dp', 'tp') mesh, and the byte accounting.

*Placement.* Slots (and prompt rows) over dp, kv heads over tp, via the rule table; a
dimension dp (tp) does not divide is replicated over dp (tp) by the rule table's
fallback, e.g. Q prompt rows when dp does not divide Q. ``Placement`` holds the
NamedShardings of the pool, of the slot arrays uploaded with every decode call, and
the replicated one (the group table), per (mesh, slots).

*Bytes.* ``token_bytes``: the K/V of one token over all layers (unsharded); live K/V
is rows x that, allocated K/V is (Q x P + slots x R) x that. ``device_bytes``,
``new_bytes`` and ``free_array`` are the host bookkeeping of jax buffers a switch uses
to report its peak extra memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl import axes
from dtarl.parallel.mesh import Rules, logical_to_spec
from dtarl.rollout import kernels as K
from dtarl.rollout.config import ContinuousConfig
from dtarl.rollout.scheduler import empty_slots


def device_bytes(x) -> int:
    """Bytes of an array on its devices (every addressable shard, replicas included)."""
    return sum(s.data.nbytes for s in x.addressable_shards)


def buffer_ids(x) -> set[int]:
    """The device buffers of ``x``'s addressable shards."""
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def new_bytes(new, old) -> int:
    """Bytes of ``new``'s buffers that are not ``old``'s (device_put may keep a shard
    whose placement does not change, e.g. a replicated array)."""
    if new is old:
        return 0
    mine = buffer_ids(old)
    return sum(
        s.data.nbytes for s in new.addressable_shards if s.data.unsafe_buffer_pointer() not in mine
    )


def free_array(old, *news) -> int:
    """Deletes ``old`` unless a new array shares one of its buffers; the bytes freed."""
    mine = buffer_ids(old)
    if any(n is old or mine & buffer_ids(n) for n in news):
        return 0
    nbytes = device_bytes(old)
    old.delete()
    return nbytes


@dataclasses.dataclass(frozen=True)
class Placement:
    """The NamedShardings of one (mesh, slots) (module docstring)."""

    pool: K.Pool
    slots: K.Slots
    replicated: NamedSharding


class KVPool:
    """The pool's arrays (``arrays``), its shapes and placements for any slot count, and
    its bytes. ``arrays`` is replaced by every program call (the pool is donated)."""

    def __init__(self, config: ContinuousConfig, model_cfg, rules: Rules):
        self.config, self.model_cfg, self.rules = config, model_cfg, rules
        cfg = model_cfg
        cd = jnp.dtype(cfg.compute_dtype)
        self.token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cd.itemsize
        self.arrays: K.Pool | None = None
        self._placements: dict[tuple[Mesh, int], Placement] = {}

    def shapes(self, n: int) -> K.Pool:
        """The pool's arrays as ShapeDtypeStructs (no sharding) for ``n`` slots."""
        c, cfg = self.config, self.model_cfg
        cd = jnp.dtype(cfg.compute_dtype)
        kv = (cfg.num_kv_heads, cfg.head_dim)
        prompt = jax.ShapeDtypeStruct((c.prompt_slots, c.prompt_len) + kv, cd)
        resp = jax.ShapeDtypeStruct((n, c.response_len) + kv, cd)
        layers = cfg.num_layers
        return K.Pool(
            prompt_k=(prompt,) * layers,
            prompt_v=(prompt,) * layers,
            prompt_len=jax.ShapeDtypeStruct((c.prompt_slots,), jnp.int32),
            resp_k=(resp,) * layers,
            resp_v=(resp,) * layers,
        )

    def placement(self, mesh: Mesh, n: int) -> Placement:
        """The shardings of ``n`` slots on ``mesh`` (cached per (mesh, slots))."""
        key = (mesh, n)
        if key in self._placements:
            return self._placements[key]
        rules = self.rules

        def kv(a):
            logical = (axes.BATCH, axes.KV_SEQ, axes.KV_HEADS, axes.HEAD_DIM)
            return NamedSharding(
                mesh, logical_to_spec(logical, a.shape, mesh, rules, exclude=())[0]
            )

        def rows(shape):
            logical = (axes.BATCH,) + (None,) * (len(shape) - 1)
            return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules, exclude=())[0])

        shapes = self.shapes(n)
        pool = K.Pool(
            prompt_k=tuple(kv(a) for a in shapes.prompt_k),
            prompt_v=tuple(kv(a) for a in shapes.prompt_v),
            prompt_len=NamedSharding(mesh, P()),
            resp_k=tuple(kv(a) for a in shapes.resp_k),
            resp_v=tuple(kv(a) for a in shapes.resp_v),
        )
        mirror = empty_slots(n, self.config.max_stop_ids)
        slots = K.Slots(**{k: rows(v.shape) for k, v in mirror.items()})
        out = Placement(pool=pool, slots=slots, replicated=NamedSharding(mesh, P()))
        self._placements[key] = out
        return out

    def compact(self, mesh: Mesh, rows: int) -> NamedSharding:
        """The sharding of a migrate's compact K/V ([rows, kv_heads, head_dim]: valid rows
        packed, ``dtarl.rollout.reshard``): rows over dp, kv heads over tp."""
        cfg = self.model_cfg
        logical = (axes.BATCH, axes.KV_HEADS, axes.HEAD_DIM)
        shape = (rows, cfg.num_kv_heads, cfg.head_dim)
        return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, self.rules, exclude=())[0])

    def zeros(self, n: int, placement: Placement | None) -> K.Pool:
        """An empty pool of ``n`` slots, created in place (on ``placement``'s
        shardings, or the default device without one)."""
        shapes = self.shapes(n)
        if placement is None:
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jax.tree.map(
            lambda a, sh: jnp.zeros(a.shape, a.dtype, device=sh), shapes, placement.pool
        )

    def abstract(self, n: int, placement: Placement) -> K.Pool:
        """The pool of ``n`` slots as sharded ShapeDtypeStructs (compiling, no memory)."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.shapes(n),
            placement.pool,
        )

    def abstract_slots(self, n: int, placement: Placement) -> K.Slots:
        """The slot arrays of ``n`` slots as sharded ShapeDtypeStructs."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            K.Slots(**empty_slots(n, self.config.max_stop_ids)),
            placement.slots,
        )

    def allocated_bytes(self, n: int) -> int:
        """K/V bytes the pool of ``n`` slots holds (unsharded)."""
        c = self.config
        return (c.prompt_slots * c.prompt_len + n * c.response_len) * self.token_bytes

    def free(self) -> int:
        """Deletes the arrays (the pool is then empty until ``arrays`` is set); the
        bytes freed."""
        freed = sum(free_array(x) for x in jax.tree.leaves(self.arrays))
        self.arrays = None
        return freed


def slot_arrays(mirror: dict[str, Any], placement: Placement | None) -> K.Slots:
    """The host mirror as device ``Slots`` (on ``placement`` when given)."""
    slots = K.Slots(**{k: jnp.asarray(v) for k, v in mirror.items()})
    return slots if placement is None else jax.device_put(slots, placement.slots)


__all__ = [
    "KVPool",
    "Placement",
    "buffer_ids",
    "device_bytes",
    "free_array",
    "new_bytes",
    "slot_arrays",
]
