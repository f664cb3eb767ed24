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

*PAT switching* (PAT, arXiv 2605.23945: adaptive tensor parallelism during generation). An
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
``request.slot``) is remapped; the prompt pool keeps its Q rows. Weights move one
parameter at a time and K/V is migrated or recomputed (``dtarl.rollout.reshard``);
``info`` reports the seconds of each stage (weights_s, kv_s, compile_s), the bytes
moved and the peak extra bytes. Programs are cached per ``ProgramKey`` (kind, mesh,
slots, statics) for the engine's life: a switch back to a shape seen before, and a
second generation with the same switches, compile nothing (``trace_count``);
``warmup(targets=)`` compiles a target's programs ahead. ``reset()`` (called by
``ContinuousSampler.generate`` after each generation) returns an idle engine to
its construction mesh and slot count without moving anything.

*Layout.* The engine is a thin shell over four parts: the pure-Python scheduler
(``dtarl.rollout.scheduler``: slots, groups, admission, retirement, stop sequences,
the host mirror), the program cache with its typed keys
(``dtarl.rollout.programs``), the K/V pool (``dtarl.rollout.pool``) and the resharder
(``dtarl.rollout.reshard``); its shapes are ``dtarl.rollout.config`` and its reports
``dtarl.rollout.stats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dtarl.model.decoder import Decoder
from dtarl.parallel.mesh import DEFAULT_RULES, Rules, param_shardings, shard_params
from dtarl.rollout.compiles import compile_count
from dtarl.rollout.config import (
    ContinuousConfig,
    EngineError,
    decode_windows,
    len_bucket,
    length_buckets,
    merged_slots,
    recompute_calls,
)
from dtarl.rollout.keys import fold_seed, member_keys, seed_key
from dtarl.rollout.pool import KVPool, Placement, slot_arrays
from dtarl.rollout.programs import ProgramCache, ProgramKey, ProgramKind
from dtarl.rollout.reasons import FinishReason
from dtarl.rollout.reshard import (
    INFO_KEYS,
    Resharder,
    mesh_for,
    switch_slots,
    switch_targets,
    target_mesh,
)
from dtarl.rollout.scheduler import Group, Request, Scheduler, Status, Turn, complete
from dtarl.rollout.stats import EngineStats, EngineView, StatsRecorder


