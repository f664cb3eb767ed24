"""Rollout generation: a jitted KV-cache sampler with prefix sharing and a resumable state.

DARTS shaping and PAT adaptive TP build on ``DecodeState`` (see dtarl.rollout.sampler).
"""

from dtarl.rollout.sampler import (
    DecodeState,
    FinishReason,
    Sampler,
    SamplerError,
    SampleResult,
    SamplingParams,
    cancel,
    decode,
    decode_step,
    prefill,
)

__all__ = [
    "DecodeState",
    "FinishReason",
    "SampleResult",
    "Sampler",
    "SamplerError",
    "SamplingParams",
    "cancel",
    "decode",
    "decode_step",
    "prefill",
]
