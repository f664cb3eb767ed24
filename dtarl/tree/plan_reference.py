"""The reference twin of ``compile_plan`` (``dtarl.tree.plan``): the plan built step by
step in pure Python, every per-entry array filled into its padded ``[T, E]`` form
segment by segment. It is what ``compile_plan`` computed before it was vectorised;
the tests require the two to agree bit for bit, and ``dtarl bench plan`` times them
side by side. Not used by the engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from dtarl.tree.order import DFSOrder, child_order
from dtarl.tree.plan import Op, bucket, fine_bucket, prefix_bucket_sizes
from dtarl.tree.trie import PrefixTree


class ReferencePlan(NamedTuple):
    """``SegmentPlan``'s fields with the per-entry arrays in padded ``[T, E]`` form."""

    op: np.ndarray
    start: np.ndarray
    pbucket: np.ndarray
    positions: np.ndarray
    inputs: np.ndarray
    targets: np.ndarray
    seg: np.ndarray
    tree_idx: np.ndarray
    slots: np.ndarray
    slot_seg: np.ndarray
    chunk_len: int
    rows: int
    wide: int
    path_len: int
    prefix_sizes: tuple[int, ...]
    num_steps: int
    computed_tokens: int
    pushed_tokens: int
    packed_steps: int
    row_steps: int
    wide_steps: int
    peak_path: int


@dataclasses.dataclass
class _Step:
    op: Op
    start: int
    # (node, first input position, last input position + 1, row, segment id)
    segs: list[tuple[int, int, int, int, int]]
    slots: list[tuple[int, int]]  # (sequence, segment)


def _run_range(st: _Step) -> tuple[int, int] | None:
    """[first, last + 1) path positions of a single-segment PUSH/POP, else None."""
    if st.op not in (Op.PUSH, Op.POP) or len({j for *_, j in st.segs}) != 1:
        return None
    return min(s for _, s, *_ in st.segs), max(e for _, _, e, *_ in st.segs)


def _merge_runs(steps: list[_Step], c: int) -> list[_Step]:
    """Merges consecutive single-segment steps over adjacent path ranges into one
    step of at most ``c`` entries: a PUSH followed by a PUSH that continues it
    downwards (a node's last chunk and its first child's first chunk), and a POP
    followed by a POP of the range right before it (a last child's first chunk and
    its parent's last chunk). Both are the same path, so the merged step is exact:
    the dependency that crossed the two steps through the stack (K/V, dK/dV and
    logprob cotangents) becomes attention inside one chunk. The merged segment
    keeps every node's visits; each sequence's loss only reads its own positions.
    """
    out: list[_Step] = []
    for st in steps:
        prev = out[-1] if out else None
        a, b = (_run_range(prev) if prev else None), _run_range(st)
        if a is not None and b is not None and prev.op == st.op:
            if st.op is Op.PUSH and a[1] == b[0] and b[1] - a[0] <= c:
                out[-1] = _Step(Op.PUSH, a[0], prev.segs + st.segs, [])
                continue
            if st.op is Op.POP and b[1] == a[0] and a[1] - b[0] <= c:
                out[-1] = _Step(Op.POP, b[0], st.segs + prev.segs, prev.slots + st.slots)
                continue
        out.append(st)
    return out


