"""Greedy evaluation: the success rate of a policy on a fixed set of problems."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from dtarl.rewards import RewardErrorPolicy, compute_rewards
from dtarl.rl.episodes import process_rollout, rollout, success_rate
from dtarl.rl.tasks import Problem, Task


def greedy_success_rate(
    sampler, params, tokenizer, task: Task, problems: Sequence[Problem], *, processes: bool
) -> float:
    """The fraction of ``problems`` that ``sampler`` (greedy) solves with ``params``,
    by the task's own verifier (a raising verifier scores 0); ``processes``: each
    process decodes its share (``process_rollout``). NaN without problems."""
    if not problems:
        return float("nan")
    trajs, _ = (process_rollout if processes else rollout)(
        sampler, params, tokenizer, task, problems, group_size=1, key=jax.random.PRNGKey(0)
    )
    completions = [t.completion for t in trajs]
    res = compute_rewards(task.reward, problems, completions, on_error=RewardErrorPolicy.ZERO)
    return success_rate(res.rewards)


__all__ = ["greedy_success_rate"]
