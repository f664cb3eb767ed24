"""dtarl.losses and the LossNorm weights against numbers worked out by hand.

Every expected value is written out below as arithmetic on the test's own tiny
inputs (one sequence of 4 tokens, entry 0 never predicted), following the
formulas of the ``ClippedSurrogateLoss`` docstring and the papers:

    r_t  = exp(logp_t - old_t)
    l_t  = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
           + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) - c_H * H_t
    loss = w * sum_t m_t l_t

The per-token tests call the loss functions directly; the normalisation tests
go through ``RolloutBatch.sequence_weights`` and, end to end, ``DenseEngine``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dtarl.batch import BatchError, LossNorm, RolloutBatch
from dtarl.engines import DenseEngine
from dtarl.losses import (
    ClippedSurrogateLoss,
    MaskedNLLLoss,
    SequenceData,
    TokenData,
    clip_fraction,
)
from dtarl.model import init_model
from dtarl.testing import tiny_config

RTOL = 1e-6  # fp32, a handful of ops on O(1) values
NAN = math.nan


def f32(*xs) -> jax.Array:
    return jnp.asarray(xs, jnp.float32)


def token_data(mask, *, old=None, ref=None, adv=None, entropy=None) -> TokenData:
    """TokenData as the engines build it: NaN where the batch has no data."""
    s = len(mask)
    absent = (NAN,) * s
    return TokenData(
        mask=f32(*mask),
        old_logprobs=f32(*(old or absent)),
        ref_logprobs=f32(*(ref or absent)),
        advantages=f32(*(adv or absent)),
        entropy=None if entropy is None else f32(*entropy),
    )


def seq_data(advantage: float, weight: float = 1.0) -> SequenceData:
    return SequenceData(advantage=jnp.float32(advantage), weight=jnp.float32(weight))


def value_and_logp_grad(loss, logp, tok, seq):
    value, grad = jax.value_and_grad(loss)(logp, tok, seq)
    return float(value), np.asarray(grad)


# ------------------------------------------------- the clipped surrogate


# log-ratios logp - old of tokens 1..3: above the band, below it, inside it.
LOGP = (0.0, -1.0, -1.0, -1.0)
OLD = (0.0, -1.5, -0.5, -1.1)
R_HIGH, R_LOW, R_IN = math.exp(0.5), math.exp(-0.5), math.exp(0.1)  # 1.649, 0.607, 1.105


def test_grpo_clips_positive_advantage_above_the_band():
    """A = +2, eps = 0.2: r = 1.649 is clipped to 1.2 (no gradient); r = 0.607 is
    below the band but the min keeps the smaller, unclipped r A; r = 1.105 is inside."""
    loss = ClippedSurrogateLoss.grpo(eps=0.2)
    tok = token_data((0, 1, 1, 1), old=OLD)
    value, grad = value_and_logp_grad(loss, f32(*LOGP), tok, seq_data(2.0, weight=0.5))
    # min(1.649 * 2, 1.2 * 2) = 2.4; min(0.607 * 2, 0.8 * 2) = 1.213; min(2.21, 2.21)
    per_token = [-(1.2 * 2.0), -(R_LOW * 2.0), -(R_IN * 2.0)]
    np.testing.assert_allclose(value, 0.5 * sum(per_token), rtol=RTOL)
    # d(-r A)/d logp = -r A where r A is the min; 0 where the clipped constant is.
    np.testing.assert_allclose(grad, [0.0, 0.0, -0.5 * R_LOW * 2.0, -0.5 * R_IN * 2.0], rtol=RTOL)


def test_grpo_clips_negative_advantage_below_the_band():
    """A = -1, eps = 0.2: r = 0.607 is clipped to 0.8 (no gradient); r = 1.649 above
    the band is kept unclipped (the pessimistic min); r = 1.105 is inside."""
    loss = ClippedSurrogateLoss.grpo(eps=0.2)
    tok = token_data((0, 1, 1, 1), old=OLD)
    value, grad = value_and_logp_grad(loss, f32(*LOGP), tok, seq_data(-1.0))
    # min(-1.649, -1.2) = -1.649; min(-0.607, -0.8) = -0.8; min(-1.105, -1.105)
    per_token = [R_HIGH, 0.8, R_IN]
    np.testing.assert_allclose(value, sum(per_token), rtol=RTOL)
    np.testing.assert_allclose(grad, [0.0, R_HIGH, 0.0, R_IN], rtol=RTOL)


def test_on_policy_without_old_logprobs_ratio_is_one():
    """No old logprobs (NaN): r = 1 exactly, value -A sum_t m_t, gradient -A m_t."""
    loss = ClippedSurrogateLoss.grpo(eps=0.2)
    value, grad = value_and_logp_grad(
        loss, f32(0.0, -3.0, -0.2, -7.0), token_data((0, 1, 1, 0)), seq_data(1.5, weight=0.25)
    )
    np.testing.assert_allclose(value, 0.25 * -(1.5 + 1.5), rtol=RTOL)
    np.testing.assert_allclose(grad, [0.0, -0.25 * 1.5, -0.25 * 1.5, 0.0], rtol=RTOL)


def test_clip_higher_eps_low_differs_from_eps_high():
    """DAPO clip-higher (eps_low 0.2, eps_high 0.28): r = 1.25 with A > 0 is inside
    its band but clipped by symmetric GRPO; r = 1.35 is clipped to 1.28; r = 0.75
    with A < 0 is clipped at 1 - eps_low = 0.8 by both."""
    dapo, grpo = ClippedSurrogateLoss.dapo(), ClippedSurrogateLoss.grpo(eps=0.2)
    assert (dapo.eps_low, dapo.eps_high) == (0.2, 0.28)
    logp = f32(0.0, 0.0, 0.0)
    up = token_data((0, 1, 1), old=(0.0, -math.log(1.25), -math.log(1.35)))
    np.testing.assert_allclose(float(dapo(logp, up, seq_data(1.0))), -(1.25 + 1.28), rtol=RTOL)
    np.testing.assert_allclose(float(grpo(logp, up, seq_data(1.0))), -(1.2 + 1.2), rtol=RTOL)
    down = token_data((0, 1, 0), old=(0.0, -math.log(0.75), 0.0))
    for loss in (dapo, grpo):
        np.testing.assert_allclose(float(loss(logp, down, seq_data(-1.0))), 0.8, rtol=RTOL)
    # The low side on its own: eps_low = 0.1 clips r = 0.85 (A < 0) at 0.9, eps 0.2 does not.
    tight_low = ClippedSurrogateLoss(eps_low=0.1, eps_high=0.2)
    r085 = token_data((0, 1, 0), old=(0.0, -math.log(0.85), 0.0))
    np.testing.assert_allclose(float(tight_low(logp, r085, seq_data(-1.0))), 0.9, rtol=RTOL)
    np.testing.assert_allclose(float(grpo(logp, r085, seq_data(-1.0))), 0.85, rtol=RTOL)


def test_k3_kl_term_and_coefficient():
    """On-policy (r = 1) with beta = 0.1: l_t = -A + 0.1 * (e^d - d - 1), d = ref - logp.

    d = -0.5: e^-0.5 + 0.5 - 1 = 0.10653; d = 1: e - 2 = 0.71828; d = 0: 0.
    d l_t / d logp_t = -A + 0.1 * (1 - e^d).
    """
    loss = ClippedSurrogateLoss.grpo(kl_coef=0.1)
    assert loss.needs_ref_logprobs
    logp = f32(0.0, -1.0, -2.0, -0.5)
    tok = token_data((0, 1, 1, 1), ref=(0.0, -1.5, -1.0, -0.5))
    value, grad = value_and_logp_grad(loss, logp, tok, seq_data(0.5, weight=2.0))
    kl = [math.exp(-0.5) + 0.5 - 1.0, math.e - 1.0 - 1.0, 0.0]
    np.testing.assert_allclose(value, 2.0 * sum(-0.5 + 0.1 * k for k in kl), rtol=RTOL)
    dkl = [1.0 - math.exp(-0.5), 1.0 - math.e, 0.0]
    np.testing.assert_allclose(grad, [0.0] + [2.0 * (-0.5 + 0.1 * g) for g in dkl], rtol=RTOL)


def test_kl_coef_zero_ignores_missing_reference():
    """Without a KL term the (NaN) reference never reaches the loss."""
    loss = ClippedSurrogateLoss.grpo()
    assert not loss.needs_ref_logprobs
    value = float(loss(f32(0.0, -1.0), token_data((0, 1)), seq_data(1.0)))
    assert value == -1.0


def test_entropy_bonus_full_value():
    """On-policy, A = 1, c_H = 0.01: l_t = -1 - 0.01 H_t on the two unmasked tokens;
    the masked token's H = 9 is not counted."""
    loss = ClippedSurrogateLoss.grpo(entropy_coef=0.01)
    tok = token_data((0, 1, 1, 0), entropy=(0.0, 2.0, 1.5, 9.0))
    value = float(loss(f32(0.0, -1.0, -1.0, -1.0), tok, seq_data(1.0, weight=0.5)))
    np.testing.assert_allclose(value, 0.5 * ((-1 - 0.01 * 2.0) + (-1 - 0.01 * 1.5)), rtol=RTOL)


