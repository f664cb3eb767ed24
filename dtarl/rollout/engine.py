"""A continuous-batching rollout engine over a prompt-shared K/V pool.

::

    engine = RolloutEngine(model, ContinuousConfig(slots=64, prompt_len=512, response_len=1024))
    group = engine.submit(prompt_ids, n=8, max_new_tokens=256, temperature=1.0, seed=3)
    done = engine.run(weights)           # every request, in completion order
    group.requests[0].tokens, .logprobs, .finish

*Prompt-shared K/V.* A group's prompt is prefilled once into one row of the
prompt pool; its ``n`` requests each own one decode slot holding only their
response K/V, and decode attention is a cascade over both (see
``dtarl.rollout.kernels``). K/V bytes of a group are ``prompt once + n x response
so far``; ``stats()`` reports the live and the allocated bytes.

Why cascade attention and not paged blocks: XLA has no paged-attention kernel,
so a block table would be resolved by gathering every row's blocks into a
contiguous [rows, context] K/V at each step (the copy the static sampler
materialises once), i.e. G reads of the shared prompt per step. The cascade
reads each prompt row once per step for all of its members (queries grouped by
prompt) and merges the partial softmaxes; measured with ``dtarl bench rollout``
on uniform lengths (the static sampler's best case) it decodes 1.6-2.5x faster
per token than the copied-prompt layout, with 1/6-1/11 of its K/V at G=16 and a
512-token prompt.

*Continuous batching.* A fixed number of slots decode together in one compiled
program (``steps_per_call`` tokens per device call). Between calls the host
retires finished requests, frees their slots and admits waiting ones; a newly
admitted group's prompt is prefilled once (prefill calls are interleaved with
decode calls). All shapes are fixed by the config (prefill lengths and extend
lengths are bucketed), so after ``warmup`` no call compiles anything.

*Per-request control.* Sampling parameters, stop ids, stop sequences, limits and
seeds are per request; ``cancel`` stops a request or a whole group;
``until`` is a group predicate evaluated whenever a member finishes (e.g.
``complete(M)``: M complete responses exist) that cancels the rest; callbacks
``on_tokens(request, tokens, logprobs)`` fire every ``stream_chunk`` tokens and
``on_finish(request, reason)`` once per turn. A callback that raises cancels
only its own request; the error is kept in ``request.error`` and ``errors``.

*Determinism.* Member j of a group submitted with ``seed`` draws the token at
position ``pos`` with ``fold_in(fold_in(key(seed), j), pos)``: its tokens depend
only on (seed, j, position) and the parameters, never on its slot, the batch or
the admission order.

*Multi-turn.* ``submit(..., hold=True)`` keeps a finished request's K/V in its
slot; ``extend(request, tool_tokens, max_new_tokens=...)`` appends tokens to its
history (one extend call, nothing prefilled again) and continues decoding;
``release`` frees the slot.

*Stop sequences* (multi-token) are matched on the host after each call; the few
tokens generated past a match (at most ``steps_per_call - 1``) are dropped and
the slot's K/V length is rolled back, so a continuation sees exactly the kept
tokens.

*PAT switching* (papers/003: adaptive tensor parallelism during generation). An
engine built on a ('dp', 'tp') mesh can change its mesh shape and its slot count
between two decode calls::

    def on_call(engine, weights):          # after every decode call
        v = engine.view()                  # dp, tp, slots, active, live, waiting,
                                           # per-request prompt/response tokens,
                                           # remaining budget, forced, decode_calls
        if v.waiting == 0 and v.tp == 1 and v.active <= 4:
            weights, info = engine.reshard((1, 8), weights, mode="migrate")
            return weights                 # used by the following calls
        return None                        # keep going as is

    engine.run(weights, on_call=on_call)   # or ContinuousSampler.generate(..., on_call=)

``reshard(mesh, weights, slots=, mode=)`` merges the DP groups' live requests
(running ones, and held ones with their K/V) into ``slots`` slots spread evenly
over the new dp shards: every decode program computes all of its slots, so the
gain of a wider TP in the tail comes with compacting the live requests into fewer
slots (default: the smallest dp * 2^k that holds them; fewer than config.slots
only when nothing waits). The host mirror (slot arrays, the group table,
``request.slot``) is remapped; the prompt pool keeps its Q rows (split over the
new dp when dp divides Q, else replicated over dp by the rule table's fallback).
Weights move one layer (one ``layers/i`` subtree) at a time by ``device_put`` onto
the rule table's NamedSharding for the new mesh; an old layer is freed as soon as
its copy exists when the engine owns it (weights a previous ``reshard`` returned,
and the copies ``ContinuousSampler.generate`` made with ``place``; the caller's
weights are never deleted unless ``donate=True``), so then the extra memory is one
layer (plus any growth of the total, e.g. towards a smaller tp). K/V: "migrate"
gathers the live response rows and moves them layer by layer (the old layer freed
after each), "recompute" frees the old pool and rebuilds each resident prompt by
prefill and each live request's rows by the extend program from its tokens. ``info`` reports the
seconds of each stage (weights_s, kv_s, compile_s), the bytes moved and the peak
extra bytes (host bookkeeping of jax buffers: the bytes of every buffer the
switch created minus those of the old buffers it freed, summed over all devices
and taken after each layer's transfer completes; buffers a ``device_put`` kept in
place count as neither). Programs are cached per (mesh, slots, kind, statics) for
the engine's life: a switch back to a shape seen before, and a second generation
with the same switches, compile nothing (``trace_count``); ``warmup(targets=)``
compiles a target's programs ahead. ``reset()`` (called by
``ContinuousSampler.generate`` after each generation) returns an idle engine to
its construction mesh and slot count without moving anything.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl import aot, axes
from dtarl.batch import token_ids
from dtarl.model.decoder import Decoder
from dtarl.parallel.mesh import (
    DEFAULT_RULES,
    MESH_AXES,
    Rules,
    logical_to_spec,
    make_mesh,
    param_shardings,
    shard_params,
)
from dtarl.rollout import kernels as K
from dtarl.rollout.sampler import FinishReason, SamplerError
from dtarl.tree.plan import bucket


class EngineError(SamplerError):
    """Bad engine input or use; the message names the argument and the accepted range."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # this turn is over (held requests keep their slot)
    RELEASED = "released"  # slot given back (or never had one)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContinuousConfig:
    """Shapes of the engine (each change compiles new programs).

    slots: requests decoding together (the decode batch).
    groups: prompts resident at once (prompt pool rows); 0 = ``slots`` // 2, at least 1.
    group_size: the most requests one ``submit`` may create (cells per group).
    prompt_len: the longest prompt, in tokens.
    response_len: the most tokens one request may hold after its prompt (all turns,
      tool tokens included).
    steps_per_call: decode steps per device call (the host sees tokens this often).
    stream_chunk: ``on_tokens`` fires every this many tokens (0 = at the end of a turn).
    prefill_batch: prompts per prefill call. extend_batch: requests per extend call.
    max_stop_ids: stop token ids per request.
    """

    slots: int = 32
    groups: int = 0
    group_size: int = 16
    prompt_len: int = 512
    response_len: int = 512
    steps_per_call: int = 16
    stream_chunk: int = 0
    prefill_batch: int = 2
    extend_batch: int = 4
    max_stop_ids: int = 4

    def __post_init__(self):
        for name in (
            "slots",
            "group_size",
            "prompt_len",
            "response_len",
            "steps_per_call",
            "prefill_batch",
            "extend_batch",
            "max_stop_ids",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise EngineError(f"ContinuousConfig.{name}={value!r} must be an int >= 1")
        for name in ("groups", "stream_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 0:
                raise EngineError(f"ContinuousConfig.{name}={value!r} must be an int >= 0")

    @property
    def prompt_slots(self) -> int:
        return self.groups or max(1, self.slots // 2)


def decode_windows(response_len: int) -> list[int]:
    """Response windows of the decode programs: R/4, R/2, R (those >= 16; one program
    each)."""
    r = int(response_len)
    return sorted({w for w in (r // 4, r // 2, r) if w >= 16} | {r})


def merged_slots(live: int, dp: int, cap: int) -> int:
    """``reshard``'s default slot count: the smallest ``dp * 2^k`` holding ``live``
    requests (at least dp), capped at ``cap`` (ContinuousConfig.slots)."""
    n = dp
    while n < live:
        n *= 2
    return min(n, cap)


def len_bucket(n: int, limit: int) -> int:
    """The padded length of a prefill or extend call over ``n`` tokens: the smallest
    power of two >= max(n, 16), capped at ``limit`` (prompt_len or response_len)."""
    return min(bucket(n, 16), int(limit))


def recompute_calls(
    prompt_tokens: Sequence[int],
    lengths: Sequence[int],
    *,
    prefill_batch: int,
    extend_batch: int,
    prompt_len: int,
    response_len: int,
) -> list[tuple[str, int, int, int]]:
    """The calls ``reshard(..., mode="recompute")`` makes to rebuild the K/V, in order:
    (kind, bucket, start, stop) each. ``prompt_tokens``: the prompt length of each
    resident prompt row (in row order; a prompt of n tokens pre-fills n - 1 rows);
    ``lengths``: the response rows of each request holding a slot (in slot order,
    held ones included). Prefill calls take the resident prompts ``[start:stop]``, in
    chunks of ``prefill_batch``, padded to the bucket of the chunk's longest; extend
    calls the requests with rows (``[start:stop]`` of those), in chunks of
    ``extend_batch``, padded to the bucket of the chunk's most rows. The engine runs
    exactly these (``_recompute``) and compiles their programs first; PAT's predictor
    prices them (``dtarl.rollout.pat.Predictor.recompute_seconds``)."""
    for name, v in (
        ("prefill_batch", prefill_batch),
        ("extend_batch", extend_batch),
        ("prompt_len", prompt_len),
        ("response_len", response_len),
    ):
        if not isinstance(v, int | np.integer) or v < 1:
            raise EngineError(f"recompute_calls: {name}={v!r} must be an int >= 1")
    if any(int(x) < 1 for x in prompt_tokens):
        raise EngineError(
            f"recompute_calls: prompt_tokens must be >= 1 each, got {list(prompt_tokens)}"
        )
    if any(int(x) < 0 for x in lengths):
        raise EngineError(f"recompute_calls: lengths must be >= 0 each, got {list(lengths)}")
    pre = [int(x) - 1 for x in prompt_tokens]
    ext = [int(x) for x in lengths if int(x) > 0]
    out = []
    for i in range(0, len(pre), prefill_batch):
        chunk = pre[i : i + prefill_batch]
        out.append(("prefill", len_bucket(max(chunk), prompt_len), i, i + len(chunk)))
    for i in range(0, len(ext), extend_batch):
        chunk = ext[i : i + extend_batch]
        out.append(("extend", len_bucket(max(chunk), response_len), i, i + len(chunk)))
    return out


def complete(m: int) -> Callable[[Group], bool]:
    """Group predicate: ``m`` members finished with a stop (not truncated, not cancelled)."""

    def pred(group: Group) -> bool:
        return sum(r.finish is FinishReason.STOP for r in group.requests) >= m

    pred.__name__ = f"complete({m})"
    return pred


@dataclasses.dataclass(eq=False)
class Request:
    """One sample of a group. ``tokens``/``logprobs``: this turn's generated tokens."""

    group: Group
    index: int  # member j of its group
    key: np.ndarray  # [2] uint32
    max_new_tokens: int
    forced: bool
    hold: bool
    status: Status = Status.WAITING
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: FinishReason = FinishReason.RUNNING
    turns: int = 0
    streamed: int = 0
    error: str | None = None
    length: int = 0  # response K/V rows (host mirror)
    # Every response-side token of every turn (generated and appended): K/V row j > 0
    # holds the token context[j - 1], row 0 the prompt's last token (``reshard`` in
    # recompute mode rebuilds the rows from it).
    context: list[int] = dataclasses.field(default_factory=list)
    pending: np.ndarray | None = None  # tokens waiting to be appended (extend)

    @property
    def id(self) -> tuple[int, int]:
        return (self.group.id, self.index)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.RELEASED)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.tokens, np.int32), np.asarray(self.logprobs, np.float32)


@dataclasses.dataclass(eq=False)
class Group:
    """The requests of one ``submit`` (one prompt)."""

    id: int
    prompt: np.ndarray
    requests: list[Request]
    temperature: float
    top_p: float
    top_k: int
    stop_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    on_tokens: Callable | None
    on_finish: Callable | None
    until: Callable[[Group], bool] | None
    pslot: int | None = None
    stopped: bool = False  # ``until`` fired
    owner: Any = None  # the engine that accepted it

    @property
    def done(self) -> bool:
        return all(r.done for r in self.requests)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineView:
    """A snapshot for a switch controller (``RolloutEngine.view``); per-request arrays
    list the running (decoding) requests."""

    dp: int
    tp: int
    slots: int  # slots now (``reshard`` may shrink them)
    active: int  # running requests
    live: int  # slots holding a request (running + held after their turn)
    waiting: int  # requests waiting for a slot (0: the queue is empty, a shrink is allowed)
    prompt_tokens: np.ndarray  # [active] prompt length
    response_tokens: np.ndarray  # [active] response K/V rows so far (all turns)
    remaining: np.ndarray  # [active] tokens it may still produce this turn
    forced: np.ndarray  # [active] its length is forced: ``remaining`` is exact
    # (seconds, steps, sum of active slots over the steps, response window read) per
    # decode call that compiled nothing, since the last ``stats(reset=True)``
    decode_calls: tuple[tuple[float, int, int, int], ...]
    # What a recompute switch rebuilds (``recompute_calls``): the prompt length of each
    # resident, prefilled prompt row (row order), and the response rows of every request
    # holding a slot (running and held, slot order).
    resident_prompt_tokens: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64)
    )
    live_response_tokens: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64)
    )

    @property
    def context_tokens(self) -> int:
        """Tokens the running requests attend at the next step (PAT's T)."""
        return int((self.prompt_tokens + self.response_tokens).sum())


