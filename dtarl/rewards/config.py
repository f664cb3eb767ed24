"""The ``reward:`` config section: which reward function scores the rollouts.

    reward:
      function: math                      # a built-in, a file or a module (one, or a list)
      # function: [my_rewards.py:correct, format]
      # weights: [1.0, 0.1]               # with a list: sum_i w_i r_i (TRL's reward_weights)
      on_error: raise                     # or zero: a raising function scores the sample 0
      max_concurrency: 64                 # async functions in flight at once
      format_pattern: '.*\\\\boxed\\{.+\\}'  # the ``format`` built-in's regex

Without ``function`` a procedural task scores with its own verifier; with it, the
function replaces the verifier (and the task's problems are its data source).
"""

from __future__ import annotations

import dataclasses
import typing

from dtarl.errors import ConfigError
from dtarl.rewards import builtin, functions
from dtarl.rewards.compute import RewardErrorPolicy, RewardFn


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSection:
    """``function``: ``path/to/file.py[:name]`` (verl's ``compute_score`` by default),
    ``package.module:name`` or a built-in (``math``, ``format``, ``exact``); a list of
    them is summed with ``weights``. See ``dtarl.rewards.functions`` for the accepted
    signatures (verl, TRL, dtarl)."""

    SECTION: typing.ClassVar[str] = "reward"
    # null: the task's own verifier; else one function or a list (see the class docstring)
    function: str | tuple[str, ...] | None = None
    # one per function of a list (default: all 1.0); the reward is sum_i w_i r_i
    weights: tuple[float, ...] = ()
    # a function that raises or returns a non-number: raise (stop naming the sample) or zero
    on_error: RewardErrorPolicy = RewardErrorPolicy.RAISE
    max_concurrency: int = 64  # async reward calls in flight at once
    # the `format` built-in's regex: 1.0 iff the whole stripped response matches (DOTALL)
    format_pattern: str | None = None

    def __post_init__(self):
        specs = self.specs
        if any(not (isinstance(s, str) and s.strip()) for s in specs) or self.function == ():
            raise ConfigError(
                f"reward.function={self.function!r}: expected a function ('file.py:name', "
                "'package.module:name', math, format, exact), a non-empty list of them, or null"
            )
        if self.weights and len(self.weights) != len(specs):
            raise ConfigError(
                f"reward.weights has {len(self.weights)} entries for {len(specs)} functions "
                f"(reward.function={list(specs)}); give one weight per function, or none "
                "(all 1.0)"
            )
        if self.max_concurrency < 1:
            raise ConfigError(f"reward.max_concurrency={self.max_concurrency} must be >= 1")
        if "format" in specs and not self.format_pattern:
            raise ConfigError(
                "reward.function uses the `format` built-in: set reward.format_pattern (a "
                "regex the whole response must match)"
            )

    @property
    def specs(self) -> tuple[str, ...]:
        """The configured functions as a tuple (empty: the task's verifier)."""
        if self.function is None:
            return ()
        return (self.function,) if isinstance(self.function, str) else tuple(self.function)

    def build_sample_reward(self) -> functions.SampleReward | None:
        """The configured reward as one ``RewardInput`` function (None without one):
        each function loaded, adapted to its signature and guarded (its errors name its
        key); a list summed with ``weights``."""
        specs = self.specs
        if not specs:
            return None
        single = isinstance(self.function, str)
        fns = []
        for i, spec in enumerate(specs):
            where = f"reward.function={spec!r}" if single else f"reward.function[{i}]={spec!r}"
            raw = functions.load_function(spec, where, format_pattern=self.format_pattern)
            fn = raw if spec in builtin.BUILTINS else functions.adapt(raw, where)
            fns.append(functions.guard(fn, where))
        if single and not self.weights:
            return fns[0]
        names = [functions.short_name(s) for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            names = [f"{n}_{i}" if n in dup else n for i, n in enumerate(names)]
        weights = self.weights or (1.0,) * len(specs)
        return functions.combine(fns, weights, names)

    def build(self, *, data_source: str = "") -> RewardFn | None:
        """The trainer's ``RewardFn(problem, completion)`` (None: use the task's
        verifier); ``data_source`` fills the input of problems that carry none."""
        fn = self.build_sample_reward()
        return None if fn is None else functions.problem_reward(fn, data_source=data_source)


__all__ = ["RewardSection"]
