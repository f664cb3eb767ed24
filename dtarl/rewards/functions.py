"""Reward functions named in a config, adapted to one interface.

dtarl scores one sample at a time from a ``RewardInput``: the prompt text, the
response text, the ground truth (the dataset's ``answer``), ``data_source`` and
``extra_info``. A function named in ``reward.function`` may have any of these
signatures (told apart by parameter names):

    verl     compute_score(data_source, solution_str, ground_truth, extra_info=None)
             -> float | dict        (a verl reward file works unchanged)
    TRL      f(prompts, completions, **kwargs) -> list[float | None]
             called with one-element lists; kwargs: ground_truth, data_source,
             extra_info and the keys of a dict extra_info (TRL passes the dataset's
             columns); None (the function does not apply) scores 0, as TRL's nansum
    dtarl    f(prompt, response, ground_truth, data_source, extra_info) -> float | dict
             (any subset of these names, by keyword)
    dtarl    f(sample: RewardInput) -> float | dict   (one parameter, like the built-ins)
    dtarl    f(problem, completion) -> float | dict   (the trainer's ``RewardFn``)

Any of them may be ``async def``: ``compute_rewards`` runs those concurrently. A dict
result's ``score`` is the reward and its other numbers become metrics.

``reward.function`` names a function as ``path/to/file.py:name`` (``:name``
defaults to verl's ``compute_score``), ``package.module:name``, or a built-in
(``dtarl.rewards.builtin``: ``math``, ``format``, ``exact``). A list of them with
``reward.weights`` scores ``sum_i w_i r_i`` (TRL's ``reward_funcs`` +
``reward_weights``) and logs each function's own reward as ``reward/<name>``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dtarl.errors import ConfigError
from dtarl.rewards import builtin


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardInput:
    """One sample to score (the interface every reward function is adapted to)."""

    prompt: str
    response: str
    ground_truth: Any
    data_source: str = ""
    extra_info: Any = None
    problem: Any = None  # the row or task problem it came from (``f(problem, completion)``)


SampleReward = Callable[[RewardInput], Any]  # -> float | dict | Awaitable of them

_VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
_BY_NAME = ("prompt", "response", "ground_truth", "data_source", "extra_info")


def _params(fn) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _varkw(params) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _await_then(value, then):
    """``then(value)``, after awaiting ``value`` when it is awaitable."""
    if inspect.isawaitable(value):

        async def later():
            return then(await value)

        return later()
    return then(value)


def adapt(fn: Callable, where: str) -> SampleReward:
    """``fn`` (one of the module docstring's signatures) as a ``RewardInput`` function;
    ``where`` names it in errors (``reward.function[0]='my.py:score'``)."""
    params = _params(fn)
    names = set(params)
    if "solution_str" in names:  # verl

        def verl(x: RewardInput):
            kw = dict(data_source=x.data_source, solution_str=x.response)
            kw["ground_truth"] = x.ground_truth
            if "extra_info" in names or _varkw(params):
                kw["extra_info"] = x.extra_info
            return fn(**kw)

        return verl
    if "completions" in names:  # TRL: batched, dataset columns as kwargs

        def trl(x: RewardInput):
            cols: dict[str, Any] = {}
            if isinstance(x.extra_info, dict):
                cols.update(x.extra_info)
            cols.update(ground_truth=x.ground_truth, data_source=x.data_source)
            cols["extra_info"] = x.extra_info
            kw = {k: [v] for k, v in cols.items() if k in names or _varkw(params)}
            if "prompts" in names or _varkw(params):
                kw["prompts"] = [x.prompt]

            def first(out):
                try:
                    (v,) = list(out)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"{where} (a TRL-style function) returned {out!r} for one completion; "
                        "expected a list of one float"
                    ) from None
                return 0.0 if v is None else v

            return _await_then(fn(completions=[x.response], **kw), first)

        return trl
    required = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if names and names <= set(_BY_NAME) | {"self"} and "response" in names:

        def by_name(x: RewardInput):
            return fn(**{n: getattr(x, n) for n in names if n in _BY_NAME})

        return by_name
    if len(required) == 1:  # f(sample: RewardInput), like the built-ins
        return fn
    if len(required) == 2:  # the trainer's RewardFn(problem, completion)

        def legacy(x: RewardInput):
            return fn(x if x.problem is None else x.problem, x.response)

        return legacy
    raise ConfigError(
        f"{where}: cannot tell how to call {getattr(fn, '__name__', fn)!r} with parameters "
        f"{list(params)}; accepted signatures: verl compute_score(data_source, solution_str, "
        "ground_truth, extra_info=None), TRL f(prompts, completions, **kwargs), dtarl "
        f"f({', '.join(_BY_NAME)}) by name (any subset with 'response'), or f(problem, "
        "completion)"
    )


def _load_file(path: str, where: str):
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"{where}: no such file {path!r} (resolved to {full})")
    name = "dtarl_reward_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_function(spec: str, where: str, *, format_pattern: str | None = None) -> Callable:
    """The callable ``spec`` names (the module docstring's forms), not yet adapted."""
    if spec == "math":
        return builtin.math_reward
    if spec == "exact":
        return builtin.exact_reward
    if spec == "format":
        if not format_pattern:
            raise ConfigError(
                f"{where}='format' needs reward.format_pattern (a regex the whole response "
                r"must match, e.g. '<think>.*</think>.*\\boxed\{.*\}')"
            )
        return builtin.format_reward(format_pattern)
    path, sep, attr = spec.rpartition(":")
    if not sep:
        path, attr = spec, ""
    if path.endswith(".py"):
        module = _load_file(path, where)
        attr = attr or "compute_score"
    elif sep and path and attr:
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise ConfigError(f"{where}: cannot import module {path!r}: {e}") from e
    else:
        raise ConfigError(
            f"{where}={spec!r}: expected 'path/to/file.py[:name]', 'package.module:name' or a "
            f"built-in {list(builtin.BUILTINS)}"
        )
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"{where}={spec!r}: {path} has no function {attr!r}; its functions: {found}"
        )
    return fn


def short_name(spec: str) -> str:
    """The metric name of a function spec: ``my/file.py:score`` -> ``score``."""
    if ":" in spec:
        return spec.rsplit(":", 1)[1]
    return os.path.splitext(os.path.basename(spec))[0]


class RewardFunctionError(RuntimeError):
    """A configured reward function raised; the message names its config key."""


def guard(fn: SampleReward, where: str) -> SampleReward:
    """``fn`` whose exceptions (also an async one's) become ``RewardFunctionError``s
    naming ``where`` (``reward.function[1]='my.py:score'``)."""

    def wrap(e: Exception) -> RewardFunctionError:
        return RewardFunctionError(f"{where} raised {type(e).__name__}: {e}")

    def guarded(x: RewardInput):
        try:
            value = fn(x)
        except Exception as e:
            raise wrap(e) from e
        if not inspect.isawaitable(value):
            return value

        async def later():
            try:
                return await value
            except Exception as e:
                raise wrap(e) from e

        return later()

    return guarded


def combine(fns: Sequence[SampleReward], weights: Sequence[float], names: Sequence[str]):
    """``sum_i w_i r_i`` of the adapted ``fns`` as one ``SampleReward`` returning a dict:
    ``score`` and each function's reward as ``names[i]`` (its own dict's other numbers
    as ``names[i]/key``); async parts are awaited together."""

    def one(i: int, value) -> dict[str, float]:
        extra = {}
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"{names[i]} returned a dict without 'score': {sorted(value)}")
            extra = {f"{names[i]}/{k}": v for k, v in value.items() if k != "score"}
            value = value["score"]
        try:
            r = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{names[i]} returned {value!r}, not a float") from None
        return {names[i]: r, **extra}

    def total(values) -> dict[str, float]:
        parts = [one(i, v) for i, v in enumerate(values)]
        out: dict[str, float] = {}
        for p in parts:
            out.update(p)
        out["score"] = sum(w * p[n] for w, p, n in zip(weights, parts, names, strict=True))
        return out

    def combined(x: RewardInput):
        values = [f(x) for f in fns]
        if not any(inspect.isawaitable(v) for v in values):
            return total(values)

        async def gather():
            done = [await v if inspect.isawaitable(v) else v for v in values]
            return total(done)

        return gather()

    return combined


def problem_reward(fn: SampleReward, *, data_source: str = "") -> Callable[[Any, str], Any]:
    """``fn`` as the trainer's ``RewardFn(problem, completion)``: the problem's (an
    object's attributes or a mapping's keys) ``prompt``, ``answer`` (the ground
    truth), ``data_source`` (else ``data_source`` here: the task's kind) and
    ``extra_info`` (else None) fill the ``RewardInput``."""

    def reward(problem, completion: str):
        get = problem.get if isinstance(problem, Mapping) else functools.partial(getattr, problem)
        x = RewardInput(
            prompt=str(get("prompt", "")),
            response=completion,
            ground_truth=get("answer", None),
            data_source=str(get("data_source", "") or data_source),
            extra_info=get("extra_info", None),
            problem=problem,
        )
        return fn(x)

    return reward


__all__ = [
    "RewardFunctionError",
    "RewardInput",
    "SampleReward",
    "adapt",
    "combine",
    "guard",
    "load_function",
    "problem_reward",
    "short_name",
]
