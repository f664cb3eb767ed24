"""Built-in tasks (generation, verifiers, tool) and the reward-function interface."""

import asyncio

import numpy as np
import pytest

from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rl.config import load_config
from dtarl.rl.rewards import RewardError, RewardErrorPolicy, compute_rewards
from dtarl.rl.tasks import (
    ArithmeticTask,
    CalculatorTask,
    CountdownTask,
    ExpressionError,
    Problem,
    Role,
    TaskKind,
    make_task,
    safe_eval,
)


@pytest.mark.parametrize("task", [ArithmeticTask(), CountdownTask(), CalculatorTask()])
def test_reference_solutions_score_one(task):
    rng = np.random.default_rng(0)
    problems = task.generate(rng, 20)
    again = task.generate(np.random.default_rng(0), 20)
    assert [p.prompt for p in problems] == [p.prompt for p in again]  # seeded
    tok = ByteTokenizer()
    for p in problems:
        completion = "".join(text for _, text in p.reference)
        assert task.reward(p, completion) == 1.0
        assert task.reward(p, "nonsense") == 0.0
        tok.encode(p.prompt + completion)  # byte-tokenizer friendly


def test_countdown_verifier_rules():
    t = CountdownTask()
    p = t.generate(np.random.default_rng(1), 1)[0]
    a, b, c = p.numbers
    assert t.reward(p, f"{a}+{a}+{a}+{a}") == 0.0 or p.numbers.count(a) >= 4
    assert t.reward(p, "__import__('os')") == 0.0
    with pytest.raises(ExpressionError):
        safe_eval("2**100")
    assert safe_eval("(2+3)*4") == (20, [2, 3, 4])


def test_countdown_uses_each_number_exactly_once():
    """2 3 4 > 6: "2*3" reaches 6 but leaves 4 out: 0 under the standard rule (the
    old verifier, "at most once", gave 1), 1 with allow_unused. "(4-2)*3" uses each
    number once; "4+2*3-4" uses 4 twice and "2*3*1" a number not given."""
    p = Problem(prompt="2 3 4>6:", answer="", reference=(), numbers=(2, 3, 4), target=6)
    exact, loose = CountdownTask(), CountdownTask(allow_unused=True)
    assert exact.reward(p, "2*3") == 0.0 and loose.reward(p, "2*3") == 1.0
    assert exact.reward(p, "4*3/2") == 0.0  # "/" is not an operator of the task
    assert exact.reward(p, "(4-2)*3") == 1.0 and loose.reward(p, "(4-2)*3") == 1.0
    for both in (exact, loose):
        assert both.reward(p, "4+2*3-4") == 0.0  # 4 twice
        assert both.reward(p, "2*3*1") == 0.0  # 1 is not given
    # The config reaches the task.
    on = make_task(TaskKind.COUNTDOWN, **load_config(None, ["task.kind=countdown"]).task.options())
    off = load_config(None, ["task.kind=countdown", "task.allow_unused=true"]).task.options()
    assert not on.allow_unused and make_task(TaskKind.COUNTDOWN, **off).allow_unused


def test_calculator_tool():
    t = CalculatorTask()
    p = t.generate(np.random.default_rng(0), 1)[0]
    assert [r for r, _ in p.reference] == [Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert t.tool(p, "[6*7]") == "=42;"
    assert t.tool(p, "[6*]") == "=error;"
    assert t.tool(p, "42") is None


def test_make_task_rejects_unknown_options():
    assert make_task(TaskKind.ARITHMETIC, max_operand=5).max_operand == 5
    with pytest.raises(ValueError, match="accepted"):
        make_task(TaskKind.COUNTDOWN, max_operand=5)


def test_sync_and_async_rewards():
    def sync(p, c):
        return float(c == "ok")

    async def slow(p, c):
        await asyncio.sleep(0.01)
        return float(c == "ok")

    for fn in (sync, slow):
        res = compute_rewards(fn, ["p"] * 3, ["ok", "no", "ok"])
        assert res.rewards.tolist() == [1.0, 0.0, 1.0] and res.errors == ()


def test_async_rewards_inside_a_running_loop():
    async def slow(p, c):
        return 1.0

    async def main():
        return compute_rewards(slow, ["p"], ["c"])

    assert asyncio.run(main()).rewards.tolist() == [1.0]


def test_raising_reward_names_the_sample_or_scores_zero():
    def bad(p, c):
        if c == "boom":
            raise KeyError("missing")
        return 1.0

    with pytest.raises(RewardError, match="sample 1 .*'boom'.*KeyError"):
        compute_rewards(bad, ["a", "b"], ["fine", "boom"])
    res = compute_rewards(bad, ["a", "b"], ["fine", "boom"], on_error=RewardErrorPolicy.ZERO)
    assert res.rewards.tolist() == [1.0, 0.0]
    assert res.errors[0][0] == 1

    async def nan(p, c):
        return float("nan")

    with pytest.raises(RewardError, match="not a finite float"):
        compute_rewards(nan, ["a"], ["c"])
