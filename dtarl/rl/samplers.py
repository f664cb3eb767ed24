"""The trainer's rollout and evaluation samplers, from ``rollout.engine``."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from dtarl.model.decoder import Decoder
from dtarl.rl.config import TrainerConfig
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.sampler import Sampler


def make_samplers(
    cfg: TrainerConfig,
    model: Decoder,
    *,
    pad_id: int,
    stop_ids: Sequence[int],
    stop_sequences: Sequence[Sequence[int]],
    prompt_len: int,
    response_len: int,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Sampler | ContinuousSampler, Sampler | ContinuousSampler]:
    """(rollout sampler, greedy evaluation sampler): ``cfg.rollout.build`` (see
    ``RolloutSection.build``) with room for DARTS' candidates and the evaluation set."""
    return cfg.rollout.build(
        model,
        pad_id=pad_id,
        stop_ids=stop_ids,
        stop_sequences=stop_sequences,
        prompt_len=prompt_len,
        response_len=response_len,
        group_size=cfg.algo.darts.candidates(cfg.rollout.group_size),
        eval_problems=cfg.eval.num_problems,
        mesh=mesh,
    )
