"""Host-side planning of ``PrefixReuseEngine`` (numpy, no JAX): which sequences form a
group, which groups are deep, and one suffix row per leaf below each group's prefix.

Groups are nodes of the batch's prefix tree (``group_nodes``): the top-level nodes
(the children of the virtual root), or the nodes below a short prefix that every
prompt shares (a BOS token, a chat template); for GRPO, one group per prompt. A
group is *deep* when nodes below its prefix are shared by enough leaves that one
row per leaf would recompute more than 10% of its suffix tokens (multi-turn trees
that branch after the first turn). ``group_plan`` is the schedule the engine's
program (``dtarl.engines.prefix_reuse``) pads into its shape buckets.

Letters: N sequences, G groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dtarl.tree.trie import PrefixTree

__all__ = ["GroupPlan", "deep_sequences", "group_nodes", "group_plan", "sequence_groups"]


def _subtree_sums(tree: PrefixTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node: leaves under it, tokens of its subtree, and the tokens the rows form
    would recompute in its subtree (``len(y) * (leaves(y) - 1)`` summed over y)."""
    n = tree.num_nodes
    leaves, tokens, extra = (np.zeros(n, np.int64) for _ in range(3))
    for y in range(n - 1, 0, -1):  # preorder ids: children after parents
        leaves[y] = 1 if not tree.children[y] else leaves[y]
        ln = int(tree.length[y])
        tokens[y] += ln
        extra[y] += ln * int(leaves[y] - 1)
        p = int(tree.parent[y])
        leaves[p] += leaves[y]
        tokens[p] += tokens[y]
        extra[p] += extra[y]
    return leaves, tokens, extra


def group_nodes(
    tree: PrefixTree, min_shared: float = 0.1, fit: tuple[int, int] | None = None
) -> tuple[tuple[int, ...], np.ndarray]:
    """The batch's groups (tree nodes, preorder) and whether each is *deep*: one where
    the rows form would recompute more than ``min_shared`` of the suffix tokens below it.

    Groups start at the root's children. A deep group is split into its children's
    groups (each with the whole path down to it as its prefix) when recomputing that
    path once per child costs at most a quarter of ``min_shared`` of the tokens
    below it and no sequence ends there: a shared first token of every prompt (a
    BOS, a chat template) makes one top-level node of the whole batch, but the
    groups are the prompts under it; a prompt shared by deep multi-turn branches
    stays one group (recomputing it per branch would cost more, padding included).
    ``fit`` = (prefix, row): a reserved engine's prefix and suffix-row lengths; a
    group whose rows would be longer (its prefix ending at most at ``prefix``) is
    split too, where it can be, so that a run's batches keep the reserved shapes.
    """
    leaves, tokens, extra = _subtree_sums(tree)
    deepest = (tree.start + tree.length).astype(np.int64)  # the longest path below
    for y in range(tree.num_nodes - 1, 0, -1):
        p = int(tree.parent[y])
        deepest[p] = max(deepest[p], deepest[y])

    def too_long(x: int) -> bool:
        if fit is None:
            return False
        end = int(tree.start[x] + tree.length[x])
        b = end if tree.ends_at[x] else min(end, fit[0] + 1)
        return int(deepest[x]) - b > fit[1]

    def is_deep(x: int) -> bool:
        ln = int(tree.length[x])
        below = int(tokens[x]) - ln
        return int(extra[x]) - ln * int(leaves[x] - 1) > min_shared * max(below, 1)

    out, deep = [], []
    stack = list(reversed(tree.children[0]))
    while stack:
        x = stack.pop()
        kids = tree.children[x]
        below = int(tokens[x]) - int(tree.length[x])
        path = int(tree.start[x] + tree.length[x])
        cheap = is_deep(x) and path * (len(kids) - 1) <= min_shared / 4 * below
        if kids and not tree.ends_at[x] and (cheap or too_long(x)):
            stack.extend(reversed(kids))
            continue
        out.append(x)
        deep.append(is_deep(x))
    return tuple(out), np.asarray(deep, bool)


