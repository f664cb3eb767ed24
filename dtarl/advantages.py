"""Advantage estimators and reward shaping as pure functions (numpy on the host).

Ground floor: the RL trainer (``dtarl.rl``) and the trace workloads
(``dtarl.traces.workload``) share these.

Letters: N sequences, T tokens (per-token arrays of one sequence or [N, T] padded).

GRPO    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)          g = group of i   (grpo_advantages)
Dr.GRPO A_i =  r_i - mean_g(r)                               (no std scaling; scale_std=False)
DAPO    dynamic sampling: drop groups whose rewards are all equal (dynamic_sampling_mask);
        overlong shaping (overlong_penalty); clip-higher and token-level loss live in
        ``ClippedSurrogateLoss.dapo()``.
PPO     GAE over per-token rewards and values (gae_advantages), optional KL-in-reward
        (kl_penalty_rewards).
"""

from __future__ import annotations

import numpy as np


def _check_groups(rewards_N, group_ids_N, dtype=np.float64):
    r = np.asarray(rewards_N, dtype).reshape(-1)
    g = np.asarray(group_ids_N).reshape(-1)
    if r.shape != g.shape:
        raise ValueError(f"rewards {r.shape} and group_ids {g.shape} must have the same shape [N]")
    if not np.all(np.isfinite(r)):
        bad = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"rewards[{bad}] = {r[bad]} is not finite")
    return r, g


def grpo_advantages(
    rewards_N,
    group_ids_N,
    *,
    scale_std: bool = True,
    eps: float = 1e-6,
    ddof: int = 0,
    compute_dtype=np.float64,
) -> np.ndarray:
    """Group-normalised advantages, as float32.

        A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)   (GRPO)
        A_i =  r_i - mean_{j in g(i)} r_j                    (Dr.GRPO: scale_std=False)

    std_g = sqrt(sum_j (r_j - mean_g)^2 / (|g| - ddof)): ``ddof=0`` the population
    std (the default, as DeepSeekMath's GRPO and verl), ``ddof=1`` the unbiased
    sample std (torch's ``std()``, TRL). A group of one, or one whose rewards are
    all equal, gets A = 0. The means and stds are taken in ``compute_dtype``
    (the trainer: float64; the trace workloads: float32).
    """
    if ddof not in (0, 1):
        raise ValueError(f"ddof={ddof} must be 0 (population std) or 1 (unbiased)")
    r, g = _check_groups(rewards_N, group_ids_N, compute_dtype)
    adv = np.zeros_like(r)
    for gid in np.unique(g):
        sel = g == gid
        centred = r[sel] - r[sel].mean()
        sd = r[sel].std(ddof=ddof) if sel.sum() > ddof else 0.0
        if scale_std:
            adv[sel] = centred / (sd + eps) if sd + eps > 0 else 0.0
        else:
            adv[sel] = centred
    return adv.astype(np.float32)


def dynamic_sampling_mask(rewards_N, group_ids_N, *, atol: float = 0.0) -> np.ndarray:
    """DAPO dynamic sampling: keep_i = (max_g r - min_g r > atol) for i's group g.

    Groups whose rewards are all equal carry no GRPO signal (A = 0) and are dropped.
    """
    r, g = _check_groups(rewards_N, group_ids_N)
    keep = np.zeros(r.shape, bool)
    for gid in np.unique(g):
        sel = g == gid
        keep[sel] = (r[sel].max() - r[sel].min()) > atol
    return keep


def overlong_penalty(lengths_N, *, max_len: int, buffer: int) -> np.ndarray:
    """DAPO soft overlong punishment, added to the reward:

    R(y) = 0                          if |y| <= L_max - L_cache
         = (L_max - L_cache - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
         = -1                         if |y| > L_max
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer} must be in (0, max_len={max_len}]")
    n = np.asarray(lengths_N, np.float64)
    soft = max_len - buffer
    out = np.where(n <= soft, 0.0, (soft - n) / buffer)
    return np.where(n > max_len, -1.0, out).astype(np.float32)


def gae_advantages(
    rewards_T, values_T, mask_T, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one sequence's response tokens.

        delta_t = r_t + gamma V_{t+1} - V_t        (V past the last action = 0)
        A_t     = delta_t + gamma lam A_{t+1}
        R_t     = A_t + V_t                         (value targets)

    Only positions with mask_t > 0 are actions; the recursion skips the others
    (prompt / tool-output tokens), so A and R are 0 there. Returns (A_T, R_T).
    """
    r = np.asarray(rewards_T, np.float64)
    v = np.asarray(values_T, np.float64)
    m = np.asarray(mask_T) > 0
    if not r.shape == v.shape == m.shape:
        raise ValueError(f"rewards {r.shape}, values {v.shape}, mask {m.shape} must match")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma={gamma} and lam={lam} must be in [0, 1]")
    adv = np.zeros_like(r)
    next_v, next_a = 0.0, 0.0
    for t in range(r.shape[0] - 1, -1, -1):
        if not m[t]:
            continue
        delta = r[t] + gamma * next_v - v[t]
        next_a = delta + gamma * lam * next_a
        adv[t] = next_a
        next_v = v[t]
    ret = np.where(m, adv + v, 0.0)
    return adv.astype(np.float32), ret.astype(np.float32)


def kl_penalty_rewards(
    reward: float, logprobs_T, ref_logprobs_T, mask_T, *, kl_coef: float
) -> np.ndarray:
    """Per-token rewards with a KL-to-reference penalty (PPO-RLHF):

    r_t = -beta (logp_t - logp_ref_t)     for every action token
    r_T += reward                         at the last action token
    """
    m = np.asarray(mask_T) > 0
    kl = np.asarray(logprobs_T, np.float64) - np.asarray(ref_logprobs_T, np.float64)
    r = np.where(m, -kl_coef * kl, 0.0)
    idx = np.flatnonzero(m)
    if idx.size:
        r[idx[-1]] += reward
    return r.astype(np.float32)


def whiten(x_N, mask_N=None, *, eps: float = 1e-8) -> np.ndarray:
    """(x - mean) / (std + eps) over the masked entries (PPO advantage normalisation)."""
    x = np.asarray(x_N, np.float64)
    m = np.ones_like(x, bool) if mask_N is None else np.asarray(mask_N) > 0
    if not m.any():
        return np.zeros_like(x, np.float32)
    mu, sd = x[m].mean(), x[m].std()
    return np.where(m, (x - mu) / (sd + eps), 0.0).astype(np.float32)


def token_kl(logp_T, ref_logp_T, mask_T) -> float:
    """Masked mean k3 KL estimate: E[exp(ref - logp) - (ref - logp) - 1]."""
    m = np.asarray(mask_T, np.float64)
    d = np.asarray(ref_logp_T, np.float64) - np.asarray(logp_T, np.float64)
    k3 = np.exp(d) - d - 1.0
    return float((m * k3).sum() / max(m.sum(), 1.0))


__all__ = [
    "dynamic_sampling_mask",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty_rewards",
    "overlong_penalty",
    "token_kl",
    "whiten",
]