_INFO_KEYS = (
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


def _phys_bytes(x) -> int:
    """Bytes of an array on its devices (every addressable shard, replicas included)."""
    return sum(s.data.nbytes for s in x.addressable_shards)


def _buffers(x) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _new_bytes(new, old) -> int:
    """Bytes of ``new``'s buffers that are not ``old``'s (device_put may keep a shard
    whose placement does not change, e.g. a replicated array)."""
    if new is old:
        return 0
    mine = _buffers(old)
    return sum(
        s.data.nbytes for s in new.addressable_shards if s.data.unsafe_buffer_pointer() not in mine
    )


def _free(old, *news) -> int:
    """Deletes ``old`` unless a new array shares one of its buffers; the bytes freed."""
    mine = _buffers(old)
    if any(n is old or mine & _buffers(n) for n in news):
        return 0
    nbytes = _phys_bytes(old)
    old.delete()
    return nbytes


@jax.jit
def _int_key(seed):
    return jax.random.key_data(jax.random.key(seed))


@functools.cache
def _member_keys_fn(n: int):
    """Jitted keys of members 0..n-1 of a group (one small program per n, not eager ops)."""
    return jax.jit(lambda base: jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n)))


def seed_key(seed) -> np.ndarray:
    if isinstance(seed, int | np.integer):
        return np.asarray(_int_key(np.uint32(int(seed) & 0xFFFFFFFF)), np.uint32)
    arr = np.asarray(
        jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed
    )
    if arr.shape != (2,) or arr.dtype != np.uint32:
        raise EngineError(
            f"seed: need an int or a PRNG key ([2] uint32), got {arr.dtype}{arr.shape}"
        )
    return arr


def fold_seed(key: np.ndarray, i: int) -> np.ndarray:
    return np.asarray(jax.random.fold_in(jnp.asarray(key), i), np.uint32)


