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

Packing. Sibling leaves whose whole segment fits in a chunk read the same stack
prefix and nothing reads their K/V, so several of them share one POP step as
separate segments (``seg``): the attention mask keeps segments apart, and each
token carries its own position. A GRPO group's G short responses cost one step.

Rows. Sibling leaves that do not fit one chunk together (a GRPO group of
responses close to C tokens) are popped ``rows`` chunks at a time: a POP_ROWS
step holds up to ``rows`` rows of C entries (each row one chunk, possibly itself
packed), all reading the same stack prefix, which the model shares between the
rows without copying it. Every step's per-entry arrays are ``rows * C`` wide;
PUSH and POP use the first C entries. Rows only ever hold leaves, so nothing
has accumulated in the stack cotangents past their start and they leave none.

Wide leaves. A leaf longer than a chunk costs, chunked, a forward of every chunk
but its last at push time and again at pop time, and one sequential step per
chunk. With ``wide`` = W > 1, sibling leaves of more than C but at most W*C
input tokens are packed (first fit) into rows of W*C entries and popped R rows
at a time as POP_WIDE steps over the shared stack prefix, when that computes at
most (1 + ``wide_slack``) x the FLOPs of chunking them (``token_flops(keys)``: a
token's forward FLOPs attending ``keys`` keys; every entry of a step attends its
prefix bucket and its whole row, padding included; without ``token_flops`` every
token costs 1). A leaf longer than W*C pushes chunks only until at most W*C
entries are left and pops those as one POP_WIDE step (its "wide tail", the only
row of its step). A wide row saves the second forward of the pushed chunks and
runs as fewer, larger steps whose rows execute in parallel; chunking saves the
masked half of a long row's attention. The slack prices the first against the
second (the engine's default is measured).

Runs. A chain of short nodes (multi-turn trees: one node per turn) would cost a
step per node on the way down and on the way up. Consecutive steps over adjacent
ranges of the same path are merged while they fit one chunk (``merge_runs``): a
node's last PUSH with its first child's first PUSH, and a last child's first POP
with its parent's last POP. This is where the DFS order matters (``DFSOrder``):
the greedy order puts an internal child first and picks the last child so that
these runs are long.

Prefix buckets. Each step also names the smallest of a few static prefix lengths
(``prefix_buckets``) that covers its stack prefix, so attention runs over at most
about twice the real prefix rather than the whole path buffer.

Shapes are bucketed (steps, path length, loss slots, sequences, flat token data)
so that a new batch reuses the compiled program unless it needs a larger bucket.

Letters: C chunk length, R rows, S path buffer length, K loss slots per step.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
from collections.abc import Callable

import numpy as np

from dtarl.tree.order import DFSOrder, child_order
from dtarl.tree.trie import PrefixTree


class Op(enum.IntEnum):
    NOOP = 0
    PUSH = 1
    POP = 2
    POP_ROWS = 3  # a POP of up to ``rows`` rows of sibling leaves over one shared prefix
    POP_WIDE = 4  # a POP of up to ``rows`` rows of ``wide`` * C entries of leaves


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int, minimum: int = 1) -> int:
    """The smallest of {1, 1.25, 1.5, 1.75} x 2^k (integers) >= max(n, minimum).

    Padding steps are not free, so step counts get quarter-octave buckets.
    """
    n = max(int(n), int(minimum), 1)
    if n <= 8:
        return bucket(n)
    k = (n - 1).bit_length() - 1
    for q in (4, 5, 6, 7, 8):
        size = (q << k) // 4
        if size >= n:
            return size
    return bucket(n)