def test_all_terms_together():
    """Clipping, k3 KL and entropy on one token: r = 1.649, A = 2, eps 0.2, beta 0.1,
    d = ref - logp = -0.5, H = 1.5, c_H = 0.01."""
    loss = ClippedSurrogateLoss(eps_low=0.2, eps_high=0.2, kl_coef=0.1, entropy_coef=0.01)
    tok = token_data((0, 1), old=(0.0, -1.5), ref=(0.0, -1.5), entropy=(0.0, 1.5))
    value = float(loss(f32(0.0, -1.0), tok, seq_data(2.0)))
    want = -(1.2 * 2.0) + 0.1 * (math.exp(-0.5) + 0.5 - 1.0) - 0.01 * 1.5
    np.testing.assert_allclose(value, want, rtol=RTOL)


# ------------------------------------------------- advantages and the mask


def test_per_token_advantages_override_the_sequence_advantage():
    """A_t = (3, <NaN: the sequence's 0.5>, -2). On-policy: -(3 + 0.5 - 2) = -1.5.
    With old logprobs the per-token sign picks the clipping side: token 3 has
    r = 0.607 and A = -2, so it is clipped at 0.8 (l = 1.6), which the sequence's
    A = 0.5 > 0 would not do."""
    loss = ClippedSurrogateLoss.ppo(eps=0.2)
    adv = (NAN, 3.0, NAN, -2.0)
    value, grad = value_and_logp_grad(
        loss, f32(*LOGP), token_data((0, 1, 1, 1), adv=adv), seq_data(0.5)
    )
    np.testing.assert_allclose(value, -(3.0 + 0.5 - 2.0), rtol=RTOL)
    np.testing.assert_allclose(grad, [0.0, -3.0, -0.5, 2.0], rtol=RTOL)
    clipped = token_data((0, 0, 0, 1), adv=adv, old=(0.0, 0.0, 0.0, -0.5))
    np.testing.assert_allclose(float(loss(f32(*LOGP), clipped, seq_data(0.5))), 1.6, rtol=RTOL)
    # MaskedNLLLoss reads A_t the same way: l_t = -A_t logp_t.
    nll = float(
        MaskedNLLLoss()(
            f32(0.0, -1.0, -2.0, -0.5), token_data((0, 1, 1, 1), adv=adv), seq_data(0.5)
        )
    )
    np.testing.assert_allclose(nll, -(3.0 * -1.0) - (0.5 * -2.0) - (-2.0 * -0.5), rtol=RTOL)


