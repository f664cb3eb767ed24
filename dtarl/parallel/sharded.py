"""Sharded training: one tree engine per dp rank, tp left to the compiler.

    L(theta)  = sum_r L_r(theta),   L_r = sum_{i in rank r} w_i loss_i   (w_i from the GLOBAL batch)
    grad L    = psum_dp grad L_r

The batch is split over the mesh's 'dp' axis by ``dtarl.parallel.partition``
(AREAL-DTA §4: contiguous cuts of the DFS order, min-max tree cost, or a baseline
when one has the lower makespan), priced by the engine that runs: its own
``partition_cost(batch)`` (``dtarl.engines.cost``: FLOPs from its work counts; auto's
pick's), else ``fallback_cost``. ``stats`` name the cost model and carry each
rank's padded work as the engine counts it (``features``: ``rank_work_flops``). Every rank
prepares its own sub-batch with the SAME engine instance, twice: the first pass
grows the engine's monotone shape buckets to the largest rank, the second
produces arrays with one common ``static`` key, so the per-rank ``args`` stack
along a new leading dp axis. The per-sequence loss weights come from the whole
batch (token-level normalisation divides by the GLOBAL token count), so the sum
over ranks is exactly the single-device loss.

Device side (``Strategy.SHARD_MAP``, the default)::

    jit(shard_map(per_rank, axis_names={'dp'}))      'tp' stays an Auto axis
    per_rank(params, args_r) = psum_dp(engine.device_fn(loss, static)(params, args_r))

'dp' is manual: each dp shard runs the engine's own program (its ``lax.scan``
over the push/pop plan, with real ``lax.switch`` branching) on its rank's data.
'tp' is automatic: the parameters enter split by the rule table
(``dtarl.parallel.mesh``) and the compiler partitions the einsums over heads /
MLP width and inserts the tp collectives. ``Strategy.JIT`` is the alternative
(plain ``jit`` of ``vmap(device_fn)`` over the stacked dp axis with
``NamedSharding`` inputs, gradient sum = ``sum(axis=0)``); it is kept for
comparison: ``vmap`` turns the DFS plan's ``lax.switch`` into a select that
runs every branch (push and pop) on every step. Measured with
``time_strategies`` on 8 fake CPU devices, tiny model, 8 GRPO groups x 8
(prompt 64, responses 16..96), step time (min of 5, compile excluded):

    engine  mesh      shard_map   jit+vmap
    dfs     dp8 tp1     0.82 s     2.01 s    (2.4x)
    dfs     dp4 tp2     0.22 s     0.52 s    (2.4x)
    dense   dp8 tp1     2.81 s     3.36 s    (1.2x)
    dense   dp4 tp2     2.56 s     3.02 s    (1.2x)

(2 shared CPU cores, so absolute times are noisy; the ratio is the point.)
Both give the same loss and gradients.

Multi-process: the partition is computed on every process (cheap, deterministic),
but a process prepares only its own dp ranks (those with a device it can address),
so the host work is split like the devices. The shapes are agreed with one small
all-gather of the engines' bucket minimums per pass (elementwise max, then the
local ranks are prepared again; a digest of every process's ``static`` and arg
shapes must match). ``finish`` decodes the local ranks' logprobs and all-gathers
them as one flat buffer, so every process returns all N. The buckets agreed
include those of an engine run inside another (prefix_reuse's DFS engine for
deep groups). ``AutoEngine`` picks one engine for all ranks, from the rank with
the most tokens (``shard_choice``; process 0's pick when several processes run),
and the ranks are then prepared by that engine and agreed as above. Any other
engine without monotone buckets (no ``engine.buckets``) falls back to preparing every
rank on every process. A collective that fails because another process died
raises ``PeerLostError`` naming this process; JAX's heartbeat bounds the rest
(see ``dtarl.parallel.launch``).

FSDP (a ('dp', 'fsdp', 'tp') mesh, ``make_train_mesh``): the batch is cut over the
R = dp x fsdp data ranks (rank r = (r // fsdp, r % fsdp)), the args split over
('dp', 'fsdp') jointly, and ``shard_map`` is manual over both; the parameters enter
split over fsdp and are gathered, the gradients reduce-scattered
(``dtarl.parallel.fsdp``; ``gather_dtype``), so the step's output gradients are
split like the parameters and the optimiser's moments follow them.

Letters: R = data ranks (dp x fsdp), N = sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import pickle
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl.batch import RolloutBatch
from dtarl.engines.base import Buckets, EngineAux
from dtarl.parallel import fsdp as fsdp_lib
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.launch import PEER_LOST_PATTERN
from dtarl.parallel.partition import (
    CostModel,
    Partition,
    PartitionMethod,
    TreeTokenCost,
    partition,
)
from dtarl.parallel.prepared import ShardedPrepared, ShardingError

__all__ = [
    "PeerLostError",
    "ShardedEngine",
    "ShardedPrepared",
    "ShardingError",
    "Strategy",
    "allgather_objects",
    "time_strategies",
    "to_host",
]


class PeerLostError(RuntimeError):
    """A multi-process collective failed: another process died, was stopped or lost its link."""


@contextlib.contextmanager
def _collective(what: str):
    """Turns a cross-process collective that failed on a lost peer into ``PeerLostError``."""
    try:
        yield
    except Exception as e:
        # Other errors (bugs, bad input) pass through as they are.
        if jax.process_count() == 1 or not PEER_LOST_PATTERN.search(f"{type(e).__name__} {e}"):
            raise
        raise PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()}: {what} failed; another "
            "process probably died or was stopped (see its log; `dtarl launch` names the "
            f"first rank that exited): {type(e).__name__}: {str(e)[:500]}"
        ) from e


class Strategy(enum.Enum):
    """How the dp ranks run.

    SHARD_MAP: ``jax.shard_map`` manual over 'dp' (tp automatic) + ``psum``.
    JIT:       ``jit`` of ``vmap`` over the stacked dp axis with NamedSharding inputs.
    """

    SHARD_MAP = "shard_map"
    JIT = "jit"


def _shapes(tree) -> list:
    return [(np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves(tree)]


def _local(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)  # fully replicated: any local copy is the value
    return x


def to_host(tree):
    """Fetches a pytree of (possibly multi-process) global arrays as numpy, on every process."""
    leaves, treedef = jax.tree.flatten(tree)
    remote = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)
    ]
    skip = set(remote)
    out = [None if i in skip else np.asarray(_local(x)) for i, x in enumerate(leaves)]
    if remote:  # one gather program for all of them
        with _collective("gathering results (to_host)"):
            got = multihost_utils.process_allgather([leaves[i] for i in remote], tiled=True)
        for i, x in zip(remote, got, strict=True):
            out[i] = np.asarray(x)
    return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(eq=False)
class ShardedEngine:
    """Runs any engine (``prepare`` / ``device_fn`` / ``finish``) data-parallel on a mesh.

    Attributes:
      engine: a dtarl engine (dense, dfs, prefix_reuse, ...).
      mesh: a ('dp', 'tp') or ('dp', 'fsdp', 'tp') mesh (``make_mesh``,
        ``make_train_mesh``).
      rules: logical axis -> mesh axis table for the parameters.
      method / keep_groups: the dp partition (``dtarl.parallel.partition``).
      cost: the partition's cost model. None (the default): the running engine's own
        (``engine.partition_cost(batch)``, its work counts in FLOPs; auto's pick's),
        or ``fallback_cost`` for an engine that has none.
      fallback_cost: the cost of an engine without ``partition_cost`` (None: tree
        tokens, ``TreeTokenCost``). The trainer passes the model's ``FlopCost``.
      strategy: ``Strategy.SHARD_MAP`` (default) or ``Strategy.JIT``.
      gather_dtype: the dtype fsdp gathers floating weights in (None: their own;
        ``dtarl.parallel.fsdp``).
      fsdp_gather: where fsdp gathers (``FsdpGather``); ``gather_used[static]``: what ran.

    ``stats["partition_cost_model"]`` names the cost used: the engine's kind
    ("dense", "dfs", "prefix_reuse"), "given:<class>" for ``cost`` or
    "fallback:<class>".
    """

    engine: Any
    mesh: Mesh
    rules: mesh_lib.Rules = dataclasses.field(default_factory=lambda: dict(mesh_lib.DEFAULT_RULES))
    method: PartitionMethod = PartitionMethod.BALANCED
    cost: CostModel | None = None
    keep_groups: bool = False
    strategy: Strategy = Strategy.SHARD_MAP
    fallback_cost: CostModel | None = None
    gather_dtype: Any = None
    fsdp_gather: mesh_lib.FsdpGather = mesh_lib.FsdpGather.LAYER

    def __post_init__(self):
        missing = [a for a in mesh_lib.MESH_AXES if a not in self.mesh.shape]
        if missing:
            raise ShardingError(
                f"mesh axes {tuple(self.mesh.axis_names)}: missing {missing}; build the mesh "
                "with dtarl.parallel.make_mesh(dp, tp) or make_train_mesh(dp, fsdp, tp)"
            )
        for attr in ("prepare", "device_fn", "finish"):
            if not callable(getattr(self.engine, attr, None)):
                raise ShardingError(
                    f"engine {type(self.engine).__name__} has no {attr}(); a sharded engine "
                    "needs the prepare / device_fn / finish API (dtarl.engines.base.Engine)"
                )
        self.strategy = Strategy(self.strategy)
        self.fsdp_gather = mesh_lib.FsdpGather.parse(self.fsdp_gather, "fsdp_gather")
        self.gather_used: dict[Any, str] = {}
        self._fns: dict[tuple, Any] = {}
        self.trace_count = 0
        self._param_shardings = None
        self._last_kind: str | None = None  # auto's last pick: its cost prices the next cut

    @property
    def dp(self) -> int:
        return int(self.mesh.shape[mesh_lib.DP])

    @property
    def tp(self) -> int:
        return int(self.mesh.shape[mesh_lib.TP])

    @property
    def fsdp(self) -> int:
        return mesh_lib.mesh_size(self.mesh, mesh_lib.FSDP)

    @property
    def ranks(self) -> int:
        """Data-parallel ranks: dp x fsdp (each runs the engine on its cut)."""
        return self.dp * self.fsdp

    @property
    def _data_axes(self) -> tuple[str, ...]:
        return (mesh_lib.DP, mesh_lib.FSDP) if self.fsdp > 1 else (mesh_lib.DP,)

    # ------------------------------------------------------------------ host side

    def local_ranks(self) -> tuple[int, ...]:
        """The data ranks with a device this process can address (all, in one process)."""
        data = [list(self.mesh.axis_names).index(a) for a in self._data_axes]
        devs = np.moveaxis(self.mesh.devices, data, range(len(data))).reshape(self.ranks, -1)
        me = jax.process_index()
        return tuple(r for r in range(self.ranks) if any(d.process_index == me for d in devs[r]))

    def reserve(self, capacity):
        """Grows the wrapped engine's shape buckets to a per-rank ``Capacity``."""
        if callable(getattr(self.engine, "reserve", None)):
            self.engine.reserve(capacity)
        return self

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> ShardedPrepared:
        """Partitions ``batch`` over dp and prepares this process's ranks with equal shapes.

        ``weights`` ([N] per-sequence loss weights) default to ``batch``'s own
        normalisation; pass them when ``batch`` is part of a larger one whose
        normalisation applies (gradient accumulation)."""
        t0 = time.perf_counter()
        n = batch.num_sequences
        k = self.ranks
        units = len(np.unique(batch.group_ids)) if self.keep_groups else n
        if units < k:
            what = "groups" if self.keep_groups else "sequences"
            axes = "dp x fsdp" if self.fsdp > 1 else "dp"
            raise ShardingError(
                f"batch has {units} {what} but the mesh has {axes}={k} ranks; every rank needs "
                f"at least one (use a batch of >= {k} {what} or a mesh with {axes} <= {units})"
            )
        multi = jax.process_count() > 1
        if weights is None:
            weights = batch.sequence_weights(loss.norm, getattr(loss, "norm_constant", None))
        else:
            weights = np.asarray(weights, np.float32)
            if weights.shape != (n,):
                raise ShardingError(
                    f"weights: shape {weights.shape}, expected ({n},) (one per sequence)"
                )
        # An engine that delegates (auto) picks one engine for every rank, from the
        # rank with the most tokens (what the step waits for; choosing on the whole
        # batch would also grow the candidates' buckets to its size); the ranks are
        # then prepared by that engine, like any other. The cut is priced by the
        # engine that runs: auto's last pick's cost first, and cut again when this
        # batch's pick differs.
        engine, kind = self.engine, None
        delegates = callable(getattr(engine, "shard_choice", None))
        if delegates:
            guess = self._last_kind if self._last_kind in engine.engines else None
            cost, cost_name = self.partition_cost(
                batch, None if guess is None else engine.engines[guess]
            )
            part = self._partition(batch, k, cost)
            ix = max(part.indices, key=lambda ix: int(batch.lengths[ix].sum()))
            kind = engine.shard_choice(batch.select(ix), loss, weights=weights[ix])
            if multi:  # the choice times host work: process 0's decides for all
                kinds = tuple(engine.engines)
                with _collective("agreeing on auto's engine (ShardedEngine.prepare)"):
                    i = multihost_utils.broadcast_one_to_all(np.int32(kinds.index(kind)))
                kind = kinds[int(i)]
            engine = engine.engines[kind]
            if kind != guess:
                cost, cost_name = self.partition_cost(batch, engine)
                part = self._partition(batch, k, cost)
            self._last_kind = kind
        else:
            cost, cost_name = self.partition_cost(batch, engine)
            part = self._partition(batch, k, cost)
        agree = multi and isinstance(getattr(engine, "buckets", None), Buckets)
        local = self.local_ranks() if agree else tuple(range(k))
        if not local:
            raise ShardingError(
                f"process {jax.process_index()} has no device in the mesh; build the mesh "
                "from every process's devices (dtarl.parallel.make_mesh does)"
            )
        subs, sub_w, dummy = [], [], []
        for r, ix in enumerate(part.indices):
            dummy.append(ix.shape[0] == 0)
            if r not in local:
                continue
            if dummy[-1]:  # a baseline partition may leave a rank empty
                subs.append(batch.select([0]))
                sub_w.append(np.zeros(1, np.float32))
            else:
                subs.append(batch.select(ix))
                sub_w.append(weights[ix])
        # Pass 1 grows the engine's monotone buckets to the largest rank; pass 2
        # (and, should a bucket still move, a third) gives every rank one shape.
        # Across processes the buckets are agreed by an all-gather (max) per pass.
        for _ in range(3):
            ranks = [engine.prepare(sb, loss, weights=w) for sb, w in zip(subs, sub_w, strict=True)]
            statics = {r.static for r in ranks}
            shapes = [_shapes(r.args) for r in ranks]
            same = len(statics) == 1 and all(s == shapes[0] for s in shapes)
            if agree:
                if self._agree_buckets(engine, ranks[0], shapes[0], same):
                    break
            elif same:
                break
        else:
            raise ShardingError(
                f"engine {type(engine).__name__}: per-rank shapes still differ after 3 "
                f"prepare passes (static keys {sorted(map(str, statics))}); its buckets must "
                "only grow (see DFSEngine.reserve)"
            )
        if kind is not None:
            ranks = [self.engine.delegated(kind, r) for r in ranks]
        args = jax.tree.map(lambda *xs: np.stack(xs), *[r.args for r in ranks])
        return ShardedPrepared(
            static=ranks[0].static,
            args=args,
            ranks=tuple(ranks),
            partition=part,
            dummy=tuple(dummy),
            num_sequences=n,
            host_seconds=time.perf_counter() - t0,
            local_ranks=local,
            cost_model=cost_name,
        )

    def partition_cost(self, batch: RolloutBatch, engine=None) -> tuple[CostModel, str]:
        """(cost model, its name) of the dp partition of ``batch`` when ``engine`` runs
        it: ``cost`` when given, else the engine's own ``partition_cost(batch)`` (its
        work counts), else ``fallback_cost`` (tree tokens when None)."""
        if self.cost is not None:
            return self.cost, f"given:{type(self.cost).__name__}"
        hook = getattr(engine, "partition_cost", None)
        if callable(hook):
            return hook(batch), str(getattr(engine, "name", type(engine).__name__))
        fallback = TreeTokenCost() if self.fallback_cost is None else self.fallback_cost
        return fallback, f"fallback:{type(fallback).__name__}"

    def _partition(self, batch: RolloutBatch, k: int, cost: CostModel) -> Partition:
        return partition(
            batch.tokens,
            k,
            method=self.method,
            cost=cost,
            group_ids=batch.group_ids,
            keep_groups=self.keep_groups,
        )

    def rank_work(self, prepared: ShardedPrepared) -> list[float]:
        """FLOPs of each local rank's program as the engine counts them (``features``:
        padding included), in ``local_ranks`` order; [] for an engine without
        ``features``. A dummy rank counts its one stand-in sequence."""
        features = getattr(self.engine, "features", None)
        if not callable(features):
            return []
        return [float(features(r).flops) for r in prepared.ranks]

    def _agree_buckets(self, engine, first, shapes, same: bool) -> bool:
        """One all-gather of (bucket minimums, shape digest, ok) over the processes.

        Sets the engine's buckets (its own and those of the engines it runs inside,
        e.g. prefix_reuse's DFS engine for deep groups) to the elementwise max. True
        (on every process alike: the decision uses only gathered values) when every
        process already had those buckets, its local ranks agree, and all digests
        are equal.
        """
        sizes = engine.buckets.sizes
        keys = [k for k, _ in sizes]
        text = repr((keys, first.static, shapes)).encode()
        digest = int.from_bytes(hashlib.sha256(text).digest()[:4], "little") & 0x7FFFFFFF
        row = np.array([v for _, v in sizes] + [digest, int(same)], np.int32)
        with _collective("agreeing on the per-rank shapes (ShardedEngine.prepare)"):
            table = np.asarray(multihost_utils.process_allgather(row))  # [P, len(keys) + 2]
        top = table[:, : len(keys)].max(axis=0)
        engine.merge_buckets(Buckets.of(dict(zip(keys, top.tolist(), strict=True))))
        return bool(
            np.all(table[:, : len(keys)] == top)
            and np.all(table[:, -2] == table[0, -2])
            and np.all(table[:, -1] == 1)
        )

    # ---------------------------------------------------------------- device side

    def param_shardings(self, params):
        return mesh_lib.param_shardings(params, self.mesh, self.rules)

    def shard_params(self, params):
        """Places ``params`` on the mesh (tp- and fsdp-split by the rules, replicated over dp)."""
        return mesh_lib.shard_params(params, self.mesh, self.rules)

    def data_sharding(self) -> NamedSharding:
        """The [R, ...] args' sharding: split over the data axes ('dp'[, 'fsdp'])."""
        return NamedSharding(self.mesh, P(self._data_axes))

    def device_args(self, prepared: ShardedPrepared) -> tuple:
        """The args as global [R, ...] arrays split over the data axes (not over 'tp').

        Each process supplies the rows of its own ranks (``prepared.local_ranks``).
        """
        sharding = self.data_sharding()
        local = prepared.local_ranks or tuple(range(self.ranks))
        if local == tuple(range(self.ranks)):
            return jax.tree.map(lambda a: mesh_lib.global_array(a, sharding), prepared.args)
        row = {r: i for i, r in enumerate(local)}

        def one(a):
            a = np.asarray(a)

            def rows(idx):
                want = range(self.ranks)[idx[0]]
                return np.stack([a[row[r]] for r in want])[(slice(None), *idx[1:])]

            return jax.make_array_from_callback((self.ranks, *a.shape[1:]), sharding, rows)

        return jax.tree.map(one, prepared.args)

    def _build(self, loss, static, params, num_args: int):
        fn = self.engine.device_fn(loss, static)
        p_shard = self.param_shardings(params)
        dp_shard = self.data_sharding()
        repl = NamedSharding(self.mesh, P())

        if self.strategy is Strategy.SHARD_MAP:
            data = self._data_axes
            treedef = jax.tree.structure(params)
            dims = mesh_lib.fsdp_dims(p_shard) if self.fsdp > 1 else None
            p_spec = P()
            if dims is not None:  # split over fsdp on entry and exit (ZeRO-3)
                p_spec = jax.tree.unflatten(treedef, fsdp_lib.manual_specs(p_shard))

            def mapped(mode):
                call = dims and fsdp_lib.sharded_call(fn, params, dims, mode, self.gather_dtype)

                def per_rank(params, *args):
                    args = jax.tree.map(lambda a: a[0], args)  # this rank's [1, ...] block
                    if not call:  # no fsdp
                        total, grads, out = fn(params, *args)
                        grads = jax.lax.psum(grads, mesh_lib.DP)
                    else:
                        total, grads, out = call(params, *args)
                    total = jax.lax.psum(total, data)
                    return total, grads, jax.tree.map(lambda o: o[None], out)

                return jax.shard_map(
                    per_rank,
                    mesh=self.mesh,
                    in_specs=(p_spec,) + (P(data),) * num_args,
                    out_specs=(P(), p_spec, P(data)),
                    axis_names=set(data),
                    # The engines' scan carries start dp-invariant (zeros) and become
                    # dp-varying; without vma checks psum is the plain all-reduce.
                    check_vma=False,
                )

            def run(params, *args):
                self.trace_count += 1
                mode = self.fsdp_gather if dims is not None else mesh_lib.FsdpGather.STEP
                mode = fsdp_lib.safe_mode(mode, mapped, params, *args)  # dfs: STEP
                self.gather_used[static] = mode.value
                return mapped(mode)(params, *args)

        else:
            batched = jax.vmap(fn, in_axes=(None,) + (0,) * num_args)

            def run(params, *args):
                self.trace_count += 1
                total, grads, out = batched(params, *args)
                return jnp.sum(total), jax.tree.map(lambda g: jnp.sum(g, axis=0), grads), out

        return jax.jit(
            run,
            in_shardings=(p_shard,) + (dp_shard,) * num_args,
            out_shardings=(repl, p_shard, dp_shard),
        )

    def get_fn(self, loss, prepared: ShardedPrepared, params):
        key = (loss, prepared.static)
        if key not in self._fns:
            self._fns[key] = self._build(loss, prepared.static, params, len(prepared.args))
        return self._fns[key]

    def place_params(self, params):
        """``params`` with every leaf on the mesh as the rules say (a no-op when it is)."""
        shardings = self.param_shardings(params)

        def one(x, s):
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, np.ndim(x)):
                return x
            return mesh_lib.global_array(x, s)

        return jax.tree.map(one, params, shardings)

    def run(self, params, prepared: ShardedPrepared, loss):
        """(loss, grads, out) on device; grads are split like the params, summed over dp."""
        fn = self.get_fn(loss, prepared, params)
        return fn(self.place_params(params), *self.device_args(prepared))

    def finish(self, prepared: ShardedPrepared, out) -> tuple[np.ndarray, ...]:
        """Per-sequence logprobs in the global batch order, on every process."""
        local = prepared.local_ranks or tuple(range(self.ranks))
        if local == tuple(range(self.ranks)):
            host = to_host(out)
            per_rank = {r: jax.tree.map(lambda o, r=r: o[r], host) for r in local}
        else:
            per_rank = _local_rows(out, local)
        logps: list = [None] * prepared.num_sequences
        for ix, rp, r in zip(
            (prepared.partition.indices[r] for r in local), prepared.ranks, local, strict=True
        ):
            if prepared.dummy[r]:
                continue
            for i, lp in zip(ix.tolist(), self.engine.finish(rp, per_rank[r]), strict=True):
                logps[i] = lp
        if local != tuple(range(self.ranks)):
            logps = _gather_logprobs(logps)
        return tuple(logps)

    def loss_fn(self, loss, *, has_aux: bool = False):
        """``f(params, prepared)``, a ``jax.custom_vjp`` function (``dtarl.parallel.function``)."""
        from dtarl.parallel.function import sharded_loss_fn  # it imports this module

        return sharded_loss_fn(self, loss, has_aux=has_aux)

    def value_and_grad(self, params, batch: RolloutBatch, loss, *, weights=None):
        """Like ``engine.value_and_grad`` but split over the mesh.

        ``params`` may be host or device arrays; they are placed on the mesh by the
        rule table (pass ``shard_params(params)`` once to avoid the copy per step).
        Returns (loss, grads, EngineAux); grads are global arrays split like params.
        """
        prepared = self.prepare(batch, loss, weights=weights)
        t1 = time.perf_counter()
        with _collective("the sharded step (psum over dp)"):
            total, grads, out = self.run(params, prepared, loss)
            jax.block_until_ready(grads)
        device_s = time.perf_counter() - t1
        logprobs = self.finish(prepared, out)
        part = prepared.partition
        loads = np.asarray(part.loads, np.float64)
        stats = dict(
            engine=f"sharded[{getattr(self.engine, 'name', type(self.engine).__name__)}]",
            strategy=self.strategy.value,
            dp=self.dp,
            fsdp=self.fsdp,
            tp=self.tp,
            fsdp_gather=self.gather_used.get(prepared.static, "step"),
            host_seconds=prepared.host_seconds,
            seconds=device_s,
            trace_count=self.trace_count,
            partition_method=part.method.value,
            partition_winner=part.winner,
            partition_cost_model=prepared.cost_model,
            rank_loads=part.loads.tolist(),
            # makespan balance under the partition's cost model: max / mean rank load
            load_balance=float(loads.max() / max(loads.mean(), 1e-30)),
            rank_tree_tokens=part.tree_tokens.tolist(),
            duplicated_tokens=part.duplicated_tokens,
            local_ranks=list(prepared.local_ranks),
            rank_stats=[r.stats for r in prepared.ranks],  # of local_ranks
            # each local rank's padded work as its engine counts it (``features``)
            rank_work_flops=self.rank_work(prepared),
        )
        chosen = {r.stats.get("chosen_engine") for r in prepared.ranks} - {None}
        if chosen:  # auto: one engine for all ranks
            stats["chosen_engine"] = chosen.pop()
        return total, grads, EngineAux(logprobs=logprobs, stats=stats)


