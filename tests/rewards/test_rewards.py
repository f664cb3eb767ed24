"""Reward functions from config: built-ins, verl/TRL/dtarl signatures, lists with
weights, async concurrency, error policies and the errors that name the key."""

import asyncio
import textwrap

import numpy as np
import pytest

from dtarl.errors import ConfigError
from dtarl.rewards import (
    RewardError,
    RewardErrorPolicy,
    RewardInput,
    RewardSection,
    compute_rewards,
    final_answer,
    problem_reward,
)
from dtarl.rewards.builtin import math_reward
from dtarl.rl.config import load_config
from dtarl.rl.tasks import ArithmeticTask


def x(response, ground_truth="4", **kw):
    return RewardInput(prompt="2+2=", response=response, ground_truth=ground_truth, **kw)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{x^{2}}", "x^{2}"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("it is 3, no 1,250 apples", "1,250"),
        ("no number here", None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_math_reward_builtin():
    assert math_reward(x("The answer is \\boxed{4}")) == 1.0
    assert math_reward(x("#### 4.0")) == 1.0
    assert math_reward(x("#### 5")) == 0.0
    assert math_reward(x("nothing")) == 0.0
    # The ground truth in GSM8K's solution format; thousands separators.
    assert math_reward(x("so 1,234", ground_truth="48+1186 = 1234\n#### 1234")) == 1.0
    # Equivalent, not equal as strings: math-verify decides.
    pytest.importorskip("math_verify")
    assert math_reward(x("\\boxed{0.5}", ground_truth="\\frac{1}{2}")) == 1.0
    assert math_reward(x("\\boxed{0.6}", ground_truth="\\frac{1}{2}")) == 0.0


def test_format_and_exact_builtins():
    fn = RewardSection(
        function="format", format_pattern=r"<think>.*</think>\d+"
    ).build_sample_reward()
    assert fn(x("<think>a\nb</think>4")) == 1.0
    assert fn(x("<think>a</think>4 extra")) == 0.0
    ex = RewardSection(function="exact").build_sample_reward()
    assert ex(x(" 4\n")) == 1.0 and ex(x("04")) == 0.0


VERL_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = float(solution_str.strip() == ground_truth)
    return {"score": ok, "length": len(solution_str), "pred": solution_str, "src": 1.0}

def trl_reward(prompts, completions, ground_truth, **kwargs):
    return [float(c == g) + 0.5 * ("hint" in kwargs) for c, g in zip(completions, ground_truth)]

def by_name(response, ground_truth):
    return 2.0 if response == ground_truth else 0.0

def problem_style(problem, completion):
    return float(completion == problem.answer)

def broken(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("missing field")

def odd(a, b, c):
    return 0.0
"""


@pytest.fixture
def rfile(tmp_path):
    p = tmp_path / "my_reward.py"
    p.write_text(textwrap.dedent(VERL_FILE))
    return str(p)


def test_verl_file_default_name_and_dict_metrics(rfile):
    fn = RewardSection(function=rfile).build(data_source="arithmetic")
    probs = ArithmeticTask(max_operand=5).generate(np.random.default_rng(0), 3)
    comps = [probs[0].answer, "zz", probs[2].answer]
    res = compute_rewards(fn, probs, comps)
    np.testing.assert_array_equal(res.rewards, [1.0, 0.0, 1.0])
    # Its other numbers are metrics (the string "pred" is not).
    assert set(res.extras) == {"length", "src"}
    assert res.extra_means() == {"length": np.mean([len(c) for c in comps]), "src": 1.0}


def test_trl_by_name_and_problem_signatures(rfile):
    extra = {"hint": "x"}
    trl = RewardSection(function=f"{rfile}:trl_reward").build_sample_reward()
    assert trl(x("4")) == 1.0 and trl(x("4", extra_info=extra)) == 1.5
    assert RewardSection(function=f"{rfile}:by_name").build_sample_reward()(x("4")) == 2.0
    prob = ArithmeticTask().generate(np.random.default_rng(1), 1)[0]
    fn = RewardSection(function=f"{rfile}:problem_style").build()
    assert fn(prob, prob.answer) == 1.0 and fn(prob, prob.answer + "0") == 0.0
    # A dataset row as a mapping: its keys fill the input.
    row = {"prompt": "1+1=", "answer": "2", "data_source": "gsm8k", "extra_info": {"hint": 1}}
    seen = problem_reward(lambda sample: sample)(row, "2")
    assert (seen.prompt, seen.ground_truth, seen.data_source, seen.extra_info) == (
        "1+1=",
        "2",
        "gsm8k",
        {"hint": 1},
    )
    with pytest.raises(ConfigError, match=r"reward.function=.*odd.*parameters \['a', 'b', 'c'\]"):
        RewardSection(function=f"{rfile}:odd").build()


def test_module_spec_and_weighted_list(rfile):
    sec = RewardSection(
        function=("dtarl.rewards.builtin:exact_reward", f"{rfile}:by_name", "math"),
        weights=(1.0, 0.25, 2.0),
    )
    out = sec.build_sample_reward()(x("4"))
    assert out == {"exact_reward": 1.0, "by_name": 2.0, "math": 1.0, "score": 1.0 + 0.5 + 2.0}
    probs = ArithmeticTask().generate(np.random.default_rng(2), 2)
    res = compute_rewards(sec.build(), probs, [probs[0].answer, "x"])
    np.testing.assert_allclose(res.rewards, [3.5, 0.0])
    assert res.extra_means() == {"by_name": 1.0, "exact_reward": 0.5, "math": 0.5}


def test_async_functions_run_concurrently_with_a_bound(tmp_path):
    state = {"now": 0, "peak": 0}

    async def slow(response, ground_truth):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return float(response == ground_truth)

    import sys
    import types

    mod = types.ModuleType("dtarl_test_async_reward")
    mod.slow = slow
    sys.modules[mod.__name__] = mod
    try:
        fn = RewardSection(function=f"{mod.__name__}:slow").build()
        probs = ArithmeticTask().generate(np.random.default_rng(3), 12)
        res = compute_rewards(fn, probs, [p.answer for p in probs], max_concurrency=3)
    finally:
        del sys.modules[mod.__name__]
    np.testing.assert_array_equal(res.rewards, np.ones(12))
    assert state["peak"] == 3  # all 12 were started together, three at a time


def test_on_error_names_the_key(rfile):
    sec = RewardSection(function=(f"{rfile}:by_name", f"{rfile}:broken"))
    probs = ArithmeticTask().generate(np.random.default_rng(4), 2)
    with pytest.raises(RewardError, match=r"reward.function\[1\]=.*:broken' raised KeyError"):
        compute_rewards(sec.build(), probs, ["1", "2"])
    res = compute_rewards(sec.build(), probs, ["1", "2"], on_error=RewardErrorPolicy.ZERO)
    np.testing.assert_array_equal(res.rewards, [0.0, 0.0])
    assert len(res.errors) == 2 and "missing field" in res.errors[0][1]


@pytest.mark.parametrize(
    "sets, match",
    [
        (["reward.function=nope.py"], r"reward.function='nope.py': no such file"),
        (
            ["reward.function=RFILE:missing"],
            r"has no function 'missing'; its functions: \[.*by_name",
        ),
        (["reward.function=no_such_pkg_x.mod:f"], r"cannot import module 'no_such_pkg_x.mod'"),
        (["reward.function=mathh"], r"expected 'path/to/file.py\[:name\]'"),
        (["reward.function=[math, exact]", "reward.weights=[1.0]"], r"reward.weights has 1"),
        (["reward.function=format"], r"set reward.format_pattern"),
        (["reward.function=[]"], r"non-empty list"),
        (["reward_on_error=zero"], r"reward_on_error is now reward.on_error"),
        (
            ["reward.on_error=skip"],
            r"reward.on_error='skip' is not valid; accepted: \['raise', 'zero'\]",
        ),
    ],
)
def test_bad_reward_config(rfile, sets, match):
    with pytest.raises(ConfigError, match=match):
        cfg = load_config(None, [s.replace("RFILE", rfile) for s in sets])
        cfg.reward.build()


def test_config_round_trip():
    from dtarl.rl.config import TrainerConfig, from_dict, to_dict

    for fn in ("math", ("math", "exact")):
        cfg = load_config(None).replace(
            reward=RewardSection(function=fn, weights=(1.0,) * (1 + (fn != "math")))
        )
        assert from_dict(TrainerConfig, to_dict(cfg)) == cfg


def test_math_builtin_on_a_procedural_task():
    """``reward.function: math`` replaces the arithmetic task's verifier: it agrees on
    exact answers and wrong ones, and reads the last number of a longer response."""
    task = ArithmeticTask(max_operand=9, ops="+-")
    probs = task.generate(np.random.default_rng(5), 20)
    fn = RewardSection(function="math").build(data_source=task.kind.value)
    comps = [p.answer if i % 2 else str(int(p.answer) + 1) for i, p in enumerate(probs)]
    res = compute_rewards(fn, probs, comps)
    expected = [task.reward(p, c) for p, c in zip(probs, comps, strict=True)]
    np.testing.assert_array_equal(res.rewards, expected)
    assert fn(probs[0], f"so it is {probs[0].answer}") == 1.0
    assert task.reward(probs[0], f"so it is {probs[0].answer}") == 0.0