class RolloutEngine:
    """Continuous batching over a prompt-shared K/V pool; see the module docstring.

    Its parts are public: ``scheduler`` (host state), ``programs`` (the program
    cache), ``pool`` (the K/V pool; ``pool.arrays`` its arrays, replaced by every
    call) and ``resharder``."""

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
        self._base_mesh = mesh  # the construction mesh (``reset`` returns to it)
        self.scheduler = Scheduler(config, vocab_size=cfg.vocab_size)
        self.pool = KVPool(config, cfg, rules)
        self.programs = ProgramCache(
            self.graphdef, self.pool, static=(repr(config), repr(cfg), repr(rules))
        )
        self.resharder = Resharder(self.pool, self.programs, rules)
        self.pool.arrays = self.pool.zeros(config.slots, self._placement())
        self._stats = StatsRecorder()

    # ------------------------------------------------------------ public state

    @property
    def trace_count(self) -> int:
        """Programs traced (or read from the program store) so far."""
        return self.programs.trace_count

    @property
    def errors(self) -> list[tuple[tuple[int, int], str]]:
        """(request id, error) of every user callback that raised."""
        return self.scheduler.errors

    @property
    def base_mesh(self) -> Mesh | None:
        """The construction mesh (``reset`` returns to it; None without a mesh)."""
        return self._base_mesh

    @property
    def slots(self) -> int:
        """Slots now (``reshard`` may shrink them below config.slots)."""
        return self.scheduler.slots

    @property
    def token_kv_bytes(self) -> int:
        """K/V bytes of one token over all layers (unsharded): live K/V = tokens x this."""
        return self.pool.token_bytes

    def live_requests(self) -> list[Request]:
        """The requests holding a slot (running, and held after their turn), slot order."""
        return self.scheduler.live()

    def kv_bytes(self) -> int:
        """Live K/V bytes: each resident prompt once + each slot's response rows."""
        return self.scheduler.kv_rows() * self.pool.token_bytes

    def allocated_kv_bytes(self) -> int:
        return self.pool.allocated_bytes(self.slots)

    def pending(self) -> bool:
        return self.scheduler.pending()

    def place(self, weights):
        """The weights on the engine's current mesh (tp-split by the rule table); as is
        without one."""
        return weights if self.mesh is None else shard_params(weights, self.mesh, self.rules)

    def adopt(self, placed, original) -> None:
        """Marks the leaves of ``placed`` that share no buffer with ``original`` (copies
        made for the engine, e.g. by ``place`` in ``ContinuousSampler.generate``) as the
        engine's own: a later ``reshard`` frees them layer by layer."""
        self.resharder.adopt(placed, original)

    def _placement(self) -> Placement | None:
        return None if self.mesh is None else self.pool.placement(self.mesh, self.slots)

    # ------------------------------------------------------------ requests

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
        return self.scheduler.submit(
            prompt,
            n=n,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            stop_sequences=stop_sequences,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            member_keys=lambda m: member_keys(seed, m),
            forced_lengths=forced_lengths,
            hold=hold,
            until=until,
            on_tokens=on_tokens,
            on_finish=on_finish,
        )

    def cancel(self, target: Request | Group) -> None:
        """Stops a request (or every request of a group) with reason CANCELLED."""
        self.scheduler.cancel(target)

    def extend(
        self, request: Request, tokens: Sequence[int], *, max_new_tokens: int = 64
    ) -> Request:
        """Continues a held, finished request after appending ``tokens`` (tool output)."""
        return self.scheduler.extend(request, tokens, max_new_tokens=max_new_tokens)

    def release(self, request: Request) -> None:
        """Frees a held request's slot (and its group's prompt row when the group is done)."""
        self.scheduler.release(request)

    # ------------------------------------------------------------ running

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
        counts in ``stats().seconds`` and, separately, in ``control_seconds``."""
        calls = 0
        while self.pending():
            decoded = self.step(weights)
            if decoded and on_call is not None:
                t0 = time.perf_counter()
                new = on_call(self, weights)
                seconds = time.perf_counter() - t0
                self._stats.seconds += seconds
                self._stats.control_seconds += seconds
                if new is not None:
                    weights = new
            calls += 1
            if max_calls is not None and calls >= max_calls:
                break
        return self.scheduler.take_finished()

    def step(self, weights) -> bool:
        """One scheduling round: admit + prefill, extends, one decode call, retire.
        Returns whether it made a decode call."""
        t0 = time.perf_counter()
        sched = self.scheduler
        sched.admit()
        while sched.to_prefill:
            self._prefill(weights, sched.take_prefill())
        while sched.to_extend:
            batch = sched.take_extend()
            self._extend(weights, [(r.slot, r.group.pslot, r.length, f) for r, f in batch])
            sched.extended(batch)
        decoded = bool(sched.mirror["active"].any())
        if decoded:
            self._decode(weights)
        self._stats.seconds += time.perf_counter() - t0
        return decoded

    def _program(self, kind: ProgramKind, **statics):
        """The program of ``kind`` on the current (mesh, slots)."""
        key = ProgramKey(kind=kind, mesh=self.mesh, slots=self.slots, **statics)
        return self.programs.get(key)

    def _prefill(self, weights, batch: list[Group], t: int | None = None) -> None:
        """One prefill call writing these groups' prompts (at most prefill_batch), padded
        to ``t`` rows (default: the bucket of the longest)."""
        qs, toks, lens = self.scheduler.prefill_inputs(batch, t, self.pad_id)
        fn = self._program(ProgramKind.PREFILL, length=toks.shape[1])
        self.pool.arrays = fn(weights, self.pool.arrays, qs, toks, lens)
        self._stats.prefill_calls += 1
        self._stats.prefill_tokens += int(lens.sum())

    def _extend(self, weights, items: list[tuple[int, int, int, np.ndarray]], t=None) -> None:
        """One extend call: (slot, prompt slot, first row, tokens) each, at most
        extend_batch, padded to ``t`` rows (default: the bucket of the most tokens)."""
        args = self.scheduler.extend_inputs(items, t, self.pad_id)
        fn = self._program(ProgramKind.EXTEND, length=args[3].shape[1])
        self.pool.arrays = fn(weights, self.pool.arrays, *args)
        self._stats.extend_calls += 1

    def _table_device(self):
        table = self.scheduler.table
        placement = self._placement()
        if placement is not None:
            return jax.device_put(table, placement.replicated)
        return jnp.asarray(table)

    def _decode_key(self) -> dict[str, Any]:
        windows = decode_windows(self.config.response_len)
        return self.scheduler.decode_statics(windows)._asdict()

    def _decode(self, weights) -> None:
        sched, st = self.scheduler, self._stats
        compiles, t0 = compile_count(), time.perf_counter()
        statics = self._decode_key()
        fn = self._program(ProgramKind.DECODE, **statics)
        slots = slot_arrays(sched.mirror, self._placement())
        self.pool.arrays, slots, out = fn(weights, self.pool.arrays, slots, self._table_device())
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        new = jax.device_get(slots)
        steps = int(out.steps)
        st.decode_calls += 1
        st.decode_steps += steps
        st.active.extend(out.batch[:steps].tolist())
        st.context.extend(out.context[:steps].tolist())
        if compile_count() == compiles:  # a compile (even one without a retrace) is no sample
            st.calls.append((seconds, steps, int(out.batch[:steps].sum()), statics["window"]))
        arrays = (out.count, out.tokens, out.logprobs, out.finish)
        arrays += (new.length, new.token, new.budget)
        turns: list[Turn] = sched.absorb(*(np.asarray(x) for x in arrays))
        st.generated_tokens += sum(t.tokens for t in turns)
        st.peak_kv_bytes = max(st.peak_kv_bytes, self.kv_bytes())  # before retiring
        sched.retire(turns)

    # ------------------------------------------------------------ compiling

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
        slots = slot_arrays(self.scheduler.mirror, self._placement())
        args = (weights, self.pool.arrays, slots, self._table_device())
        self.programs.warm((self.mesh, self.slots), args, filtered=filtered, extend=extend)
        for target in targets:
            if len(target) != 3:
                raise EngineError(f"warmup: targets need (dp, tp, slots) triples, got {target!r}")
            dp, tp, n = target
            mesh = target_mesh(self._base_mesh, (dp, tp), self.cfg.num_kv_heads, "warmup: targets")
            n = self.config.slots if n is None else n
            if not isinstance(n, int | np.integer) or not 1 <= n <= self.config.slots:
                raise EngineError(
                    f"warmup: targets slots={n!r} must be an int in [1, {self.config.slots}] "
                    "(ContinuousConfig.slots)"
                )
            n = int(n)
            sh = self.pool.placement(mesh, n)
            w = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                weights,
                param_shardings(weights, mesh, self.rules),
            )
            table = jax.ShapeDtypeStruct(
                self.scheduler.table.shape, np.int32, sharding=sh.replicated
            )
            args = (w, self.pool.abstract(n, sh), self.pool.abstract_slots(n, sh), table)
            self.programs.warm((mesh, n), args, filtered=filtered, extend=extend)
        return self

    def time_bucket_call(self, kind: str, length: int, weights) -> float:
        """Seconds of ONE full prefill (``kind="prefill"``: prefill_batch prompts) or
        extend call (``"extend"``: extend_batch requests) padded to ``length`` rows, on
        the idle engine, through the engine's own call path (the first one of a bucket
        compiles its program; PAT's profiler times the later ones). The rows it writes
        belong to no request and are masked or overwritten before anything reads them;
        nothing is counted in ``stats()``."""
        c = self.config
        if kind not in ("prefill", "extend"):
            raise EngineError(f"time_bucket_call: kind={kind!r} must be 'prefill' or 'extend'")
        limit = c.prompt_len if kind == "prefill" else c.response_len
        if length not in length_buckets(limit):
            raise EngineError(
                f"time_bucket_call: length={length!r} must be one of {length_buckets(limit)} "
                f"(the {kind} buckets)"
            )
        if not self.scheduler.idle():
            raise EngineError(
                "time_bucket_call: the engine holds requests; call it on an idle engine"
            )
        saved = self._stats
        self._stats = StatsRecorder()
        try:
            t0 = time.perf_counter()
            if kind == "prefill":
                self._prefill(weights, self.scheduler.placeholder_prefill(length), length)
            else:
                self._extend(weights, self.scheduler.placeholder_extend(length), length)
            jax.block_until_ready(self.pool.arrays)
            return time.perf_counter() - t0
        finally:
            self._stats = saved

    # ------------------------------------------------------------ PAT switching

    def mesh_for(self, dp: int, tp: int) -> Mesh:
        """The ('dp', 'tp') mesh of shape (dp, tp) over the engine's devices (in the
        construction mesh's order, so equal shapes give equal meshes: one program cache)."""
        return mesh_for(self._base_mesh, dp, tp)

    def switch_targets(self) -> list[tuple[int, int]]:
        """The (dp, tp) shapes ``reshard`` accepts: dp * tp = the construction mesh's
        device count and tp dividing num_kv_heads (plus the construction shape)."""
        return switch_targets(self._base_mesh, self.cfg.num_kv_heads)

    def view(self) -> EngineView:
        """What a switch controller reads between decode calls (a snapshot)."""
        sched = self.scheduler
        running = sched.running()
        shape = (1, 1) if self.mesh is None else tuple(int(x) for x in self.mesh.devices.shape)
        return EngineView(
            dp=shape[0],
            tp=shape[1],
            slots=self.slots,
            active=len(running),
            live=len(sched.live()),
            waiting=sched.waiting(),
            prompt_tokens=np.asarray([r.group.prompt.size for r in running], np.int64),
            response_tokens=np.asarray([r.length for r in running], np.int64),
            remaining=np.asarray([sched.mirror["budget"][r.slot] for r in running], np.int64),
            forced=np.asarray([r.forced for r in running], bool),
            decode_calls=tuple(self._stats.calls),
            resident_prompt_tokens=np.asarray([g.prompt.size for g in sched.resident()], np.int64),
            live_response_tokens=np.asarray([r.length for r in sched.live()], np.int64),
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
        """Switches the engine to ``mesh`` and ``slots`` slots between decode calls (PAT;
        ``dtarl.rollout.reshard``).

        mesh: a ('dp', 'tp') Mesh over the engine's devices or a (dp, tp) pair (see
          ``switch_targets``). slots: the new slot count (default: the smallest dp * 2^k
          holding every live request, capped at config.slots; config.slots while a request
          waits); below config.slots only when no request waits. mode: "migrate" (pack
          only the valid K/V rows and move them, layer by layer) or "recompute" (rebuild
          every resident prompt by prefill and every live request's rows by extend from
          its tokens). A switch to the current (mesh, slots) does nothing.
          donate: also free the caller's weight buffers as they move (weights a
          previous ``reshard`` returned are the engine's own and are always freed).

        Returns (weights on the new mesh, info); info: mode, dp, tp, slots, live,
        weights_s, kv_s, compile_s (the target's decode program, and the prefill/extend
        or row pack/unpack programs the K/V stage runs; excluded from kv_s; ~0 cached),
        seconds, compiled (programs traced), moved_weight_bytes, moved_kv_bytes,
        live_kv_bytes, peak_extra_bytes, weights_peak_extra_bytes, kv_peak_extra_bytes
        (summed over the addressable shards of every device; ``dtarl.rollout.reshard``).
        """
        t_start = time.perf_counter()
        sched = self.scheduler
        mesh = target_mesh(self._base_mesh, mesh, self.cfg.num_kv_heads)
        if mode not in ("migrate", "recompute"):
            raise EngineError(f"mode={mode!r} must be 'migrate' or 'recompute'")
        live = sched.live()
        dp, tp = (int(x) for x in mesh.devices.shape)
        cap, waiting = self.config.slots, sched.waiting()
        n = switch_slots(slots, live=len(live), waiting=waiting, dp=dp, cap=cap)
        if mesh == self.mesh and n == self.slots:  # nothing to do
            info = dict.fromkeys(INFO_KEYS, 0)
            info.update(mode=mode, dp=dp, tp=tp, slots=n, live=len(live), seconds=0.0)
            info.update(live_kv_bytes=self.kv_bytes(), weights_s=0.0, kv_s=0.0, compile_s=0.0)
            self._stats.switches.append(info)
            return weights, info
        traces = self.trace_count
        t0 = time.perf_counter()
        new_weights, w_moved, w_peak = self.resharder.move_weights(weights, mesh, donate)
        weights_s = time.perf_counter() - t0
        old_at = (self.mesh, self.slots)
        live_kv = self.kv_bytes()
        src = sched.reshape(n, dp)  # the host mirror, remapped
        self.mesh = mesh
        # Programs of the target (compiled now unless cached): decode, and for recompute
        # the prefill and extend buckets it runs.
        t0 = time.perf_counter()
        calls = self._recompute_calls() if mode == "recompute" else []
        self._compile_target(new_weights, calls)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if mode == "migrate":
            self.pool.arrays, kv_moved, kv_peak, rows_compile_s = self.resharder.migrate(
                self.pool.arrays, old_at, (mesh, n), src, sched
            )
        else:
            kv_moved, kv_peak, rows_compile_s = 0, self._recompute(new_weights, calls), 0.0
        kv_s = time.perf_counter() - t0 - rows_compile_s
        compile_s += rows_compile_s
        self.resharder.own(new_weights)
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
        self._stats.switches.append(info)
        return new_weights, info

    def move_idle(self, mesh: Mesh | tuple[int, int], weights, *, slots: int | None = None):
        """Moves an idle engine (nothing waiting, running or held) to ``mesh`` and
        ``slots`` slots (default config.slots) by a recompute ``reshard``: the weights
        move (the moved copy is dropped: ``place`` the weights for the new mesh) and the
        empty pool is re-created. Returns the switch's info, or None when the engine is
        already there."""
        target = target_mesh(self._base_mesh, mesh, self.cfg.num_kv_heads)
        n = self.config.slots if slots is None else slots
        if self.pending() or not self.scheduler.idle():
            raise EngineError("move_idle: the engine holds requests; finish or release them")
        if target.devices.shape == self.mesh.devices.shape and n == self.slots:
            return None
        _, info = self.reshard(target, weights, slots=n, mode="recompute")
        return info

    def _compile_target(self, weights, calls) -> None:
        placement = self._placement()
        pool = self.pool.abstract(self.slots, placement)
        if self.scheduler.mirror["active"].any():
            slots = slot_arrays(self.scheduler.mirror, placement)
            fn = self._program(ProgramKind.DECODE, **self._decode_key())
            fn.lower(weights, pool, slots, self._table_device()).compile()
        at = (self.mesh, self.slots)
        for t in sorted({t for kind, t, *_ in calls if kind == "prefill"}):
            self.programs.compile_prefill(at, t, weights, pool)
        for t in sorted({t for kind, t, *_ in calls if kind == "extend"}):
            self.programs.compile_extend(at, t, weights, pool)

    def _recompute_calls(self) -> list[tuple[str, int, int, int]]:
        c, sched = self.config, self.scheduler
        return recompute_calls(
            [g.prompt.size for g in sched.resident()],
            [r.length for r in sched.live()],
            prefill_batch=c.prefill_batch,
            extend_batch=c.extend_batch,
            prompt_len=c.prompt_len,
            response_len=c.response_len,
        )

    def _recompute(self, weights, calls) -> int:
        """Frees the old pool, then rebuilds the K/V on the new mesh: each resident
        prompt by prefill, each live request's response rows by extend from its tokens
        (row 0 the prompt's last token, row j > 0 ``context[j - 1]``). Returns the peak
        extra bytes."""
        sched = self.scheduler
        peak = self.resharder.fresh_pool((self.mesh, self.slots))
        resident = sched.resident()
        items = [
            (
                r.slot,
                r.group.pslot,
                0,
                np.asarray([r.group.prompt[-1]] + r.context[: r.length - 1], np.int32),
            )
            for r in sched.live()
            if r.length
        ]
        for kind, t, lo, hi in calls:
            if kind == "prefill":
                self._prefill(weights, resident[lo:hi], t)
            else:
                self._extend(weights, items[lo:hi], t)
        jax.block_until_ready(self.pool.arrays)
        return peak

    def reset(self) -> None:
        """Back to the construction mesh and config.slots slots between generations; the
        pool is re-created empty (nothing is moved), so no request may hold a slot or a
        prompt row (release held requests first, or use ``reshard``)."""
        base, n = self._base_mesh, self.config.slots
        if base is None or (self.mesh == base and self.slots == n):
            return
        sched = self.scheduler
        if not sched.idle():
            held = len(sched.live())
            rows = sum(g is not None for g in sched.pslot_group)
            raise EngineError(
                f"reset: {held} slots and {rows} prompt rows are in use; release or finish "
                "them first, or reshard(mesh, weights, slots=config.slots) to move them"
            )
        self.pool.free()
        self.mesh = base
        sched.clear_slots(n)
        self.pool.arrays = self.pool.zeros(n, self._placement())

    # ------------------------------------------------------------ stats

    def stats(self, *, reset: bool = False) -> EngineStats:
        """The counters since the last ``stats(reset=True)`` (``EngineStats``)."""
        out = self._stats.snapshot(
            slots=self.config.slots,
            allocated_kv_bytes=self.allocated_kv_bytes(),
            trace_count=self.trace_count,
            callback_errors=len(self.errors),
        )
        if reset:
            self._stats.reset()
        return out


__all__ = [
    "ContinuousConfig",
    "EngineError",
    "EngineStats",
    "EngineView",
    "FinishReason",
    "Group",
    "Request",
    "RolloutEngine",
    "Status",
    "complete",
    "decode_windows",
    "fold_seed",
    "len_bucket",
    "merged_slots",
    "recompute_calls",
    "seed_key",
]