def test_masked_tokens_contribute_nothing():
    """Token 2 is masked and carries extreme data (r = e^20, KL delta 20, H = 1e3):
    neither the value nor any gradient sees it. A fractional mask scales a token."""
    loss = ClippedSurrogateLoss(eps_low=0.2, eps_high=0.2, kl_coef=0.1, entropy_coef=0.01)
    logp = f32(0.0, -1.0, -1.0, -1.0)
    tok = token_data(
        (0, 1, 0, 0.5),
        old=(0.0, -1.0, -21.0, -1.0),
        ref=(0.0, -1.0, 19.0, -1.0),
        entropy=(0.0, 0.0, 1e3, 0.0),
    )
    value, g_logp = value_and_logp_grad(loss, logp, tok, seq_data(-1.0))
    # Tokens 1 and 3: r = 1, KL 0, H 0, so l = +1 each; token 3 at mask 0.5.
    np.testing.assert_allclose(value, 1.0 + 0.5 * 1.0, rtol=RTOL)
    np.testing.assert_allclose(g_logp, [0.0, 1.0, 0.0, 0.5], rtol=RTOL)
    g_ent = jax.grad(lambda h: loss(logp, tok._replace(entropy=h), seq_data(-1.0)))(tok.entropy)
    np.testing.assert_allclose(g_ent, [0.0, -0.01, 0.0, -0.005], rtol=RTOL)
    # MaskedNLLLoss: only unmasked tokens, -A logp_t, times the weight.
    nll = float(MaskedNLLLoss()(f32(0.0, -1.0, -50.0, -3.0), tok, seq_data(1.0, weight=0.5)))
    np.testing.assert_allclose(nll, 0.5 * (1.0 + 0.5 * 3.0), rtol=RTOL)


