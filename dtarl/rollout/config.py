"""The continuous engine's shapes and the host-side rules derived from them (no JAX):
``ContinuousConfig``, the decode windows, the length buckets of prefill/extend calls,
``reshard``'s default slot count and the calls of a recompute switch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dtarl.rollout.reasons import SamplerError
from dtarl.tree.plan import bucket


class EngineError(SamplerError):
    """Bad engine input or use; the message names the argument and the accepted range."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContinuousConfig:
    """Shapes of the engine (each change compiles new programs).

    slots: requests decoding together (the decode batch).
    groups: prompts resident at once (prompt pool rows); 0 = ``slots`` // 2, at least 1.
    group_size: the most requests one ``submit`` may create (cells per group).
    prompt_len: the longest prompt, in tokens.
    response_len: the most tokens one request may hold after its prompt (all turns,
      tool tokens included).
    steps_per_call: decode steps per device call (the host sees tokens this often).
    stream_chunk: ``on_tokens`` fires every this many tokens (0 = at the end of a turn).
    prefill_batch: prompts per prefill call. extend_batch: requests per extend call.
    max_stop_ids: stop token ids per request.
    """

    slots: int = 32
    groups: int = 0
    group_size: int = 16
    prompt_len: int = 512
    response_len: int = 512
    steps_per_call: int = 16
    stream_chunk: int = 0
    prefill_batch: int = 2
    extend_batch: int = 4
    max_stop_ids: int = 4

    def __post_init__(self):
        for name in (
            "slots",
            "group_size",
            "prompt_len",
            "response_len",
            "steps_per_call",
            "prefill_batch",
            "extend_batch",
            "max_stop_ids",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise EngineError(f"ContinuousConfig.{name}={value!r} must be an int >= 1")
        for name in ("groups", "stream_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 0:
                raise EngineError(f"ContinuousConfig.{name}={value!r} must be an int >= 0")

    @property
    def prompt_slots(self) -> int:
        return self.groups or max(1, self.slots // 2)


def decode_windows(response_len: int) -> list[int]:
    """Response windows of the decode programs: R/4, R/2, R (those >= 16; one program
    each)."""
    r = int(response_len)
    return sorted({w for w in (r // 4, r // 2, r) if w >= 16} | {r})


def merged_slots(live: int, dp: int, cap: int) -> int:
    """``reshard``'s default slot count: the smallest ``dp * 2^k`` holding ``live``
    requests (at least dp), capped at ``cap`` (ContinuousConfig.slots)."""
    n = dp
    while n < live:
        n *= 2
    return min(n, cap)


def len_bucket(n: int, limit: int) -> int:
    """The padded length of a prefill or extend call over ``n`` tokens: the smallest
    power of two >= max(n, 16), capped at ``limit`` (prompt_len or response_len)."""
    return min(bucket(n, 16), int(limit))


def recompute_calls(
    prompt_tokens: Sequence[int],
    lengths: Sequence[int],
    *,
    prefill_batch: int,
    extend_batch: int,
    prompt_len: int,
    response_len: int,
) -> list[tuple[str, int, int, int]]:
    """The calls ``reshard(..., mode="recompute")`` makes to rebuild the K/V, in order:
    (kind, bucket, start, stop) each. ``prompt_tokens``: the prompt length of each
    resident prompt row (in row order; a prompt of n tokens pre-fills n - 1 rows);
    ``lengths``: the response rows of each request holding a slot (in slot order,
    held ones included). Prefill calls take the resident prompts ``[start:stop]``, in
    chunks of ``prefill_batch``, padded to the bucket of the chunk's longest; extend
    calls the requests with rows (``[start:stop]`` of those), in chunks of
    ``extend_batch``, padded to the bucket of the chunk's most rows. The engine runs
    exactly these (``RolloutEngine.reshard``) and compiles their programs first; PAT's predictor
    prices them (``dtarl.rollout.pat.Predictor.recompute_seconds``)."""
    for name, v in (
        ("prefill_batch", prefill_batch),
        ("extend_batch", extend_batch),
        ("prompt_len", prompt_len),
        ("response_len", response_len),
    ):
        if not isinstance(v, int | np.integer) or v < 1:
            raise EngineError(f"recompute_calls: {name}={v!r} must be an int >= 1")
    if any(int(x) < 1 for x in prompt_tokens):
        raise EngineError(
            f"recompute_calls: prompt_tokens must be >= 1 each, got {list(prompt_tokens)}"
        )
    if any(int(x) < 0 for x in lengths):
        raise EngineError(f"recompute_calls: lengths must be >= 0 each, got {list(lengths)}")
    pre = [int(x) - 1 for x in prompt_tokens]
    ext = [int(x) for x in lengths if int(x) > 0]
    out = []
    for i in range(0, len(pre), prefill_batch):
        chunk = pre[i : i + prefill_batch]
        out.append(("prefill", len_bucket(max(chunk), prompt_len), i, i + len(chunk)))
    for i in range(0, len(ext), extend_batch):
        chunk = ext[i : i + extend_batch]
        out.append(("extend", len_bucket(max(chunk), response_len), i, i + len(chunk)))
    return out


def length_buckets(limit: int) -> list[int]:
    """Every padded length ``len_bucket`` gives up to ``limit``: 16, 32, ... and limit
    (one prefill or extend program each)."""
    sizes, b = [], 16
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [int(limit)]


__all__ = [
    "ContinuousConfig",
    "EngineError",
    "decode_windows",
    "len_bucket",
    "length_buckets",
    "merged_slots",
    "recompute_calls",
]
