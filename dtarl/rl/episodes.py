"""Episodes: from problems to a training batch.

    rollout -> trajectories -> rewards (+ DAPO overlong shaping) -> dynamic sampling
            -> reference logprobs -> advantages (GRPO groups or PPO's GAE) -> RolloutBatch

The chain lives in two modules, re-exported here: ``dtarl.rl.multiturn`` (the
multi-turn ``rollout`` on any ``Rollout`` sampler, ``process_rollout``) and
``dtarl.rl.step`` (``rl_batch``: the RL step as named stages). This module keeps the
reference policy's ``Scorer`` and the SFT ``reference_batch``; every piece is a plain
function usable on its own (see notebooks/).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl import aot
from dtarl.batch import RolloutBatch
from dtarl.engines.base import logprob_temperature
from dtarl.model.decoder import token_logprobs
from dtarl.rl.multiturn import (
    Trajectory,
    encode_prompt,
    ends_with_any,
    problem_ids,
    process_rollout,
    process_share,
    rollout,
    tool_stop_sequences,
)
from dtarl.rl.step import (
    ReferenceFn,
    advantage_abs_mean,
    group_advantages,
    rl_batch,
    shaped_rewards,
    success_rate,
)
from dtarl.rl.tasks import Problem, Role
from dtarl.tree.plan import bucket


def reference_batch(tokenizer, problems: Sequence[Problem]) -> RolloutBatch:
    """SFT batch: prompt + the reference trajectory + eos; loss on assistant tokens."""
    toks, masks = [], []
    for p in problems:
        seq = [problem_ids(tokenizer, p)]
        mask = [np.zeros(seq[0].shape, np.float32)]
        for role, text in p.reference:
            ids = np.asarray(tokenizer.encode(text), np.int32)
            seq.append(ids)
            mask.append(np.full(ids.shape, 1.0 if role is Role.ASSISTANT else 0.0, np.float32))
        seq.append(np.asarray([tokenizer.eos_id], np.int32))
        mask.append(np.ones(1, np.float32))
        toks.append(np.concatenate(seq))
        masks.append(np.concatenate(mask))
    return RolloutBatch.create(tokens=toks, loss_mask=masks)


class Scorer:
    """Jitted dense per-token logprobs of a batch under given weights (reference policy),
    of logits / ``temperature`` like the training engine's (``logprob_temperature``)."""

    def __init__(self, model, *, temperature: float = 1.0):
        self.graphdef, _ = nnx.split(model, nnx.Param)
        self.cfg = model.cfg
        self.temperature = logprob_temperature(temperature)
        self._fn = aot.jit(self._score, name="_score", static=(repr(self.cfg), self.temperature))
        self._min = dict(n=1, t=8)
        self._compiled: dict[tuple[int, int], Any] = {}  # (rows, length) -> executable
        self._reserved: tuple[int, int] | None = None  # (rows, longest length) to warm

    def _score(self, weights, tokens_NxT):
        model = nnx.merge(self.graphdef, weights)
        n, t = tokens_NxT.shape
        pos = jnp.broadcast_to(jnp.arange(t), (n, t))
        hidden, _ = model(tokens_NxT, pos, return_hidden=True)
        lp, _ = token_logprobs(
            model.lm_head_weight(),
            hidden[:, :-1],
            tokens_NxT[:, 1:],
            chunk=self.cfg.logits_chunk,
            temperature=self.temperature,
            dtype=self.cfg.compute_dtype,
        )
        return jnp.concatenate([jnp.zeros((n, 1), jnp.float32), lp], axis=1)

    def reserve(self, *, sequences: int, length: int) -> Scorer:
        """Sizes the row bucket for ``sequences`` up front and, at the first call,
        compiles the program of every length bucket from that call's up to ``length``:
        a longer batch later in the run then compiles nothing, while each batch still
        runs at its own (power-of-two) length bucket, never below an earlier one's (so
        the buckets below the first call's are never compiled)."""
        self._min["n"] = bucket(sequences, self._min["n"])
        self._reserved = (self._min["n"], bucket(length, self._min["t"]))
        return self

    def _program(self, weights, n: int, t: int):
        fn = self._compiled.get((n, t))
        if fn is None:
            arr = jax.ShapeDtypeStruct((n, t), jnp.int32)
            fn = self._compiled[(n, t)] = self._fn.lower(weights, arr).compile()
        return fn

    def __call__(self, weights, tokens: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self._reserved is not None:
            n, top = self._reserved
            t = bucket(max(len(x) for x in tokens), self._min["t"])
            while t <= top:
                self._program(weights, n, t)
                t *= 2
            self._reserved = None
        self._min["n"] = n = bucket(len(tokens), self._min["n"])
        self._min["t"] = t = bucket(max(len(x) for x in tokens), self._min["t"])
        arr = np.zeros((n, t), np.int32)
        for i, x in enumerate(tokens):
            arr[i, : len(x)] = x
        out = np.asarray(self._program(weights, n, t)(weights, arr))
        return [out[i, : len(x)].copy() for i, x in enumerate(tokens)]


__all__ = [
    "ReferenceFn",
    "Scorer",
    "Trajectory",
    "advantage_abs_mean",
    "encode_prompt",
    "ends_with_any",
    "group_advantages",
    "process_rollout",
    "process_share",
    "reference_batch",
    "rl_batch",
    "rollout",
    "shaped_rewards",
    "success_rate",
    "tool_stop_sequences",
]