def test_clip_fraction_counts_the_clipped_side_per_advantage_sign():
    """Ratios (1.649, 0.607, 1.105) with A > 0 clip only the first; with A < 0 only
    the second; the masked entry 0 is not counted."""
    logp, old, mask = f32(*LOGP), f32(*OLD), f32(0, 1, 1, 1)
    for adv in (f32(0, 1, 1, 1), f32(0, -1, -1, -1)):
        frac = float(clip_fraction(logp, old, mask, adv, 0.2, 0.2))
        np.testing.assert_allclose(frac, 1 / 3, rtol=RTOL)
    # Mixed signs: A = (+, -, +) clips tokens 1 and 2; clip-higher 0.7 un-clips token 1.
    mixed = f32(0, 1, -1, 1)
    np.testing.assert_allclose(float(clip_fraction(logp, old, mask, mixed, 0.2, 0.2)), 2 / 3)
    np.testing.assert_allclose(float(clip_fraction(logp, old, mask, mixed, 0.2, 0.7)), 1 / 3)


# ------------------------------------------------- presets and validation


def test_presets():
    grpo = ClippedSurrogateLoss.grpo(eps=0.1, kl_coef=0.05)
    assert (grpo.eps_low, grpo.eps_high, grpo.kl_coef, grpo.norm) == (
        0.1,
        0.1,
        0.05,
        LossNorm.SEQUENCE,
    )
    dapo = ClippedSurrogateLoss.dapo()
    assert (dapo.eps_low, dapo.eps_high, dapo.kl_coef, dapo.norm) == (
        0.2,
        0.28,
        0.0,
        LossNorm.TOKEN,
    )
    dr = ClippedSurrogateLoss.dr_grpo(max_len=100)
    assert (dr.norm, dr.norm_constant, dr.eps_low, dr.eps_high) == (
        LossNorm.CONSTANT,
        100,
        0.2,
        0.2,
    )
    ppo = ClippedSurrogateLoss.ppo()
    assert (ppo.norm, ppo.eps_low, ppo.eps_high) == (LossNorm.TOKEN, 0.2, 0.2)
    assert MaskedNLLLoss().norm is LossNorm.TOKEN


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(norm=LossNorm.CONSTANT), "norm_constant"),
        (dict(norm=LossNorm.CONSTANT, norm_constant=0.0), "norm_constant"),
    ],
)
def test_bad_loss_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClippedSurrogateLoss(**kwargs)


# ------------------------------------------------- normalisation (LossNorm)

# Three sequences; mask sums M = (2, 3, 1.5): the third has a half-weighted token.
TOKENS = ([5, 6, 7], [5, 6, 8, 9, 10], [11, 12, 13])
MASKS = ([0, 1, 1], [0, 0, 1, 1, 1], [0, 0.5, 1])
ADV = (1.0, -2.0, 0.5)


def _batch(masks=MASKS) -> RolloutBatch:
    return RolloutBatch.create(tokens=TOKENS, loss_mask=masks, advantages=ADV)


def test_token_norm_weights():
    """TOKEN: w_i = 1 / sum_i M_i = 1 / (2 + 3 + 1.5)."""
    w = _batch().sequence_weights(LossNorm.TOKEN)
    np.testing.assert_allclose(w, [1 / 6.5] * 3, rtol=RTOL)


def test_sequence_norm_weights():
    """SEQUENCE: w_i = 1 / (N M_i), N = 3."""
    w = _batch().sequence_weights(LossNorm.SEQUENCE)
    np.testing.assert_allclose(w, [1 / (3 * 2), 1 / (3 * 3), 1 / (3 * 1.5)], rtol=RTOL)


def test_sequence_sum_norm_weights():
    """SEQUENCE_SUM (seq-mean-token-sum): w_i = 1 / N = 1/3, independent of M_i."""
    w = _batch().sequence_weights(LossNorm.SEQUENCE_SUM)
    np.testing.assert_allclose(w, [1 / 3] * 3, rtol=RTOL)


