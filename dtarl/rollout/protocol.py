"""``Rollout``: what the trainer and the RL step need of a sampler.

Two classes implement it: ``ContinuousSampler`` (``dtarl.rollout.continuous``, the
trainer's default: continuous batching over a prompt-shared K/V pool) and the static
reference ``Sampler`` (``dtarl.rollout.sampler``: one static batch per call, the
test reference and baseline). Callers never ask which one they hold; what differs
between them is declared in ``features``::

    if Feature.SWITCH not in sampler.features:
        raise ConfigError("rollout.pat needs a sampler that can switch its mesh")

A sampler that is asked for something it does not declare raises ``SamplerError``
naming the argument (``require``).

=================  ==========================  ==========  ================
Feature            ``generate`` argument       Sampler     ContinuousSampler
=================  ==========================  ==========  ================
``SWITCH``         ``on_call``                 no          yes
``SHARE``          ``index_offset``            no          yes
``CANDIDATES``     ``early_stop``              no          yes
``STREAM``         ``stream``                  no          yes
``EXTEND``         ``on_turn``                 no          yes
=================  ==========================  ==========  ================

Per-prompt sample counts (``num_samples=[...]``) are plain ``generate``: both take
them. DARTS needs ``CANDIDATES`` for the early stop and the finish order
(``SampleResult.finish_rank``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from dtarl.rollout.sampler import FinishReason, SamplerError, SampleResult


class Feature(enum.Enum):
    """What a ``Rollout`` can do beyond plain ``generate``."""

    SWITCH = "switch"  # ``on_call``: a hook between decode calls that may reshard (PAT)
    SHARE = "share"  # ``index_offset``: a share of a larger batch samples as it does there
    CANDIDATES = "candidates"  # ``early_stop``: cancel a group's rest, record finish order
    STREAM = "stream"  # ``stream``: forward-only scoring between decode calls
    EXTEND = "extend"  # ``on_turn``: tool turns appended to a sample's own K/V


# ``on_turn(sample, tokens, raw_logprobs, finish)``: called when a turn of sample
# ``sample`` (its row in the result) ends; returns the tool output's token ids to append
# and continue the sample with, or None to end it.
TurnFn = Callable[[int, np.ndarray, np.ndarray, FinishReason], "np.ndarray | None"]


@runtime_checkable
class Rollout(Protocol):
    """A sampler of responses for the RL step.

    ``generate(weights, prompts, num_samples=G, seed=s)`` samples ``G`` responses per
    prompt (or ``num_samples[i]`` for prompt ``i``) and returns a ``SampleResult``
    whose ``raw_logprobs`` are the training policy's (logits / T).
    ``max_new_tokens`` / ``forced_lengths``: one int per sample (limits; exact
    lengths for benchmarks). The other keyword arguments each need their ``Feature``
    (module docstring):

    - ``index_offset=k``: prompt i is keyed as prompt k + i of a larger batch.
    - ``on_call(engine, weights)``: runs between decode calls; a non-None result
      replaces the weights (PAT's controller).
    - ``early_stop[i] = m > 0``: prompt i's other samples are cancelled once ``m`` of
      them finished with a stop (``FinishReason.CANCELLED``); ``finish_rank`` of the
      result records the order in which samples finished.
    - ``stream``: ``dtarl.rollout.stream.Stream`` models scored while decoding goes on;
      the result's ``streamed[kind][i]`` holds the scores of sample i's tokens after
      the prompt (every turn and tool output), its stats the ``stream_*`` timings.
    - ``on_turn`` (a ``TurnFn``): multi-turn samples; a sample whose turn ended is
      continued on its own K/V with the returned tool tokens appended. The result
      then holds each sample's last turn; a sample whose tool output does not fit
      ends with ``FinishReason.LENGTH``.
    """

    max_new_tokens: int
    features: frozenset[Feature]

    def generate(
        self,
        weights,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int | Sequence[int] = 1,
        seed: int | jax.Array = 0,
        max_new_tokens: Sequence[int] | None = None,
        forced_lengths: Sequence[int] | None = None,
        index_offset: int = 0,
        on_call: Callable[[Any, Any], Any] | None = None,
        early_stop: Sequence[int] | None = None,
        stream: Sequence[Any] = (),
        on_turn: TurnFn | None = None,
    ) -> SampleResult: ...

    def warmup(self, weights, *, extend: bool = False) -> None:
        """Compiles what ``generate`` will need (a no-op where programs grow on demand)."""
        ...

    def reserve(self, *, prompts: int, rows: int, prompt_len: int, response: int) -> None:
        """Sizes the sampler for the run's largest call: ``prompts`` distinct prompts,
        ``rows`` samples, prompts (or, re-prefilling tool turns, histories) of up to
        ``prompt_len`` tokens and turns of up to ``response`` tokens, so that later calls
        compile nothing new."""
        ...

    @property
    def trace_count(self) -> int:
        """Traces of the sampler's programs so far (no recompilation per batch)."""
        ...


# The argument of ``generate`` that asks for each feature.
ARGUMENT = {
    Feature.SWITCH: "on_call",
    Feature.SHARE: "index_offset",
    Feature.CANDIDATES: "early_stop",
    Feature.STREAM: "stream",
    Feature.EXTEND: "on_turn",
}


def features_of(sampler) -> frozenset[Feature]:
    """``sampler.features``; a bare ``generate`` (a test double) declares none."""
    return frozenset(getattr(sampler, "features", ()))


def require(sampler, feature: Feature, argument: str | None = None) -> None:
    """Raises ``SamplerError`` naming ``argument`` (default: the ``generate`` argument of
    ``feature``) unless ``sampler`` declares ``feature``."""
    if feature in features_of(sampler):
        return
    have = sorted(f.value for f in features_of(sampler)) or "none"
    raise SamplerError(
        f"{argument or ARGUMENT[feature]}: needs a sampler with Feature.{feature.name}; "
        f"{type(sampler).__name__} declares {have} (the continuous engine, "
        "rollout.engine=continuous, declares every feature)"
    )


__all__ = ["ARGUMENT", "Feature", "Rollout", "TurnFn", "features_of", "require"]
