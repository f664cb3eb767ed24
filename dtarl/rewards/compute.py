"""Running a reward function over a batch: sync or async callables, with an error policy.

The trainer's reward function takes a problem and the model's completion text and
returns a float, or a dict whose ``score`` is the reward and whose other numbers are
metrics (verl's ``compute_score`` convention)::

    def reward(problem, completion: str) -> float | dict            # sync
    async def reward(problem, completion: str) -> float | dict      # async (tool-like latency)

(``dtarl.rewards.functions`` adapts verl, TRL and dtarl's by-name signatures to it.)

``compute_rewards`` evaluates one per sample; async functions run concurrently
(at most ``max_concurrency`` at a time) on an event loop of their own, which
also works inside Jupyter's running loop. A function that raises or returns a
non-finite value either stops training with a ``RewardError`` naming the sample
(``RewardErrorPolicy.RAISE``) or scores the sample 0 and reports it (``ZERO``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

RewardFn = Callable[[Any, str], "float | dict | Awaitable[float | dict]"]


class RewardErrorPolicy(enum.Enum):
    RAISE = "raise"  # stop with a RewardError naming the sample
    ZERO = "zero"  # score the sample 0 and count it in the metrics


class RewardError(RuntimeError):
    """A reward function failed; the message names the sample, its prompt and completion."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
    rewards: np.ndarray  # [N] float32
    errors: tuple[tuple[int, str], ...]  # (sample index, message) scored 0 under ZERO
    # A dict result's other numbers, per key: [N] float64, NaN where a sample had none.
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def extra_means(self, prefix: str = "") -> dict[str, float]:
        """``{prefix + key: mean}`` of each extra over the samples that reported it."""
        out = {}
        for k, v in sorted(self.extras.items()):
            ok = np.isfinite(v)
            if ok.any():
                out[prefix + k] = float(v[ok].mean())
        return out


def _short(s: str, n: int = 80) -> str:
    s = repr(s)
    return s if len(s) <= n else s[: n - 3] + "..."


def _describe(i: int, problem, completion: str, err: str) -> str:
    prompt = getattr(problem, "prompt", problem)
    return (
        f"reward function failed on sample {i} (prompt {_short(str(prompt))}, completion "
        f"{_short(completion)}): {err}. Fix the reward function, or set "
        "reward.on_error=zero to score such samples 0"
    )


def _run_coro(coro):
    """``asyncio.run`` that also works when the caller already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def compute_rewards(
    fn: RewardFn,
    problems: Sequence[Any],
    completions: Sequence[str],
    *,
    on_error: RewardErrorPolicy = RewardErrorPolicy.RAISE,
    max_concurrency: int = 64,
) -> RewardResult:
    """r_i = fn(problems[i], completions[i]) for every sample (see the module docstring)."""
    if len(problems) != len(completions):
        raise ValueError(
            f"problems ({len(problems)}) and completions ({len(completions)}) differ in length"
        )
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    n = len(problems)
    out = np.zeros(n, np.float32)
    errors: list[tuple[int, str]] = []
    extras: dict[str, np.ndarray] = {}

    def check(i: int, value) -> None:
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(
                    f"returned a dict without 'score' (keys {sorted(value)}); a dict result "
                    "needs 'score' (the reward), its other numbers are logged as metrics"
                )
            for k, x in value.items():
                if k != "score" and _is_number(x):
                    extras.setdefault(str(k), np.full(n, np.nan))[i] = float(x)
            value = value["score"]
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"returned {value!r}, not a float") from None
        if not math.isfinite(v):
            raise ValueError(f"returned {v}, not a finite float")
        out[i] = v

    def fail(i: int, e: BaseException) -> None:
        msg = _describe(i, problems[i], completions[i], f"{type(e).__name__}: {e}")
        if on_error is RewardErrorPolicy.RAISE:
            raise RewardError(msg) from e
        out[i] = 0.0
        errors.append((i, msg))

    pending: list[tuple[int, Awaitable]] = []
    for i in range(n):
        try:
            value = fn(problems[i], completions[i])
        except Exception as e:
            fail(i, e)
            continue
        if inspect.isawaitable(value):
            pending.append((i, value))
            continue
        try:
            check(i, value)
        except ValueError as e:
            fail(i, e)
    if pending:

        async def gather():
            sem = asyncio.Semaphore(max_concurrency)

            async def one(aw):
                async with sem:
                    return await aw

            return await asyncio.gather(*(one(aw) for _, aw in pending), return_exceptions=True)

        values = _run_coro(gather())
        for (i, _), value in zip(pending, values, strict=True):
            if isinstance(value, BaseException):
                fail(i, value)
                continue
            try:
                check(i, value)
            except ValueError as e:
                fail(i, e)
    errors.sort()
    return RewardResult(rewards=out, errors=tuple(errors), extras=extras)


def _is_number(x) -> bool:
    """A metric-able value of a reward dict (bools count as 0/1; strings are not metrics)."""
    return isinstance(x, int | float | np.number) and math.isfinite(float(x))


__all__ = ["RewardError", "RewardErrorPolicy", "RewardFn", "RewardResult", "compute_rewards"]
