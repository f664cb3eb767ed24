"""The trainer's rollout and evaluation samplers, from ``rollout.engine``."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from dtarl.model.decoder import Decoder
from dtarl.rl.config import ConfigError, RolloutEngineKind, TrainerConfig
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import ContinuousConfig
from dtarl.rollout.protocol import Rollout
from dtarl.rollout.sampler import Sampler, SamplingParams
from dtarl.tree.plan import bucket


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
) -> tuple[Rollout, Rollout]:
    """(rollout sampler, greedy evaluation sampler): both implement the ``Rollout``
    protocol (``dtarl.rollout.protocol``); what they can do is in their ``features``.

    ``continuous`` (the default): every prompt of a step is resident at once (one
    prompt row each) and ``rollout.slots`` samples decode together (0: the whole
    step; with DARTS, room for every candidate). ``response_len`` rows hold every
    turn of a sample plus its tool tokens; a longer tool output ends that sample as
    truncated. A prompt longer than
    ``prompt_len`` rebuilds the engine once (see ``ContinuousSampler``).
    ``static``: the reference sampler, one static batch per call.

    ``mesh`` (continuous only): the rollout engine's mesh: decode slots and prompt
    rows split over 'dp', weights and K/V heads over 'tp' (``RolloutEngine``).
    """
    r = cfg.rollout
    greedy_kw = dict(max_new_tokens=r.max_new_tokens, stop_tokens=stop_ids)
    if r.engine is RolloutEngineKind.STATIC:
        if mesh is not None:
            raise ConfigError(
                "rollout.engine=static has no mesh support; with mesh.dp x mesh.tp > 1 use "
                "rollout.engine=continuous (or mesh.dp=1, mesh.tp=1)"
            )
        params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_sequences=stop_sequences,
            **greedy_kw,
        )
        greedy = SamplingParams.greedy(stop_sequences=stop_sequences, **greedy_kw)
        return Sampler(model, params, pad_id=pad_id), Sampler(model, greedy, pad_id=pad_id)
    group = r.group_size
    if cfg.algo.darts.enabled:  # up to M_up candidates per prompt
        group = max(group, int(cfg.algo.darts.up_factor * r.group_size))
    rows = r.prompts_per_step * group
    shape = dict(
        prompt_len=bucket(prompt_len), response_len=response_len, steps_per_call=r.steps_per_call
    )
    stream = r.streaming.chunk if r.streaming.enabled else 0
    train = ContinuousConfig(
        slots=r.slots or rows,
        groups=r.prompts_per_step,
        group_size=group,
        stream_chunk=stream,
        **shape,
    )
    n_eval = max(1, cfg.eval_problems)
    evals = ContinuousConfig(slots=n_eval, groups=n_eval, group_size=1, **shape)
    common = dict(
        stop_ids=stop_ids,
        stop_sequences=stop_sequences,
        max_new_tokens=r.max_new_tokens,
        pad_id=pad_id,
    )
    rollout = ContinuousSampler(
        model, train, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, mesh=mesh, **common
    )
    return rollout, ContinuousSampler(model, evals, temperature=0.0, mesh=mesh, **common)
