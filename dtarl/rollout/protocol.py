"""``Rollout``: what the trainer and the RL step need of a sampler.

Two classes implement it: ``ContinuousSampler`` (``dtarl.rollout.continuous``, the
trainer's default: continuous batching over a prompt-shared K/V pool) and the static
reference ``Sampler`` (``dtarl.rollout.sampler``: one static batch per call, the
test reference and baseline). Callers never ask which one they hold; what differs
between them is declared in ``features``::

    if Feature.SWITCH not in sampler.features:
        raise ConfigError("rollout.pat needs a sampler that can switch its mesh")

A sampler that is asked for something it does not declare raises ``SamplerError``
naming the argument.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from dtarl.rollout.sampler import SampleResult


class Feature(enum.Enum):
    """What a ``Rollout`` can do beyond plain ``generate``."""

    SWITCH = "switch"  # ``on_call``: a hook between decode calls that may reshard (PAT)
    SHARE = "share"  # ``index_offset``: a share of a larger batch samples as it does there
    CANDIDATES = "candidates"  # per-prompt candidate counts and early stop (DARTS)
    STREAM = "stream"  # streamed scoring between decode calls (rollout.streaming)
    EXTEND = "extend"  # tool turns appended to a sample's own K/V (nothing re-prefilled)


@runtime_checkable
class Rollout(Protocol):
    """A sampler of responses for the RL step.

    ``generate(weights, prompts, num_samples=G, seed=s)`` samples ``G`` responses per
    prompt (or ``num_samples[i]`` for prompt ``i``) and returns a ``SampleResult``
    whose ``raw_logprobs`` are the training policy's (logits / T).
    ``max_new_tokens`` / ``forced_lengths``: one int per sample (limits; exact
    lengths for benchmarks). ``index_offset`` and ``on_call`` need ``Feature.SHARE``
    and ``Feature.SWITCH``.
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
    ) -> SampleResult: ...

    def warmup(self, weights, *, extend: bool = False) -> None:
        """Compiles what ``generate`` will need (a no-op where programs grow on demand)."""
        ...

    def reserve(self, *, prompts: int, rows: int, prompt_len: int, response: int) -> None:
        """Sizes the sampler for the run's largest call: ``prompts`` distinct prompts,
        ``rows`` samples, prompts of up to ``prompt_len`` tokens and responses of up to
        ``response`` tokens, so that later calls compile nothing new."""
        ...

    @property
    def trace_count(self) -> int:
        """Traces of the sampler's programs so far (no recompilation per batch)."""
        ...


__all__ = ["Feature", "Rollout"]
