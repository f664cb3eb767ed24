"""Token-level streaming: forward-only scoring while generation goes on (DARTS §4.3, App. E).

A ``StreamingScorer`` keeps, for another model's weights (the reference policy,
or the PPO critic), the same prompt-shared K/V layout as the rollout engine: each
prompt's K/V once per group, and per trajectory only its own tokens' K/V. As a
trajectory produces tokens (the engine's ``on_tokens`` callback, every
``stream_chunk`` tokens), they are queued with ``add``; ``flush`` runs the queued
chunks of many trajectories together through one incremental forward (only the
new tokens, attending to the prompt and the trajectory's history). Tool tokens of
a multi-turn trajectory are added the same way (they are context; their scores
are computed and later masked). What a token's score is depends on ``kind``:

- ``ScoreKind.LOGPROBS`` (the reference policy; weights = the decoder's params):
  log softmax(logits / T)[token] (``kernels.extend_score``).
- ``ScoreKind.VALUES`` (the critic; weights = ``ValueModel.params``, ``{"trunk":
  decoder params, "head": {"w": [E], "b": []}}``): V[t] = head(hidden at t - 1),
  the ``dtarl.rl.value`` convention (``kernels.extend_values``). The prompt's
  values are never actions, so they are not streamed.

The policy itself is not streamed: the sampler already returns its logprobs at
the rollout weights, and ``algo.recompute_old_logprobs`` exists to replace those
with the *training engine's* numbers (its kernels and dtype); an incremental
forward over a prompt-shared K/V is the sampler's computation again, so a
streamed recompute would give the sampler's numbers back and fix nothing (and the
recompute of the first minibatch costs no pass: it is its update's own forward).

Shapes are fixed (``rows`` trajectories x ``chunk`` tokens per call, prefill
lengths bucketed as in the engine), so after warm-up nothing compiles. With
``device`` the scorer's K/V pool and its weights (``place``) live on that device,
so its calls run there, beside the rollout's decode on another device (a separate
device slice of one device; ``rollout.streaming.device``). There ``flush`` does
not wait for its calls: their results are read at the next ``flush``, ``result``
or ``close``, so the device scores while the host runs the next decode call. The
result equals the dense forward over the whole sequence (the ``Scorer``,
``ValueModel.values``) to fp32 rounding.

    scorer.open(key, group, prompt)    # a trajectory of group ``group``
    scorer.add(key, tokens)            # as they are generated (or appended)
    scorer.flush(weights)              # score what is queued (interleave with decode)
    scorer.result(key) -> [n] scores of every added token; scorer.close(key)
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from dtarl.model.decoder import Decoder
from dtarl.rollout import kernels as K
from dtarl.rollout.engine import ContinuousConfig, EngineError
from dtarl.tree.plan import bucket


class ScoreKind(enum.Enum):
    """What a ``StreamingScorer`` returns per token (see the module docstring)."""

    LOGPROBS = "logprobs"
    VALUES = "values"


@dataclasses.dataclass(eq=False)
class _Traj:
    group: Hashable
    slot: int
    last: int  # the token whose K/V is not in the cache yet (fed next)
    length: int = 0  # response rows written
    pending: list[int] = dataclasses.field(default_factory=list)
    scores: list[float] = dataclasses.field(default_factory=list)


class StreamingScorer:
    """Incremental forward-only scores of streamed tokens (see the module docstring).

    config: slots = trajectories open at once, groups = prompts resident at once,
    prompt_len / response_len as the rollout engine's; ``chunk`` tokens per
    trajectory per call and ``rows`` trajectories per call; ``kind``: logprobs
    (``model``'s weights) or values (a ``ValueModel``'s params on ``model``'s graph).
    """

    def __init__(
        self,
        model: Decoder,
        config: ContinuousConfig,
        *,
        chunk: int = 16,
        rows: int = 8,
        temperature: float = 1.0,
        pad_id: int = 0,
        kind: ScoreKind = ScoreKind.LOGPROBS,
        device: jax.Device | None = None,
    ):
        if chunk < 1 or rows < 1:
            raise EngineError(f"chunk={chunk} and rows={rows} must be >= 1")
        self.kind, self.device = ScoreKind(kind), device
        self.config, self.cfg = config, model.cfg
        self.chunk, self.rows = int(chunk), min(int(rows), config.slots)
        self.temperature = 1.0 if temperature <= 0 else float(temperature)
        self.pad_id = int(pad_id)
        self.graphdef, _ = nnx.split(model, nnx.Param)
        q, n = config.prompt_slots, config.slots
        self._pool = K.Pool.zeros(
            self.cfg,
            groups=config.prompt_slots,
            prompt_len=config.prompt_len,
            slots=config.slots,
            response_len=config.response_len,
        )
        if device is not None:
            self._pool = jax.device_put(self._pool, device)
        self._free_slots = list(range(n))
        self._free_rows = list(range(q))
        self._groups: dict[Hashable, list] = {}  # group -> [prompt row, open trajectories]
        self._prefill: list[tuple[int, np.ndarray]] = []
        self._open: dict[Hashable, _Traj] = {}
        # Calls not read back yet (own device only): (scores [rows, chunk], [(traj, row, n)]).
        self._inflight: list[tuple[Any, list[tuple[_Traj, int, int]]]] = []
        self._fns: dict[tuple, Any] = {}
        self.trace_count = 0
        self.stats = dict(scored_tokens=0, calls=0, seconds=0.0)

    def _fn(self, kind: str, t: int):
        if (kind, t) not in self._fns:
            if kind == "prefill":

                def fn(weights, pool, qslot, tokens, lens):
                    self.trace_count += 1
                    model = nnx.merge(self.graphdef, self._trunk(weights))
                    return K.prefill(model, pool, qslot, tokens, lens)

            elif self.kind is ScoreKind.VALUES:

                def fn(weights, pool, slot, group, length, tokens, count, targets):
                    self.trace_count += 1
                    model = nnx.merge(self.graphdef, weights["trunk"])
                    head = weights["head"]
                    return K.extend_values(
                        model, pool, slot, group, length, tokens, count, head["w"], head["b"]
                    )

            else:

                def fn(weights, pool, slot, group, length, tokens, count, targets):
                    self.trace_count += 1
                    model = nnx.merge(self.graphdef, weights)
                    return K.extend_score(
                        model, pool, slot, group, length, tokens, count, targets, self.temperature
                    )

            self._fns[(kind, t)] = jax.jit(fn, donate_argnums=(1,))
        return self._fns[(kind, t)]

    def place(self, weights):
        """``weights`` on the scorer's device (as they are without one): pass the placed
        weights to ``flush`` / ``close``, placed once, not at every call."""
        return weights if self.device is None else jax.device_put(weights, self.device)

    def _trunk(self, weights):
        return weights["trunk"] if self.kind is ScoreKind.VALUES else weights

    # ------------------------------------------------------------ API

    def open(self, key: Hashable, group: Hashable, prompt: Sequence[int]) -> None:
        """Starts a trajectory of ``group`` (whose prompt is stored once for all of them)."""
        if key in self._open:
            raise EngineError(f"streaming scorer: trajectory {key!r} is already open")
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if prompt.size == 0 or prompt.size > self.config.prompt_len:
            raise EngineError(
                f"streaming scorer: prompt of {prompt.size} tokens; "
                f"need 1..{self.config.prompt_len}"
            )
        if not self._free_slots:
            raise EngineError(f"streaming scorer: all {self.config.slots} slots are open")
        if group not in self._groups:
            if not self._free_rows:
                raise EngineError(
                    f"streaming scorer: all {self.config.prompt_slots} prompt rows are in use"
                )
            row = self._free_rows.pop(0)
            self._groups[group] = [row, 0]
            self._prefill.append((row, prompt))
        self._groups[group][1] += 1
        self._open[key] = _Traj(group=group, slot=self._free_slots.pop(0), last=int(prompt[-1]))

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        t = self._open[key]
        if t.length + len(t.pending) + len(tokens) > self.config.response_len:
            raise EngineError(
                f"streaming scorer: trajectory {key!r} exceeds response_len="
                f"{self.config.response_len}"
            )
        t.pending.extend(int(x) for x in tokens)

    @property
    def lag(self) -> int:
        """Tokens added but not scored yet."""
        return sum(len(t.pending) for t in self._open.values())

    def flush(self, weights, *, max_calls: int | None = None) -> int:
        """Scores queued tokens (at most ``max_calls`` calls); returns the calls run.
        On the scorer's own device the calls are not waited for (module docstring)."""
        t0 = time.perf_counter()
        self._collect()
        self._run_prefill(weights)
        calls = 0
        while max_calls is None or calls < max_calls:
            ready = [t for t in self._open.values() if t.pending]
            if not ready:
                break
            ready.sort(key=lambda t: -len(t.pending))  # the longest queues first
            self._score(weights, ready[: self.rows])
            calls += 1
        self.stats["seconds"] += time.perf_counter() - t0
        return calls

    def result(self, key: Hashable) -> np.ndarray:
        """Scores of every token added to ``key`` so far (flush first)."""
        t = self._open[key]
        if t.pending:
            raise EngineError(f"streaming scorer: {key!r} has {len(t.pending)} unscored tokens")
        self._collect()
        return np.asarray(t.scores, np.float32)

    def is_open(self, key: Hashable) -> bool:
        return key in self._open

    def pending(self, key: Hashable) -> int:
        """Tokens of ``key`` added but not scored yet."""
        return len(self._open[key].pending)

    def close(self, key: Hashable, weights=None) -> np.ndarray:
        """Frees the trajectory's slot (and its prompt row after the group's last one)
        and returns its scores; with ``weights`` its queued tokens are scored first,
        without them they are dropped."""
        if weights is not None and self._open[key].pending:
            self._run_prefill(weights)
            while self._open[key].pending:
                self._score(weights, [self._open[key]])
        self._collect()
        t = self._open.pop(key)
        self._free_slots.append(t.slot)
        g = self._groups[t.group]
        g[1] -= 1
        if g[1] == 0:
            self._free_rows.append(g[0])
            del self._groups[t.group]
        return np.asarray(t.scores, np.float32)

    def warmup(self, weights) -> StreamingScorer:
        c = self.config
        for t in _buckets(c.prompt_len):
            self._fn("prefill", t).lower(
                weights,
                self._pool,
                np.zeros(c.prefill_batch, np.int32),
                np.zeros((c.prefill_batch, t), np.int32),
                np.zeros(c.prefill_batch, np.int32),
            ).compile()
        z = np.zeros(self.rows, np.int32)
        zz = np.zeros((self.rows, self.chunk), np.int32)
        self._fn("score", self.chunk).lower(weights, self._pool, z, z, z, zz, z, zz).compile()
        return self

    # ------------------------------------------------------------ calls

    def _run_prefill(self, weights):
        c = self.config
        while self._prefill:
            batch, self._prefill = (
                self._prefill[: c.prefill_batch],
                self._prefill[c.prefill_batch :],
            )
            t = min(bucket(max(p.size - 1 for _, p in batch), 16), c.prompt_len)
            qs = np.full(c.prefill_batch, c.prompt_slots, np.int32)
            toks = np.full((c.prefill_batch, t), self.pad_id, np.int32)
            lens = np.zeros(c.prefill_batch, np.int32)
            for j, (row, p) in enumerate(batch):
                qs[j], lens[j] = row, p.size - 1
                toks[j, : p.size - 1] = p[:-1]
            self._pool = self._fn("prefill", t)(weights, self._pool, qs, toks, lens)

    def _score(self, weights, trajs: list[_Traj]):
        e, t = self.rows, self.chunk
        slot = np.full(e, self.config.slots, np.int32)
        group = np.zeros(e, np.int32)
        length = np.zeros(e, np.int32)
        feed = np.full((e, t), self.pad_id, np.int32)
        target = np.zeros((e, t), np.int32)
        count = np.zeros(e, np.int32)
        for j, tr in enumerate(trajs):
            take = tr.pending[:t]
            slot[j], group[j], length[j], count[j] = (
                tr.slot,
                self._groups[tr.group][0],
                tr.length,
                len(take),
            )
            feed[j, : len(take)] = [tr.last] + take[:-1]
            target[j, : len(take)] = take
        self._pool, lp = self._fn("score", t)(
            weights, self._pool, slot, group, length, feed, count, target
        )
        parts = []
        for j, tr in enumerate(trajs):
            n = int(count[j])
            parts.append((tr, j, n))
            tr.last = tr.pending[n - 1]
            tr.length += n
            del tr.pending[:n]
            self.stats["scored_tokens"] += n
        self.stats["calls"] += 1
        self._inflight.append((lp, parts))
        if self.device is None:  # the rollout's device: nothing to overlap, read it now
            self._collect()

    def _collect(self):
        """Reads back the calls in flight, in call order (a trajectory's scores in order)."""
        for lp, parts in self._inflight:
            lp = np.asarray(lp)
            for tr, j, n in parts:
                tr.scores.extend(lp[j, :n].tolist())
        self._inflight = []


class StreamingScorers:
    """One ``StreamingScorer`` per engine shape (the rollout engine may grow), built on
    first use and kept (its programs compile once; with ``warmup``, all of them when
    it is built, so that a longer prompt later does not compile mid-rollout)."""

    def __init__(
        self,
        model: Decoder,
        *,
        chunk: int,
        temperature: float = 1.0,
        pad_id: int = 0,
        kind: ScoreKind = ScoreKind.LOGPROBS,
        warmup: bool = False,
        device: jax.Device | None = None,
    ):
        self.model, self.chunk, self.temperature, self.pad_id = model, chunk, temperature, pad_id
        self.kind, self.warmup, self.device = ScoreKind(kind), warmup, device
        self._by_config: dict[ContinuousConfig, StreamingScorer] = {}

    def get(self, config: ContinuousConfig, weights=None) -> StreamingScorer:
        """The scorer of ``config`` (``weights``: what a new one warms up with)."""
        if config not in self._by_config:
            sc = self._by_config[config] = StreamingScorer(
                self.model,
                config,
                chunk=self.chunk,
                rows=max(1, config.slots // 2),
                temperature=self.temperature,
                pad_id=self.pad_id,
                kind=self.kind,
                device=self.device,
            )
            if self.warmup and weights is not None:
                sc.warmup(sc.place(weights))
        return self._by_config[config]


@dataclasses.dataclass(frozen=True)
class Stream:
    """One forward-only model streamed during a rollout: its scorers and the weights
    they score with (the reference policy's params, or ``ValueModel.params``)."""

    scorers: StreamingScorers
    weights: Any

    @property
    def kind(self) -> ScoreKind:
        return self.scorers.kind


def _buckets(limit: int) -> list[int]:
    sizes, b = [], 16
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [limit]


__all__ = ["ScoreKind", "Stream", "StreamingScorer", "StreamingScorers"]
