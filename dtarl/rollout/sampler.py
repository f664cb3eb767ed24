"""A jitted KV-cache sampler for the NNX ``Decoder`` with prefix sharing.

Generation is split into three pure, jit-able stages over an explicit state
pytree, so a controller can stop the decode loop, inspect or move the state
(PAT: ``jax.device_put`` onto another mesh), cancel samples (DARTS early stop)
and continue::

    state = prefill(model, prompts_QxP, prompt_len_Q, prompt_of_B, keys_B, max_new_B, forced_B)
    state = decode(model, state, stop_at)       # lax.while_loop, resumable
    ... state = cancel(state, mask_B)            # DARTS: abort samples
    state = decode(model, state, stop_at + 64)   # continue from the same state

*Prefill* runs each distinct prompt once (``Q`` prompts) and broadcasts its K/V
to the rows of its ``G`` samples (compute is shared; the cache rows are copied,
because the decoder reads one contiguous prefix per row). It then samples every
row's first token from the prompt's last logits. *Decode* feeds each row's last
token at position ``prompt_len + n - 1``, writes its K/V to that cache row and
samples token ``n``, until every row is done or ``step == stop_at``.

Sampling is batch-independent and resumable: token ``n`` of row ``b`` uses the
key ``fold_in(keys[b], n)``, so the output of a row depends only on its prompt,
its key and the parameters, not on the batch it runs in, nor on where the loop
was paused or on which mesh it continued.

Finished rows keep running through the batched forward (their results are
discarded) until the whole batch is done: the loop exits as soon as every row
is done. A compacting controller (DARTS) can shrink the batch between calls.

Letters: Q prompts, B sample rows, P prompt bucket, R response bucket,
S = P + R cache rows, V vocab, L layers, K kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl.batch import token_ids
from dtarl.model.decoder import Decoder, KVCache
from dtarl.tree.plan import bucket


class SamplerError(ValueError):
    """Bad sampler input; the message names the argument and the accepted range."""


class FinishReason(enum.IntEnum):
    """Why a sample stopped (``RUNNING`` while it has not)."""

    RUNNING = 0
    STOP = 1  # sampled a stop token (included in the output)
    LENGTH = 2  # reached its max_new (or forced) length
    CANCELLED = 3  # cancelled by a controller (DARTS early stop, a group predicate)
    ABORTED = 3  # the same value (an alias kept for existing code)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How tokens are drawn. Static: a change compiles a new program.

    temperature: 0 = greedy (argmax); otherwise logits / temperature.
    top_k: keep the k largest logits (0 = off). top_p: nucleus mass (1 = off).
    stop_tokens: ids that end a sample (kept as its last token).
    stop_sequences: id sequences that end a sample when its generated tokens end
      with one (kept in the output), e.g. a stop string's tokens. Checked on the
      device at every step (one compare per sequence, static shapes).
    max_new_tokens: the default per-sample generation limit.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 64

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SamplerError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise SamplerError(f"top_p={self.top_p} must be in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise SamplerError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise SamplerError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        seqs = []
        for i, sq in enumerate(self.stop_sequences):
            ids = token_ids(f"stop_sequences[{i}]", list(sq), error=SamplerError).reshape(-1)
            if ids.size == 0:
                raise SamplerError(f"stop_sequences[{i}] is empty (need at least one id)")
            seqs.append(tuple(int(t) for t in ids))
        object.__setattr__(self, "stop_sequences", tuple(seqs))

    @classmethod
    def greedy(
        cls, *, max_new_tokens: int = 64, stop_tokens=(), stop_sequences=()
    ) -> SamplingParams:
        return cls(
            temperature=0.0,
            max_new_tokens=max_new_tokens,
            stop_tokens=tuple(stop_tokens),
            stop_sequences=tuple(stop_sequences),
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class DecodeState(NamedTuple):
    """Everything the decode loop needs, as arrays (a pytree; device_put-able).

    tokens/logprobs/raw_logprobs [B, R]: generated token n of row b at [b, n];
    ``logprobs`` under the sampling policy (temperature, then top-k/p truncation and
    renormalisation: what drew the token), ``raw_logprobs`` under log softmax(logits
    / T) without truncation, T = the sampling temperature (1 when greedy): the
    old-policy logprob that a training engine at the same temperature recomputes
    (``dtarl.engines.base.logprob_temperature``; verl, TRL).
    """

    cache: KVCache  # [L, B, S, K, D]; rows [0, prompt_len + num_gen - 1) valid
    tokens: jax.Array  # [B, R] int32
    logprobs: jax.Array  # [B, R] f32
    raw_logprobs: jax.Array  # [B, R] f32
    prompt_len: jax.Array  # [B] int32
    num_gen: jax.Array  # [B] int32 (>= 1 after prefill for real rows)
    max_new: jax.Array  # [B] int32
    forced: jax.Array  # [B] bool: ignore stop tokens, generate exactly max_new
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] int32 FinishReason
    keys: jax.Array  # [B, 2] uint32 per-row base keys
    step: jax.Array  # [] int32 decode steps run so far

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])


# ------------------------------------------------------------------ sampling


def filter_logits(logits_BxV, params: SamplingParams):
    """Temperature, then top-k, then top-p; excluded entries become -inf.

    top-k:  keep z_v >= z_(k)  (the k-th largest)
    top-p:  keep the smallest prefix of the sorted distribution with mass >= p
    """
    z = logits_BxV / params.temperature
    if params.top_k > 0 and params.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, params.top_k)[0][:, -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if params.top_p < 1.0:
        z_sorted = -jnp.sort(-z, axis=-1)
        probs = jax.nn.softmax(z_sorted, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before entry i
        keep = before < params.top_p
        thresh = jnp.min(jnp.where(keep, z_sorted, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z < thresh, -jnp.inf, z)
    return z


def sample_tokens(logits_BxV, keys_Bx2, index_B, params: SamplingParams):
    """Draws one token per row: (token [B], policy logprob [B], raw logprob [B]).

    policy: log softmax of ``filter_logits`` (temperature, top-k, top-p), the
    distribution the token was drawn from. raw: log softmax(logits / T), T the
    temperature, without truncation; greedy (T = 0) uses T = 1, and both values
    are then that one.
    """
    if params.is_greedy:
        raw = jax.nn.log_softmax(logits_BxV, axis=-1)
        tok = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        raw_lp = jnp.take_along_axis(raw, tok[:, None], axis=-1)[:, 0]
        return tok, raw_lp, raw_lp
    raw = jax.nn.log_softmax(logits_BxV / params.temperature, axis=-1)
    z = filter_logits(logits_BxV, params)
    step_keys = jax.vmap(jax.random.fold_in)(keys_Bx2, index_B)
    tok = jax.vmap(jax.random.categorical)(step_keys, z).astype(jnp.int32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tok[:, None], axis=-1)[:, 0]
    raw_lp = jnp.take_along_axis(raw, tok[:, None], axis=-1)[:, 0]
    return tok, lp, raw_lp


def _ends_with_stop(tokens_BxR, num_gen_B, params: SamplingParams):
    """Rows whose first ``num_gen`` generated tokens end with a stop sequence."""
    hit = jnp.zeros(num_gen_B.shape, bool)
    r = tokens_BxR.shape[1]
    for seq in params.stop_sequences:  # static: one gather + compare per sequence
        n = len(seq)
        idx_BxL = num_gen_B[:, None] - n + jnp.arange(n)[None, :]
        got = jnp.take_along_axis(tokens_BxR, jnp.clip(idx_BxL, 0, r - 1), axis=1)
        hit |= (num_gen_B >= n) & jnp.all(got == jnp.asarray(seq, jnp.int32)[None, :], axis=1)
    return hit


def _finish_after(tok_B, num_gen_B, max_new_B, forced_B, params: SamplingParams, tokens_BxR):
    """Finish reason of rows that just produced their ``num_gen``-th token (the last
    entry of their ``tokens`` so far)."""
    is_stop = jnp.zeros_like(forced_B)
    if params.stop_tokens:
        is_stop |= jnp.isin(tok_B, jnp.asarray(params.stop_tokens, jnp.int32))
    if params.stop_sequences:
        is_stop |= _ends_with_stop(tokens_BxR, num_gen_B, params)
    is_stop &= ~forced_B
    at_len = num_gen_B >= max_new_B
    reason = jnp.where(
        is_stop, FinishReason.STOP, jnp.where(at_len, FinishReason.LENGTH, FinishReason.RUNNING)
    )
    return reason.astype(jnp.int32)


# ------------------------------------------------------------ pure stages


def prefill(
    model: Decoder,
    prompts_QxP,
    prompt_len_Q,
    prompt_of_B,
    keys_Bx2,
    max_new_B,
    forced_B,
    *,
    response_bucket: int,
    params: SamplingParams,
) -> DecodeState:
    """Runs each prompt once, shares its K/V with its rows and samples token 0.

    Rows with ``max_new == 0`` are padding: done from the start (RUNNING, 0 tokens).
    """
    cfg = model.cfg
    q, p = prompts_QxP.shape
    b = prompt_of_B.shape[0]
    r = response_bucket
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (q, p))
    hidden_QxPxE, kv = model(prompts_QxP, pos, return_hidden=True)
    last_QxE = jnp.take_along_axis(hidden_QxPxE, (prompt_len_Q - 1)[:, None, None], axis=1)[:, 0]
    logits_QxV = jnp.einsum(
        "qe,ev->qv",
        last_QxE,
        model.lm_head_weight().astype(last_QxE.dtype),
        preferred_element_type=jnp.float32,
    )
    # Share: every row reads its prompt's K/V (computed once above).
    pad = ((0, 0), (0, 0), (0, r), (0, 0), (0, 0))
    cache = KVCache(
        jnp.pad(kv.k[:, prompt_of_B], pad).astype(cfg.compute_dtype),
        jnp.pad(kv.v[:, prompt_of_B], pad).astype(cfg.compute_dtype),
    )
    zeros_i = jnp.zeros((b,), jnp.int32)
    tok, lp, raw_lp = sample_tokens(logits_QxV[prompt_of_B], keys_Bx2, zeros_i, params)
    real = max_new_B > 0
    num_gen = real.astype(jnp.int32)
    tokens = jnp.zeros((b, r), jnp.int32).at[:, 0].set(jnp.where(real, tok, 0))
    finish = jnp.where(real, _finish_after(tok, num_gen, max_new_B, forced_B, params, tokens), 0)
    logprobs = jnp.zeros((b, r), jnp.float32).at[:, 0].set(jnp.where(real, lp, 0.0))
    raw = jnp.zeros((b, r), jnp.float32).at[:, 0].set(jnp.where(real, raw_lp, 0.0))
    return DecodeState(
        cache=cache,
        tokens=tokens,
        logprobs=logprobs,
        raw_logprobs=raw,
        prompt_len=prompt_len_Q[prompt_of_B].astype(jnp.int32),
        num_gen=num_gen,
        max_new=max_new_B.astype(jnp.int32),
        forced=forced_B.astype(bool),
        done=(finish != FinishReason.RUNNING) | ~real,
        finish=finish.astype(jnp.int32),
        keys=keys_Bx2,
        step=jnp.zeros((), jnp.int32),
    )


def decode_step(model: Decoder, state: DecodeState, params: SamplingParams) -> DecodeState:
    """One token for every running row (finished rows are left unchanged)."""
    b, r = state.tokens.shape
    s = state.cache.k.shape[2]
    rows = jnp.arange(b)
    last = jnp.maximum(state.num_gen - 1, 0)
    tok_in = state.tokens[rows, last]
    at = jnp.minimum(state.prompt_len + last, s - 1)  # cache row (= position) of tok_in
    logits, kv_new = model(tok_in[:, None], at[:, None], state.cache, at)
    running = ~state.done
    # Finished rows write nothing: their cache rows are kept bit for bit.
    k_old = state.cache.k[:, rows, at]
    v_old = state.cache.v[:, rows, at]
    # The cache keeps the compute dtype (with fp32 activations the new K/V are fp32
    # values that the attention only ever uses rounded to it).
    k_put = jnp.where(running[None, :, None, None], kv_new.k[:, :, 0].astype(k_old.dtype), k_old)
    v_put = jnp.where(running[None, :, None, None], kv_new.v[:, :, 0].astype(v_old.dtype), v_old)
    cache = KVCache(
        state.cache.k.at[:, rows, at].set(k_put), state.cache.v.at[:, rows, at].set(v_put)
    )
    n = state.num_gen
    tok, lp, raw_lp = sample_tokens(logits[:, 0], state.keys, n, params)
    write = jnp.minimum(n, r - 1)
    new_n = jnp.where(running, n + 1, n)
    tokens = state.tokens.at[rows, write].set(jnp.where(running, tok, state.tokens[rows, write]))
    reason = _finish_after(tok, new_n, state.max_new, state.forced, params, tokens)
    return state._replace(
        cache=cache,
        tokens=tokens,
        logprobs=state.logprobs.at[rows, write].set(
            jnp.where(running, lp, state.logprobs[rows, write])
        ),
        raw_logprobs=state.raw_logprobs.at[rows, write].set(
            jnp.where(running, raw_lp, state.raw_logprobs[rows, write])
        ),
        num_gen=new_n,
        finish=jnp.where(running, reason, state.finish),
        done=state.done | (running & (reason != FinishReason.RUNNING)),
        step=state.step + 1,
    )


def decode(model: Decoder, state: DecodeState, stop_at, params: SamplingParams) -> DecodeState:
    """``lax.while_loop`` of ``decode_step`` while any row runs and ``step < stop_at``."""

    def cond(st: DecodeState):
        return jnp.any(~st.done) & (st.step < stop_at)

    return jax.lax.while_loop(cond, lambda st: decode_step(model, st, params), state)


def cancel(state: DecodeState, mask_B) -> DecodeState:
    """Marks running rows in ``mask`` as done with ``ABORTED`` (DARTS early stop)."""
    hit = jnp.asarray(mask_B, bool) & ~state.done
    return state._replace(
        done=state.done | hit, finish=jnp.where(hit, int(FinishReason.ABORTED), state.finish)
    )


# ------------------------------------------------------------ host wrapper


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SampleResult:
    """Host-side samples. Row i is a sample of ``prompts[prompt_index[i]]``.

    tokens/logprobs/raw_logprobs: per sample [n_i] (generated tokens only, the
    stop token included). ``logprobs``: under the sampling policy (top-k/p
    truncated); ``raw_logprobs``: under log softmax(logits / T) untruncated (T = 1
    when greedy), the old-policy logprobs to train with (``DecodeState``).
    finish: [N] FinishReason values.
    """

    tokens: tuple[np.ndarray, ...]
    logprobs: tuple[np.ndarray, ...]
    raw_logprobs: tuple[np.ndarray, ...]
    finish: np.ndarray
    prompt_index: np.ndarray
    stats: dict[str, Any]

    @property
    def lengths(self) -> np.ndarray:
        return np.array([t.shape[0] for t in self.tokens], np.int64)


class Sampler:
    """Bucketed, jitted generation for a ``Decoder`` (state-split: params are an input).

    ``generate(params, prompts, num_samples=G)`` returns a ``SampleResult``.
    Buckets (prompt count, rows, prompt length, response length) only grow, so a
    smaller batch reuses the last program; ``reserve`` pre-sizes them.
    ``trace_count`` counts traces of the prefill and decode programs.
    """

    def __init__(self, model: Decoder, params: SamplingParams, *, pad_id: int = 0):
        self.graphdef, _ = nnx.split(model, nnx.Param)
        self.cfg = model.cfg
        self.params = params
        self.pad_id = int(pad_id)
        self.trace_count = 0
        self._min = dict(prompts=1, rows=1, prompt_len=8, response=8)
        self._prefill_fns: dict[tuple, Any] = {}
        self._decode_fn = None

    features: frozenset = frozenset()  # ``Rollout.features``: plain ``generate`` only

    def warmup(self, weights, *, extend: bool = False) -> None:
        """``Rollout.warmup``: nothing (the static sampler's buckets compile on demand)."""

    def reserve(
        self, *, prompts: int = 1, rows: int = 1, prompt_len: int = 8, response: int = 8
    ) -> Sampler:
        for key, value in (
            ("prompts", prompts),
            ("rows", rows),
            ("prompt_len", prompt_len),
            ("response", response),
        ):
            self._min[key] = max(self._min[key], bucket(value))
        return self

    def _model(self, weights):
        return nnx.merge(self.graphdef, weights)

    def prefill_fn(self, response_bucket: int):
        key = response_bucket
        if key not in self._prefill_fns:

            def fn(weights, *args):
                self.trace_count += 1
                return prefill(
                    self._model(weights),
                    *args,
                    response_bucket=response_bucket,
                    params=self.params,
                )

            self._prefill_fns[key] = jax.jit(fn)
        return self._prefill_fns[key]

    def decode_fn(self):
        if self._decode_fn is None:

            def fn(weights, state, stop_at):
                self.trace_count += 1
                return decode(self._model(weights), state, stop_at, self.params)

            self._decode_fn = jax.jit(fn, donate_argnums=(1,))
        return self._decode_fn

    def init(
        self,
        weights,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int | Sequence[int] = 1,
        seed: int | jax.Array = 0,
        max_new_tokens: Sequence[int] | None = None,
        forced_lengths: Sequence[int] | None = None,
    ) -> tuple[DecodeState, np.ndarray]:
        """Prefills and returns (state, prompt_index of every real row).

        ``num_samples``: G for every prompt, or one count per prompt.
        ``max_new_tokens``: optional per-row limit (<= params.max_new_tokens).
        ``forced_lengths``: optional per-row exact lengths (>= 1; stop tokens
        ignored), for trace replay; rows are ordered prompt by prompt.
        """
        q = len(prompts)
        if q == 0:
            raise SamplerError("prompts: empty (need at least one prompt)")
        plist = []
        for i, pr in enumerate(prompts):
            a = token_ids(f"prompts[{i}]", pr, error=SamplerError).reshape(-1)
            if a.size == 0:
                raise SamplerError(f"prompts[{i}] is empty (need at least one token, e.g. bos)")
            if a.min() < 0 or a.max() >= self.cfg.vocab_size:
                raise SamplerError(
                    f"prompts[{i}]: token ids must be in [0, {self.cfg.vocab_size}), got "
                    f"[{a.min()}, {a.max()}]"
                )
            plist.append(a.astype(np.int32))
        counts = (
            [int(num_samples)] * q if np.ndim(num_samples) == 0 else [int(c) for c in num_samples]
        )
        if len(counts) != q or min(counts) < 1:
            raise SamplerError(f"num_samples: need an int >= 1 or {q} ints >= 1, got {num_samples}")
        prompt_index = np.repeat(np.arange(q), counts)
        n = prompt_index.shape[0]
        limit = self.params.max_new_tokens
        max_new = np.full(n, limit, np.int64)
        if max_new_tokens is not None:
            m = np.asarray(max_new_tokens, np.int64).reshape(-1)
            if m.shape != (n,) or m.min() < 1 or m.max() > limit:
                raise SamplerError(
                    f"max_new_tokens: need {n} ints in [1, {limit}] (params.max_new_tokens), "
                    f"got shape {m.shape}, range [{m.min()}, {m.max()}]"
                )
            max_new = m
        forced = np.zeros(n, bool)
        if forced_lengths is not None:
            f = np.asarray(forced_lengths, np.int64).reshape(-1)
            if f.shape != (n,) or f.min() < 1:
                raise SamplerError(f"forced_lengths: need {n} ints >= 1, got {f.tolist()}")
            max_new = f
            forced[:] = True
        r = bucket(int(max_new.max()), self._min["response"])
        p = bucket(max(a.shape[0] for a in plist), self._min["prompt_len"])
        if p + r > self.cfg.max_position_embeddings:
            raise SamplerError(
                f"prompt bucket {p} + response bucket {r} exceeds the model's "
                f"max_position_embeddings={self.cfg.max_position_embeddings}"
            )
        qb = bucket(q, self._min["prompts"])
        bb = bucket(n, self._min["rows"])
        self._min.update(prompts=qb, rows=bb, prompt_len=p, response=r)
        prompts_np = np.full((qb, p), self.pad_id, np.int32)
        plen = np.ones(qb, np.int32)
        for i, a in enumerate(plist):
            prompts_np[i, : a.shape[0]] = a
            plen[i] = a.shape[0]
        prompt_of = np.zeros(bb, np.int32)
        prompt_of[:n] = prompt_index
        mn = np.zeros(bb, np.int32)
        mn[:n] = max_new
        fc = np.zeros(bb, bool)
        fc[:n] = forced
        if isinstance(seed, int | np.integer):
            base = jax.random.PRNGKey(int(seed))
        else:
            base = seed
        keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(bb))
        state = self.prefill_fn(r)(weights, prompts_np, plen, prompt_of, keys, mn, fc)
        return state, prompt_index

    def step(self, weights, state: DecodeState, num_steps: int | None = None) -> DecodeState:
        """Runs up to ``num_steps`` more decode steps (all remaining when None)."""
        stop = np.iinfo(np.int32).max if num_steps is None else int(state.step) + int(num_steps)
        return self.decode_fn()(weights, state, jnp.asarray(stop, jnp.int32))

    @staticmethod
    def results(state: DecodeState, prompt_index: np.ndarray, stats=None) -> SampleResult:
        n = prompt_index.shape[0]
        toks = np.asarray(state.tokens)
        lps = np.asarray(state.logprobs)
        raw = np.asarray(state.raw_logprobs)
        ng = np.asarray(state.num_gen)
        return SampleResult(
            tokens=tuple(toks[i, : ng[i]].copy() for i in range(n)),
            logprobs=tuple(lps[i, : ng[i]].copy() for i in range(n)),
            raw_logprobs=tuple(raw[i, : ng[i]].copy() for i in range(n)),
            finish=np.asarray(state.finish)[:n].copy(),
            prompt_index=prompt_index,
            stats=dict(stats or {}),
        )

    def generate(
        self,
        weights,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int | Sequence[int] = 1,
        seed: int | jax.Array = 0,
        max_new_tokens: Sequence[int] | None = None,
        forced_lengths: Sequence[int] | None = None,
    ) -> SampleResult:
        t0 = time.perf_counter()
        state, prompt_index = self.init(
            weights,
            prompts,
            num_samples=num_samples,
            seed=seed,
            max_new_tokens=max_new_tokens,
            forced_lengths=forced_lengths,
        )
        state = self.step(weights, state)
        jax.block_until_ready(state.tokens)
        seconds = time.perf_counter() - t0
        res = self.results(state, prompt_index)
        gen = int(res.lengths.sum())
        stats = dict(
            seconds=seconds,
            generated_tokens=gen,
            tokens_per_second=gen / max(seconds, 1e-9),
            decode_steps=int(state.step),
            rows=state.batch,
            trace_count=self.trace_count,
        )
        return dataclasses.replace(res, stats=stats)


__all__ = [
    "DecodeState",
    "FinishReason",
    "SampleResult",
    "Sampler",
    "SamplerError",
    "SamplingParams",
    "cancel",
    "decode",
    "decode_step",
    "filter_logits",
    "prefill",
    "sample_tokens",
]
