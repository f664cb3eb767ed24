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
    RolloutEngine,
    fold_seed,
    seed_key,
)
from dtarl.rollout.protocol import Feature
from dtarl.rollout.sampler import SampleResult, SamplingParams
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
    """

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

    features = frozenset(Feature)  # ``Rollout.features``: switch, share, candidates, ...

    def reserve(self, *, prompts: int, rows: int, prompt_len: int, response: int) -> None:
        """``Rollout.reserve``: nothing (the engine is sized by its ``ContinuousConfig``;
        ``ensure`` grows it)."""

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
    ) -> SampleResult:
        """Samples ``num_samples`` responses per prompt. ``on_call`` is passed to
        ``RolloutEngine.run`` (a PAT controller); the engine is back on its construction
        mesh and slot count when this returns."""
        t0 = time.perf_counter()
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
        total = sum(counts)
        for name, vals in (("max_new_tokens", max_new_tokens), ("forced_lengths", forced_lengths)):
            if vals is not None and np.asarray(vals).reshape(-1).shape != (total,):
                raise EngineError(f"{name}: need {total} ints (one per sample), got {len(vals)}")
        longest = self.max_new_tokens if max_new_tokens is None else max(max_new_tokens)
        if forced_lengths is not None:
            longest = max(forced_lengths)
        self.ensure(
            prompt_len=max(len(p) for p in prompts),
            group_size=max(counts),
            response_len=int(longest),
        )
        placed = self.engine.place(weights)
        if on_call is not None:  # copies place() made are ours: a switch may free them
            self.engine.adopt(placed, weights)
        weights = placed
        base = seed_key(seed)
        groups, at = [], 0
        for i, prompt in enumerate(prompts):
            n = counts[i]
            mx = (
                self.max_new_tokens if max_new_tokens is None else list(max_new_tokens[at : at + n])
            )
            fl = None if forced_lengths is None else list(forced_lengths[at : at + n])
            groups.append(
                self.engine.submit(
                    prompt,
                    n=n,
                    max_new_tokens=mx,
                    forced_lengths=fl,
                    seed=fold_seed(base, index_offset + i),
                    **self.sampling,
                )
            )
            at += n
        self.engine.stats(reset=True)
        try:
            self.engine.run(weights, on_call=on_call)
        finally:
            if not self.engine.pending():
                self.engine.reset()
        reqs = [r for g in groups for r in g.requests]
        res = [r.result() for r in reqs]
        st = self.engine.stats()
        stats = dict(
            seconds=time.perf_counter() - t0,  # wall clock, submits included
            generated_tokens=st["generated_tokens"],
            tokens_per_second=st["tokens_per_second"],
            decode_steps=st["decode_steps"],
            rows=self.engine.config.slots,
            trace_count=self.trace_count,
            slot_utilisation=st["slot_utilisation"],
            peak_kv_bytes=st["peak_kv_bytes"],
            switches=list(st["switches"]),
        )
        return SampleResult(
            tokens=tuple(t for t, _ in res),
            logprobs=tuple(lp for _, lp in res),
            raw_logprobs=tuple(lp for _, lp in res),
            finish=np.asarray([int(r.finish) for r in reqs], np.int64),
            prompt_index=np.repeat(np.arange(q), counts),
            stats=stats,
        )


__all__ = ["ContinuousSampler"]
