"""What every training engine shares: the call contract and per-sequence data.

    engine.value_and_grad(params, batch, loss) -> (loss, grads, EngineAux)

``params`` is the model's ``nnx.State`` of ``nnx.Param`` (``nnx.split(model,
nnx.Param)[1]``); ``grads`` has the same structure in fp32. ``EngineAux`` carries
the per-token logprobs of every sequence (aligned with its tokens, entry 0 = 0)
and engine statistics. Every engine must agree with ``jax.grad`` of the dense
per-sequence loss (the equivalence contract, tested in tests/engines).

Every engine takes ``temperature=T`` at construction (default 1.0): its logprobs
(and entropies) are those of softmax(logits / T), the sampler's distribution at
temperature T without top-k/top-p truncation (``logprob_temperature``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl import aot
from dtarl.batch import BatchError, RolloutBatch
from dtarl.losses import SequenceData, TokenData
from dtarl.model.decoder import Decoder


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class EngineAux:
    logprobs: tuple[np.ndarray, ...]  # per sequence, [n_i] fp32, entry 0 = 0
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkFeatures:
    """What one engine call computes, padding included: the numbers cost models price.

    Every engine counts its own (``engine.features(prepared)``), from the shapes
    of the program it will run, so auto's cost model and the step-time simulator
    (``dtarl.bench.simulate``) price the same work:

    lin_flops: FLOPs that grow with the tokens alone (matmuls, all passes).
    attn_flops: attention FLOPs, which also grow with each token's context; a
      masked position the program computes anyway counts.
    steps: sequential device steps (scan iterations).
    tokens: token positions computed per pass (padding included), for TP traffic.
    program: the engine kind whose program runs ("dfs" ... ; for auto, its pick).
    sub: programs of other kinds run inside the same call (prefix_reuse hands
    deep groups to a DFS program); each is priced with its own kind's
    coefficients, without their per-call constant (``price``).
    """

    lin_flops: float
    attn_flops: float
    steps: float
    tokens: float
    program: str = ""
    sub: tuple[WorkFeatures, ...] = ()

    def row(self) -> np.ndarray:
        """[4] regressors of (1): (F_lin, F_attn, n_steps, 1)."""
        return np.array([self.lin_flops, self.attn_flops, self.steps, 1.0])

    @property
    def total_tokens(self) -> float:
        return self.tokens + sum(x.total_tokens for x in self.sub)

    @property
    def total_steps(self) -> float:
        return self.steps + sum(x.total_steps for x in self.sub)

    def merged(self) -> WorkFeatures:
        """One row with every sub-program's features added in (no sub left)."""
        if not self.sub:
            return self
        subs = [x.merged() for x in self.sub]
        return WorkFeatures(
            lin_flops=self.lin_flops + sum(x.lin_flops for x in subs),
            attn_flops=self.attn_flops + sum(x.attn_flops for x in subs),
            steps=self.steps + sum(x.steps for x in subs),
            tokens=self.tokens + sum(x.tokens for x in subs),
            program=self.program,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkFeatures:
        d = dict(d)
        d["sub"] = tuple(cls.from_dict(x) for x in d.get("sub", ()))
        return cls(**d)

    @property
    def flops(self) -> float:
        """All FLOPs, sub-programs included."""
        m = self.merged()
        return m.lin_flops + m.attn_flops


@dataclasses.dataclass(frozen=True)
class Buckets:
    """An engine's shape buckets: the minimum size of each padded dimension, by name.

    Buckets only grow: ``engine.reserve(buckets)`` merges them into the engine's
    (elementwise max), and every ``prepare`` grows them to the batch it pads. Two
    engines (or two processes) that hold the same buckets pad a batch to the same
    shapes, so ``a.merge(b)`` is how ranks agree on one program. Names of an inner
    engine's buckets carry its prefix (``"dfs.steps"`` in prefix_reuse).
    """

    sizes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, sizes: dict[str, int] | None = None, **more: int) -> Buckets:
        merged = {**(sizes or {}), **more}
        return cls(tuple(sorted((str(k), int(v)) for k, v in merged.items())))

    def __getitem__(self, name: str) -> int:
        return dict(self.sizes)[name]

    def names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(self.sizes)

    def merge(self, other: Buckets) -> Buckets:
        """The elementwise max over the union of names."""
        out = self.as_dict()
        for k, v in other.sizes:
            out[k] = max(out.get(k, 0), v)
        return Buckets.of(out)

    def with_prefix(self, prefix: str) -> Buckets:
        return Buckets.of({prefix + k: v for k, v in self.sizes})

    def under(self, prefix: str) -> Buckets:
        """The buckets named ``prefix...``, with the prefix removed."""
        return Buckets.of({k[len(prefix) :]: v for k, v in self.sizes if k.startswith(prefix)})


