"""``ContinuousSampler``: the ``Rollout`` protocol on a ``RolloutEngine`` (the trainer's
rollout: one group per prompt, continuous batching, tool turns extended in place)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dtarl.model.decoder import Decoder
from dtarl.rollout.engine import (
    ContinuousConfig,
    EngineError,
    Request,
    RolloutEngine,
    Status,
    complete,
    fold_seed,
    seed_key,
)
from dtarl.rollout.protocol import Feature, TurnFn
from dtarl.rollout.sampler import FinishReason, SampleResult, SamplingParams
from dtarl.rollout.stream import ScoreKind, Stream
from dtarl.tree.plan import bucket


class ContinuousSampler:
    """The ``Sampler.generate`` interface on a ``RolloutEngine`` (the trainer's rollout).

    ``generate(weights, prompts, num_samples=G, seed=...)`` submits one group per
    prompt (member j of prompt i gets key ``fold_in(fold_in(seed, i), j)``; with
    ``index_offset=k`` prompt i is keyed as prompt k + i, so a share of a larger
    batch samples as it does there), runs the engine and returns a ``SampleResult``
    whose ``raw_logprobs`` are the training policy's (logits / T). Top-k/top-p only
    shape the draws.

    A prompt longer than the engine's ``prompt_len`` or a group larger than its
    ``group_size`` rebuilds the engine with the next power-of-two size (new
    programs compile once, like the static sampler's growing buckets; a warning
    says so), so a trainer never fails on one long prompt.

    It declares every ``Feature`` of the ``Rollout`` protocol: ``on_call`` (PAT),
    ``index_offset``, ``early_stop`` (DARTS), ``stream`` (streamed scoring) and
    ``on_turn`` (tool turns extended in place: nothing is prefilled again).
    """

    features: frozenset[Feature] = frozenset(Feature)

    def __init__(
        self,
        model: Decoder,
        config: ContinuousConfig,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_ids: Sequence[int] = (),
        stop_sequences: Sequence[Sequence[int]] = (),
        max_new_tokens: int = 64,
        pad_id: int = 0,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.model, self.pad_id, self.mesh = model, pad_id, mesh
        self._old_traces = 0
        self.engine = RolloutEngine(model, config, pad_id=pad_id, mesh=mesh)
        self.sampling = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_ids=tuple(stop_ids),
            stop_sequences=tuple(tuple(s) for s in stop_sequences),
        )
        self.max_new_tokens = int(max_new_tokens)

    @property
    def trace_count(self) -> int:
        return self._old_traces + self.engine.trace_count

    @property
    def params(self) -> SamplingParams:
        """The sampling settings, as the static sampler's ``SamplingParams``."""
        sp = self.sampling
        return SamplingParams(
            temperature=sp["temperature"],
            top_p=sp["top_p"],
            top_k=sp["top_k"],
            stop_tokens=sp["stop_ids"],
            stop_sequences=sp["stop_sequences"],
            max_new_tokens=self.max_new_tokens,
        )

    def warmup(self, weights, *, extend: bool = False, targets: Sequence[tuple] = ()) -> None:
        """Compiles every program ``generate`` can need with these sampling settings
        (each decode window, each prefill bucket and, with ``extend``, each extend
        bucket; also on the (dp, tp, slots) switch ``targets``), so that no later call
        compiles unless ``ensure`` rebuilds the engine."""
        sp = self.sampling
        filtered = bool(sp["temperature"] > 0 and (sp["top_k"] > 0 or sp["top_p"] < 1))
        self.engine.warmup(
            self.engine.place(weights), filtered=filtered, extend=extend, targets=targets
        )

    def reserve(
        self, *, prompts: int = 1, rows: int = 1, prompt_len: int = 8, response: int = 8
    ) -> None:
        """Checks the arguments (ints >= 1) and grows the engine only where ``generate``
        would: a turn of ``response`` tokens that its ``response_len`` rows cannot
        hold. Nothing else: the engine was sized at construction (``make_samplers``:
        prompt rows, slots, every turn plus tool tokens in ``response_len``), more
        ``prompts`` or ``rows`` than it holds wait in its queue, and ``prompt_len`` (the
        static sampler's longest re-prefilled history) is never prefilled here: a tool
        turn is appended to the sample's own K/V. A first-turn prompt longer than the
        engine's ``prompt_len`` still rebuilds it at that call (``ensure``)."""
        for name, value in (
            ("prompts", prompts),
            ("rows", rows),
            ("prompt_len", prompt_len),
            ("response", response),
        ):
            if not isinstance(value, int | np.integer) or value < 1:
                raise EngineError(f"reserve: {name}={value!r} must be an int >= 1")
        self.ensure(prompt_len=1, group_size=1, response_len=int(response))

    def ensure(self, *, prompt_len: int, group_size: int, response_len: int = 0):
        """The engine, rebuilt larger if a prompt, a group or a response does not fit it."""
        c = self.engine.config
        if prompt_len <= c.prompt_len and group_size <= c.group_size:
            if response_len <= c.response_len:
                return self.engine
        new = dataclasses.replace(
            c,
            prompt_len=max(c.prompt_len, bucket(prompt_len)),
            group_size=max(c.group_size, bucket(group_size)),
            response_len=max(c.response_len, bucket(response_len)),
        )
        warnings.warn(
            f"rollout engine: prompt {prompt_len} tokens, group {group_size}, response "
            f"{response_len} tokens do not fit prompt_len={c.prompt_len}, group_size="
            f"{c.group_size}, response_len={c.response_len}; rebuilding with prompt_len="
            f"{new.prompt_len}, group_size={new.group_size}, response_len={new.response_len} "
            "(compiles once)",
            RuntimeWarning,
            stacklevel=3,
        )
        self._old_traces += self.engine.trace_count
        self.engine = RolloutEngine(self.model, new, pad_id=self.pad_id, mesh=self.mesh)
        return self.engine

    def generate(
        self,
        weights,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int | Sequence[int] = 1,
        seed: int | jax.Array = 0,
        max_new_tokens: Sequence[int] | None = None,
        forced_lengths: Sequence[int] | None = None,
        index_offset: int = 0,
        on_call: Callable[[RolloutEngine, Any], Any] | None = None,
        early_stop: Sequence[int] | None = None,
        stream: Sequence[Stream] = (),
        on_turn: TurnFn | None = None,
    ) -> SampleResult:
        """Samples ``num_samples`` responses per prompt (the arguments: ``Rollout``).
        ``on_call`` is passed to ``RolloutEngine.run`` (a PAT controller; a non-None
        result replaces the weights for later calls); the engine is back on its
        construction mesh and slot count when this returns. Streams score between
        decode calls; ``stream_lag_tokens`` are the tokens some streamed model had not
        scored when the last decode call returned (scored in ``stream_tail_seconds``),
        ``stream_seconds`` the host's time in every scorer call."""
        t0 = time.perf_counter()
        counts = self._counts(prompts, num_samples, index_offset, early_stop)
        total = sum(counts)
        for name, vals in (("max_new_tokens", max_new_tokens), ("forced_lengths", forced_lengths)):
            if vals is not None and np.asarray(vals).reshape(-1).shape != (total,):
                raise EngineError(f"{name}: need {total} ints (one per sample), got {len(vals)}")
        longest = self.max_new_tokens if max_new_tokens is None else max(max_new_tokens)
        if forced_lengths is not None:
            longest = max(forced_lengths)
        eng = self.ensure(
            prompt_len=max(len(p) for p in prompts),
            group_size=max(counts),
            response_len=int(longest),
        )
        placed = eng.place(weights)
        if on_call is not None:  # copies place() made are ours: a switch may free them
            eng.adopt(placed, weights)
        weights = placed
        streams = _Streams(eng, stream, [np.asarray(p, np.int32).reshape(-1) for p in prompts])
        groups = self._submit(
            prompts,
            counts,
            seed_key(seed),
            max_new_tokens=max_new_tokens,
            forced_lengths=forced_lengths,
            index_offset=index_offset,
            early_stop=early_stop,
            hold=on_turn is not None,
            on_tokens=streams.on_tokens if stream else None,
        )
        reqs = [r for g in groups for r in g.requests]
        row_of = {id(r): j for j, r in enumerate(reqs)}
        streams.rows(row_of, {id(r): i for i, g in enumerate(groups) for r in g.requests})
        rank = np.full(total, -1, np.int64)
        final: list[tuple[np.ndarray, np.ndarray, FinishReason] | None] = [None] * total

        def hook(engine, w):  # a switch re-places the weights: later calls take the new ones
            nonlocal weights
            new = on_call(engine, w)
            if new is not None:
                weights = new
            return new

        eng.stats(reset=True)
        try:
            finished = 0
            while eng.pending():
                done = eng.run(weights, max_calls=1, on_call=None if on_call is None else hook)
                streams.flush()
                for r in done:
                    row = row_of[id(r)]
                    rank[row], finished = finished, finished + 1
                    tk, lp = r.result()
                    finish = r.finish
                    if on_turn is not None:
                        ids = on_turn(row, tk, lp, finish)
                        if ids is not None and self._extend(r, ids, streams, row):
                            continue
                        if ids is not None:  # no room for another turn: ends truncated
                            finish = r.finish = FinishReason.LENGTH  # (not a final stop)
                        if r.status is not Status.RELEASED:
                            eng.release(r)
                    final[row] = (tk, lp, finish)
                    streams.close(row)
            stats = engine_stats(eng, seconds=time.perf_counter() - t0, traces=self.trace_count)
        finally:
            if not eng.pending() and (on_turn is None or all(f is not None for f in final)):
                eng.reset()
        stats.update(streams.stats())
        return SampleResult(
            tokens=tuple(f[0] for f in final),
            logprobs=tuple(f[1] for f in final),
            raw_logprobs=tuple(f[1] for f in final),
            finish=np.asarray([int(f[2]) for f in final], np.int64),
            prompt_index=np.repeat(np.arange(len(prompts)), counts),
            stats=stats,
            finish_rank=rank,
            streamed=streams.results(total),
        )

    def _submit(
        self,
        prompts,
        counts,
        base,
        *,
        max_new_tokens,
        forced_lengths,
        index_offset,
        early_stop,
        hold,
        on_tokens,
    ) -> list:
        """One engine group per prompt (prompt i keyed ``fold_seed(base, index_offset + i)``)."""
        groups, at = [], 0
        for i, prompt in enumerate(prompts):
            n = counts[i]
            mx = self.max_new_tokens
            if max_new_tokens is not None:
                mx = list(max_new_tokens[at : at + n])
            stop = 0 if early_stop is None else int(early_stop[i])
            groups.append(
                self.engine.submit(
                    prompt,
                    n=n,
                    max_new_tokens=mx,
                    forced_lengths=None if forced_lengths is None else forced_lengths[at : at + n],
                    seed=fold_seed(base, index_offset + i),
                    hold=hold,
                    until=complete(stop) if stop else None,
                    on_tokens=on_tokens,
                    **self.sampling,
                )
            )
            at += n
        return groups

    def _counts(self, prompts, num_samples, index_offset, early_stop) -> list[int]:
        """Samples per prompt, after checking ``generate``'s per-prompt arguments."""
        q = len(prompts)
        if q == 0:
            raise EngineError("prompts: empty (need at least one prompt)")
        if index_offset < 0:
            raise EngineError(f"index_offset: need an int >= 0, got {index_offset}")
        counts = (
            [int(num_samples)] * q if np.ndim(num_samples) == 0 else [int(c) for c in num_samples]
        )
        if len(counts) != q or min(counts) < 1:
            raise EngineError(f"num_samples: need an int >= 1 or {q} ints >= 1, got {num_samples}")
        if early_stop is not None and (len(early_stop) != q or min(early_stop) < 0):
            raise EngineError(f"early_stop: need {q} ints >= 0 (0: never), got {early_stop}")
        return counts

    def _extend(self, request: Request, ids, streams: _Streams, row: int) -> bool:
        """Continues ``request`` with the tool tokens ``ids`` appended, if its response
        rows hold them and one more token; False when they do not."""
        ids = np.asarray(ids, np.int32).reshape(-1)
        room = self.engine.config.response_len - request.length - ids.size
        if not ids.size or room < 1:
            return False
        self.engine.extend(request, ids, max_new_tokens=min(self.max_new_tokens, room))
        streams.add(row, ids)
        return True


def engine_stats(engine: RolloutEngine, *, seconds: float, traces: int) -> dict[str, Any]:
    """A generation's stats from ``engine.stats()`` (the one place that reads them):
    ``seconds`` (wall clock, submits included), ``engine_seconds`` and
    ``tokens_per_second`` (the engine's own time), ``decode_calls`` ((seconds, steps,
    tokens) per decode call: DARTS' cost model), ``rows`` (decode slots) and the rest."""
    st = engine.stats()
    return dict(
        seconds=seconds,
        engine_seconds=st.seconds,
        generated_tokens=st.generated_tokens,
        tokens_per_second=st.tokens_per_second,
        decode_steps=st.decode_steps,
        decode_calls=list(st.calls),
        rows=engine.config.slots,
        trace_count=traces,
        slot_utilisation=st.slot_utilisation,
        peak_kv_bytes=st.peak_kv_bytes,
        switches=list(st.switches),
    )


class _Streams:
    """The ``stream`` models of one ``generate``: a scorer per model on the engine's
    shape, a trajectory per sample opened at its first tokens, flushed once per decode
    call and closed (its lag scored) when the sample ends."""

    def __init__(self, engine: RolloutEngine, stream: Sequence[Stream], prompts):
        kinds = [s.kind for s in stream]
        if len(set(kinds)) != len(kinds):
            raise EngineError(f"stream: {[k.value for k in kinds]}; one of each kind at most")
        self.kinds, self.prompts = kinds, prompts
        self.scorers = []  # (scorer, its weights placed on its device)
        for s in stream:
            sc = s.scorers.get(engine.config, s.weights)
            self.scorers.append((sc, sc.place(s.weights)))
        self.scored: dict[ScoreKind, dict[int, np.ndarray]] = {k: {} for k in kinds}
        self.lag, self.tail, self.seconds = 0, 0.0, 0.0

    def rows(self, row_of: dict[int, int], group_of: dict[int, int]) -> None:
        self.row_of, self.group_of = row_of, group_of

    def on_tokens(self, req, toks, lps) -> None:
        row, group = self.row_of[id(req)], self.group_of[id(req)]
        for sc, _ in self.scorers:
            if not sc.is_open(row):
                sc.open(row, group, self.prompts[group])
            sc.add(row, toks)

    def add(self, row: int, ids: np.ndarray) -> None:
        for sc, _ in self.scorers:
            sc.add(row, ids)

    def flush(self) -> None:
        """One scorer call of each model (after a decode call); a new call's tail."""
        t0 = time.perf_counter()
        for sc, w in self.scorers:
            sc.flush(w, max_calls=1)
        self.seconds += time.perf_counter() - t0
        self.lag, self.tail = 0, 0.0

    def close(self, row: int) -> None:
        if not self.scorers or not self.scorers[0][0].is_open(row):
            return
        t0 = time.perf_counter()
        self.lag += max(sc.pending(row) for sc, _ in self.scorers)
        for (sc, w), kind in zip(self.scorers, self.kinds, strict=True):
            self.scored[kind][row] = sc.close(row, w)  # scores its lag, frees its slot
        self.tail += time.perf_counter() - t0
        self.seconds += time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        if not self.scorers:
            return {}
        return dict(
            stream_tokens=float(sum(s.size for s in self.scored[self.kinds[0]].values())),
            stream_lag_tokens=float(self.lag),
            stream_tail_seconds=self.tail,
            stream_seconds=self.seconds,
        )

    def results(self, n: int) -> dict[ScoreKind, tuple[np.ndarray, ...]]:
        """Per kind, every sample's scores (empty where it was cancelled before its
        first token: never opened)."""
        empty = np.zeros(0, np.float32)
        return {k: tuple(got.get(i, empty) for i in range(n)) for k, got in self.scored.items()}


__all__ = ["ContinuousSampler", "engine_stats"]
