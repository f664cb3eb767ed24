"""The continuous engine's program cache: one jitted program per ``ProgramKey`` (its
kind, the mesh and slot count it runs on, and the statics of its kind), kept for the
engine's life, so a shape seen before compiles nothing.

``trace_count`` counts the programs traced (and those read from the program store,
``dtarl.aot``, though their function never runs): a test that runs the same shapes
twice asserts it does not move.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dtarl import aot
from dtarl.rollout import kernels as K
from dtarl.rollout.config import decode_windows, length_buckets
from dtarl.rollout.pool import KVPool


class ProgramKind(enum.Enum):
    """What a program computes."""

    DECODE = "decode"  # steps decode steps of every slot (kernels.decode_chunk)
    PREFILL = "prefill"  # prefill_batch prompts into prompt rows (kernels.prefill)
    EXTEND = "extend"  # extend_batch requests' appended tokens (kernels.extend)
    PACK = "pack"  # ``rows`` valid rows of one K/V layer into a compact [rows, K, D]
    UNPACK_PROMPT = "unpack_prompt"  # a compact array into an empty prompt layer
    UNPACK_RESPONSE = "unpack_response"  # ... into an empty response layer of ``slots``


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramKey:
    """One program: ``kind`` on ``mesh`` (None: one device) with ``slots`` slots, and
    the statics of its kind (the others stay 0/False): decode ``steps``, ``filtered``
    (top-k/top-p on), ``window`` (response rows read); prefill/extend ``length`` (the
    padded tokens per row, a ``len_bucket``); pack/unpack ``rows`` (compact rows)."""

    kind: ProgramKind
    mesh: Mesh | None
    slots: int
    steps: int = 0
    filtered: bool = False
    window: int = 0
    length: int = 0
    rows: int = 0

    def __post_init__(self):
        if not isinstance(self.kind, ProgramKind):
            raise TypeError(f"ProgramKey.kind={self.kind!r} must be a ProgramKind")
        if not isinstance(self.slots, int | np.integer) or self.slots < 1:
            raise ValueError(f"ProgramKey.slots={self.slots!r} must be an int >= 1")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(dp, tp); (1, 1) without a mesh."""
        return (1, 1) if self.mesh is None else tuple(int(x) for x in self.mesh.devices.shape)

    @property
    def statics(self) -> tuple:
        """The statics of the kind, in the order the program store names them."""
        if self.kind is ProgramKind.DECODE:
            return (self.steps, self.filtered, self.window)
        if self.kind in (ProgramKind.PREFILL, ProgramKind.EXTEND):
            return (self.length,)
        return (self.rows,)


