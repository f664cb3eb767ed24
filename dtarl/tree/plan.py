"""Compile a prefix tree into a fixed-shape push/pop segment plan.

Segments. A node X covering path positions [a, b) *computes* the inputs at
positions [max(a-1, 0), b-1): its parent's last token followed by its own tokens
but the last. Their logits predict the tokens at [max(a, 1), b), all of which
belong to X, so every fork logit (the parent's last token predicting a child's
first token) is evaluated by the child that needs it: one extra input token per
child, exact by the chain rule, and no [depth, vocab] fork buffers. The K/V
stacked for X are those of positions [max(a-1, 0), b-1), so the stack is always
a contiguous run [0, b-1) of the current path. A leaf's last token is never an
input, and the last chunk of a leaf is never pushed at all: it is computed once,
under ``vjp``, when popped ("cut tail").

Steps. Segments are cut into chunks of at most C tokens. A DFS over the tree
emits, for node X: PUSH for each chunk (except a leaf's last chunk), the
children's steps, then POP for each chunk in reverse. The POP of X's last chunk
also evaluates the loss of every sequence ending at X ("visit"): at that point
all of the path's logprobs are known, and every sequence that passes through X
(all in X's subtree) has already been visited, so the logprob cotangents X needs
are complete.

Shapes are bucketed (steps, path length, loss slots, sequences, flat token data)
so that a new batch reuses the compiled program unless it needs a larger bucket.

Letters: C chunk length, S path buffer length, K loss slots per step.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from dtarl.tree.order import DFSOrder, child_order
from dtarl.tree.trie import PrefixTree


class Op(enum.IntEnum):
    NOOP = 0
    PUSH = 1
    POP = 2


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SegmentPlan:
    """Fixed-shape device program for one tree. Arrays are host numpy.

    Per step (padded to ``num_steps_padded`` with NOOP):
      op [T], start [T] (path position of the chunk's first input), n_valid [T],
      inputs [T, C], targets [T, C], tree_off [T] (offset in the tree's flat token
      data of the chunk's first target, for writing logprobs), slots [T, K]
      (ids of sequences visited at this step, -1 = empty).
    """

    op: np.ndarray
    start: np.ndarray
    n_valid: np.ndarray
    inputs: np.ndarray
    targets: np.ndarray
    tree_off: np.ndarray
    slots: np.ndarray
    chunk_len: int
    path_len: int  # S: padded path buffer for logprobs / sequence data
    num_steps: int  # real steps (before padding)
    computed_tokens: int  # sum of segment lengths = tokens actually run forward
    pushed_tokens: int  # tokens whose forward also runs at push time
    peak_path: int  # longest stacked prefix + chunk

    @property
    def shape_key(self) -> tuple[int, ...]:
        """Everything that determines the compiled program's shapes."""
        return (self.op.shape[0], self.chunk_len, self.path_len, self.slots.shape[1])


def compile_plan(
    tree: PrefixTree,
    *,
    chunk_len: int,
    order: DFSOrder = DFSOrder.GREEDY,
    min_steps: int = 1,
    min_path: int = 1,
    min_slots: int = 1,
) -> SegmentPlan:
    """Turns ``tree`` into a bucketed push/pop plan (see the module docstring)."""
    if chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len} must be >= 1")
    c = int(chunk_len)
    children = child_order(tree, order, chunk_len=c)
    start_pos, length = tree.start, tree.length

    def chunks(x: int) -> list[tuple[int, int]]:
        a, b = int(start_pos[x]), int(start_pos[x] + length[x])
        s0, s1 = max(a - 1, 0), b - 1
        return [(s, min(s + c, s1)) for s in range(s0, s1, c)]

    ops: list[tuple[int, int, int, int, tuple[int, ...]]] = []  # op, node, s, e, slots
    computed = pushed = peak = 0
    # Iterative DFS: ("enter", x) / ("exit", x).
    stack: list[tuple[bool, int]] = [(False, ch) for ch in reversed(children[0])]
    while stack:
        leaving, x = stack.pop()
        cks = chunks(x)
        leaf = len(children[x]) == 0
        if not leaving:
            if not cks and tree.ends_at[x]:
                raise ValueError(
                    f"node {x}: sequences {tree.ends_at[x]} end at a node with no predicted "
                    "token (length-1 sequences are not trainable)"
                )
            to_push = cks[:-1] if leaf else cks
            for s, e in to_push:
                ops.append((Op.PUSH, x, s, e, ()))
                pushed += e - s
            stack.append((True, x))
            stack.extend((False, ch) for ch in reversed(children[x]))
        else:
            for i in range(len(cks) - 1, -1, -1):
                s, e = cks[i]
                slots = tuple(tree.ends_at[x]) if i == len(cks) - 1 else ()
                ops.append((Op.POP, x, s, e, slots))
                computed += e - s
                peak = max(peak, e)

    n_steps = len(ops)
    t_pad = bucket(n_steps, min_steps)
    k_pad = bucket(max((len(o[4]) for o in ops), default=1), min_slots)
    s_pad = bucket(int(tree.stats.longest_path), min_path)
    op = np.zeros(t_pad, np.int32)
    start = np.zeros(t_pad, np.int32)
    n_valid = np.zeros(t_pad, np.int32)
    inputs = np.zeros((t_pad, c), np.int32)
    targets = np.zeros((t_pad, c), np.int32)
    tree_off = np.zeros(t_pad, np.int32)
    slots = np.full((t_pad, k_pad), -1, np.int32)
    for i, (o, x, s, e, sl) in enumerate(ops):
        # Tokens at path positions [a-1, b): the parent's last token, then X's own.
        a = int(start_pos[x])
        own = tree.node_tokens(x)
        if a > 0:
            par = int(tree.parent[x])
            last = tree.token_data[int(tree.offset[par] + tree.length[par]) - 1]
            ext, base = np.concatenate([[last], own]), a - 1
        else:
            ext, base = own, 0
        n = e - s
        op[i], start[i], n_valid[i] = int(o), s, n
        inputs[i, :n] = ext[s - base : e - base]
        targets[i, :n] = ext[s - base + 1 : e - base + 1]
        tree_off[i] = int(tree.offset[x]) + (s + 1 - int(start_pos[x]))
        slots[i, : len(sl)] = sl
    return SegmentPlan(
        op=op,
        start=start,
        n_valid=n_valid,
        inputs=inputs,
        targets=targets,
        tree_off=tree_off,
        slots=slots,
        chunk_len=c,
        path_len=s_pad,
        num_steps=n_steps,
        computed_tokens=computed,
        pushed_tokens=pushed,
        peak_path=peak,
    )