def test_constant_norm_weights():
    """CONSTANT (Dr.GRPO, seq-mean-token-sum-norm): w_i = 1 / (N c) = 1 / (3 * 8).

    Before the fix the weight was 1 / c, so the loss grew with the batch."""
    w = _batch().sequence_weights(LossNorm.CONSTANT, 8.0)
    np.testing.assert_allclose(w, [1 / 24] * 3, rtol=RTOL)
    with pytest.raises(BatchError, match="constant > 0"):
        _batch().sequence_weights(LossNorm.CONSTANT)


def test_fully_masked_sequence_weights():
    """A sequence with no trained token gets weight 0 in SEQUENCE (no 0/0) but still
    counts in N; TOKEN's denominator has nothing from it."""
    masks = ([0, 1, 1], [0, 0, 0, 0, 0], [0, 0.5, 1])
    b = _batch(masks)
    np.testing.assert_allclose(
        b.sequence_weights(LossNorm.SEQUENCE), [1 / (3 * 2), 0.0, 1 / (3 * 1.5)], rtol=RTOL
    )
    np.testing.assert_allclose(b.sequence_weights(LossNorm.TOKEN), [1 / 3.5] * 3, rtol=RTOL)
    all_masked = _batch(([0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0]))
    for norm in (LossNorm.TOKEN, LossNorm.SEQUENCE):
        np.testing.assert_array_equal(all_masked.sequence_weights(norm), [0.0] * 3)
    # The sum modes count the empty sequence in N too: nothing to divide by zero.
    np.testing.assert_allclose(b.sequence_weights(LossNorm.SEQUENCE_SUM), [1 / 3] * 3)
    np.testing.assert_allclose(b.sequence_weights(LossNorm.CONSTANT, 4.0), [1 / 12] * 3)


@pytest.fixture(scope="module")
def dense_engine():
    model = init_model(tiny_config(), seed=0)
    _, params = nnx.split(model, nnx.Param)
    return DenseEngine(model), params


@pytest.mark.parametrize(
    "loss,want",
    [
        # On policy r = 1, so L = -sum_i w_i A_i M_i with A M = (2, -6, 0.75):
        # TOKEN: -(2 - 6 + 0.75) / 6.5 = 0.5
        pytest.param(ClippedSurrogateLoss(norm=LossNorm.TOKEN), 3.25 / 6.5, id="token"),
        # SEQUENCE: -(1/3) (2/2 - 6/3 + 0.75/1.5) = -(1/3)(1 - 2 + 0.5) = 1/6
        pytest.param(ClippedSurrogateLoss(norm=LossNorm.SEQUENCE), 0.5 / 3, id="sequence"),
        # SEQUENCE_SUM: -(1/3)(2 - 6 + 0.75) = 3.25 / 3
        pytest.param(ClippedSurrogateLoss(norm=LossNorm.SEQUENCE_SUM), 3.25 / 3, id="sequence_sum"),
        # CONSTANT c = 8: -(2 - 6 + 0.75) / (N c) = 3.25 / 24
        pytest.param(
            ClippedSurrogateLoss(norm=LossNorm.CONSTANT, norm_constant=8.0),
            3.25 / 24,
            id="constant",
        ),
    ],
)
def test_norm_end_to_end_through_dense_engine(dense_engine, loss, want):
    """The public path: RolloutBatch -> DenseEngine.value_and_grad applies the
    normaliser of ``loss.norm`` to the per-token losses."""
    engine, params = dense_engine
    value, _, _ = engine.value_and_grad(params, _batch(), loss)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)


def test_dr_grpo_loss_is_the_token_sum_over_n_max_len(dense_engine):
    """Dr.GRPO on policy, end to end: L = -sum_i A_i |o_i| / (N L_max), with
    |o_i| = M_i = (2, 3, 1.5), A = (1, -2, 0.5), N = 3, L_max = 8. The loss does not
    change when the batch is repeated (the old 1/L_max normaliser doubled it)."""
    engine, params = dense_engine
    loss = ClippedSurrogateLoss.dr_grpo(max_len=8)
    want = -(1.0 * 2 + -2.0 * 3 + 0.5 * 1.5) / (3 * 8)
    value, grads, _ = engine.value_and_grad(params, _batch(), loss)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    twice = RolloutBatch.create(tokens=TOKENS * 2, loss_mask=MASKS * 2, advantages=ADV * 2)
    value2, grads2, _ = engine.value_and_grad(params, twice, loss)
    np.testing.assert_allclose(float(value2), want, rtol=1e-5)
    for g, g2 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_allclose(np.asarray(g2), np.asarray(g), rtol=1e-4, atol=1e-7)
