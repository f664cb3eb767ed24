"""Advantage estimators: hand-computed cases."""

import numpy as np
import pytest

from dtarl import advantages as A


def test_grpo_group_normalised():
    r = np.array([1.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    g = np.array([0, 0, 0, 0, 1, 1])
    adv = A.grpo_advantages(r, g, eps=0.0)
    np.testing.assert_allclose(adv, [1, -1, 1, -1, 0, 0], atol=1e-6)
    adv = A.grpo_advantages(r, g, scale_std=False)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.5, -0.5, 0, 0], atol=1e-6)


def test_grpo_std_ddof():
    """Group (1, 0, 0, 0): mean 0.25, squared deviations sum 0.75. ddof=0 (default):
    std = sqrt(0.75 / 4) = 0.4330; ddof=1: sqrt(0.75 / 3) = 0.5. A group of one is 0
    under both (no n - 1 = 0 division)."""
    r = np.array([1.0, 0.0, 0.0, 0.0, 7.0])
    g = np.array([0, 0, 0, 0, 1])
    centred = np.array([0.75, -0.25, -0.25, -0.25, 0.0])
    pop = A.grpo_advantages(r, g, eps=0.0)
    np.testing.assert_allclose(pop, centred / np.sqrt(0.75 / 4) * [1, 1, 1, 1, 0], atol=1e-6)
    unbiased = A.grpo_advantages(r, g, eps=0.0, ddof=1)
    np.testing.assert_allclose(unbiased, centred / 0.5, atol=1e-6)
    with pytest.raises(ValueError, match="ddof=2"):
        A.grpo_advantages(r, g, ddof=2)


def test_grpo_rejects_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        A.grpo_advantages([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="rewards\\[1\\]"):
        A.grpo_advantages([1.0, np.nan], [0, 0])


def test_dynamic_sampling_drops_equal_groups():
    keep = A.dynamic_sampling_mask([1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 2, 2])
    assert keep.tolist() == [False, False, True, True, False, False]


def test_overlong_penalty():
    out = A.overlong_penalty([5, 8, 9, 10, 11], max_len=10, buffer=2)
    np.testing.assert_allclose(out, [0, 0, -0.5, -1.0, -1.0])


def test_gae_hand_computed():
    # actions at t = 2, 3 (mask); gamma = 1, lam = 0.5
    r = np.array([0, 0, 0.0, 1.0])
    v = np.array([0, 0, 0.5, 0.25])
    m = np.array([0, 0, 1, 1])
    adv, ret = A.gae_advantages(r, v, m, gamma=1.0, lam=0.5)
    d3 = 1.0 - 0.25
    d2 = 0.0 + 0.25 - 0.5
    np.testing.assert_allclose(adv, [0, 0, d2 + 0.5 * d3, d3], atol=1e-6)
    np.testing.assert_allclose(ret, [0, 0, d2 + 0.5 * d3 + 0.5, d3 + 0.25], atol=1e-6)


def test_gae_skips_tool_tokens():
    # a masked-out tool token between two actions is skipped by the recursion
    adv, _ = A.gae_advantages([0, 0, 0, 1.0], [0, 0.1, 9.0, 0.2], [0, 1, 0, 1], gamma=1, lam=1)
    np.testing.assert_allclose(adv, [0, 1.0 - 0.1, 0, 1.0 - 0.2], atol=1e-6)


def test_kl_penalty_rewards_and_token_kl():
    r = A.kl_penalty_rewards(2.0, [0, -1.0, -2.0], [0, -1.5, -2.0], [0, 1, 1], kl_coef=0.1)
    np.testing.assert_allclose(r, [0, -0.05, 2.0], atol=1e-6)
    assert A.token_kl([0, -1.0], [0, -1.0], [0, 1]) == 0.0
    d = 0.5
    np.testing.assert_allclose(A.token_kl([0, -1.0], [0, -0.5], [0, 1]), np.exp(d) - d - 1)


def test_whiten():
    w = A.whiten([1.0, 2.0, 3.0, 100.0], [1, 1, 1, 0])
    np.testing.assert_allclose(w[:3], [-1.2247449, 0, 1.2247449], atol=1e-6)
    assert w[3] == 0