class BucketState:
    """Mixin for engines whose monotone buckets live in ``self._min`` (a dict)."""

    _min: dict[str, int]

    @property
    def buckets(self) -> Buckets:
        return Buckets.of(self._min)

    def merge_buckets(self, buckets: Buckets) -> None:
        """Grows the engine's buckets to ``buckets`` (names it does not have are errors)."""
        unknown = sorted(set(buckets.names()) - set(self._min))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown buckets {unknown}; this engine has {sorted(self._min)}"
            )
        for k, v in buckets.sizes:
            self._min[k] = max(self._min[k], v)

    def _init_engine(self, model: Decoder, config, *, name: str, temperature: float) -> None:
        """What every engine's ``__init__`` sets: the model and its split graph, its
        config (already ``configured``), name, logprob temperature and jit cache."""
        self.model = model
        self.config = config
        self.name = name
        self.temperature = logprob_temperature(temperature)
        self.graphdef, _ = split_model(model)
        self.cfg = model.cfg
        self.jit = JitCache(self)

    def loss_fn(self, loss, *, has_aux: bool = False):
        """``f(params, prepared)``: this engine's loss as a ``jax.custom_vjp`` function
        of the parameters (``dtarl.engines.function.TreeLoss``)."""
        from dtarl.engines.function import TreeLoss  # engines -> base -> function, no cycle

        return TreeLoss(self, loss, has_aux=has_aux, prepared_type=Prepared)

    def prepare_async(self, batch: RolloutBatch, loss, *, weights=None) -> Future[Planned]:
        """``prepare`` on this engine's planning thread, returning a ``Future`` of
        ``Planned`` (the ``Prepared`` and the host seconds its prepare took).

        One background thread per engine runs the submitted prepares one at a time in
        submission order, so the buckets grow exactly as calling ``prepare`` in that
        order would: the plans, and so the results, equal the synchronous path's.
        Meanwhile the caller's thread runs the device program of an earlier batch
        (``run_prepared``): the host planning of batch k + 1 overlaps batch k on the
        device. Do not call ``prepare`` directly while a submitted one is pending.
        """
        pool = self.__dict__.get("_planner")
        if pool is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-plan")
            self._planner = pool
        return pool.submit(timed_prepare, self, batch, loss, weights)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Prepared:
    """A batch compiled for one engine on the host.

    ``static`` (a hashable NamedTuple of the engine's, e.g. ``DFSStatic``) fixes the
    device program's shapes; ``args`` are the numpy pytrees it takes after
    ``params``; ``host`` (a NamedTuple too) keeps what ``finish`` needs.
    Sharded runners stack ``args`` of several ranks prepared with equal ``static``.
    """

    static: tuple
    args: tuple
    host: Any
    stats: dict[str, Any]


# Prepared is a pytree (for ``engine.loss_fn``: ``dtarl.engines.function``): its leaves
# are ``args``, its structure holds ``static``; ``host`` and ``stats`` stay on the
# Python object (an unflattened copy has host=None), so they are never traced and
# two batches of one bucket have one structure.
jax.tree_util.register_pytree_node(
    Prepared,
    lambda p: ((p.args,), p.static),
    lambda static, children: Prepared(static=static, args=children[0], host=None, stats={}),
)


class Engine(Protocol):
    """The contract every training engine keeps (module docstring)."""

    name: str
    config: Any  # the engine's frozen settings (``dtarl.engines.config``)
    temperature: float  # logprobs of logits / temperature (``logprob_temperature``)

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> Prepared:
        """Host side: the batch padded to the engine's buckets (typed static/host)."""
        ...

    def device_fn(self, loss, static):
        """Pure ``f(params, *args) -> (loss, grads_f32, out)``; jit/shard_map-able."""
        ...

    def finish(self, prepared: Prepared, out) -> tuple[np.ndarray, ...]:
        """Per-sequence logprobs from the device output."""
        ...

    def features(self, prepared: Prepared) -> WorkFeatures:
        """What the device program computes for ``prepared``, padding included."""
        ...

    def reserve(self, capacity) -> Engine:
        """Grows the shape buckets to a ``Capacity``; returns the engine."""
        ...

    @property
    def buckets(self) -> Buckets: ...

    def value_and_grad(
        self, params: nnx.State, batch: RolloutBatch, loss, *, weights: np.ndarray | None = None
    ) -> tuple[jax.Array, nnx.State, EngineAux]: ...

    def loss_fn(self, loss, *, has_aux: bool = False):
        """``f(params, prepared)``, differentiable (``dtarl.engines.function.TreeLoss``)."""
        ...