def sequence_groups(tree: PrefixTree, groups: Sequence[int]) -> np.ndarray:
    """int [N]: the index in ``groups`` of the group of each sequence."""
    index = {x: g for g, x in enumerate(groups)}
    out = np.zeros(tree.stats.num_sequences, np.int64)
    for i, node in enumerate(tree.seq_node.tolist()):
        while node not in index:
            node = int(tree.parent[node])
        out[i] = index[node]
    return out


def deep_sequences(
    tree: PrefixTree, min_shared: float = 0.1, fit: tuple[int, int] | None = None
) -> np.ndarray:
    """bool [N]: sequence i belongs to a *deep* group (``group_nodes``), one where the
    rows form would recompute more than ``min_shared`` of the group's suffix tokens.

    The rows form recomputes a node y below the prefix once per leaf under it, so
    ``len(y) * (leaves(y) - 1)`` extra tokens; a few accidentally shared first
    tokens of GRPO responses stay well under the threshold (rows), shared turns of
    a multi-turn tree do not (dfs).
    """
    groups, deep = group_nodes(tree, min_shared, fit)
    return deep[sequence_groups(tree, groups)]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GroupPlan:
    """The host-side schedule of one batch (before padding)."""

    prefix_nodes: tuple[int, ...]  # per group, the tree node of its prefix
    prefix_end: np.ndarray  # [G] b: the prefix covers path positions [0, b)
    row_leaf: tuple[tuple[int, ...], ...]  # per group, the leaf node of each suffix row
    row_slots: tuple[tuple[tuple[int, ...], ...], ...]  # per group, per row, sequences
    prefix_slots: tuple[tuple[int, ...], ...]  # per group, sequences ending at the prefix
    seq_group: np.ndarray  # [N] group of sequence i
    seq_row: np.ndarray  # [N] row within its group (-1: ends at the prefix)


def group_plan(tree: PrefixTree, fit: tuple[int, int] | None = None) -> GroupPlan:
    """Groups = ``group_nodes``; one suffix row per leaf below each group's node.

    A sequence ending at an internal node Z below the prefix is evaluated on the
    row of the first leaf under Z (its logprobs are a prefix of that row's path).
    """
    n = tree.stats.num_sequences
    seq_group = np.zeros(n, np.int64)
    seq_row = np.full(n, -1, np.int64)
    nodes, ends, leaves_all, slots_all, pslots = [], [], [], [], []
    for g, x in enumerate(group_nodes(tree, fit=fit)[0]):
        nodes.append(x)
        ends.append(int(tree.start[x] + tree.length[x]))
        for i in tree.ends_at[x]:
            seq_group[i] = g
        pslots.append(tuple(tree.ends_at[x]))
        leaves: list[int] = []
        row_of_leaf: dict[int, int] = {}
        slots: list[list[int]] = []
        # Preorder walk of the subtree below x; first_leaf(z) is the first leaf reached.
        stack = list(reversed(tree.children[x]))
        while stack:
            z = stack.pop()
            y = z
            while tree.children[y]:
                y = tree.children[y][0]
            if y not in row_of_leaf:
                row_of_leaf[y] = len(leaves)
                leaves.append(y)
                slots.append([])
            r = row_of_leaf[y]
            for i in tree.ends_at[z]:
                slots[r].append(i)
                seq_group[i] = g
                seq_row[i] = r
            stack.extend(reversed(tree.children[z]))
        leaves_all.append(tuple(leaves))
        slots_all.append(tuple(tuple(s) for s in slots))
    return GroupPlan(
        prefix_nodes=tuple(nodes),
        prefix_end=np.asarray(ends, np.int64),
        row_leaf=tuple(leaves_all),
        row_slots=tuple(slots_all),
        prefix_slots=tuple(pslots),
        seq_group=seq_group,
        seq_row=seq_row,
    )