class ProgramCache:
    """The engine's programs (module docstring). ``graphdef``: the model's
    ``nnx.split`` graph (weights merge into it inside a program); ``static``: what,
    besides the key, pins a program for the program store (the configs and rules)."""

    def __init__(self, graphdef, pool: KVPool, *, static: tuple):
        self.graphdef, self.pool, self.static = graphdef, pool, static
        self.trace_count = 0
        self._fns: dict[ProgramKey, Any] = {}

    def __len__(self) -> int:
        return len(self._fns)

    def __contains__(self, key: ProgramKey) -> bool:
        return key in self._fns

    def keys(self) -> list[ProgramKey]:
        """The keys of the programs built so far, in the order they were built."""
        return list(self._fns)

    def get(self, key: ProgramKey) -> Callable:
        """The jitted program of ``key`` (built on first use; ``.lower`` compiles it)."""
        if key not in self._fns:
            self._fns[key] = self._build(key)
        return self._fns[key]

    def compile(self, key: ProgramKey, *args) -> None:
        """Compiles ``key``'s program for ``args`` (arrays or ShapeDtypeStructs) unless
        it is compiled already."""
        self.get(key).lower(*args).compile()

    def compile_prefill(self, at: tuple[Mesh | None, int], length: int, weights, pool) -> None:
        """Compiles the prefill program of bucket ``length`` on ``at`` = (mesh, slots)."""
        b = self.pool.config.prefill_batch
        z = np.zeros(b, np.int32)
        key = ProgramKey(kind=ProgramKind.PREFILL, mesh=at[0], slots=at[1], length=length)
        self.compile(key, weights, pool, z, np.zeros((b, length), np.int32), z)

    def compile_extend(self, at: tuple[Mesh | None, int], length: int, weights, pool) -> None:
        """Compiles the extend program of bucket ``length`` on ``at`` = (mesh, slots)."""
        e = self.pool.config.extend_batch
        z = np.zeros(e, np.int32)
        key = ProgramKey(kind=ProgramKind.EXTEND, mesh=at[0], slots=at[1], length=length)
        self.compile(key, weights, pool, z, z, z, np.zeros((e, length), np.int32), z)

    def warm(
        self, at: tuple[Mesh | None, int], args, *, filtered: bool | None, extend: bool
    ) -> None:
        """Compiles every program a run on ``at`` = (mesh, slots) can need: decode per
        window (``filtered`` None: both sampling variants), prefill per prompt bucket
        and, with ``extend``, extend per response bucket. ``args``: (weights, pool,
        slots, table) as arrays or sharded ShapeDtypeStructs."""
        c = self.pool.config
        weights, pool, slots, table = args
        mesh, n = at
        for f in (False, True) if filtered is None else (filtered,):
            for w in decode_windows(c.response_len):
                key = ProgramKey(
                    kind=ProgramKind.DECODE,
                    mesh=mesh,
                    slots=n,
                    steps=c.steps_per_call,
                    filtered=f,
                    window=w,
                )
                self.compile(key, weights, pool, slots, table)
        for t in length_buckets(c.prompt_len):
            self.compile_prefill(at, t, weights, pool)
        if extend:
            for t in length_buckets(c.response_len):
                self.compile_extend(at, t, weights, pool)

    def _count(self) -> None:
        self.trace_count += 1

    def _build(self, key: ProgramKey):
        kind, count = key.kind, self._count
        if kind is ProgramKind.DECODE:

            def fn(weights, pool, slots, table):
                count()
                return K.decode_chunk(
                    self._model(weights),
                    pool,
                    slots,
                    table,
                    steps=key.steps,
                    filtered=key.filtered,
                    window=key.window,
                )

            return self._jit(fn, key, pool_only=False)
        if kind is ProgramKind.PREFILL:

            def fn(weights, pool, qslot, tokens, lens):
                count()
                return K.prefill(self._model(weights), pool, qslot, tokens, lens)

            return self._jit(fn, key, pool_only=True)
        if kind is ProgramKind.EXTEND:

            def fn(weights, pool, slot, group, length, tokens, count_):
                count()
                return K.extend(self._model(weights), pool, slot, group, length, tokens, count_)

            return self._jit(fn, key, pool_only=True)
        rows = key.rows
        if kind is ProgramKind.PACK:

            def fn(x, idx):
                count()
                return x.reshape((-1,) + x.shape[2:])[idx]

            return jax.jit(fn, out_shardings=self.pool.compact(key.mesh, rows))
        part = "prompt_k" if kind is ProgramKind.UNPACK_PROMPT else "resp_k"
        like = getattr(self.pool.shapes(key.slots), part)[0]
        out = getattr(self.pool.placement(key.mesh, key.slots).pool, part)[0]

        def fn(c, idx):
            count()
            flat = jnp.zeros((like.shape[0] * like.shape[1],) + like.shape[2:], like.dtype)
            return flat.at[idx].set(c, mode="drop").reshape(like.shape)

        return jax.jit(fn, out_shardings=out)

    def _model(self, weights):
        return nnx.merge(self.graphdef, weights)

    def _jit(self, fn, key: ProgramKey, *, pool_only: bool):
        """jit with the pool donated; on a mesh, outputs keep the inputs' shardings (so a
        call never sees a new input sharding and compiles again). Through the program
        store when one is enabled (``dtarl.aot``): a program read from it counts as a
        trace though ``fn`` never runs."""
        outs = None
        if key.mesh is not None:
            sh = self.pool.placement(key.mesh, key.slots)
            outs = sh.pool if pool_only else (sh.pool, sh.slots, sh.replicated)
        return aot.jit(
            fn,
            name=f"rollout_{key.kind.value}",
            static=(*self.static, key.slots, key.statics, aot.shardings_text(outs)),
            donate_argnums=(1,),
            out_shardings=outs,
            on_load=self._count,
        )


__all__ = ["ProgramCache", "ProgramKey", "ProgramKind"]