class RolloutEngine:
    """Continuous batching over a prompt-shared K/V pool; see the module docstring."""

    def __init__(
        self,
        model: Decoder,
        config: ContinuousConfig | None = None,
        *,
        pad_id: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
    ):
        self.config = config = config or ContinuousConfig()
        self.mesh, self.rules = mesh, rules
        self.cfg = cfg = model.cfg
        self.graphdef, _ = nnx.split(model, nnx.Param)
        self.pad_id = int(pad_id)
        if config.prompt_len + config.response_len > cfg.max_position_embeddings:
            raise EngineError(
                f"prompt_len {config.prompt_len} + response_len {config.response_len} exceeds "
                f"the model's max_position_embeddings={cfg.max_position_embeddings}"
            )
        n, q, m = config.slots, config.prompt_slots, config.group_size
        self.trace_count = 0
        self.errors: list[tuple[tuple[int, int], str]] = []
        cd = jnp.dtype(cfg.compute_dtype)
        self._token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cd.itemsize
        self._mesh0 = mesh  # the construction mesh (``reset`` returns to it)
        self._n = n  # slots now (``reshard`` may shrink it below config.slots)
        self._sh_cache: dict[tuple, dict[str, Any]] = {}
        self._own_weights: list[weakref.ref] = []  # engine-owned weight leaves (see adopt)
        self._s = self._empty_slots(n)  # host mirror of the slot state
        self._shardings = self._sharding_for(mesh, n) if mesh is not None else None
        self._pool = self._zeros_pool(n)
        self._table = np.full((q, m), n, np.int32)
        self._slot_req: list[Request | None] = [None] * n
        self._pslot_group: list[Group | None] = [None] * q
        self._queue: deque[Group] = deque()  # groups with waiting members, FIFO
        self._to_prefill: list[Group] = []
        self._to_extend: list[Request] = []
        self._finished: list[Request] = []
        self._next_group = 0
        self._fns: dict[tuple, Any] = {}
        self._reset_stats()

    def _empty_slots(self, n: int) -> dict[str, np.ndarray]:
        return dict(
            group=np.zeros(n, np.int32),
            cell=np.zeros(n, np.int32),
            length=np.zeros(n, np.int32),
            token=np.zeros(n, np.int32),
            active=np.zeros(n, bool),
            budget=np.zeros(n, np.int32),
            forced=np.zeros(n, bool),
            key=np.zeros((n, 2), np.uint32),
            temperature=np.ones(n, np.float32),
            top_p=np.ones(n, np.float32),
            top_k=np.zeros(n, np.int32),
            stop_ids=np.full((n, self.config.max_stop_ids), -1, np.int32),
        )

    def _pool_shapes(self, n: int) -> K.Pool:
        """The pool's arrays as ShapeDtypeStructs (no sharding) for ``n`` slots."""
        c, cfg = self.config, self.cfg
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

    def _zeros_pool(self, n: int) -> K.Pool:
        """An empty pool of ``n`` slots, created in place on the current shardings."""
        shapes = self._pool_shapes(n)
        if self._shardings is None:
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jax.tree.map(
            lambda a, sh: jnp.zeros(a.shape, a.dtype, device=sh), shapes, self._shardings["pool"]
        )

    # ------------------------------------------------------------ programs

    def _model(self, weights):
        return nnx.merge(self.graphdef, weights)

    def _sharding_for(self, mesh: Mesh, n: int) -> dict[str, Any]:
        """Slots (and prompt rows) over dp, kv heads over tp, via the rule table; one dict
        per (mesh, slots), cached. A dimension dp (tp) does not divide is replicated over
        dp (tp) by the rule table's fallback, e.g. Q prompt rows when dp does not divide Q."""
        key = (mesh, n)
        if key in self._sh_cache:
            return self._sh_cache[key]
        rules = self.rules

        def kv(a):
            logical = (axes.BATCH, axes.KV_SEQ, axes.KV_HEADS, axes.HEAD_DIM)
            return NamedSharding(
                mesh, logical_to_spec(logical, a.shape, mesh, rules, exclude=())[0]
            )

        def rows(shape):
            logical = (axes.BATCH,) + (None,) * (len(shape) - 1)
            return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules, exclude=())[0])

        shapes = self._pool_shapes(n)
        pool = K.Pool(
            prompt_k=tuple(kv(a) for a in shapes.prompt_k),
            prompt_v=tuple(kv(a) for a in shapes.prompt_v),
            prompt_len=NamedSharding(mesh, P()),
            resp_k=tuple(kv(a) for a in shapes.resp_k),
            resp_v=tuple(kv(a) for a in shapes.resp_v),
        )
        slots = K.Slots(**{k: rows((n,) + v.shape[1:]) for k, v in self._s.items()})
        out = dict(pool=pool, slots=slots, replicated=NamedSharding(mesh, P()))
        self._sh_cache[key] = out
        return out

    def place(self, weights):
        """The weights on the engine's current mesh (tp-split by the rule table); as is
        without one."""
        return weights if self.mesh is None else shard_params(weights, self.mesh, self.rules)

    def _fn(self, kind: str, *statics, at: tuple | None = None):
        """The jitted program ``kind`` for (mesh, slots) ``at`` (default: the current
        ones); one per (mesh, slots, kind, statics), kept for the engine's life, so a
        shape seen before compiles nothing."""
        mesh, n = at or (self.mesh, self._n)
        key = (mesh, n, kind) + statics
        if key not in self._fns:
            if kind == "decode":
                steps, filtered, window = statics

                def fn(weights, pool, slots, table):
                    self.trace_count += 1
                    return K.decode_chunk(
                        self._model(weights),
                        pool,
                        slots,
                        table,
                        steps=steps,
                        filtered=filtered,
                        window=window,
                    )

                self._fns[key] = self._jit(fn, "decode", mesh, n, key)
            elif kind == "prefill":

                def fn(weights, pool, qslot, tokens, lens):
                    self.trace_count += 1
                    return K.prefill(self._model(weights), pool, qslot, tokens, lens)

                self._fns[key] = self._jit(fn, "pool", mesh, n, key)
            elif kind == "gather":  # rows ``idx`` of a response layer, out: ``rows`` slots
                (rows,) = statics

                def fn(x, idx):
                    self.trace_count += 1
                    return x[idx]

                out = self._sharding_for(mesh, rows)["pool"].resp_k[0]
                self._fns[key] = jax.jit(fn, out_shardings=out)
            elif kind == "cut":  # the first ``rows`` rows of a response layer
                (rows,) = statics

                def fn(x):
                    self.trace_count += 1
                    return x[:rows]

                out = self._sharding_for(mesh, rows)["pool"].resp_k[0]
                self._fns[key] = jax.jit(fn, out_shardings=out)
            else:

                def fn(weights, pool, slot, group, length, tokens, count):
                    self.trace_count += 1
                    return K.extend(self._model(weights), pool, slot, group, length, tokens, count)

                self._fns[key] = self._jit(fn, "pool", mesh, n, key)
        return self._fns[key]

    def _jit(self, fn, out: str, mesh, n: int, key: tuple):
        """jit with the pool donated; on a mesh, outputs keep the inputs' shardings (so a
        call never sees a new input sharding and compiles again). Through the program
        store when one is enabled (``dtarl.aot``): a program read from it counts as a
        trace (``trace_count``) though ``fn`` never runs."""
        outs = None
        if mesh is not None:
            sh = self._sharding_for(mesh, n)
            outs = sh["pool"] if out == "pool" else (sh["pool"], sh["slots"], sh["replicated"])
        _, _, kind, *statics = key
        return aot.jit(
            fn,
            name=f"rollout_{kind}",
            static=(
                repr(self.config),
                repr(self.cfg),
                repr(self.rules),
                n,
                tuple(statics),
                aot.shardings_text(outs),
            ),
            donate_argnums=(1,),
            out_shardings=outs,
            on_load=self._count_trace,
        )

    def _count_trace(self) -> None:
        self.trace_count += 1

    def _windows(self) -> list[int]:
        return decode_windows(self.config.response_len)

    def _buckets(self, limit: int) -> list[int]:
        sizes, b = [], 16
        while b < limit:
            sizes.append(b)
            b *= 2
        return sizes + [limit]

    def _len_bucket(self, n: int, limit: int) -> int:
        return len_bucket(n, limit)

    def warmup(
        self,
        weights,
        *,
        filtered: bool | None = None,
        extend: bool = False,
        targets: Sequence[tuple[int, int, int | None]] = (),
    ) -> RolloutEngine:
        """Compiles every program a run can need (decode, each prefill length bucket and,
        with ``extend``, each extend bucket), so that no later call compiles.

        ``targets``: (dp, tp, slots) switch targets (slots None = config.slots) whose
        programs are compiled too (from shapes and shardings only, nothing is moved), so
        that ``reshard`` onto them and the calls after it compile nothing."""
        args = (weights, self._pool, self._slots_device(), self._table_device())
        self._warm(self.mesh, self._n, args, filtered, extend)
        for target in targets:
            if len(target) != 3:
                raise EngineError(f"warmup: targets need (dp, tp, slots) triples, got {target!r}")
            dp, tp, n = target
            mesh = self._target_mesh((dp, tp), "warmup: targets")
            n = self.config.slots if n is None else n
            if not isinstance(n, int | np.integer) or not 1 <= n <= self.config.slots:
                raise EngineError(
                    f"warmup: targets slots={n!r} must be an int in [1, {self.config.slots}] "
                    "(ContinuousConfig.slots)"
                )
            sh = self._sharding_for(mesh, int(n))
            w = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                weights,
                param_shardings(weights, mesh, self.rules),
            )
            pool = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                self._pool_shapes(int(n)),
                sh["pool"],
            )
            slots = K.Slots(
                **{
                    k: jax.ShapeDtypeStruct((int(n),) + v.shape[1:], v.dtype, sharding=s)
                    for (k, v), s in zip(self._s.items(), sh["slots"], strict=True)
                }
            )
            table = jax.ShapeDtypeStruct(self._table.shape, np.int32, sharding=sh["replicated"])
            self._warm(mesh, int(n), (w, pool, slots, table), filtered, extend)
        return self

    def _warm(self, mesh, n: int, args, filtered: bool | None, extend: bool):
        c = self.config
        weights, pool, slots, table = args
        at = (mesh, n)
        for f in (False, True) if filtered is None else (filtered,):
            for w in self._windows():
                self._fn("decode", c.steps_per_call, f, w, at=at).lower(
                    weights, pool, slots, table
                ).compile()
        for t in self._buckets(c.prompt_len):
            self._fn("prefill", t, at=at).lower(
                weights,
                pool,
                np.zeros(c.prefill_batch, np.int32),
                np.zeros((c.prefill_batch, t), np.int32),
                np.zeros(c.prefill_batch, np.int32),
            ).compile()
        if extend:
            e = c.extend_batch
            for t in self._buckets(c.response_len):
                z = np.zeros(e, np.int32)
                self._fn("extend", t, at=at).lower(
                    weights, pool, z, z, z, np.zeros((e, t), np.int32), z
                ).compile()

    # ------------------------------------------------------------ PAT switching

    def mesh_for(self, dp: int, tp: int) -> Mesh:
        """The ('dp', 'tp') mesh of shape (dp, tp) over the engine's devices (in the
        construction mesh's order, so equal shapes give equal meshes: one program cache)."""
        self._need_mesh()
        if (dp, tp) == tuple(self._mesh0.devices.shape):
            return self._mesh0
        return make_mesh(dp, tp, devices=list(self._mesh0.devices.flat))

    def switch_targets(self) -> list[tuple[int, int]]:
        """The (dp, tp) shapes ``reshard`` accepts: dp * tp = the construction mesh's
        device count and tp dividing num_kv_heads (plus the construction shape)."""
        if self._mesh0 is None:
            return []
        d, kvh = self._mesh0.devices.size, self.cfg.num_kv_heads
        out = [(d // t, t) for t in range(1, d + 1) if d % t == 0 and kvh % t == 0]
        first = tuple(int(x) for x in self._mesh0.devices.shape)
        return sorted(set(out) | {first}, key=lambda s: s[1])

    def _need_mesh(self):
        if self._mesh0 is None:
            raise EngineError(
                "mesh: the engine was built without a mesh; pass RolloutEngine(..., "
                "mesh=make_mesh(dp, tp)) to switch meshes"
            )

    def _target_mesh(self, mesh, field: str = "mesh") -> Mesh:
        self._need_mesh()
        ok = self.switch_targets()
        if isinstance(mesh, Mesh):
            if tuple(mesh.axis_names) != MESH_AXES:
                raise EngineError(
                    f"{field}: axis names {tuple(mesh.axis_names)}, need {MESH_AXES} "
                    "(dtarl.parallel.mesh.make_mesh)"
                )
            ids = sorted(d.id for d in mesh.devices.flat)
            if ids != sorted(d.id for d in self._mesh0.devices.flat):
                raise EngineError(
                    f"{field}: devices {ids} are not the engine's "
                    f"{sorted(d.id for d in self._mesh0.devices.flat)} (a switch keeps the "
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
                f"(dp * tp = {self._mesh0.devices.size} devices, tp dividing "
                f"num_kv_heads={self.cfg.num_kv_heads})"
            )
        return mesh if isinstance(mesh, Mesh) else self.mesh_for(*shape)

    def _waiting(self) -> int:
        return sum(r.status is Status.WAITING for g in self._queue for r in g.requests)

    def view(self) -> EngineView:
        """What a switch controller reads between decode calls (a snapshot)."""
        running = [r for r in self._slot_req if r is not None and self._s["active"][r.slot]]
        shape = (1, 1) if self.mesh is None else tuple(int(x) for x in self.mesh.devices.shape)
        return EngineView(
            dp=shape[0],
            tp=shape[1],
            slots=self._n,
            active=len(running),
            live=sum(r is not None for r in self._slot_req),
            waiting=self._waiting(),
            prompt_tokens=np.asarray([r.group.prompt.size for r in running], np.int64),
            response_tokens=np.asarray([r.length for r in running], np.int64),
            remaining=np.asarray([self._s["budget"][r.slot] for r in running], np.int64),
            forced=np.asarray([r.forced for r in running], bool),
            decode_calls=tuple(self._stats["calls"]),
            resident_prompt_tokens=np.asarray([g.prompt.size for g in self._resident()], np.int64),
            live_response_tokens=np.asarray(
                [r.length for r in self._slot_req if r is not None], np.int64
            ),
        )

    def reshard(
        self,
        mesh: Mesh | tuple[int, int],
        weights,
        *,
        slots: int | None = None,
        mode: str = "migrate",
        donate: bool = False,
    ) -> tuple[Any, dict[str, Any]]:
        """Switches the engine to ``mesh`` and ``slots`` slots between decode calls (PAT).

        mesh: a ('dp', 'tp') Mesh over the engine's devices or a (dp, tp) pair (see
          ``switch_targets``). slots: the new slot count (default: the smallest dp * 2^k
          holding every live request, capped at config.slots; config.slots while a request
          waits); below config.slots only when no request waits. mode: "migrate" (gather
          the live response rows and move them, layer by layer) or "recompute" (rebuild
          every resident prompt by prefill and every live request's rows by extend from
          its tokens). A switch to the current (mesh, slots) does nothing.
          donate: also free the caller's weight buffers as they move (weights a
          previous ``reshard`` returned are the engine's own and are always freed).

        Returns (weights on the new mesh, info); info: mode, dp, tp, slots, live,
        weights_s, kv_s, compile_s (the target's decode program, and the prefill/extend
        or row-gather programs the K/V stage runs; excluded from kv_s; ~0 when cached),
        seconds, compiled (programs traced), moved_weight_bytes,
        moved_kv_bytes, live_kv_bytes, peak_extra_bytes, weights_peak_extra_bytes,
        kv_peak_extra_bytes. Bytes are summed over the addressable shards of every
        device; a "peak extra" is the largest sum, during the switch, of the buffers it
        created minus the old buffers it already freed (host bookkeeping of jax buffers,
        taken after each transfer completes).
        """
        t_start = time.perf_counter()
        mesh = self._target_mesh(mesh)
        if mode not in ("migrate", "recompute"):
            raise EngineError(f"mode={mode!r} must be 'migrate' or 'recompute'")
        live = [r for r in self._slot_req if r is not None]
        dp, tp = (int(x) for x in mesh.devices.shape)
        cap = self.config.slots
        waiting = self._waiting()
        if slots is None and waiting:
            n = cap  # requests wait: keep every slot
        elif slots is None:
            n = merged_slots(len(live), dp, cap)
        else:
            if not isinstance(slots, int | np.integer) or not max(1, len(live)) <= slots <= cap:
                raise EngineError(
                    f"slots={slots!r} must be an int in [{max(1, len(live))}, {cap}] (the "
                    f"{len(live)} live requests .. ContinuousConfig.slots)"
                )
            n = int(slots)
        if n < cap and waiting:
            raise EngineError(
                f"slots={n} < ContinuousConfig.slots={cap} while {waiting} requests wait for "
                "a slot: shrink only in the tail (empty queue), or keep slots=config.slots"
            )
        if mesh == self.mesh and n == self._n:  # nothing to do
            info = dict.fromkeys(_INFO_KEYS, 0)
            info.update(mode=mode, dp=dp, tp=tp, slots=n, live=len(live), seconds=0.0)
            info.update(live_kv_bytes=self.kv_bytes(), weights_s=0.0, kv_s=0.0, compile_s=0.0)
            self._stats["switches"].append(info)
            return weights, info
        traces = self.trace_count
        # Weights, one layer at a time.
        t0 = time.perf_counter()
        new_weights, w_moved, w_peak = self._move_weights(weights, mesh, donate)
        weights_s = time.perf_counter() - t0
        # Live requests spread evenly over the new dp shards (request k -> shard k % dp).
        per = n // dp if n % dp == 0 else n
        ways = dp if n % dp == 0 else 1
        src = np.zeros(n, np.int32)  # new slot j reads old row src[j] (free slots: any row)
        remap = np.full(self._n + 1, n, np.int32)  # old slot -> new slot (old N -> new N)
        for k, r in enumerate(live):
            j = (k % ways) * per + k // ways
            src[j], remap[r.slot] = r.slot, j
        old_pool, old_mesh, old_n = self._pool, self.mesh, self._n
        live_kv = self.kv_bytes()
        self.mesh, self._n = mesh, n
        self._shardings = self._sharding_for(mesh, n)
        old_s, self._s = self._s, self._empty_slots(n)
        self._slot_req = [None] * n
        for r in live:
            j = int(remap[r.slot])
            for k, v in old_s.items():
                self._s[k][j] = v[r.slot]
            self._slot_req[j] = r
            r.slot = j
        self._table = remap[self._table]
        # Programs of the target (compiled now unless cached): decode, and for recompute
        # the prefill and extend buckets it runs.
        t0 = time.perf_counter()
        self._compile_target(new_weights, mode, live)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if mode == "migrate":
            kv_moved, kv_peak, rows_compile_s = self._migrate(old_pool, (old_mesh, old_n), src)
        else:
            kv_moved, kv_peak = self._recompute(old_pool, new_weights, live)
            rows_compile_s = 0.0
        kv_s = time.perf_counter() - t0 - rows_compile_s
        compile_s += rows_compile_s
        self._own_weights = [weakref.ref(x) for x in jax.tree.leaves(new_weights)]
        info = dict(
            mode=mode,
            dp=dp,
            tp=tp,
            slots=n,
            live=len(live),
            weights_s=weights_s,
            kv_s=kv_s,
            compile_s=compile_s,
            seconds=time.perf_counter() - t_start,
            compiled=self.trace_count - traces,
            moved_weight_bytes=w_moved,
            moved_kv_bytes=kv_moved,
            live_kv_bytes=live_kv,
            weights_peak_extra_bytes=w_peak,
            kv_peak_extra_bytes=kv_peak,
            peak_extra_bytes=max(w_peak, kv_peak),
        )
        self._stats["switches"].append(info)
        return new_weights, info

    def adopt(self, placed, original) -> None:
        """Marks the leaves of ``placed`` that share no buffer with ``original`` (copies
        made for the engine, e.g. by ``place`` in ``ContinuousSampler.generate``) as the
        engine's own: a later ``reshard`` frees them layer by layer."""
        self._own_weights = [
            weakref.ref(p)
            for p, o in zip(jax.tree.leaves(placed), jax.tree.leaves(original), strict=True)
            if p is not o and not (_buffers(p) & _buffers(o) if isinstance(o, jax.Array) else 0)
        ]

    def _move_weights(self, weights, mesh: Mesh, donate: bool) -> tuple[Any, int, int]:
        """device_put per leaf onto the rule table's NamedSharding, one layer (one
        ``layers/i`` subtree, or one top-level parameter) at a time; the old leaves of a
        layer are freed once its new ones exist (engine-owned or ``donate``)."""
        target = jax.tree.leaves(param_shardings(weights, mesh, self.rules))
        flat, treedef = jax.tree_util.tree_flatten_with_path(weights)
        if len(target) != len(flat):
            raise EngineError("reshard: weights do not match the model's parameters")
        owned = {id(x) for ref in self._own_weights if (x := ref()) is not None}
        groups: dict[tuple, list[int]] = {}
        for i, (path, _) in enumerate(flat):
            names = [getattr(k, "key", getattr(k, "name", k)) for k in path]
            cut = names.index("layers") + 2 if "layers" in names[:-1] else 1
            groups.setdefault(tuple(names[:cut]), []).append(i)
        out: list[Any] = [None] * len(flat)
        extra = peak = moved = 0
        for idx in groups.values():
            for i in idx:
                x = flat[i][1]
                out[i] = y = jax.device_put(x, target[i])
                fresh = _new_bytes(y, x)
                extra += fresh
                moved += fresh
            jax.block_until_ready([out[i] for i in idx])
            peak = max(peak, extra)
            for i in idx:
                x = flat[i][1]
                if donate or id(x) in owned:
                    extra -= _free(x, out[i])
        return jax.tree_util.tree_unflatten(treedef, out), moved, peak

    def _compile_target(self, weights, mode: str, live: list[Request]):
        args = (weights, self._pool_abstract(), self._slots_device(), self._table_device())
        if self._s["active"].any():
            self._fn("decode", *self._decode_statics()).lower(*args).compile()
        if mode != "recompute":
            return
        c = self.config
        calls = self._recompute_calls(live)
        for t in sorted({t for kind, t, *_ in calls if kind == "prefill"}):
            self._fn("prefill", t).lower(
                weights,
                args[1],
                np.zeros(c.prefill_batch, np.int32),
                np.zeros((c.prefill_batch, t), np.int32),
                np.zeros(c.prefill_batch, np.int32),
            ).compile()
        e = c.extend_batch
        for t in sorted({t for kind, t, *_ in calls if kind == "extend"}):
            z = np.zeros(e, np.int32)
            self._fn("extend", t).lower(
                weights, args[1], z, z, z, np.zeros((e, t), np.int32), z
            ).compile()

    def _pool_abstract(self) -> K.Pool:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self._pool_shapes(self._n),
            self._shardings["pool"],
        )

    def _migrate(self, old: K.Pool, old_at: tuple, src: np.ndarray) -> tuple[int, int, float]:
        """Moves the live response rows (rows ``src`` of each old layer) and the prompt
        pool onto the new shardings, one layer at a time, each old buffer freed as soon as
        its copy exists. The rows are gathered on the old mesh into a row count its dp
        divides (so nothing is replicated there), moved, and cut to ``slots`` rows on the
        new mesh when that count was padded: one layer's buffers in flight at a time."""
        sh = self._shardings["pool"]
        old_mesh, _ = old_at
        n = int(src.size)
        dp0 = old_mesh.shape["dp"]
        pad = -(-n // dp0) * dp0
        gather = self._fn("gather", pad, at=old_at)
        idx = np.zeros(pad, np.int32)  # uncommitted: follows x onto its mesh
        idx[:n] = src
        t0 = time.perf_counter()  # compile (or find cached) the row programs first
        gather.lower(old.resp_k[0], idx).compile()
        if pad != n:
            mid = self._sharding_for(self.mesh, pad)["pool"].resp_k[0]
            cut = self._fn("cut", n, at=(self.mesh, pad))
            a = old.resp_k[0]
            cut.lower(jax.ShapeDtypeStruct((pad,) + a.shape[1:], a.dtype, sharding=mid)).compile()
        compile_s = time.perf_counter() - t0
        extra = peak = moved = 0

        def move(x, target, rows):
            nonlocal extra, peak, moved
            chain = [x]
            if rows:
                chain.append(gather(x, idx))
            chain.append(jax.device_put(chain[-1], mid if rows and pad != n else target))
            moved += _new_bytes(chain[-1], chain[-2])
            if rows and pad != n:
                chain.append(cut(chain[-1]))
            z = chain[-1]
            z.block_until_ready()
            extra += sum(_new_bytes(b, a) for a, b in zip(chain, chain[1:], strict=False))
            peak = max(peak, extra)
            for i, a in enumerate(chain[:-1]):  # oldest first: x, then the intermediates
                extra -= _free(a, *chain[i + 1 :])
            return z

        resp_k = tuple(move(x, s, True) for x, s in zip(old.resp_k, sh.resp_k, strict=True))
        resp_v = tuple(move(x, s, True) for x, s in zip(old.resp_v, sh.resp_v, strict=True))
        prompt_k = tuple(move(x, s, False) for x, s in zip(old.prompt_k, sh.prompt_k, strict=True))
        prompt_v = tuple(move(x, s, False) for x, s in zip(old.prompt_v, sh.prompt_v, strict=True))
        plen = move(old.prompt_len, sh.prompt_len, False)
        self._pool = K.Pool(prompt_k, prompt_v, plen, resp_k, resp_v)
        return moved, peak, compile_s

    def _recompute(self, old: K.Pool, weights, live: list[Request]) -> tuple[int, int]:
        """Frees the old pool, then rebuilds the K/V on the new mesh: each resident
        prompt by prefill, each live request's response rows by extend from its tokens
        (row 0 the prompt's last token, row j > 0 ``context[j - 1]``)."""
        freed = sum(_free(x) for x in jax.tree.leaves(old))
        self._pool = self._zeros_pool(self._n)
        created = sum(_phys_bytes(x) for x in jax.tree.leaves(self._pool))
        resident = self._resident()
        items = []
        for r in live:
            if r.length:
                rows = np.asarray([r.group.prompt[-1]] + r.context[: r.length - 1], np.int32)
                items.append((r.slot, r.group.pslot, 0, rows))
        for kind, t, lo, hi in self._recompute_calls(live):
            if kind == "prefill":
                self._prefill_groups(weights, resident[lo:hi], t)
            else:
                self._extend_rows(weights, items[lo:hi], t)
        jax.block_until_ready(self._pool)
        return 0, max(0, created - freed)

    def _resident(self) -> list[Group]:
        """The prompt rows a recompute re-fills: resident and already prefilled."""
        return [g for g in self._pslot_group if g is not None and g not in self._to_prefill]

    def _recompute_calls(self, live: list[Request]) -> list[tuple[str, int, int, int]]:
        c = self.config
        return recompute_calls(
            [g.prompt.size for g in self._resident()],
            [r.length for r in live],
            prefill_batch=c.prefill_batch,
            extend_batch=c.extend_batch,
            prompt_len=c.prompt_len,
            response_len=c.response_len,
        )

    def reset(self) -> None:
        """Back to the construction mesh and config.slots slots between generations; the
        pool is re-created empty (nothing is moved), so no request may hold a slot or a
        prompt row (release held requests first, or use ``reshard``)."""
        if self._mesh0 is None or (self.mesh == self._mesh0 and self._n == self.config.slots):
            return
        held = sum(r is not None for r in self._slot_req)
        rows = sum(g is not None for g in self._pslot_group)
        if held or rows or self._to_prefill or self._to_extend:
            raise EngineError(
                f"reset: {held} slots and {rows} prompt rows are in use; release or finish "
                "them first, or reshard(mesh, weights, slots=config.slots) to move them"
            )
        for x in jax.tree.leaves(self._pool):
            _free(x)
        n = self.config.slots
        self.mesh, self._n = self._mesh0, n
        self._shardings = self._sharding_for(self._mesh0, n)
        self._pool = self._zeros_pool(n)
        self._s = self._empty_slots(n)
        self._slot_req = [None] * n
        self._table = np.full(self._table.shape, n, np.int32)

    # ------------------------------------------------------------ public API

    def submit(
        self,
        prompt: Sequence[int],
        *,
        n: int = 1,
        max_new_tokens: int | Sequence[int] | None = None,
        stop_ids: Sequence[int] = (),
        stop_sequences: Sequence[Sequence[int]] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | jax.Array = 0,
        forced_lengths: Sequence[int] | None = None,
        hold: bool = False,
        until: Callable[[Group], bool] | None = None,
        on_tokens: Callable | None = None,
        on_finish: Callable | None = None,
    ) -> Group:
        """Queues ``n`` samples of ``prompt``; returns their ``Group``."""
        c, cfg = self.config, self.cfg
        ids = token_ids("prompt", prompt, error=EngineError).reshape(-1)
        if ids.size == 0:
            raise EngineError("prompt is empty (need at least one token, e.g. bos)")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise EngineError(
                f"prompt: token ids must be in [0, {cfg.vocab_size}), "
                f"got [{ids.min()}, {ids.max()}]"
            )
        if ids.size > c.prompt_len:
            raise EngineError(
                f"prompt has {ids.size} tokens; the engine's prompt_len is {c.prompt_len} "
                "(ContinuousConfig.prompt_len)"
            )
        if not isinstance(n, int | np.integer) or not 1 <= n <= c.group_size:
            raise EngineError(f"n={n!r} must be an int in [1, {c.group_size}] (group_size)")
        limit = c.response_len
        if max_new_tokens is None:  # as many as the response rows hold
            max_new_tokens = limit
        mx = (
            np.broadcast_to(np.asarray(max_new_tokens, np.int64), (n,))
            if np.ndim(max_new_tokens) == 0
            else np.asarray(max_new_tokens, np.int64).reshape(-1)
        )
        forced = forced_lengths is not None
        if not forced and (mx.shape != (n,) or mx.min() < 1 or mx.max() > limit):
            raise EngineError(
                f"max_new_tokens: need an int or {n} ints in [1, {limit}] (response_len), "
                f"got {np.asarray(max_new_tokens).tolist()}"
            )
        if forced:  # exact lengths (trace replay); max_new_tokens is not used
            f = np.asarray(forced_lengths, np.int64).reshape(-1)
            if f.shape != (n,) or f.min() < 1 or f.max() > limit:
                raise EngineError(
                    f"forced_lengths: need {n} ints in [1, {limit}], got {f.tolist()}"
                )
            mx = f
        stops = tuple(
            int(t) for t in token_ids("stop_ids", list(stop_ids), error=EngineError).reshape(-1)
        )
        if len(stops) > c.max_stop_ids:
            raise EngineError(
                f"stop_ids: {len(stops)} ids, the engine takes at most {c.max_stop_ids} "
                "(ContinuousConfig.max_stop_ids); use stop_sequences for the rest"
            )
        if any(not 0 <= t < cfg.vocab_size for t in stops):
            raise EngineError(f"stop_ids: ids must be in [0, {cfg.vocab_size}), got {stops}")
        seqs = []
        for i, sq in enumerate(stop_sequences):
            a = token_ids(f"stop_sequences[{i}]", list(sq), error=EngineError).reshape(-1)
            if a.size == 0:
                raise EngineError(f"stop_sequences[{i}] is empty (need at least one id)")
            seqs.append(tuple(int(t) for t in a))
        if not temperature >= 0:
            raise EngineError(f"temperature={temperature} must be >= 0 (0 = greedy)")
        if not 0 < top_p <= 1:
            raise EngineError(f"top_p={top_p} must be in (0, 1]")
        if not isinstance(top_k, int | np.integer) or top_k < 0:
            raise EngineError(f"top_k={top_k!r} must be an int >= 0 (0 = off)")
        base = seed_key(seed)
        keys = np.asarray(_member_keys_fn(int(n))(base), np.uint32)
        group = Group(
            id=self._next_group,
            prompt=ids.astype(np.int32),
            requests=[],
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            stop_ids=stops,
            stop_sequences=tuple(seqs),
            on_tokens=on_tokens,
            on_finish=on_finish,
            until=until,
            owner=self,
        )
        self._next_group += 1
        group.requests = [
            Request(
                group=group,
                index=j,
                key=keys[j],
                max_new_tokens=int(mx[j]),
                forced=forced,
                hold=hold,
            )
            for j in range(n)
        ]
        self._queue.append(group)
        return group

    def cancel(self, target: Request | Group) -> None:
        """Stops a request (or every request of a group) with reason CANCELLED."""
        reqs = target.requests if isinstance(target, Group) else [target]
        if isinstance(target, Group) and target.owner is not self:
            raise EngineError(f"unknown group handle {target.id} (submitted to another engine)")
        for r in reqs:
            self._check(r)
            if r.status in (Status.WAITING, Status.RUNNING):
                self._finish(r, FinishReason.ABORTED)

    def extend(
        self, request: Request, tokens: Sequence[int], *, max_new_tokens: int = 64
    ) -> Request:
        """Continues a held, finished request after appending ``tokens`` (tool output)."""
        self._check(request)
        if not request.hold or request.status is not Status.FINISHED or request.slot is None:
            raise EngineError(
                f"extend: request {request.id} must be a finished request submitted with "
                f"hold=True and not released (status {request.status.value})"
            )
        ids = token_ids("tokens", tokens, error=EngineError).reshape(-1)
        if ids.size == 0:
            raise EngineError("extend: tokens is empty (need at least one token)")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise EngineError(f"extend: token ids must be in [0, {self.cfg.vocab_size})")
        # Rows: the last sampled token + all appended but the last (the next input).
        room = self.config.response_len - request.length - ids.size
        if max_new_tokens < 1 or max_new_tokens > room:
            raise EngineError(
                f"extend: max_new_tokens={max_new_tokens} must be in [1, {room}] (the request "
                f"holds {request.length} of response_len={self.config.response_len} rows and "
                f"appends {ids.size})"
            )
        request.pending = ids.astype(np.int32)
        request.max_new_tokens = int(max_new_tokens)
        request.tokens, request.logprobs = [], []
        request.streamed = 0
        request.finish = FinishReason.RUNNING
        request.status = Status.RUNNING
        self._to_extend.append(request)
        return request

    def release(self, request: Request) -> None:
        """Frees a held request's slot (and its group's prompt row when the group is done)."""
        self._check(request)
        if request.status is Status.RUNNING:
            raise EngineError(f"release: request {request.id} is still running; cancel it first")
        self._free(request)

    def pending(self) -> bool:
        return bool(self._queue or self._to_extend or any(self._s["active"]))

    def run(
        self,
        weights,
        *,
        max_calls: int | None = None,
        on_call: Callable[[RolloutEngine, Any], Any] | None = None,
    ) -> list[Request]:
        """Steps until nothing is waiting or running; returns the requests finished meanwhile.

        ``on_call(engine, weights)`` runs after every step that made a decode call (a PAT
        controller: read ``view()``, maybe ``reshard``); a non-None result replaces the
        weights for the following steps (the re-placed weights of a switch). Its time
        counts in ``stats()["seconds"]`` and, separately, in ``control_seconds``."""
        calls = 0
        while self.pending():
            decoded = self.step(weights)
            if decoded and on_call is not None:
                t0 = time.perf_counter()
                new = on_call(self, weights)
                seconds = time.perf_counter() - t0
                self._stats["seconds"] += seconds
                self._stats["control_seconds"] += seconds
                if new is not None:
                    weights = new
            calls += 1
            if max_calls is not None and calls >= max_calls:
                break
        out, self._finished = self._finished, []
        return out

    def step(self, weights) -> bool:
        """One scheduling round: admit + prefill, extends, one decode call, retire.
        Returns whether it made a decode call."""
        t0 = time.perf_counter()
        self._admit()
        self._run_prefill(weights)
        self._run_extend(weights)
        decoded = bool(self._s["active"].any())
        if decoded:
            self._decode(weights)
        self._stats["seconds"] += time.perf_counter() - t0
        return decoded

    # ------------------------------------------------------------ scheduling

    def _check(self, r: Request):
        if not isinstance(r, Request) or r.group.owner is not self:
            raise EngineError(f"unknown request handle {r!r}")

    def _admit(self):
        s, c = self._s, self.config
        free = [i for i, r in enumerate(self._slot_req) if r is None]
        while self._queue and free:
            g = self._queue[0]
            waiting = [r for r in g.requests if r.status is Status.WAITING]
            if not waiting:
                self._queue.popleft()
                continue
            if g.pslot is None:
                try:
                    g.pslot = self._pslot_group.index(None)
                except ValueError:
                    break  # every prompt row is in use: wait for a group to finish
                self._pslot_group[g.pslot] = g
                self._to_prefill.append(g)
            for r in waiting:
                if not free:
                    break
                i = free.pop(0)
                r.slot, r.status, r.length = i, Status.RUNNING, 0
                r.context = []
                self._slot_req[i] = r
                self._table[g.pslot, r.index] = i
                s["group"][i] = g.pslot
                s["cell"][i] = g.pslot * c.group_size + r.index
                s["length"][i] = 0
                s["token"][i] = g.prompt[-1]
                s["active"][i] = True
                s["budget"][i] = r.max_new_tokens
                s["forced"][i] = r.forced
                s["key"][i] = r.key
                s["temperature"][i] = g.temperature
                s["top_p"][i] = g.top_p
                s["top_k"][i] = g.top_k
                s["stop_ids"][i] = -1
                s["stop_ids"][i, : len(g.stop_ids)] = g.stop_ids
            if all(r.status is not Status.WAITING for r in g.requests):
                self._queue.popleft()

    def _run_prefill(self, weights):
        c = self.config
        while self._to_prefill:
            batch, self._to_prefill = (
                self._to_prefill[: c.prefill_batch],
                self._to_prefill[c.prefill_batch :],
            )
            self._prefill_groups(weights, batch)

    def _prefill_groups(self, weights, batch: list[Group], t: int | None = None):
        """One prefill call writing these groups' prompts (at most prefill_batch), padded
        to ``t`` rows (default: the bucket of the longest)."""
        c = self.config
        if t is None:
            t = self._len_bucket(max(g.prompt.size - 1 for g in batch), c.prompt_len)
        qs = np.full(c.prefill_batch, c.prompt_slots, np.int32)
        toks = np.full((c.prefill_batch, t), self.pad_id, np.int32)
        lens = np.zeros(c.prefill_batch, np.int32)
        for j, g in enumerate(batch):
            qs[j] = g.pslot
            toks[j, : g.prompt.size - 1] = g.prompt[:-1]
            lens[j] = g.prompt.size - 1
        self._pool = self._fn("prefill", t)(weights, self._pool, qs, toks, lens)
        self._stats["prefill_calls"] += 1
        self._stats["prefill_tokens"] += int(lens.sum())

    def _run_extend(self, weights):
        c, s = self.config, self._s
        while self._to_extend:
            batch, self._to_extend = (
                self._to_extend[: c.extend_batch],
                self._to_extend[c.extend_batch :],
            )
            # Feed the last sampled token and every appended token but the last.
            feeds = [np.concatenate([[s["token"][r.slot]], r.pending[:-1]]) for r in batch]
            self._extend_rows(
                weights,
                [(r.slot, r.group.pslot, r.length, f) for r, f in zip(batch, feeds, strict=True)],
            )
            for r, f in zip(batch, feeds, strict=True):
                i = r.slot
                r.length += f.size
                s["length"][i] = r.length
                s["token"][i] = r.pending[-1]
                s["active"][i] = True
                s["budget"][i] = r.max_new_tokens
                r.context.extend(r.pending.tolist())
                r.pending = None
                r.turns += 1

    def _extend_rows(self, weights, items: list[tuple[int, int, int, np.ndarray]], t=None):
        """One extend call: (slot, prompt slot, first row, tokens) each, at most
        extend_batch, padded to ``t`` rows (default: the bucket of the most tokens)."""
        c = self.config
        if t is None:
            t = self._len_bucket(max(f.size for *_, f in items), c.response_len)
        e = c.extend_batch
        slot = np.full(e, self._n, np.int32)
        grp = np.zeros(e, np.int32)
        length = np.zeros(e, np.int32)
        toks = np.full((e, t), self.pad_id, np.int32)
        count = np.zeros(e, np.int32)
        for j, (sl, g, first, f) in enumerate(items):
            slot[j], grp[j], length[j] = sl, g, first
            toks[j, : f.size] = f
            count[j] = f.size
        self._pool = self._fn("extend", t)(weights, self._pool, slot, grp, length, toks, count)
        self._stats["extend_calls"] += 1

    def _slots_device(self) -> K.Slots:
        slots = K.Slots(**{k: jnp.asarray(v) for k, v in self._s.items()})
        if self._shardings is not None:
            slots = jax.device_put(slots, self._shardings["slots"])
        return slots

    def _table_device(self):
        if self._shardings is not None:
            return jax.device_put(self._table, self._shardings["replicated"])
        return jnp.asarray(self._table)

    def _decode_statics(self) -> tuple[int, bool, int]:
        """(steps, filtered, window) of the next decode call (some slot must be active)."""
        c, s = self.config, self._s
        filtered = bool(
            np.any(s["active"] & ((s["top_k"] > 0) | (s["top_p"] < 1)) & (s["temperature"] > 0))
        )
        # Attention reads the response rows up to the longest active one after this call.
        need = int(s["length"][s["active"]].max()) + c.steps_per_call + 1
        window = next(w for w in self._windows() if w >= need or w == c.response_len)
        return c.steps_per_call, filtered, window

    def _decode(self, weights):
        s = self._s
        traces = self.trace_count
        t0 = time.perf_counter()
        statics = self._decode_statics()
        window = statics[2]
        self._pool, slots, out = self._fn("decode", *statics)(
            weights, self._pool, self._slots_device(), self._table_device()
        )
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        new = jax.tree.map(np.array, jax.device_get(slots))  # writable copies
        steps = int(out.steps)
        st = self._stats
        st["decode_calls"] += 1
        st["decode_steps"] += steps
        st["active"].extend(out.batch[:steps].tolist())
        st["context"].extend(out.context[:steps].tolist())
        if self.trace_count == traces:  # a call that compiled would price the compile
            st["calls"].append((seconds, steps, int(out.batch[:steps].sum()), window))
        produced = []
        for i in np.flatnonzero(out.count):
            r = self._slot_req[i]
            cnt = int(out.count[i])
            toks = out.tokens[i, :cnt].tolist()
            lps = out.logprobs[i, :cnt].tolist()
            reason = FinishReason(int(out.finish[i]))
            cut = self._stop_sequence_cut(r, toks)
            if cut is not None and (cut < cnt or reason is not FinishReason.STOP):
                # A stop sequence ends inside this call: drop what follows, roll back.
                toks, lps, reason = toks[:cut], lps[:cut], FinishReason.STOP
                new.length[i] -= cnt - cut
                new.token[i] = toks[-1]
            r.tokens.extend(toks)
            r.logprobs.extend(lps)
            r.context.extend(toks)
            r.length = int(new.length[i])
            s["length"][i] = new.length[i]
            s["token"][i] = new.token[i]
            s["budget"][i] = new.budget[i]
            st["generated_tokens"] += len(toks)
            produced.append((r, reason))
        self._note_kv()  # before retiring: the K/V this call held
        for r, reason in produced:
            self._stream(r)
            if reason is not FinishReason.RUNNING and r.status is Status.RUNNING:
                self._finish(r, reason, check=False)
        # Group predicates see every member that finished in this call.
        for g in {id(r.group): r.group for r, _ in produced}.values():
            self._check_until(g)

    def _stop_sequence_cut(self, r: Request, new: list[int]) -> int | None:
        """Index (exclusive) in ``new`` where the first stop-sequence match ends, if any."""
        seqs = r.group.stop_sequences
        if not seqs or r.forced:
            return None
        old = r.tokens
        for j in range(len(new)):
            for sq in seqs:
                n = len(sq)
                end = len(old) + j + 1
                if end < n:
                    continue
                tail = (old + new[: j + 1])[end - n : end]
                if tuple(tail) == sq:
                    return j + 1
        return None

    def _stream(self, r: Request, *, flush: bool = False):
        g, chunk = r.group, self.config.stream_chunk
        if g.on_tokens is None or r.error is not None:
            return
        while len(r.tokens) - r.streamed >= max(chunk, 1) and (chunk or flush):
            end = r.streamed + (chunk or len(r.tokens) - r.streamed)
            if not self._call(
                r,
                g.on_tokens,
                r,
                np.asarray(r.tokens[r.streamed : end], np.int32),
                np.asarray(r.logprobs[r.streamed : end], np.float32),
            ):
                return
            r.streamed = end
        if flush and len(r.tokens) > r.streamed:
            end = len(r.tokens)
            if self._call(
                r,
                g.on_tokens,
                r,
                np.asarray(r.tokens[r.streamed :], np.int32),
                np.asarray(r.logprobs[r.streamed :], np.float32),
            ):
                r.streamed = end

    def _call(self, r: Request, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - a user callback; it must not wedge the engine
            r.error = f"{type(exc).__name__}: {exc}"
            self.errors.append((r.id, r.error))
            warnings.warn(
                f"rollout engine: callback {getattr(fn, '__name__', fn)!r} of request {r.id} "
                f"raised {r.error}; the request is cancelled",
                RuntimeWarning,
                stacklevel=2,
            )
            if r.status in (Status.WAITING, Status.RUNNING):
                self._finish(r, FinishReason.ABORTED)
            return False

    def _finish(self, r: Request, reason: FinishReason, *, check: bool = True):
        s = self._s
        if r.slot is not None:
            s["active"][r.slot] = False
        r.finish = reason
        r.status = Status.FINISHED
        self._finished.append(r)
        self._stream(r, flush=True)
        if r.group.on_finish is not None:
            self._call(r, r.group.on_finish, r, reason)
        if not r.hold or reason is FinishReason.ABORTED:
            self._free(r)
        if check and reason is not FinishReason.ABORTED:
            self._check_until(r.group)

    def _check_until(self, g: Group):
        """Cancels the group's unfinished members once its ``until`` predicate holds."""
        if g.until is None or g.stopped or not g.until(g):
            return
        g.stopped = True
        for other in g.requests:
            if other.status in (Status.WAITING, Status.RUNNING):
                self._finish(other, FinishReason.ABORTED, check=False)

    def _free(self, r: Request):
        g = r.group
        if r.slot is not None:
            self._slot_req[r.slot] = None
            self._s["active"][r.slot] = False
            if g.pslot is not None:
                self._table[g.pslot, r.index] = self._n
            r.slot = None
        r.status = Status.RELEASED
        if g.pslot is not None and all(
            q.status is Status.RELEASED or (q.status is Status.FINISHED and q.slot is None)
            for q in g.requests
        ):
            self._pslot_group[g.pslot] = None
            g.pslot = None

    # ------------------------------------------------------------ stats

    def _reset_stats(self):
        self._stats = dict(
            seconds=0.0,
            decode_calls=0,
            decode_steps=0,
            prefill_calls=0,
            prefill_tokens=0,
            extend_calls=0,
            generated_tokens=0,
            active=[],
            context=[],
            # per decode call that compiled nothing: (seconds, steps, sum of active
            # slots, response window read)
            calls=[],
            peak_kv_bytes=0,
            switches=[],  # the info dict of every reshard
            control_seconds=0.0,  # in ``run``'s on_call (switches included)
        )

    def _note_kv(self):
        self._stats["peak_kv_bytes"] = max(self._stats["peak_kv_bytes"], self.kv_bytes())

    @property
    def token_kv_bytes(self) -> int:
        """K/V bytes of one token over all layers (unsharded): live K/V = tokens x this."""
        return self._token_bytes

    def kv_bytes(self) -> int:
        """Live K/V bytes: each resident prompt once + each slot's response rows."""
        rows = sum(g.prompt.size - 1 for g in self._pslot_group if g is not None)
        rows += sum(r.length for r in self._slot_req if r is not None)
        return rows * self._token_bytes

    def allocated_kv_bytes(self) -> int:
        c = self.config
        return (c.prompt_slots * c.prompt_len + self._n * c.response_len) * self._token_bytes

    def stats(self, *, reset: bool = False) -> dict[str, Any]:
        st = dict(self._stats)
        active = np.asarray(st.pop("active"), np.int64)
        context = np.asarray(st.pop("context"), np.int64)
        st.update(
            active_per_step=active,
            context_per_step=context,
            slot_utilisation=float(active.mean() / self.config.slots) if active.size else 0.0,
            tokens_per_second=st["generated_tokens"] / max(st["seconds"], 1e-9),
            allocated_kv_bytes=self.allocated_kv_bytes(),
            trace_count=self.trace_count,
            callback_errors=len(self.errors),
        )
        if reset:
            self._reset_stats()
        return st


__all__ = [
    "ContinuousConfig",
    "EngineError",
    "EngineView",
    "Group",
    "Request",
    "RolloutEngine",
    "Status",
    "complete",
    "decode_windows",
    "len_bucket",
    "merged_slots",
    "recompute_calls",
]
