"""The capacity a run reserves: one computation for ``dtarl train`` and ``dtarl bench train``.

A run pre-sizes its samplers' and engines' buckets to its largest batch, so that no
program compiles after the first step of each phase, whatever the depth, leaf
counts and lengths of its trees (auto's candidates are sized as if each ran alone,
and its choice signature counts every depth from 1 + 2 * turns up as one):

    cap = capacity(sequences=..., groups=..., length=..., group_size=...,
                   prompt_len=..., response_len=..., turns=..., dp=dp)
    engine.reserve(cap)

``TOOL_TOKENS`` tokens of tool output are reserved per tool turn (``turns - 1`` of
them); a longer tool output ends its sample as truncated (``RolloutSection.build``).
"""

from __future__ import annotations

from dtarl.engines import Capacity

TOOL_TOKENS = 16  # tool output reserved per tool turn


def response_budget(max_new_tokens: int, turns: int) -> int:
    """Tokens after the prompt of a ``turns``-turn sample: ``max_new_tokens`` per turn
    plus ``TOOL_TOKENS`` per tool turn."""
    if turns < 1:
        raise ValueError(f"turns={turns} must be >= 1")
    return max_new_tokens * turns + TOOL_TOKENS * (turns - 1)


def capacity(
    *,
    sequences: int,
    groups: int,
    length: int,
    group_size: int,
    prompt_len: int,
    response_len: int,
    turns: int,
    dp: int = 1,
) -> Capacity:
    """The ``Capacity`` of a largest batch of ``sequences`` sequences in ``groups``
    groups (of at most ``group_size``), each of at most ``length`` tokens (a prompt of
    ``prompt_len`` + a response of ``response_len``) over ``turns`` turns; split over
    ``dp`` ranks, each of which gets about 1/dp of the sequences and groups (rounded up)."""
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    return Capacity(
        sequences=-(-sequences // dp),
        length=length,
        group_size=group_size,
        groups=-(-groups // dp),
        prompt_len=prompt_len,
        response_len=response_len,
        turns=turns,
    )


__all__ = ["TOOL_TOKENS", "capacity", "response_budget"]