def _local_rows(out, local: tuple[int, ...]) -> dict[int, Any]:
    """{rank: that rank's [...] slice of every [R, ...] leaf} from this process's shards."""
    leaves, treedef = jax.tree.flatten(out)
    rows: dict[int, list] = {r: [None] * len(leaves) for r in local}
    for li, leaf in enumerate(leaves):
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data)
            for j, r in enumerate(range(leaf.shape[0])[shard.index[0]]):
                if r in rows and rows[r][li] is None:
                    rows[r][li] = data[j]
    return {r: jax.tree.unflatten(treedef, v) for r, v in rows.items()}


def _gather_logprobs(logps: list) -> list[np.ndarray]:
    """Fills every process's missing per-sequence logprobs from a process that has them.

    Two all-gathers: the lengths (-1 = not local), then one flat float32 buffer
    with every sequence at the same offset on every process.
    """
    lens = np.array([-1 if lp is None else lp.shape[0] for lp in logps], np.int32)
    with _collective("gathering logprobs (ShardedEngine.finish)"):
        all_lens = np.asarray(multihost_utils.process_allgather(lens))  # [P, N]
        size = all_lens.max(axis=0)
        if np.any(size < 0):
            missing = np.flatnonzero(size < 0)[:8].tolist()
            raise ShardingError(f"finish: no process holds the logprobs of sequences {missing}")
        offsets = np.concatenate([[0], np.cumsum(size)])
        flat = np.zeros(max(int(offsets[-1]), 1), np.float32)
        for i, lp in enumerate(logps):
            if lp is not None:
                flat[offsets[i] : offsets[i + 1]] = lp
        all_flat = np.asarray(multihost_utils.process_allgather(flat))  # [P, T]
    owner = np.argmax(all_lens >= 0, axis=0)
    return [
        lp if lp is not None else all_flat[owner[i], offsets[i] : offsets[i + 1]].copy()
        for i, lp in enumerate(logps)
    ]


