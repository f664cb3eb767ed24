"""Policy losses as pure functions of one sequence's full-path token logprobs.

A loss is a pure function

    loss(logp_S, tok: TokenData, seq: SequenceData) -> scalar

of one sequence's full-path per-token logprobs ``logp_S`` (and, when the loss
says ``needs_entropy``, the per-token entropies in ``tok.entropy``) plus that
sequence's data: no state, no batch-level reductions, no side effects. Every
engine (dense, dfs, prefix_reuse) evaluates the batch loss as

    L = sum_i w_i * sum_t m_it * l(logp_it, ...)                       (1)

where ``w_i`` comes from the normalisation mode (``LossNorm``, computed on the
host from the whole batch) and ``l`` is the per-token loss below. A loss object
only ever sees one sequence at a time, laid out along its path: arrays of shape
[S] with entry ``t`` for token ``t`` (entry 0 is never predicted and is masked),
so a tree engine can evaluate it at the leaf where the sequence ends. Engines
differentiate it with respect to ``logp_S`` and ``tok.entropy`` (both functions
of the parameters), and only compute the entropy when ``needs_entropy`` is True.

Letters: S = padded path length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from dtarl.batch import LossNorm


class TokenData(NamedTuple):
    """Per-token inputs of one sequence, each [S] (fp32).

    Engines fill ``old_logprobs`` / ``ref_logprobs`` with NaN when the batch has
    none; a loss that needs them must say so through ``needs_*_logprobs`` (the
    engine then refuses such a batch) or treat NaN as "absent".

    ``entropy`` is aligned with ``logp_S``: entry t is the entropy
    H_t = -sum_v p(v | tokens < t) log p(v | tokens < t) of the distribution
    that predicted token t (entry 0 = 0). It is differentiable (a function of
    the parameters, like ``logp_S``), and only present (not None) when the loss
    says ``needs_entropy``.
    """

    mask: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    advantages: jax.Array  # per-token advantage; NaN = use SequenceData.advantage
    entropy: jax.Array | None = None  # H_t; None unless the loss needs_entropy


def token_entropy(tok: TokenData, loss) -> jax.Array:
    """tok.entropy, or a trace-time error naming the loss when the engine gave none."""
    if tok.entropy is None:
        raise ValueError(
            f"{type(loss).__name__} needs per-token entropy (needs_entropy=True), but "
            "TokenData.entropy is None: the caller must compute it "
            "(token_logprobs(..., entropy=True)) and pass it as TokenData.entropy"
        )
    return tok.entropy


def token_advantage(tok: TokenData, seq: SequenceData) -> jax.Array:
    """A_t: the per-token advantage where given, else the sequence's A_i."""
    return jnp.where(jnp.isnan(tok.advantages), seq.advantage, tok.advantages)


