"""Built-in tasks (generation, verifiers, tool) and the reward-function interface."""

import asyncio

import numpy as np
import pytest

from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rewards import RewardError, RewardErrorPolicy, compute_rewards
from dtarl.rl.config import ConfigError, load_config
from dtarl.rl.tasks import (
    ArithmeticTask,
    CalculatorTask,
    CountdownTask,
    ExpressionError,
    Problem,
    Role,
    TaskKind,
    VerboseArithmeticTask,
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


def test_verbose_arithmetic_reward_and_steps():
    t = VerboseArithmeticTask()
    p = Problem(prompt="17+5=", answer="22", reference=())
    assert t.reward(p, "#22") == 1.0
    assert t.reward(p, "7+5=12;10+12=22;so 22;#22") == 1.0
    assert t.reward(p, "#21") == 0.0
    assert t.reward(p, "so 22;") == 0.0  # no answer marker
    assert t.reward(p, "#21;so 22;#22 ") == 1.0  # the last marker's answer counts
    assert t.reward(p, "#22;so 21;#21") == 0.0
    # The step pool of 17+5 by hand, and of 13-6 (negative units part).
    assert t.steps(17, "+", 5) == ["17=10+7;", "7+5=12;", "10+12=22;", "22-5=17;", "so 22;"]
    assert t.steps(13, "-", 6) == ["13=10+3;", "3-6=-3;", "10-3=7;", "7+6=13;", "so 7;"]

    def value(side: str) -> int:  # safe_eval has no unary minus: "-3" as "0-3"
        return safe_eval("0" + side if side.startswith("-") else side)[0]

    for a, op, b in [(17, "+", 5), (13, "-", 6), (0, "-", 9), (9, "+", 9)]:
        for step in t.steps(a, op, b):  # every step is a true statement
            if "=" in step:
                lhs, rhs = step.rstrip(";").split("=")
                assert value(lhs) == value(rhs), step


def test_verbose_arithmetic_references_are_long_tailed():
    t = VerboseArithmeticTask(max_operand=9, short_fraction=0.4, wrong_fraction=0.15)
    problems = t.generate(np.random.default_rng(0), 2000)
    again = t.generate(np.random.default_rng(0), 2000)
    assert [p.reference for p in problems] == [p.reference for p in again]  # seeded
    texts = [p.reference[0][1] for p in problems]
    lens = np.asarray([len(ByteTokenizer().encode(x)) for x in texts])
    rewards = np.asarray([t.reward(p, x) for p, x in zip(problems, texts, strict=True)])
    short = np.asarray([x.startswith("#") for x in texts])
    # 40% short (15% of all wrong, off by 1-3), 60% verbose and always correct.
    assert abs(short.mean() - 0.4) < 0.04
    assert abs((rewards == 0).mean() - 0.15) < 0.03
    assert (rewards[~short] == 1).all() and (rewards[short] == 0).any()
    assert all(t.reward(p, f"#{p.answer}") == 1 for p in problems[:50])
    # Varied lengths with a long tail: p90 several times the median, capped by the
    # 8 steps of at most 10 bytes each plus the answer.
    med, p90, top = np.percentile(lens, [50, 90, 100])
    assert len(np.unique(lens)) > 20
    assert p90 >= 3 * med and top > 2 * p90
    assert top <= 8 * 10 + 3
    # The verbosity tail follows Geometric(0.4): P(v >= 5 | verbose) = 0.6^4 ~ 0.13.
    steps = np.asarray([x.count(";") for x in texts])[~short]
    assert abs((steps >= 5).mean() - 0.6**4) < 0.04 and steps.max() == 8


def test_verbose_arithmetic_config():
    cfg = load_config(None, ["task.kind=verbose_arithmetic", "task.max_verbosity=4"])
    task = make_task(cfg.task.kind, **cfg.task.options())
    assert isinstance(task, VerboseArithmeticTask) and task.max_verbosity == 4
    with pytest.raises(ConfigError, match="task.wrong_fraction=0.5 must be in"):
        load_config(None, ["task.kind=verbose_arithmetic", "task.wrong_fraction=0.5"])
    with pytest.raises(ConfigError, match="subset of '\\+-'"):
        load_config(None, ["task.kind=verbose_arithmetic", "task.ops='*'"])
    with pytest.raises(ConfigError, match="task.max_verbosity=0 must be > 0"):
        load_config(None, ["task.kind=verbose_arithmetic", "task.max_verbosity=0"])
    with pytest.raises(ConfigError, match="only task.kind=verbose_arithmetic"):
        load_config(None, ["task.kind=arithmetic", "task.short_fraction=0.2"])
    with pytest.raises(ValueError, match="wrong_fraction"):
        VerboseArithmeticTask(short_fraction=0.1, wrong_fraction=0.2)