class JitCache:
    """``jax.jit`` of an engine's device function per (loss, static), with a trace count.

    With the program store enabled (``dtarl.aot``; the trainer's ``compile_cache_dir``),
    programs come from it: one read from the store counts as a trace (``trace_count``)
    though the device function never runs. Its key holds ``engine_identity``."""

    def __init__(self, engine):
        self._engine = engine
        self._fns: dict[tuple, Any] = {}
        self.trace_count = 0

    def _count(self) -> None:
        self.trace_count += 1

    def get(self, loss, static):
        key = (loss, static)
        if key not in self._fns:
            inner = self._engine.device_fn(loss, static)

            def counted(params, *args):
                self._count()
                return inner(params, *args)

            # Named after the engine: compile events (jax.monitoring) then say whose.
            name = f"{getattr(self._engine, 'name', type(self._engine).__name__)}_engine"
            counted.__name__ = counted.__qualname__ = name
            self._fns[key] = aot.jit(
                counted,
                name=name,
                static=(engine_identity(self._engine), repr(loss), repr(static)),
                on_load=self._count,
            )
        return self._fns[key]

    def __call__(self, loss, static, params, args):
        return self.get(loss, static)(params, *args)

    def lower(self, loss, static, params, args):
        return self.get(loss, static).lower(params, *args)


def engine_identity(engine) -> tuple:
    """What an engine's device functions depend on besides the loss, the static shapes
    and dtarl's source: its class, settings, temperature, the model's config (and
    those of an inner engine: prefix_reuse's deep-group DFS), for the program store's key."""
    inner = getattr(engine, "dfs", None)
    return (
        type(engine).__qualname__,
        getattr(engine, "name", None),
        repr(getattr(engine, "config", None)),
        repr(getattr(engine, "temperature", None)),
        repr(getattr(engine, "cfg", None)),
        None if inner is None else engine_identity(inner),
    )


class Planned(NamedTuple):
    """A batch prepared on the host (``prepare_async``) and the seconds that took."""

    prepared: Prepared
    seconds: float


def timed_prepare(engine, batch: RolloutBatch, loss, weights=None) -> Planned:
    """``engine.prepare(batch, loss, weights=weights)`` and its host seconds."""
    t0 = time.perf_counter()
    prepared = engine.prepare(batch, loss, weights=weights)
    return Planned(prepared=prepared, seconds=time.perf_counter() - t0)


def run_value_and_grad(engine, params, batch, loss, weights):
    """The shared ``value_and_grad``: prepare on host, run jitted, finish on host."""
    t0 = time.perf_counter()
    prepared = engine.prepare(batch, loss, weights=weights)
    host_s = time.perf_counter() - t0
    return run_prepared(engine, params, prepared, loss, host_seconds=host_s)


def run_prepared(engine, params, prepared: Prepared, loss, *, host_seconds: float = 0.0):
    """Runs an already-prepared batch (jitted program, then ``finish`` on host);
    ``host_seconds`` is what its preparation took, reported in the stats."""
    t1 = time.perf_counter()
    total, grads, out = engine.jit(loss, prepared.static, params, prepared.args)
    jax.block_until_ready(grads)
    device_s = time.perf_counter() - t1
    logprobs = engine.finish(prepared, out)
    stats = dict(
        engine=engine.name,
        host_seconds=host_seconds,
        seconds=device_s,
        trace_count=engine.jit.trace_count,
        **prepared.stats,
    )
    return total, grads, EngineAux(logprobs=logprobs, stats=stats)


class SeqData(NamedTuple):
    """Per-sequence device data in flat form (padded to buckets).

    Sequence i's per-token data live at flat[off[i]: off[i] + len[i]]; the flat
    arrays carry ``pad`` extra entries so a fixed-size slice never runs off.
    """

    off: jax.Array  # [N] int32
    length: jax.Array  # [N] int32
    advantage: jax.Array  # [N] f32
    weight: jax.Array  # [N] f32
    mask: jax.Array  # [F] f32
    old: jax.Array  # [F] f32 (NaN = absent)
    ref: jax.Array  # [F] f32 (NaN = absent)
    tok_adv: jax.Array  # [F] f32 (NaN = use the sequence's advantage)


