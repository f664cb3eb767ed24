"""Evaluation on held-out problems with the run's reward function.

    greedy pass@1   the fraction of problems whose greedy response succeeds
    pass@k          the fraction with at least one success among k samples at the
                    rollout temperature (k = ``eval.num_samples``; the unbiased
                    estimator of pass@k with n = k samples)
    reward_mean     the mean reward of the greedy responses

A response succeeds when its reward is >= 1 (the built-in tasks and rewards score 0
or 1; ``success_rate``). A raising reward function scores 0 here (counted in
``val/reward_errors``) whatever ``reward.on_error`` says: evaluation never stops a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dtarl.rewards import RewardErrorPolicy, RewardFn, compute_rewards
from dtarl.rl.episodes import process_rollout, rollout, success_rate
from dtarl.rl.tasks import Problem, Task


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalResult:
    """One evaluation; ``metrics()`` names its numbers as logged (verl's ``val/``)."""

    num_problems: int
    pass_at_1: float  # greedy
    reward_mean: float  # greedy
    response_length_mean: float  # greedy, tokens
    reward_errors: int
    k: int = 1
    pass_at_k: float | None = None  # with k > 1

    def metrics(self) -> dict[str, float]:
        m = {
            "val/pass@1": self.pass_at_1,
            "val/reward_mean": self.reward_mean,
            "val/response_length/mean": self.response_length_mean,
            "val/reward_errors": self.reward_errors,
        }
        if self.pass_at_k is not None:
            m[f"val/pass@{self.k}"] = self.pass_at_k
            m["val/pass@k"] = self.pass_at_k
        return m


def _sample(sampler, params, tokenizer, task, problems, *, group_size, key, processes):
    trajs, _ = (process_rollout if processes else rollout)(
        sampler, params, tokenizer, task, problems, group_size=group_size, key=key
    )
    return trajs


def evaluate_policy(
    greedy_sampler,
    params,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    reward_fn: RewardFn | None = None,
    processes: bool = False,
    sampler=None,
    k: int = 1,
    chunk: int = 0,
    key: jax.Array | None = None,
) -> EvalResult | None:
    """Greedy pass@1 and reward of ``problems`` under ``params`` scored by ``reward_fn``
    (default: the task's verifier), and pass@k with k > 1 samples per problem from
    ``sampler`` (the rollout sampler, ``chunk`` problems per call: its prompts per
    step), keyed by ``key``. ``processes``: each process decodes its share. None
    without problems."""
    if not problems:
        return None
    reward_fn = task.reward if reward_fn is None else reward_fn
    zero = RewardErrorPolicy.ZERO
    key = jax.random.PRNGKey(0) if key is None else key
    trajs = _sample(
        greedy_sampler,
        params,
        tokenizer,
        task,
        problems,
        group_size=1,
        key=key,
        processes=processes,
    )
    res = compute_rewards(reward_fn, problems, [t.completion for t in trajs], on_error=zero)
    errors = len(res.errors)
    pass_k = None
    if k > 1:
        if sampler is None:
            raise ValueError("evaluate_policy: pass@k (k > 1) needs the rollout sampler")
        step = chunk or len(problems)
        solved = np.zeros(len(problems), bool)
        for start in range(0, len(problems), step):
            part = list(problems[start : start + step])
            sub = jax.random.fold_in(key, 1 + start)
            ts = _sample(
                sampler,
                params,
                tokenizer,
                task,
                part,
                group_size=k,
                key=sub,
                processes=processes,
            )
            owners = [part[t.problem_index] for t in ts]
            r = compute_rewards(reward_fn, owners, [t.completion for t in ts], on_error=zero)
            errors += len(r.errors)
            for t, v in zip(ts, r.rewards, strict=True):
                solved[start + t.problem_index] |= bool(v >= 1.0)
        pass_k = float(solved.mean())
    return EvalResult(
        num_problems=len(problems),
        pass_at_1=success_rate(res.rewards),
        reward_mean=float(np.mean(res.rewards)),
        response_length_mean=float(np.mean([t.response_len for t in trajs])),
        reward_errors=errors,
        k=k,
        pass_at_k=pass_k,
    )


def greedy_success_rate(
    sampler, params, tokenizer, task: Task, problems: Sequence[Problem], *, processes: bool
) -> float:
    """The fraction of ``problems`` that ``sampler`` (greedy) solves with ``params``,
    by the task's own verifier (``evaluate_policy``'s pass@1). NaN without problems."""
    res = evaluate_policy(sampler, params, tokenizer, task, problems, processes=processes)
    return float("nan") if res is None else res.pass_at_1


__all__ = ["EvalResult", "evaluate_policy", "greedy_success_rate"]