class SequenceData(NamedTuple):
    """Per-sequence scalars."""

    advantage: jax.Array
    weight: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskedNLLLoss:
    """Masked negative log-likelihood (SFT):  l_t = -A_t * logp_t.

    With advantages of 1 this is plain cross-entropy on the masked tokens.
    """

    norm: LossNorm = LossNorm.TOKEN
    norm_constant: float | None = None
    needs_old_logprobs = False
    needs_ref_logprobs = False
    needs_entropy = False

    def __call__(self, logp_S, tok: TokenData, seq: SequenceData) -> jax.Array:
        per_token = -token_advantage(tok, seq) * logp_S
        return seq.weight * jnp.sum(tok.mask * per_token)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClippedSurrogateLoss:
    """PPO-style clipped surrogate, optionally with a k3 KL penalty to a reference
    and an entropy bonus.

        r_t   = exp(logp_t - logp_old_t)
        l_t   = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
                + beta * kl_t - entropy_coef * H_t
        kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                (k3 estimator)
        H_t   = -sum_v p_t(v) log p_t(v)     (entropy of the distribution predicting t)

    The entropy bonus is aggregated exactly like the policy term (masked token
    sum, times the sequence weight w_i of (1)), so it follows ``norm``.
    ``entropy_coef`` must be finite and >= 0 (a bonus, never a penalty);
    with entropy_coef = 0 the entropy is not computed at all (``needs_entropy``).

    Presets: ``grpo()`` (symmetric clip, per-sequence mean), ``dapo()``
    (clip-higher eps_high = 0.28, token-level normalisation), ``dr_grpo()``
    (normaliser N * max_len: each sequence's token sum, no per-length mean, and
    the batch size does not scale the gradient), ``ppo()`` (token-level,
    symmetric clip). A_t is the batch's per-token advantage where given
    (PPO/GAE), else the sequence's A_i.
    Without old logprobs the rollout is taken as on-policy: logp_old =
    stop_gradient(logp), so r_t = 1 with gradient A_i * grad(logp_t).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    norm: LossNorm = LossNorm.SEQUENCE
    norm_constant: float | None = None

    def __post_init__(self):
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low={self.eps_low} must be in [0, 1)")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high={self.eps_high} must be >= 0")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0")
        if not (math.isfinite(self.entropy_coef) and self.entropy_coef >= 0):
            raise ValueError(
                f"entropy_coef={self.entropy_coef} must be finite and >= 0 "
                "(0 disables the entropy bonus)"
            )
        if self.norm is LossNorm.CONSTANT and not (self.norm_constant or 0) > 0:
            raise ValueError("norm_constant must be > 0 when norm is LossNorm.CONSTANT")

    needs_old_logprobs = False  # optional: NaN (absent) means on-policy

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0

    @classmethod
    def grpo(
        cls, *, eps: float = 0.2, kl_coef: float = 0.0, entropy_coef: float = 0.0
    ) -> ClippedSurrogateLoss:
        return cls(
            eps_low=eps,
            eps_high=eps,
            kl_coef=kl_coef,
            entropy_coef=entropy_coef,
            norm=LossNorm.SEQUENCE,
        )

    @classmethod
    def dapo(
        cls, *, eps_low: float = 0.2, eps_high: float = 0.28, entropy_coef: float = 0.0
    ) -> ClippedSurrogateLoss:
        return cls(
            eps_low=eps_low, eps_high=eps_high, entropy_coef=entropy_coef, norm=LossNorm.TOKEN
        )

    @classmethod
    def dr_grpo(
        cls, *, max_len: int, eps: float = 0.2, entropy_coef: float = 0.0
    ) -> ClippedSurrogateLoss:
        return cls(
            eps_low=eps,
            eps_high=eps,
            entropy_coef=entropy_coef,
            norm=LossNorm.CONSTANT,
            norm_constant=max_len,
        )

    @classmethod
    def ppo(
        cls, *, eps: float = 0.2, kl_coef: float = 0.0, entropy_coef: float = 0.0
    ) -> ClippedSurrogateLoss:
        return cls(
            eps_low=eps,
            eps_high=eps,
            kl_coef=kl_coef,
            entropy_coef=entropy_coef,
            norm=LossNorm.TOKEN,
        )

    def __call__(self, logp_S, tok: TokenData, seq: SequenceData) -> jax.Array:
        # Missing old logprobs arrive as NaN (see TokenData): on-policy.
        old = jnp.where(
            jnp.isnan(tok.old_logprobs), jax.lax.stop_gradient(logp_S), tok.old_logprobs
        )
        ratio = jnp.exp(logp_S - old)
        adv = token_advantage(tok, seq)
        clipped = jnp.clip(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)
        per_token = -jnp.minimum(ratio * adv, clipped * adv)
        if self.kl_coef > 0:
            delta = tok.ref_logprobs - logp_S
            per_token = per_token + self.kl_coef * (jnp.exp(delta) - delta - 1.0)
        if self.needs_entropy:
            per_token = per_token - self.entropy_coef * token_entropy(tok, self)
        return seq.weight * jnp.sum(tok.mask * per_token)


def clip_fraction(logp, old_logp, mask, adv, eps_low: float, eps_high: float) -> jax.Array:
    """Fraction of masked tokens whose ratio was clipped (a PPO diagnostic)."""
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.where(adv >= 0, ratio > 1 + eps_high, ratio < 1 - eps_low)
    return jnp.sum(mask * clipped) / jnp.maximum(jnp.sum(mask), 1.0)


# ---------------------------------------------------------------------------
# The open loss interface (engine.loss_fn, value_and_grad and the trainer all take
# any object that keeps this protocol) and losses written only against it.


@runtime_checkable
class SequenceLoss(Protocol):
    """The public per-sequence loss protocol every engine evaluates.

    ``loss(logp_S, tok, seq) -> scalar`` is one sequence's contribution to

        L = sum_i loss(logp_i, tok_i, seq_i)                                (2)

    (already multiplied by its weight ``seq.weight``: the built-in losses return
    ``seq.weight * sum_t tok.mask[t] * l_t``, eq. (1), but a loss may combine its
    tokens in any differentiable way, e.g. a sequence-level ratio). Every engine
    (dense, dfs, prefix_reuse, auto, and ``ShardedEngine`` around any of them)
    calls it once per sequence, where the sequence's whole path is known, with:

      logp_S          [S] fp32: log p(token_t | tokens < t) along the sequence's full
                      path (prompt included; entry 0 = 0; entries past the end = 0),
                      at the engine's temperature. Differentiable.
      tok.entropy     [S] fp32: H_t of the distribution that predicted token t, only
                      when ``needs_entropy`` (else None). Differentiable.
      tok.mask        [S] the batch's loss mask (0 past the end).
      tok.old_logprobs, tok.ref_logprobs
                      [S] the batch's behaviour / reference logprobs; NaN when the
                      batch has none (0 past the end).
      tok.advantages  [S] per-token advantages; NaN = use ``seq.advantage``
                      (``token_advantage(tok, seq)`` resolves it).
      seq.advantage   the sequence's advantage A_i.
      seq.weight      w_i from the normaliser ``norm`` (``LossNorm``; computed on the
                      host from the whole batch, e.g. 1 / total masked tokens for
                      TOKEN), or the caller's ``weights``. 0 for padding sequences.

    S is a padded length and differs between engines: a loss must depend on entries
    past the sequence's end only through ``tok.mask`` (which is 0 there).

    Attributes engines read:
      norm: LossNorm, and ``norm_constant`` (float | None; for LossNorm.CONSTANT).
      needs_old_logprobs / needs_ref_logprobs: an engine refuses a batch without
        them (BatchError) before any device work.
      needs_entropy: the engine computes ``tok.entropy`` only when True.

    A loss must be a pure function of its inputs, hashable, with a ``repr`` that
    determines it (engines key compiled programs on ``(loss, shapes)`` and the program
    store on ``repr(loss)``): a frozen dataclass of its settings, as below. No group
    ids or sequence-level normalisers beyond ``seq.weight`` are provided: a sequence's
    loss may not depend on other sequences (a tree engine evaluates it at its leaf).
    """

    norm: LossNorm
    needs_old_logprobs: bool
    needs_ref_logprobs: bool
    needs_entropy: bool

    def __call__(self, logp_S: jax.Array, tok: TokenData, seq: SequenceData) -> jax.Array: ...


def check_sequence_loss(loss) -> None:
    """A one-line TypeError naming what ``loss`` lacks of ``SequenceLoss``."""
    missing = [
        a
        for a in ("norm", "needs_old_logprobs", "needs_ref_logprobs", "needs_entropy")
        if not hasattr(loss, a)
    ]
    if not callable(loss):
        missing.append("__call__(logp_S, tok, seq)")
    if missing:
        raise TypeError(
            f"{type(loss).__name__} is not a SequenceLoss: it lacks {', '.join(missing)} "
            "(see dtarl.losses.SequenceLoss)"
        )
    if not isinstance(loss.norm, LossNorm):
        raise TypeError(f"{type(loss).__name__}.norm must be a LossNorm, got {loss.norm!r}")
    try:
        hash(loss)
    except TypeError:
        raise TypeError(
            f"{type(loss).__name__} must be hashable (a frozen dataclass): engines key "
            "compiled programs on it"
        ) from None


def _on_policy_old(logp_S, tok: TokenData) -> jax.Array:
    """The behaviour logprobs, or stop_gradient(logp) where absent (NaN): on-policy."""
    return jnp.where(jnp.isnan(tok.old_logprobs), jax.lax.stop_gradient(logp_S), tok.old_logprobs)


def _check_eps(eps_low: float, eps_high: float, *, low_max: float) -> None:
    if not (math.isfinite(eps_low) and 0 <= eps_low <= low_max):
        raise ValueError(f"eps_low={eps_low} must be in [0, {low_max}]")
    if not (math.isfinite(eps_high) and eps_high >= 0):
        raise ValueError(f"eps_high={eps_high} must be finite and >= 0")


def _check_norm(norm, constant) -> None:
    if not isinstance(norm, LossNorm):
        raise ValueError(f"norm={norm!r} must be a LossNorm")
    if norm is LossNorm.CONSTANT and not (constant or 0) > 0:
        raise ValueError("norm_constant must be > 0 when norm is LossNorm.CONSTANT")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GSPOLoss:
    """GSPO (Group Sequence Policy Optimization, arXiv 2507.18071): the importance
    ratio and its clipping are per sequence.

        s_i = exp( sum_t m_it (logp_it - old_it) / sum_t m_it )
        l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
        loss_i = w_i * (sum_t m_it) * l_i

    With ``norm=LossNorm.SEQUENCE`` (default; w_i = 1 / (N sum_t m_it)) the batch
    loss is the paper's mean over sequences, (1/N) sum_i l_i; with TOKEN, sequences
    count by their trained tokens. A_i is the sequence advantage. Without old
    logprobs the rollout is taken as on-policy (s_i = 1, gradient A_i times the
    masked mean of grad logp). Defaults are the paper's clip range (3e-4, 4e-4).
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    norm: LossNorm = LossNorm.SEQUENCE
    norm_constant: float | None = None
    needs_old_logprobs = False  # optional: NaN (absent) means on-policy
    needs_ref_logprobs = False
    needs_entropy = False

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high, low_max=1.0 - 1e-12)
        _check_norm(self.norm, self.norm_constant)

    def __call__(self, logp_S, tok: TokenData, seq: SequenceData) -> jax.Array:
        tokens = jnp.sum(tok.mask)
        delta = tok.mask * (logp_S - _on_policy_old(logp_S, tok))
        ratio = jnp.exp(jnp.sum(delta) / jnp.maximum(tokens, 1.0))
        clipped = jnp.clip(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)
        adv = seq.advantage
        per_seq = -jnp.minimum(ratio * adv, clipped * adv)
        return seq.weight * tokens * per_seq