def check_batch(batch: RolloutBatch, loss, vocab_size: int) -> None:
    """Host-side checks that need the model or the loss (before any device work)."""
    if not isinstance(batch, RolloutBatch):
        raise BatchError(f"batch must be a RolloutBatch, got {type(batch).__name__}")
    batch.check_vocab(vocab_size)
    if getattr(loss, "needs_ref_logprobs", False) and batch.ref_logprobs is None:
        raise BatchError(f"{type(loss).__name__} needs ref_logprobs, but the batch has none")
    if getattr(loss, "needs_old_logprobs", False) and batch.old_logprobs is None:
        raise BatchError(f"{type(loss).__name__} needs old_logprobs, but the batch has none")


def sequence_weights(batch: RolloutBatch, loss, weights: np.ndarray | None) -> np.ndarray:
    if weights is not None:
        w = np.asarray(weights, np.float32).reshape(-1)
        if w.shape != (batch.num_sequences,):
            raise BatchError(f"weights: expected shape ({batch.num_sequences},), got {w.shape}")
        return w
    return batch.sequence_weights(loss.norm, getattr(loss, "norm_constant", None))


def flat_sequence_data(
    batch: RolloutBatch, weights: np.ndarray, *, n_pad: int, f_pad: int, pad: int
) -> SeqData:
    """Host numpy -> padded flat arrays (see SeqData)."""
    n = batch.num_sequences
    lengths = batch.lengths
    off = np.zeros(n_pad, np.int32)
    off[:n] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ln = np.zeros(n_pad, np.int32)
    ln[:n] = lengths
    adv = np.zeros(n_pad, np.float32)
    adv[:n] = batch.advantages
    w = np.zeros(n_pad, np.float32)
    w[:n] = weights
    total = int(lengths.sum())
    size = f_pad + pad
    assert size >= total + pad

    def flat(arrs, fill):
        out = np.full(size, fill, np.float32)
        if arrs is not None:
            out[:total] = np.concatenate(arrs)
        return out

    return SeqData(
        off=off,
        length=ln,
        advantage=adv,
        weight=w,
        mask=flat(batch.loss_mask, 0.0),
        old=flat(batch.old_logprobs, np.nan),
        ref=flat(batch.ref_logprobs, np.nan),
        tok_adv=flat(batch.token_advantages, np.nan),
    )


def sequence_loss(loss, logp_S, seq: SeqData, sid, ent_S=None) -> jax.Array:
    """The loss of sequence ``sid`` (or 0 when sid < 0) from its path logprobs [S].

    ``ent_S`` (optional, [S], aligned with ``logp_S``: entry t = entropy of the
    distribution that predicted token t, entry 0 = 0) becomes ``TokenData.entropy``;
    engines pass it when ``loss.needs_entropy``. Positions past the sequence's end
    are sanitised to 0 in both so that garbage in a shared path buffer can never
    reach the loss (not even as 0 * inf).
    """
    s = logp_S.shape[0]
    real = sid >= 0
    i = jnp.maximum(sid, 0)
    valid = (jnp.arange(s) < seq.length[i]) & real

    def window(flat):
        return jnp.where(valid, jax.lax.dynamic_slice_in_dim(flat, seq.off[i], s), 0.0)

    tok = TokenData(
        mask=window(seq.mask),
        old_logprobs=window(seq.old),
        ref_logprobs=window(seq.ref),
        advantages=jnp.where(
            valid, jax.lax.dynamic_slice_in_dim(seq.tok_adv, seq.off[i], s), jnp.nan
        ),
        entropy=None if ent_S is None else jnp.where(valid, ent_S, 0.0),
    )
    sd = SequenceData(advantage=seq.advantage[i], weight=jnp.where(real, seq.weight[i], 0.0))
    return loss(jnp.where(valid, logp_S, 0.0), tok, sd)


def logprob_temperature(value, *, name: str = "temperature") -> float:
    """``value`` checked as the temperature T an engine's logprobs are computed at,
    log softmax(logits / T) (no top-k/top-p: verl, TRL): a finite number > 0.

    Pass the rollout's sampling temperature, so that the trainer's logprobs are
    those of the policy that sampled; greedy sampling (T = 0) trains at 1.0
    (``training_temperature``). Default everywhere: 1.0.
    """
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = float("nan")
    if isinstance(value, bool) or not (math.isfinite(t) and t > 0):
        raise ValueError(
            f"{name}={value!r} must be a finite number > 0 (the sampling temperature the "
            "logprobs are computed at; greedy sampling trains at 1.0)"
        )
    return t


def training_temperature(sampling_temperature: float) -> float:
    """The temperature to train at for a rollout sampled at ``sampling_temperature``:
    the same, except greedy decoding (0), whose tokens are trained at 1.0."""
    t = float(sampling_temperature)
    return 1.0 if t == 0 else t


def zeros_like_f32(params: nnx.State) -> nnx.State:
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


def split_model(model: Decoder):
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params
