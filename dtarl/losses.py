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
from typing import NamedTuple

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
