"""Test doubles that ship with the package: tiny models and synthetic rollout batches.

Used by the tests, the benchmarks and the notebooks so everything runs on a CPU.
"""

from __future__ import annotations

import numpy as np

from dtarl.batch import RolloutBatch
from dtarl.model.config import ModelConfig, ModelFamily


def tiny_config(family: ModelFamily = ModelFamily.QWEN3, **overrides) -> ModelConfig:
    return ModelConfig.tiny(family, **overrides)


def grpo_groups(
    *,
    num_groups: int,
    group_size: int,
    prompt_len: int,
    response_len: int | tuple[int, int],
    vocab_size: int = 256,
    seed: int = 0,
    with_old_logprobs: bool = False,
) -> RolloutBatch:
    """GRPO-shaped batch: each group's responses share one prompt.

    ``response_len`` is a fixed length or an inclusive (low, high) range.
    Advantages are group-normalised random rewards.
    """
    rs = np.random.RandomState(seed)
    toks, plens, gids = [], [], []
    for g in range(num_groups):
        prompt = rs.randint(3, vocab_size, prompt_len)
        for _ in range(group_size):
            if isinstance(response_len, tuple):
                n = rs.randint(response_len[0], response_len[1] + 1)
            else:
                n = response_len
            toks.append(np.concatenate([prompt, rs.randint(3, vocab_size, n)]))
            plens.append(prompt_len)
            gids.append(g)
    rewards = rs.rand(len(toks)).astype(np.float32)
    gid = np.array(gids)
    adv = np.zeros_like(rewards)
    for g in range(num_groups):
        r = rewards[gid == g]
        adv[gid == g] = (r - r.mean()) / (r.std() + 1e-6)
    old = [-(rs.rand(len(t)) * 4.0 + 1.0) for t in toks] if with_old_logprobs else None
    return RolloutBatch.create(
        tokens=toks,
        prompt_lens=plens,
        advantages=adv,
        group_ids=gid,
        rewards=rewards,
        old_logprobs=old,
    )


__all__ = ["grpo_groups", "tiny_config"]