@dataclasses.dataclass(frozen=True, kw_only=True)
class CISPOLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585): a clipped, stop-gradient token-level
    importance weight times the REINFORCE term, so no token's gradient is dropped.

        r_t = exp(logp_t - old_t)
        l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t
        loss_i = w_i * sum_t m_it l_t

    Default: token-level normalisation (the paper's 1 / sum_i |o_i|), no lower bound
    (eps_low = 1: the bound 0 never binds, as in the paper) and eps_high = 0.28 (the
    paper leaves it a tuning choice; this is DAPO's clip-higher). A_t is the per-token
    advantage where given, else A_i. Without old logprobs: r_t = 1 (on-policy).
    """

    eps_low: float = 1.0
    eps_high: float = 0.28
    norm: LossNorm = LossNorm.TOKEN
    norm_constant: float | None = None
    needs_old_logprobs = False  # optional: NaN (absent) means on-policy
    needs_ref_logprobs = False
    needs_entropy = False

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high, low_max=1.0)
        _check_norm(self.norm, self.norm_constant)

    def __call__(self, logp_S, tok: TokenData, seq: SequenceData) -> jax.Array:
        ratio = jnp.exp(logp_S - _on_policy_old(logp_S, tok))
        weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high))
        per_token = -weight * token_advantage(tok, seq) * logp_S
        return seq.weight * jnp.sum(tok.mask * per_token)