def allgather_objects(obj: Any, *, what: str) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order, on every process.

    Two all-gathers: the pickled sizes, then the pickles as uint8 rows padded to the
    longest. One process: ``[obj]`` (no collective). ``what`` names the call in the
    ``PeerLostError`` raised when a peer is lost meanwhile.
    """
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    with _collective(what):
        sizes = np.asarray(
            multihost_utils.process_allgather(np.array([data.size], np.int32))
        ).reshape(-1)
        row = np.zeros(max(int(sizes.max()), 1), np.uint8)
        row[: data.size] = data
        rows = np.asarray(multihost_utils.process_allgather(row))  # [P, longest]
    return [pickle.loads(rows[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]


def time_strategies(
    make_engine, params, batch: RolloutBatch, loss, mesh: Mesh, *, repeats: int = 5
) -> dict[str, dict[str, float]]:
    """Step seconds of each ``Strategy`` (min and median of ``repeats``, compile excluded).

    ``make_engine()`` must return a fresh engine (each strategy gets its own).
    """
    out = {}
    for strategy in Strategy:
        sharded = ShardedEngine(make_engine(), mesh, strategy=strategy)
        placed = sharded.place_params(params)
        prepared = sharded.prepare(batch, loss)
        t0 = time.perf_counter()
        jax.block_until_ready(sharded.run(placed, prepared, loss))
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(sharded.run(placed, prepared, loss))
            times.append(time.perf_counter() - t0)
        out[strategy.value] = dict(
            min=float(np.min(times)), median=float(np.median(times)), first=compile_s
        )
    return out
