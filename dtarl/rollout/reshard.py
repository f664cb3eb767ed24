"""PAT's resharder (PAT, arXiv 2605.23945): the moves behind ``RolloutEngine.reshard``.

*Targets.* An engine built on a ('dp', 'tp') mesh may switch to any (dp, tp) with
dp * tp = its device count and tp dividing num_kv_heads (``switch_targets``); the
mesh of a shape is built over the construction mesh's devices in their order, so
equal shapes give equal meshes and one program cache (``mesh_for``).

*Weights* move one parameter at a time (a stacked layer parameter, [L, ...], holds
that weight of every layer) onto the rule table's NamedSharding for the new mesh,
device to device (a jitted identity with ``out_shardings``: ``transfer``;
``device_put`` between two meshes over the same devices would round-trip every array
through the host); an old parameter is freed as soon as its copy exists when the
engine owns it (weights a previous ``reshard`` returned, and copies the caller marked
with ``adopt``; the caller's weights are never deleted unless ``donate=True``), so the
extra memory is the largest parameter (plus any growth of the total, e.g. towards a
smaller tp).

*K/V.* "migrate" moves only the valid K/V (``migrate_rows``): on the old mesh it packs
the valid rows of each layer (each resident prompt's ``prompt.size - 1`` rows, each live
request's ``length`` response rows) into one compact [V, K, D] array per pool part,
V padded up to a multiple of lcm(old dp, new dp) so the rows split over dp on both
meshes and nothing is replicated; moves the compact arrays (``transfer``) and scatters
them into the empty pool of the new slot count on the new mesh (new slot j takes old
slot ``src[j]``'s rows, prompt rows keep their rows), layer by layer, each old buffer
freed as soon as its copy exists. Padded slot rows, free slots and free prompt rows
never move; the prompt lengths are the host's (scheduler) values, uploaded. "recompute"
frees the old pool, creates the empty one and rebuilds every resident prompt by prefill
and every live request's rows by extend from its tokens (``recompute_calls``; the
engine runs the calls).

Bytes are host bookkeeping of jax buffers (``dtarl.rollout.pool``): a "peak extra" is
the largest sum, during the switch, of the buffers it created minus the old buffers it
already freed, taken after each transfer completes.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dtarl.parallel.mesh import MESH_AXES, Rules, make_mesh, param_shardings
from dtarl.rollout import kernels as K
from dtarl.rollout.config import EngineError, merged_slots
from dtarl.rollout.pool import KVPool, buffer_ids, device_bytes, free_array, new_bytes
from dtarl.rollout.programs import ProgramCache, ProgramKey, ProgramKind
from dtarl.rollout.scheduler import Scheduler

# The keys of ``reshard``'s info dict.
INFO_KEYS = (
    "mode",
    "dp",
    "tp",
    "slots",
    "live",
    "weights_s",
    "kv_s",
    "compile_s",
    "seconds",
    "compiled",
    "moved_weight_bytes",
    "moved_kv_bytes",
    "live_kv_bytes",
    "weights_peak_extra_bytes",
    "kv_peak_extra_bytes",
    "peak_extra_bytes",
)


def switch_targets(base: Mesh | None, kv_heads: int) -> list[tuple[int, int]]:
    """The (dp, tp) shapes a switch from ``base`` (the construction mesh) accepts:
    dp * tp = its device count and tp dividing ``kv_heads`` (plus ``base``'s shape)."""
    if base is None:
        return []
    d = base.devices.size
    out = [(d // t, t) for t in range(1, d + 1) if d % t == 0 and kv_heads % t == 0]
    first = tuple(int(x) for x in base.devices.shape)
    return sorted(set(out) | {first}, key=lambda s: s[1])


def switch_slots(slots: int | None, *, live: int, waiting: int, dp: int, cap: int) -> int:
    """The slot count of a switch: ``slots``, checked to be in [max(1, live), cap]; by
    default the smallest dp * 2^k holding the ``live`` requests (``merged_slots``), or
    ``cap`` (config.slots) while requests wait. Fewer than ``cap`` only with an empty
    queue."""
    if slots is None:
        n = cap if waiting else merged_slots(live, dp, cap)
    elif not isinstance(slots, int | np.integer) or not max(1, live) <= slots <= cap:
        raise EngineError(
            f"slots={slots!r} must be an int in [{max(1, live)}, {cap}] (the "
            f"{live} live requests .. ContinuousConfig.slots)"
        )
    else:
        n = int(slots)
    if n < cap and waiting:
        raise EngineError(
            f"slots={n} < ContinuousConfig.slots={cap} while {waiting} requests wait for "
            "a slot: shrink only in the tail (empty queue), or keep slots=config.slots"
        )
    return n


def need_mesh(base: Mesh | None) -> Mesh:
    if base is None:
        raise EngineError(
            "mesh: the engine was built without a mesh; pass RolloutEngine(..., "
            "mesh=make_mesh(dp, tp)) to switch meshes"
        )
    return base


def mesh_for(base: Mesh | None, dp: int, tp: int) -> Mesh:
    """The ('dp', 'tp') mesh of shape (dp, tp) over ``base``'s devices, in their order."""
    base = need_mesh(base)
    if (dp, tp) == tuple(base.devices.shape):
        return base
    return make_mesh(dp, tp, devices=list(base.devices.flat))


def target_mesh(base: Mesh | None, mesh, kv_heads: int, field: str = "mesh") -> Mesh:
    """``mesh`` (a Mesh over ``base``'s devices or a (dp, tp) pair) checked against
    ``switch_targets``; errors name ``field``."""
    base = need_mesh(base)
    ok = switch_targets(base, kv_heads)
    mine = sorted(d.id for d in base.devices.flat)
    if isinstance(mesh, Mesh):
        if tuple(mesh.axis_names) != MESH_AXES:
            raise EngineError(
                f"{field}: axis names {tuple(mesh.axis_names)}, need {MESH_AXES} "
                "(dtarl.parallel.mesh.make_mesh)"
            )
        ids = sorted(d.id for d in mesh.devices.flat)
        if ids != mine:
            raise EngineError(
                f"{field}: devices {ids} are not the engine's {mine} (a switch keeps the "
                "device set; build the mesh with engine.mesh_for(dp, tp))"
            )
        shape = tuple(int(x) for x in mesh.devices.shape)
    else:
        try:
            shape = tuple(int(x) for x in mesh)
        except TypeError:
            shape = ()
        if len(shape) != 2:
            raise EngineError(f"{field}: need a jax Mesh or a (dp, tp) pair, got {mesh!r}")
    if shape not in ok:
        raise EngineError(
            f"{field}: (dp, tp) = {shape} is not a switch target; accepted (dp, tp): {ok} "
            f"(dp * tp = {base.devices.size} devices, tp dividing num_kv_heads={kv_heads})"
        )
    return mesh if isinstance(mesh, Mesh) else mesh_for(base, *shape)


def migrate_rows(
    prompt_rows: Sequence[int], response_rows: Sequence[int], dp_src: int, dp_dst: int
) -> tuple[int, int]:
    """(prompt rows, response rows) a migrate moves: the valid rows of each pool part
    (each resident prompt's, each live request's), each sum padded up to a multiple of
    lcm(dp_src, dp_dst) so the compact rows split over dp on both meshes (0 stays 0)."""
    m = math.lcm(int(dp_src), int(dp_dst))

    def pad(v) -> int:
        return -(-int(sum(int(x) for x in v)) // m) * m

    return pad(prompt_rows), pad(response_rows)


def _identity(x):
    return x


@functools.lru_cache(maxsize=256)
def _mover(target: NamedSharding):
    """A jitted identity whose output lands on ``target``: XLA moves the shards
    between the devices (collectives); nothing is fetched to the host."""
    return jax.jit(_identity, out_shardings=target)


def transfer(x, target):
    """``x`` onto the sharding ``target``, device to device when ``x`` is a jax array
    on the same devices (any mesh over them): on jax 0.10, ``device_put`` between two
    meshes over the same devices fetches every array to the host and uploads it
    again, which JAX's transfer guards do not see. An array already on ``target``
    (the same sharding) is returned as is: a switch that keeps the TP moves no
    weights. Anything else (host arrays, another device set) goes through
    ``device_put``."""
    if isinstance(x, jax.Array) and x.sharding == target:  # equal, not just equivalent:
        return x  # an equivalent sharding on another mesh would retrace the programs
    if (
        isinstance(x, jax.Array)
        and isinstance(target, NamedSharding)
        and x.sharding.device_set == target.device_set
        and x.is_fully_addressable
    ):
        return _mover(target)(x)
    return jax.device_put(x, target)


class Resharder:
    """Moves weights and K/V between meshes (module docstring) and remembers which
    weight leaves the engine owns (weak references: freed leaves drop out)."""

    def __init__(self, pool: KVPool, programs: ProgramCache, rules: Rules):
        self.pool, self.programs, self.rules = pool, programs, rules
        self.owned: list[weakref.ref] = []

    def own(self, weights) -> None:
        """Every leaf of ``weights`` is the engine's (a ``reshard`` made them)."""
        self.owned = [weakref.ref(x) for x in jax.tree.leaves(weights)]

    def adopt(self, placed, original) -> None:
        """The leaves of ``placed`` that share no buffer with ``original`` are the
        engine's (copies made for it, e.g. by ``place``)."""
        self.owned = [
            weakref.ref(p)
            for p, o in zip(jax.tree.leaves(placed), jax.tree.leaves(original), strict=True)
            if p is not o and not (buffer_ids(p) & buffer_ids(o) if isinstance(o, jax.Array) else 0)
        ]

    def move_weights(self, weights, mesh: Mesh, donate: bool) -> tuple[Any, int, int]:
        """(weights on ``mesh``, bytes moved, peak extra bytes), one parameter at a time."""
        target = jax.tree.leaves(param_shardings(weights, mesh, self.rules))
        flat, treedef = jax.tree_util.tree_flatten_with_path(weights)
        if len(target) != len(flat):
            raise EngineError("reshard: weights do not match the model's parameters")
        owned = {id(x) for ref in self.owned if (x := ref()) is not None}
        groups = {i: [i] for i in range(len(flat))}
        out: list[Any] = [None] * len(flat)
        extra = peak = moved = 0
        for idx in groups.values():
            for i in idx:
                x = flat[i][1]
                out[i] = y = transfer(x, target[i])
                fresh = new_bytes(y, x)
                extra += fresh
                moved += fresh
            jax.block_until_ready([out[i] for i in idx])
            peak = max(peak, extra)
            for i in idx:
                x = flat[i][1]
                if donate or id(x) in owned:
                    extra -= free_array(x, out[i])
        return jax.tree_util.tree_unflatten(treedef, out), moved, peak

    def migrate(
        self,
        old: K.Pool,
        old_at: tuple[Mesh, int],
        new_at: tuple[Mesh, int],
        src: np.ndarray,
        sched: Scheduler,
    ) -> tuple[K.Pool, int, int, float]:
        """The pool on ``new_at`` = (mesh, slots) holding only the valid K/V (module
        docstring): new slot j takes old slot ``src[j]``'s rows, ``sched`` (already
        reshaped to the new slots) names the live requests and resident prompts;
        (pool, bytes moved, peak extra bytes, compile seconds of the row programs)."""
        c = self.pool.config
        (old_mesh, old_n), (mesh, n) = old_at, new_at
        dp0, dp1 = old_mesh.shape["dp"], mesh.shape["dp"]
        resident = sched.resident()
        live = [(j, r) for j, r in enumerate(sched.slot_req) if r is not None and r.length]
        p_rows = [g.prompt.size - 1 for g in resident]
        vp, vr = migrate_rows(p_rows, [r.length for _, r in live], dp0, dp1)
        p_at = [
            g.pslot * c.prompt_len + np.arange(k) for g, k in zip(resident, p_rows, strict=True)
        ]
        r_old = [int(src[j]) * c.response_len + np.arange(r.length) for j, r in live]
        r_new = [j * c.response_len + np.arange(r.length) for j, r in live]
        plen = np.zeros(c.prompt_slots, np.int32)
        for g, k in zip(resident, p_rows, strict=True):
            plen[g.pslot] = k
        programs = self.programs
        sh = self.pool.placement(mesh, n).pool
        parts = []  # (pool part, its programs and indices or None: no valid rows)
        t0 = time.perf_counter()  # compile (or find cached) the row programs first
        for name, rows, at_old, at_new, drop, kind in (
            ("prompt", vp, p_at, p_at, c.prompt_slots * c.prompt_len, ProgramKind.UNPACK_PROMPT),
            ("resp", vr, r_old, r_new, n * c.response_len, ProgramKind.UNPACK_RESPONSE),
        ):
            if not rows:
                parts.append((name, None))
                continue
            i_old = np.zeros(rows, np.int32)  # pad rows read row 0 and are dropped
            i_new = np.full(rows, drop, np.int32)
            if at_old:
                i_old[: sum(x.size for x in at_old)] = np.concatenate(at_old)
                i_new[: sum(x.size for x in at_new)] = np.concatenate(at_new)
            pack = programs.get(
                ProgramKey(kind=ProgramKind.PACK, mesh=old_mesh, slots=old_n, rows=rows)
            )
            unpack = programs.get(ProgramKey(kind=kind, mesh=mesh, slots=n, rows=rows))
            x = getattr(old, f"{name}_k")[0]
            pack.lower(x, i_old).compile()
            compact = self.pool.compact(mesh, rows)
            unpack.lower(
                jax.ShapeDtypeStruct((rows,) + x.shape[2:], x.dtype, sharding=compact), i_new
            ).compile()
            parts.append((name, (pack, unpack, i_old, i_new, compact)))
        compile_s = time.perf_counter() - t0
        extra = peak = moved = 0

        def move(x, prog):
            nonlocal extra, peak, moved
            pack, unpack, i_old, i_new, compact = prog
            chain = [x, pack(x, i_old)]
            chain.append(transfer(chain[-1], compact))  # as is when the mesh is kept
            moved += device_bytes(chain[-1])  # the valid rows, rewritten into the new pool
            chain.append(unpack(chain[-1], i_new))
            z = chain[-1]
            z.block_until_ready()
            extra += sum(new_bytes(b, a) for a, b in zip(chain, chain[1:], strict=False))
            peak = max(peak, extra)
            for i, a in enumerate(chain[:-1]):  # oldest first: x, then the intermediates
                extra -= free_array(a, *chain[i + 1 :])
            return z

        def empty(x, like, target):  # a part with no valid rows: nothing moves
            nonlocal extra, peak
            z = jnp.zeros(like.shape, like.dtype, device=target)
            extra += device_bytes(z)
            peak = max(peak, extra)
            extra -= free_array(x, z)
            return z

        out, shapes = {}, self.pool.shapes(n)
        for name, prog in parts:
            for field in (f"{name}_k", f"{name}_v"):
                out[field] = tuple(
                    empty(x, a, t) if prog is None else move(x, prog)
                    for x, a, t in zip(
                        getattr(old, field), getattr(shapes, field), getattr(sh, field), strict=True
                    )
                )
        old.prompt_len.delete()
        plen = jax.device_put(plen, sh.prompt_len)  # the host's lengths, uploaded
        return K.Pool(prompt_len=plen, **out), moved, peak, compile_s

    def fresh_pool(self, new_at: tuple[Mesh, int]) -> int:
        """Frees the pool's arrays and creates the empty pool of ``new_at``; the extra
        bytes (created minus freed, at least 0) before anything is rebuilt into it."""
        freed = self.pool.free()
        mesh, n = new_at
        self.pool.arrays = self.pool.zeros(n, self.pool.placement(mesh, n))
        created = sum(device_bytes(x) for x in jax.tree.leaves(self.pool.arrays))
        return max(0, created - freed)


__all__ = [
    "INFO_KEYS",
    "Resharder",
    "mesh_for",
    "migrate_rows",
    "need_mesh",
    "switch_slots",
    "switch_targets",
    "target_mesh",
    "transfer",
]