def compile_plan_reference(
    tree: PrefixTree,
    *,
    chunk_len: int,
    order: DFSOrder = DFSOrder.GREEDY,
    pack_leaves: bool = True,
    rows: int = 1,
    wide: int = 0,
    token_flops: Callable[[float], float] | None = None,
    wide_slack: float = 0.0,
    merge_runs: bool = True,
    prefix_levels: int = 3,
    min_steps: int = 1,
    min_path: int = 1,
    min_slots: int = 1,
    min_wide: int = 0,
) -> ReferencePlan:
    """``compile_plan``'s reference twin: the same plan, built step by step in
    Python with every per-entry array padded to the widest op."""
    if chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len} must be >= 1")
    if prefix_levels < 1:
        raise ValueError(f"prefix_levels={prefix_levels} must be >= 1")
    if rows < 1:
        raise ValueError(f"rows={rows} must be >= 1")
    if wide < 0:
        raise ValueError(f"wide={wide} must be >= 0 (0 or 1: no wide pops)")
    if not wide_slack >= 0:
        raise ValueError(f"wide_slack={wide_slack} must be >= 0")
    c, r = int(chunk_len), int(rows)
    children = child_order(tree, order, chunk_len=c)
    start_pos, length = tree.start, tree.length

    def seg_range(x: int) -> tuple[int, int]:
        a, b = int(start_pos[x]), int(start_pos[x] + length[x])
        return max(a - 1, 0), b - 1

    def chunks(x: int) -> list[tuple[int, int]]:
        s0, s1 = seg_range(x)
        return [(s, min(s + c, s1)) for s in range(s0, s1, c)]

    def check_trainable(x: int) -> None:
        s0, s1 = seg_range(x)
        if s1 <= s0 and tree.ends_at[x]:
            raise ValueError(
                f"node {x}: sequences {tree.ends_at[x]} end at a node with no predicted "
                "token (length-1 sequences are not trainable)"
            )

    # W: the widest leaf in chunks, capped at ``wide`` (and never below the
    # engine's previous W, so the program is reused).
    longest_leaf = max(
        (seg_range(x)[1] - seg_range(x)[0] for x in range(1, tree.num_nodes) if not children[x]),
        default=0,
    )
    w_chunks = min(int(wide), -(-longest_leaf // c)) if longest_leaf > c else 0
    w_chunks = max(w_chunks, int(min_wide))
    w_chunks = w_chunks if w_chunks >= 2 else 0
    wc = w_chunks * c

    steps: list[_Step] = []
    pushed = 0

    def first_fit(leaves: list[int], cap: int) -> list[list[int]]:
        """First-fit decreasing of whole leaf segments into bins of ``cap`` entries
        (one leaf per bin without packing)."""
        bins: list[tuple[int, list[int]]] = []
        for x in sorted(leaves, key=lambda y: -(seg_range(y)[1] - seg_range(y)[0])):
            size = seg_range(x)[1] - seg_range(x)[0]
            for i, (used, members) in enumerate(bins):
                if pack_leaves and used + size <= cap:
                    bins[i] = (used + size, members + [x])
                    break
            else:
                bins.append((size, [x]))
        return [members for _, members in bins]

    def pop_step(op: Op, group: list[list[int]]) -> _Step:
        members = [(row, x) for row, xs in enumerate(group) for x in xs]
        segs = [(x, *seg_range(x), row, j) for j, (row, x) in enumerate(members)]
        slots = [(sid, j) for j, (_, x) in enumerate(members) for sid in tree.ends_at[x]]
        return _Step(op, segs[0][1], segs, slots)

    def emit_leaves(leaves: list[int]) -> None:
        # Chunks of C entries, then up to R chunks per step.
        bins = first_fit(leaves, c)
        for first in range(0, len(bins), r):
            group = bins[first : first + r]
            steps.append(pop_step(Op.POP_ROWS if len(group) > 1 else Op.POP, group))

    s_pad = bucket(int(tree.stats.longest_path), min_path)
    sizes = prefix_bucket_sizes(s_pad, c, prefix_levels)
    flops = token_flops or (lambda keys: 1.0)

    def step_flops(width: int, start: int) -> float:
        """Forward FLOPs of a step of ``width`` entries reading the stack up to
        ``start``: every entry attends the prefix bucket and the whole row."""
        p = sizes[int(np.searchsorted(sizes, start))]
        return width * flops(p + width)

    def chunked_flops(s0: int, s1: int) -> float:
        """Forward + backward FLOPs of [s0, s1) chunked: pushed (but for the last
        chunk) and popped under the VJP (3x)."""
        firsts = list(range(s0, s1, c))
        return sum(step_flops(c, a) for a in firsts[:-1]) + 3 * sum(
            step_flops(c, a) for a in firsts
        )

    def emit_wide(leaves: list[int]) -> list[int]:
        """POP_WIDE steps (up to R rows of W*C) for the bins of leaves that cost at
        most (1 + wide_slack) x their chunked FLOPs wide; returns the leaves left to
        chunk."""
        left, wide_bins = [], []
        for members in first_fit(leaves, wc):
            chunked = sum(chunked_flops(*seg_range(x)) for x in members)
            if 3 * step_flops(wc, seg_range(members[0])[0]) <= (1 + wide_slack) * chunked:
                wide_bins.append(members)
            else:
                left.extend(members)
        for first in range(0, len(wide_bins), r):
            steps.append(pop_step(Op.POP_WIDE, wide_bins[first : first + r]))
        return left

    def tail_start(x: int) -> int | None:
        """Where a long leaf's wide tail starts (None: chunk the whole leaf)."""
        s0, s1 = seg_range(x)
        if not wc or children[x] or s1 - s0 <= wc:
            return None
        tail = s0 + -(-(s1 - s0 - wc) // c) * c
        # Alone in its step: the step's other R - 1 rows are padding.
        wide_cost = 3 * r * step_flops(wc, tail)
        return tail if wide_cost <= (1 + wide_slack) * chunked_flops(tail, s1) else None

    # Iterative DFS: (leaving?, node).
    stack: list[tuple[bool, int]] = [(False, 0)]
    while stack:
        leaving, x = stack.pop()
        if x == 0 and not leaving:
            kids = children[0]
        elif not leaving:
            check_trainable(x)
            cks = chunks(x)
            leaf = len(children[x]) == 0
            tail = tail_start(x)
            if tail is not None:
                cks = [(s, e) for s, e in cks if s < tail]
            for s, e in cks[:-1] if leaf and tail is None else cks:
                steps.append(_Step(Op.PUSH, s, [(x, s, e, 0, 0)], []))
                pushed += e - s
            stack.append((True, x))
            kids = children[x]
        else:
            cks = chunks(x)
            tail = tail_start(x)
            if tail is not None:
                end = seg_range(x)[1]
                ends = [(q, 0) for q in tree.ends_at[x]]
                steps.append(_Step(Op.POP_WIDE, tail, [(x, tail, end, 0, 0)], ends))
                cks = [(s, e) for s, e in cks if s < tail]
            for i in range(len(cks) - 1, -1, -1):
                s, e = cks[i]
                last = i == len(cks) - 1 and tail is None
                steps.append(
                    _Step(
                        Op.POP,
                        s,
                        [(x, s, e, 0, 0)],
                        [(q, 0) for q in tree.ends_at[x]] if last else [],
                    )
                )
            continue
        packable, wideable, rest = [], [], []
        for ch in kids:
            s0, s1 = seg_range(ch)
            if (pack_leaves or r > 1) and not children[ch] and 0 < s1 - s0 <= c:
                check_trainable(ch)
                packable.append(ch)
            elif wc and not children[ch] and c < s1 - s0 <= wc:
                wideable.append(ch)
            else:
                rest.append(ch)
        if packable:
            emit_leaves(packable)
        if wideable:
            rest += emit_wide(wideable)
        stack.extend((False, ch) for ch in reversed(rest))

    if merge_runs:
        steps = _merge_runs(steps, c)
    n_steps = len(steps)
    t_pad = fine_bucket(n_steps, min_steps)
    k_pad = bucket(max((len(st.slots) for st in steps), default=1), min_slots)
    op = np.zeros(t_pad, np.int32)
    start = np.zeros(t_pad, np.int32)
    pbucket = np.zeros(t_pad, np.int32)
    w = r * max(w_chunks, 1) * c
    positions = np.zeros((t_pad, w), np.int32)
    inputs = np.zeros((t_pad, w), np.int32)
    targets = np.zeros((t_pad, w), np.int32)
    seg = np.full((t_pad, w), -1, np.int32)
    tree_idx = np.full((t_pad, w), -1, np.int32)
    slots = np.full((t_pad, k_pad), -1, np.int32)
    slot_seg = np.zeros((t_pad, k_pad), np.int32)
    computed = packed = row_steps = wide_steps = peak = 0
    for t, st in enumerate(steps):
        op[t], start[t] = int(st.op), st.start
        pbucket[t] = int(np.searchsorted(sizes, st.start))
        used = [0] * r
        cap = wc if st.op is Op.POP_WIDE else c
        for x, s, e, row, j in st.segs:
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
            col = row * cap + used[row]
            sl = slice(col, col + n)
            positions[t, sl] = np.arange(s, e)
            inputs[t, sl] = ext[s - base : e - base]
            targets[t, sl] = ext[s - base + 1 : e - base + 1]
            seg[t, sl] = j
            tree_idx[t, sl] = int(tree.offset[x]) + np.arange(s + 1, e + 1) - a
            used[row] += n
            assert used[row] <= cap
            peak = max(peak, e)
        if st.op in (Op.POP, Op.POP_ROWS, Op.POP_WIDE):
            computed += sum(used)
            packed += len({row for *_, row, _ in st.segs}) < len({j for *_, j in st.segs})
            row_steps += st.op is Op.POP_ROWS
            wide_steps += st.op is Op.POP_WIDE
        for k, (sid, j) in enumerate(st.slots):
            slots[t, k], slot_seg[t, k] = sid, j
    return ReferencePlan(
        op=op,
        start=start,
        pbucket=pbucket,
        positions=positions,
        inputs=inputs,
        targets=targets,
        seg=seg,
        tree_idx=tree_idx,
        slots=slots,
        slot_seg=slot_seg,
        chunk_len=c,
        rows=r,
        wide=w_chunks,
        path_len=s_pad,
        prefix_sizes=sizes,
        num_steps=n_steps,
        computed_tokens=computed,
        pushed_tokens=pushed,
        packed_steps=packed,
        row_steps=row_steps,
        wide_steps=wide_steps,
        peak_path=peak,
    )


__all__ = ["ReferencePlan", "compile_plan_reference"]