def prefix_bucket_sizes(path_len: int, chunk_len: int, levels: int) -> tuple[int, ...]:
    """Static prefix lengths a step may attend to: 0 and path_len / 2^k (k < levels)."""
    sizes = {0, path_len}
    for k in range(1, max(levels, 1)):
        size = path_len >> k
        if size >= max(chunk_len // 2, 8):
            sizes.add(size)
    return tuple(sorted(sizes))


# The per-entry arrays, in the order the device program's step record holds them.
ENTRY_FIELDS = ("positions", "inputs", "targets", "seg", "tree_idx")
_ENTRY_FILL = dict(positions=0, inputs=0, targets=0, seg=-1, tree_idx=-1)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SegmentPlan:
    """Fixed-shape device program for one tree. Arrays are host numpy.

    Per step t (padded to a step bucket with NOOP) and entry i < E = R*max(W, 1)*C
    (row i // C of a POP_ROWS step, row i // (W*C) of a POP_WIDE step):
      op [T]; saved [T]: a POP whose entries all were pushed (on the stack: the
      engine may run only their backward); start [T]: stack prefix length the
      step reads (= path position of its first input); pbucket [T]: index into ``prefix_sizes``;
      positions [T, E], inputs [T, E], targets [T, E]; seg [T, E]: segment
      of the entry (unique within the step), -1 for padding; tree_idx [T, E]:
      where the target's logprob goes in the tree's flat token data, -1 for padding;
      slots [T, K]: sequences visited at this step (-1 = empty), slot_seg [T, K].
    PUSH steps are a single contiguous segment starting at ``start``; PUSH and
    POP steps use row 0 only.

    Storage. The per-entry arrays are held compactly (most steps fill a small part
    of the E entries, which are sized for the widest op): ``entries`` maps each
    name in ``ENTRY_FIELDS`` to a flat [N] int32 array of the N real entries in
    step order (column order within a step), ``entry_col`` [N] is each entry's
    column i and ``entry_ptr`` [T + 1] the CSR offsets of the steps' entries. The
    padded [T, E] arrays above (``positions`` ...) are expanded from them on first
    use (``padded``) and kept.
    """

    op: np.ndarray
    saved: np.ndarray
    start: np.ndarray
    pbucket: np.ndarray
    entries: dict[str, np.ndarray]
    entry_col: np.ndarray
    entry_ptr: np.ndarray
    slots: np.ndarray
    slot_seg: np.ndarray
    chunk_len: int
    rows: int  # R: rows of a POP_ROWS step
    wide: int  # W: a POP_WIDE step's R rows are W * C entries (0: no POP_WIDE steps)
    path_len: int  # S: padded path buffer for logprobs / sequence data
    prefix_sizes: tuple[int, ...]
    num_steps: int  # real steps (before padding)
    computed_tokens: int  # tokens run forward+backward (popped)
    pushed_tokens: int  # tokens whose forward also runs at push time
    packed_steps: int  # pop steps with a row holding more than one leaf
    row_steps: int  # POP_ROWS steps
    wide_steps: int  # POP_WIDE steps
    peak_path: int  # longest stacked prefix + chunk
    _padded: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    @property
    def width(self) -> int:
        """E = R * max(W, 1) * C: entries per step in the padded form."""
        return self.rows * max(self.wide, 1) * self.chunk_len

    @property
    def num_entries(self) -> int:
        """N: the real (non-padding) entries of all steps."""
        return int(self.entry_col.shape[0])

    @property
    def entry_step(self) -> np.ndarray:
        """[N] the step of each entry."""
        counts = np.diff(self.entry_ptr)
        return np.repeat(np.arange(counts.shape[0], dtype=np.int32), counts)

    @property
    def host_nbytes(self) -> int:
        """Host bytes of the plan as stored (compact entries, per-step and slot arrays)."""
        arrays = [self.op, self.saved, self.start, self.pbucket, self.entry_col, self.entry_ptr]
        arrays += [self.slots, self.slot_seg, *self.entries.values()]
        return int(sum(a.nbytes for a in arrays))

    def padded(self, name: str) -> np.ndarray:
        """The per-entry array ``name`` (one of ``ENTRY_FIELDS``) as [T, E] int32, padding
        filled (0, or -1 for ``seg`` and ``tree_idx``); read-only, built once."""
        if name not in _ENTRY_FILL:
            raise ValueError(f"padded({name!r}): accepted names are {ENTRY_FIELDS}")
        out = self._padded.get(name)
        if out is None:
            out = np.full((self.op.shape[0], self.width), _ENTRY_FILL[name], np.int32)
            out[self.entry_step, self.entry_col] = self.entries[name]
            out.flags.writeable = False
            self._padded[name] = out
        return out

    positions = property(lambda self: self.padded("positions"))
    inputs = property(lambda self: self.padded("inputs"))
    targets = property(lambda self: self.padded("targets"))
    seg = property(lambda self: self.padded("seg"))
    tree_idx = property(lambda self: self.padded("tree_idx"))

    @property
    def shape_key(self) -> tuple:
        """Everything that determines the compiled program's shapes."""
        return (
            self.op.shape[0],
            self.chunk_len,
            self.rows,
            self.wide,
            self.path_len,
            self.slots.shape[1],
            self.prefix_sizes,
        )


@dataclasses.dataclass
class _Step:
    op: Op
    start: int
    # (node, first input position, last input position + 1, row, segment id)
    segs: list[tuple[int, int, int, int, int]]
    slots: list[tuple[int, int]]  # (sequence, segment)
    # A POP whose every entry an earlier PUSH of this path computed (its K/V, logprobs
    # and layer outputs are on the stack): no leaf's cut tail, no packed leaves.
    pushed: bool = False


def _run_range(st: _Step) -> tuple[int, int, int] | None:
    """[first, last + 1) path positions and the segment id of a single-segment PUSH /
    POP step, else None."""
    if st.op not in (Op.PUSH, Op.POP):
        return None
    segs = st.segs
    j = segs[0][4]
    if any(sg[4] != j for sg in segs):
        return None
    return min(sg[1] for sg in segs), max(sg[2] for sg in segs), j


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
    a = None  # the range of out[-1]
    for st in steps:
        b = _run_range(st)
        if a is not None and b is not None and out[-1].op == st.op and a[2] == b[2]:
            prev = out[-1]
            if st.op is Op.PUSH and a[1] == b[0] and b[1] - a[0] <= c:
                out[-1] = _Step(Op.PUSH, a[0], prev.segs + st.segs, [])
                a = (a[0], b[1], a[2])
                continue
            if st.op is Op.POP and b[1] == a[0] and a[1] - b[0] <= c:
                both = prev.pushed and st.pushed
                out[-1] = _Step(Op.POP, b[0], st.segs + prev.segs, prev.slots + st.slots, both)
                a = (b[0], a[1], a[2])
                continue
        out.append(st)
        a = b
    return out


def compile_plan(
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
) -> SegmentPlan:
    """Turns ``tree`` into a bucketed push/pop plan (see the module docstring)."""
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

    per_bucket: dict[tuple[int, int], float] = {}

    def step_flops(width: int, start: int) -> float:
        """Forward FLOPs of a step of ``width`` entries reading the stack up to
        ``start``: every entry attends the prefix bucket and the whole row."""
        p = sizes[bisect.bisect_left(sizes, start)]
        got = per_bucket.get((width, p))
        if got is None:
            got = per_bucket[(width, p)] = width * flops(p + width)
        return got

    def chunked_flops(s0: int, s1: int) -> float:
        """Forward + backward FLOPs of [s0, s1) chunked: pushed (but for the last
        chunk) and popped under the VJP (3x); summed in chunk order."""
        each = [step_flops(c, a) for a in range(s0, s1, c)]
        return sum(each[:-1]) + 3 * sum(each)

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
                        pushed=bool(children[x]) or not last,
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
    return _assemble(
        tree,
        steps,
        c=c,
        r=r,
        w_chunks=w_chunks,
        s_pad=s_pad,
        sizes=sizes,
        pushed=pushed,
        min_steps=min_steps,
        min_slots=min_slots,
    )


def _assemble(
    tree: PrefixTree,
    steps: list[_Step],
    *,
    c: int,
    r: int,
    w_chunks: int,
    s_pad: int,
    sizes: tuple[int, ...],
    pushed: int,
    min_steps: int,
    min_slots: int,
) -> SegmentPlan:
    """The plan's arrays from its steps, vectorised over entries.

    An entry at path position p of node x (covering [a, b)) predicts the token at
    p + 1, flat index ``tree_idx = offset[x] + p + 1 - a`` in the tree's token data;
    its input is the token before, ``token_data[tree_idx - 1]``, except at p = a - 1
    where it is the parent's last token.
    """
    n_steps = len(steps)
    t_pad = fine_bucket(n_steps, min_steps)
    wc = w_chunks * c
    # One row per segment: node, first / last + 1 position, row, segment id; its step.
    chain = itertools.chain.from_iterable
    table = np.array(list(chain(st.segs for st in steps)), np.int64).reshape(-1, 5)
    seg_x, seg_s, seg_e, seg_row, seg_j = table.T
    seg_t = np.repeat(np.arange(n_steps, dtype=np.int64), [len(st.segs) for st in steps])
    n_slots = [len(st.slots) for st in steps]
    slot_t = np.repeat(np.arange(n_steps, dtype=np.int64), n_slots)
    slot_k = np.arange(slot_t.shape[0]) - np.repeat(np.cumsum(n_slots) - n_slots, n_slots)
    slot_tab = np.array(list(chain(st.slots for st in steps)), np.int64).reshape(-1, 2)
    op = np.zeros(t_pad, np.int32)
    start = np.zeros(t_pad, np.int32)
    op[:n_steps] = [int(st.op) for st in steps]
    start[:n_steps] = [st.start for st in steps]
    saved = np.zeros(t_pad, bool)
    saved[:n_steps] = [st.op is Op.POP and st.pushed for st in steps]
    pbucket = np.zeros(t_pad, np.int32)
    pbucket[:n_steps] = np.searchsorted(np.asarray(sizes), start[:n_steps])
    most_slots = max((len(st.slots) for st in steps), default=1)
    k_pad = bucket(most_slots, min_slots)
    slots = np.full((t_pad, k_pad), -1, np.int32)
    slot_seg = np.zeros((t_pad, k_pad), np.int32)
    slots[slot_t, slot_k] = slot_tab[:, 0]
    slot_seg[slot_t, slot_k] = slot_tab[:, 1]

    i64 = np.int64
    n = seg_e - seg_s
    # Columns: a row's segments are laid out one after the other from the row's start.
    cap = np.where(op[seg_t] == Op.POP_WIDE, wc, c)
    key = seg_t * r + seg_row
    by_row = np.argsort(key, kind="stable")
    csum = np.cumsum(n[by_row])
    first = np.r_[True, key[by_row][1:] != key[by_row][:-1]]
    row_base = np.maximum.accumulate(np.where(first, csum - n[by_row], 0))
    used = np.empty_like(n)
    used[by_row] = csum - row_base  # the row's entries up to and including the segment
    if (used > cap).any():
        raise AssertionError("a step's row holds more entries than its capacity")
    col0 = seg_row * cap + used - n

    # Every per-entry value is the entry's index plus a per-segment constant.
    total = int(n.sum())
    first_entry = np.cumsum(n) - n
    seg_of = np.repeat(np.arange(n.shape[0], dtype=np.int32), n)
    idx = np.arange(total, dtype=np.int32)
    a = tree.start[seg_x]
    pos_shift = seg_s - first_entry
    tidx_shift = pos_shift + tree.offset[seg_x] + 1 - a
    tree_idx = idx + tidx_shift.astype(np.int32)[seg_of]
    data = tree.token_data
    inputs = data[tree_idx - 1]
    # A segment starting at its node's first position - 1 reads the parent's last token.
    reads_parent = np.flatnonzero(seg_s < a)
    par = tree.parent[seg_x[reads_parent]]
    inputs[first_entry[reads_parent]] = data[tree.offset[par] + tree.length[par] - 1]
    entries = dict(
        positions=idx + pos_shift.astype(np.int32)[seg_of],
        inputs=inputs,
        targets=data[tree_idx],
        seg=seg_j.astype(np.int32)[seg_of],
        tree_idx=tree_idx,
    )
    entry_ptr = np.zeros(t_pad + 1, i64)
    np.cumsum(np.bincount(seg_t, weights=n, minlength=t_pad).astype(i64), out=entry_ptr[1:])

    is_pop = np.isin(op, (Op.POP, Op.POP_ROWS, Op.POP_WIDE))
    packed = 0
    for t in np.flatnonzero(is_pop[:n_steps]):
        segs = steps[t].segs
        packed += len({row for *_, row, _ in segs}) < len({j for *_, j in segs})
    return SegmentPlan(
        op=op,
        saved=saved,
        start=start,
        pbucket=pbucket,
        entries=entries,
        entry_col=idx + (col0 - first_entry).astype(np.int32)[seg_of],
        entry_ptr=entry_ptr,
        slots=slots,
        slot_seg=slot_seg,
        chunk_len=c,
        rows=r,
        wide=w_chunks,
        path_len=s_pad,
        prefix_sizes=sizes,
        num_steps=n_steps,
        computed_tokens=int(n[is_pop[seg_t]].sum()),
        pushed_tokens=pushed,
        packed_steps=packed,
        row_steps=int((op == Op.POP_ROWS).sum()),
        wide_steps=int((op == Op.POP_WIDE).sum()),
        peak_path=int(seg_e.max(initial=0)),
    )
