"""Reward functions: the interface, verl/TRL adapters, built-ins and the batch runner.

    from dtarl.rewards import RewardInput, compute_rewards, RewardSection
    fn = RewardSection(function="math").build_sample_reward()
    fn(RewardInput(prompt="2+2=", response="#### 4", ground_truth="4"))   # 1.0

``compute`` runs a ``(problem, completion)`` function over a batch (sync or async,
with an error policy); ``functions`` loads and adapts what ``reward.function``
names; ``builtin`` holds ``math``, ``format`` and ``exact``; ``config`` the section.
No JAX here: the layer is plain Python (floor 3).
"""

from __future__ import annotations

from dtarl.rewards.builtin import answers_equal, final_answer
from dtarl.rewards.compute import (
    RewardError,
    RewardErrorPolicy,
    RewardFn,
    RewardResult,
    compute_rewards,
)
from dtarl.rewards.config import RewardSection
from dtarl.rewards.functions import (
    RewardFunctionError,
    RewardInput,
    SampleReward,
    adapt,
    combine,
    load_function,
    problem_reward,
)

__all__ = [
    "RewardError",
    "RewardErrorPolicy",
    "RewardFn",
    "RewardFunctionError",
    "RewardInput",
    "RewardResult",
    "RewardSection",
    "SampleReward",
    "adapt",
    "answers_equal",
    "combine",
    "compute_rewards",
    "final_answer",
    "load_function",
    "problem_reward",
]
