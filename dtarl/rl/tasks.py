"""Built-in verifiable tasks, generated procedurally (no downloads), byte-tokenizer friendly.

ARITHMETIC   ``17+5=``            -> ``22``                       reward 1 iff the answer is exact
COUNTDOWN    ``3 5 7>22:``        -> ``3*5+7``                    reward 1 iff a valid expression
                                                                  using each given number exactly
                                                                  once equals the target (at most
                                                                  once: ``allow_unused=True``)
CALCULATOR   ``37*12+5=``         -> ``[37*12]`` (tool) ``=444;`` then ``449``
             multi-turn: a turn that ends in ``]`` is a calculator call; the tool appends
             ``=value;`` (masked out of the loss) and generation continues. Reward 1 iff
             the final answer is exact. Samples that make the same calls share earlier
             turns, so their trajectories form multi-level prefix trees.
VERBOSE_ARITHMETIC ``17+5=``      -> ``7+5=12;10+12=22;22-5=17;#22``   reward 1 iff the text
             after the last ``#`` is the exact answer. The SFT references carry a
             scratchpad of random verbosity (0 to ``max_verbosity`` partly redundant
             steps, long-tailed): short correct, verbose correct, and a
             ``wrong_fraction`` of short *wrong* answers, so that a model warmed up on
             them answers one prompt with long-tailed lengths (the DARTS workload).

A task is a small frozen dataclass with ``generate(rng, n) -> list[Problem]``,
``reward(problem, completion) -> float`` (a sync reward function, see
``dtarl.rewards``) and ``tool(problem, turn_text) -> str | None``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np


class TaskKind(enum.Enum):
    ARITHMETIC = "arithmetic"
    COUNTDOWN = "countdown"
    CALCULATOR = "calculator"
    VERBOSE_ARITHMETIC = "verbose_arithmetic"


class Role(enum.Enum):
    ASSISTANT = "assistant"  # trained on (loss mask 1)
    TOOL = "tool"  # environment output (loss mask 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """One prompt. ``reference`` is a correct trajectory (for SFT): (role, text) turns.

    A dataset row's problem (``dtarl.rl.datatask``) also carries ``prompt_ids`` (the
    prompt's tokens, chat template applied: rolled out as they are, no BOS added),
    ``answer`` as the file holds it (the ground truth: any JSON value), the row's
    ``data_source`` and ``extra_info`` (verl's columns) and ``row`` (the whole
    ``dtarl.data.Row``: every column, and ``row.where`` = ``file:row``).
    """

    prompt: str
    answer: Any
    reference: tuple[tuple[Role, str], ...]
    numbers: tuple[int, ...] = ()
    target: int = 0
    prompt_ids: tuple[int, ...] | None = None  # None: BOS + the tokenizer's ids of prompt
    data_source: str = ""
    extra_info: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    row: Any = dataclasses.field(default=None, hash=False)  # a dataset problem's dtarl.data.Row


class ExpressionError(ValueError):
    pass


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def safe_eval(expr: str, *, max_len: int = 64) -> tuple[int, list[int]]:
    """Evaluates ``+ - *`` over non-negative integer literals and parentheses.

    Returns (value, literals used). Raises ExpressionError on anything else.
    """
    if len(expr) > max_len:
        raise ExpressionError(f"expression longer than {max_len} characters")
    if not re.fullmatch(r"[0-9+\-*() ]+", expr or "x"):
        raise ExpressionError(f"unexpected characters in {expr!r}")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ExpressionError(f"cannot parse {expr!r}") from None
    used: list[int] = []

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            used.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            v = _OPS[type(node.op)](a, b)
            if abs(v) > 10**9:
                raise ExpressionError("value out of range")
            return v
        raise ExpressionError(f"unsupported syntax in {expr!r}")

    return ev(tree), used


def _final(completion: str) -> str:
    return completion.strip()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """``a op b=`` with operands in [0, max_operand] and ops from ``ops`` (subset of ``+-*``)."""

    max_operand: int = 20
    ops: str = "+-"
    max_turns = 1
    stop_strings = ()
    kind = TaskKind.ARITHMETIC

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"task.max_operand={self.max_operand} must be >= 1")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"task.ops={self.ops!r} must be a non-empty subset of '+-*'")

    def generate(self, rng: np.random.Generator, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, 2))
            op = self.ops[int(rng.integers(len(self.ops)))]
            ans = str(safe_eval(f"{a}{op}{b}")[0])
            out.append(
                Problem(prompt=f"{a}{op}{b}=", answer=ans, reference=((Role.ASSISTANT, ans),))
            )
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        return float(_final(completion) == problem.answer)

    def tool(self, problem: Problem, turn_text: str) -> str | None:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownTask:
    """Reach ``target`` from ``num_numbers`` numbers in [1, max_number] with ``+ - *``,
    using each number exactly once (the standard rule); ``allow_unused=True`` also
    accepts expressions that leave some numbers out (each still at most once)."""

    num_numbers: int = 3
    max_number: int = 9
    allow_unused: bool = False
    max_turns = 1
    stop_strings = ()
    kind = TaskKind.COUNTDOWN

    def __post_init__(self):
        if not 2 <= self.num_numbers <= 6:
            raise ValueError(f"task.num_numbers={self.num_numbers} must be in [2, 6]")
        if self.max_number < 2:
            raise ValueError(f"task.max_number={self.max_number} must be >= 2")

    def generate(self, rng: np.random.Generator, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            nums = [int(x) for x in rng.integers(1, self.max_number + 1, self.num_numbers)]
            order = [nums[i] for i in rng.permutation(self.num_numbers)]
            expr = str(order[0])
            for x in order[1:]:
                expr += "+-*"[int(rng.integers(3))] + str(x)
            target = safe_eval(expr)[0]
            prompt = " ".join(map(str, nums)) + f">{target}:"
            out.append(
                Problem(
                    prompt=prompt,
                    answer=expr,
                    reference=((Role.ASSISTANT, expr),),
                    numbers=tuple(nums),
                    target=target,
                )
            )
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        try:
            value, used = safe_eval(_final(completion))
        except ExpressionError:
            return 0.0
        used, given = Counter(used), Counter(problem.numbers)
        if used - given:
            return 0.0  # a number not given, or used too often
        if not self.allow_unused and used != given:
            return 0.0  # a given number left out

        return float(value == problem.target)

    def tool(self, problem: Problem, turn_text: str) -> str | None:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorTask:
    """``a*b+c=`` solved with a calculator call ``[a*b]`` (tool output ``=v;``), then the answer."""

    max_operand: int = 20
    max_turns: int = 2
    stop_strings = ("]",)  # tool-call markers: any string (``episodes.tool_stop_sequences``)
    kind = TaskKind.CALCULATOR

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"task.max_operand={self.max_operand} must be >= 1")
        if self.max_turns < 2:
            raise ValueError(f"task.max_turns={self.max_turns} must be >= 2 for the tool task")

    def generate(self, rng: np.random.Generator, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b, c = (int(x) for x in rng.integers(0, self.max_operand + 1, 3))
            prod = a * b
            ans = str(prod + c)
            out.append(
                Problem(
                    prompt=f"{a}*{b}+{c}=",
                    answer=ans,
                    reference=(
                        (Role.ASSISTANT, f"[{a}*{b}]"),
                        (Role.TOOL, f"={prod};"),
                        (Role.ASSISTANT, ans),
                    ),
                    numbers=(a, b, c),
                )
            )
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        # The final answer is the text after the last tool output.
        tail = completion.rsplit(";", 1)[-1]
        return float(_final(tail) == problem.answer)

    def tool(self, problem: Problem, turn_text: str) -> str | None:
        """The calculator: ``...[expr]`` -> ``=value;`` (``=error;`` if unparsable)."""
        if not turn_text.endswith("]") or "[" not in turn_text:
            return None
        expr = turn_text[turn_text.rfind("[") + 1 : -1]
        try:
            return f"={safe_eval(expr)[0]};"
        except ExpressionError:
            return "=error;"


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerboseArithmeticTask:
    """``a op b=`` (ops from ``+-``) answered as ``<scratchpad>#<answer>``.

    Reference verbosity v (scratchpad steps): 0 with probability ``short_fraction``
    (of which ``wrong_fraction`` of all references give a wrong answer, off by 1-3),
    else Geometric(0.4) on {1, 2, ...} (mean 2.5) capped at ``max_verbosity``. Steps are drawn with
    replacement from the problem's decomposition, partial sums, a check by the
    inverse operation and restatements (``so 22;``), so long scratchpads repeat
    themselves: redundant reasoning, not more information.
    """

    max_operand: int = 20
    ops: str = "+-"
    max_verbosity: int = 8
    short_fraction: float = 0.4
    wrong_fraction: float = 0.15
    max_turns = 1
    stop_strings = ()
    kind = TaskKind.VERBOSE_ARITHMETIC

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"task.max_operand={self.max_operand} must be >= 1")
        if not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"task.ops={self.ops!r} must be a non-empty subset of '+-'")
        if self.max_verbosity < 1:
            raise ValueError(f"task.max_verbosity={self.max_verbosity} must be >= 1")
        if not 0 <= self.wrong_fraction <= self.short_fraction <= 1:
            raise ValueError(
                f"task.wrong_fraction={self.wrong_fraction} and task.short_fraction="
                f"{self.short_fraction} must satisfy 0 <= wrong_fraction <= short_fraction <= 1"
            )

    @staticmethod
    def steps(a: int, op: str, b: int) -> list[str]:
        """The pool of scratchpad steps of ``a op b`` (each ends in ``;``)."""
        ans = a + b if op == "+" else a - b
        tens, units = a - a % 10, a % 10
        part = units + b if op == "+" else units - b
        inv = "-" if op == "+" else "+"
        return [
            f"{a}={tens}+{units};",
            f"{units}{op}{b}={part};",
            f"{tens}+{part}={ans};" if part >= 0 else f"{tens}-{-part}={ans};",
            f"{ans}{inv}{b}={a};",
            f"so {ans};",
        ]

    def generate(self, rng: np.random.Generator, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, 2))
            op = self.ops[int(rng.integers(len(self.ops)))]
            ans = a + b if op == "+" else a - b
            u = float(rng.random())
            if u < self.short_fraction:
                pad, shown = "", ans
                if u < self.wrong_fraction:
                    shown = ans + int(rng.choice([-3, -2, -1, 1, 2, 3]))
            else:
                v = min(self.max_verbosity, int(rng.geometric(0.4)))
                pool = self.steps(a, op, b)
                pad = "".join(pool[int(i)] for i in rng.integers(0, len(pool), v))
                shown = ans
            text = f"{pad}#{shown}"
            out.append(
                Problem(
                    prompt=f"{a}{op}{b}=",
                    answer=str(ans),
                    reference=((Role.ASSISTANT, text),),
                    numbers=(a, b),
                )
            )
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        if "#" not in completion:
            return 0.0
        return float(_final(completion.rsplit("#", 1)[1]) == problem.answer)

    def tool(self, problem: Problem, turn_text: str) -> str | None:
        return None


Task = ArithmeticTask | CountdownTask | CalculatorTask | VerboseArithmeticTask


def make_task(kind: TaskKind, **options) -> Task:
    cls = {
        TaskKind.ARITHMETIC: ArithmeticTask,
        TaskKind.COUNTDOWN: CountdownTask,
        TaskKind.CALCULATOR: CalculatorTask,
        TaskKind.VERBOSE_ARITHMETIC: VerboseArithmeticTask,
    }[TaskKind(kind)]
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = set(options) - valid
    if unknown:
        raise ValueError(
            f"task options {sorted(unknown)} are not valid for {TaskKind(kind).value}; "
            f"accepted: {sorted(valid)}"
        )
    return cls(**options)


__all__ = [
    "ArithmeticTask",
    "CalculatorTask",
    "CountdownTask",
    "ExpressionError",
    "Problem",
    "Role",
    "Task",
    "TaskKind",
    "VerboseArithmeticTask",
    "make_task",
    "safe_eval",
]
