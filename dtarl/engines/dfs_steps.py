"""The DFS program's plan input: the per-step records the loop reads, their
compact per-entry arrays, and the host-side mapping of tree logprobs back to
sequences (``dtarl.engines.dfs``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dtarl.tree.trie import PrefixTree


class PlanSteps(NamedTuple):
    """The plan as the program takes it: per step [T] (looped over) its op, stack
    start, prefix bucket, loss slots [T, K], and where its entries are in the flat
    ``entries`` (``PlanEntries``, not per step): ``first`` and ``count``."""

    op: jax.Array
    saved: jax.Array
    start: jax.Array
    pbucket: jax.Array
    slots: jax.Array
    slot_seg: jax.Array
    first: jax.Array
    count: jax.Array
    entries: PlanEntries | None


class PlanEntries(NamedTuple):
    """The plan's real entries, flat [N + E] in step order (``SegmentPlan.entries``,
    padded with E entries so that a step's E-entry window never runs off): each
    entry's column in its step (``col``) and its values. The program expands a step's
    entries to its E columns (``expand_step``), so no host array is [T, E]."""

    col: jax.Array
    positions: jax.Array
    inputs: jax.Array
    targets: jax.Array
    seg: jax.Array
    tree_idx: jax.Array


ENTRY_FILL = dict(positions=0, inputs=0, targets=0, seg=-1, tree_idx=-1)


class Step(NamedTuple):
    op: jax.Array
    saved: jax.Array
    start: jax.Array
    pbucket: jax.Array
    positions: jax.Array
    inputs: jax.Array
    targets: jax.Array
    seg: jax.Array
    tree_idx: jax.Array
    slots: jax.Array
    slot_seg: jax.Array


def expand_step(p: PlanSteps, entries: PlanEntries, width: int) -> Step:
    """One step's record with its per-entry arrays in padded [E] form (E = ``width``):
    the step's ``count`` entries from ``first`` scattered to their columns, padding
    filled with 0 (-1 for ``seg`` and ``tree_idx``), as ``SegmentPlan.padded`` is."""
    mine = jnp.arange(width) < p.count
    window = lambda a: jax.lax.dynamic_slice_in_dim(a, p.first, width)
    col = jnp.where(mine, window(entries.col), width)  # width: dropped

    def put(name: str) -> jax.Array:
        empty = jnp.full((width,), ENTRY_FILL[name], jnp.int32)
        return empty.at[col].set(window(getattr(entries, name)), mode="drop")

    return Step(
        op=p.op,
        saved=p.saved,
        start=p.start,
        pbucket=p.pbucket,
        slots=p.slots,
        slot_seg=p.slot_seg,
        **{name: put(name) for name in ENTRY_FILL},
    )


def sequence_logprobs(tree: PrefixTree, tree_logp: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Per-sequence logprobs from the per-tree-token logprobs (host side)."""
    out = []
    cache: dict[int, np.ndarray] = {}
    for i in range(n):
        x = int(tree.seq_node[i])
        if x not in cache:
            parts = []
            y = x
            while y > 0:
                o, ln = int(tree.offset[y]), int(tree.length[y])
                parts.append(tree_logp[o : o + ln])
                y = int(tree.parent[y])
            cache[x] = np.concatenate(parts[::-1]).astype(np.float32)
        out.append(cache[x].copy())
    return tuple(out)


__all__ = ["PlanEntries", "PlanSteps", "Step", "expand_step", "sequence_logprobs"]
