"""The prefix tree of a batch of rollouts (host-side numpy, no JAX).

Sequences are stored in a *compressed* trie: every chain of single-child
prefixes is merged into one node. A node is cut

* wherever two sequences diverge (the node's children start with distinct
  tokens), and
* wherever a sequence ends (every sequence ends exactly at the last token of
  some node, so sequences that are prefixes of others end at internal nodes).

Exact duplicates end at the same node and are all listed in its ``ends_at``.

Node 0 is a virtual root with no tokens. Node ids are assigned in
lexicographic DFS preorder, so ``parent[i] < i`` for every non-root node.

Letter legend: N = sequences, M = nodes (root included), L = tokens stored in
the tree (``tree_tokens``).

Construction (``build_tree``): sort the sequences lexicographically, compute
the longest common prefix (LCP) of neighbours with vectorised numpy compares,
then build the trie with one stack pass over the sorted sequences (the
suffix-array + LCP construction of a suffix tree). Cost: O(N log N)
byte-string comparisons plus O(total tokens) numpy work; there is no Python
object per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_I32_MIN = np.iinfo(np.int32).min
_I32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TreeStats:
    """Size of a prefix tree versus the dense batch it encodes."""

    num_sequences: int
    num_tokens: int  # dense: sum of sequence lengths
    tree_tokens: int  # sum of node lengths (= number of distinct non-empty prefixes)
    depth: int  # max number of nodes on a root-to-node path (root excluded)
    longest_path: int  # max sequence length
    num_forks: int  # nodes (incl. the virtual root) with >= 2 children
    num_leaves: int

    @property
    def ideal_token_ratio(self) -> float:
        """``num_tokens / tree_tokens``: the compute saving of perfect prefix reuse."""
        return self.num_tokens / self.tree_tokens


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PrefixTree:
    """A compressed trie of token sequences.

    Node 0 is a virtual root holding no tokens (length 0, start 0, parent -1).
    Arrays are read-only.
    """

    parent: np.ndarray  # [M] int32
    start: np.ndarray  # [M] int64: path position (depth in tokens) of the node's first token
    length: np.ndarray  # [M] int64: tokens in the node (0 only for the root)
    offset: np.ndarray  # [M] int64: node i is token_data[offset[i]: offset[i] + length[i]]
    token_data: np.ndarray  # [L] int32
    children: tuple[tuple[int, ...], ...]  # per node, sorted by the child's first token
    ends_at: tuple[tuple[int, ...], ...]  # per node, sequences ending there (input order)
    seq_node: np.ndarray  # [N] int32: node where sequence i ends
    stats: TreeStats

    @property
    def num_nodes(self) -> int:
        """M, the number of nodes including the virtual root."""
        return int(self.parent.shape[0])

    def node_tokens(self, i: int) -> np.ndarray:
        """The tokens of node ``i`` (a read-only view; empty for the root)."""
        o = int(self.offset[i])
        return self.token_data[o : o + int(self.length[i])]

    def path_tokens(self, i: int) -> np.ndarray:
        """The tokens on the path root -> ``i`` (``start[i] + length[i]`` tokens)."""
        parts = []
        while i > 0:
            parts.append(self.node_tokens(i))
            i = int(self.parent[i])
        if not parts:
            return np.zeros((0,), np.int32)
        return np.concatenate(parts[::-1])

    def is_leaf(self, i: int) -> bool:
        """True for a node without children (never the root of a non-empty tree)."""
        return i != 0 and not self.children[i]


def _validate(sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
    if len(sequences) == 0:
        raise ValueError("build_tree needs at least one sequence; got an empty list")
    out = []
    for i, s in enumerate(sequences):
        a = np.asarray(s)
        if a.ndim != 1:
            raise ValueError(
                f"sequences[{i}] must be a 1-D array of token ids; got shape {a.shape}"
            )
        if a.shape[0] == 0:
            raise ValueError(f"sequences[{i}] is empty; every sequence needs >= 1 token")
        if not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
            raise ValueError(f"sequences[{i}] must hold integer token ids; got dtype {a.dtype}")
        if a.dtype != np.int32:
            lo, hi = int(a.min()), int(a.max())
            if lo < _I32_MIN or hi > _I32_MAX:
                raise ValueError(
                    f"sequences[{i}] has token ids in [{lo}, {hi}], outside the int32 range"
                )
            a = a.astype(np.int32)
        out.append(a)
    return out


def sort_key(a: np.ndarray) -> bytes:
    """Bytes that order token sequences lexicographically (a proper prefix sorts first).

    Each token is cast to int32, its sign bit flipped and written big-endian, so byte
    order == numeric order, exactly like tuple comparison of the int sequences.
    """
    a32 = np.asarray(a).astype(np.int32, copy=False)
    return (a32.view(np.uint32) ^ np.uint32(0x80000000)).astype(">u4").tobytes()


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays."""
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    neq = a[:m] != b[:m]
    k = int(np.argmax(neq))
    return k if neq[k] else m


def build_tree(sequences: Sequence[np.ndarray]) -> PrefixTree:
    """Build the compressed prefix tree of ``sequences``.

    Args:
      sequences: N non-empty 1-D integer arrays (token ids in the int32 range).

    Returns:
      A ``PrefixTree`` with node ids in lexicographic DFS preorder; sequence
      ``i`` is ``tree.path_tokens(tree.seq_node[i])``.

    Raises:
      ValueError: no sequences, a sequence that is not 1-D, empty, or not integer.
    """
    seqs = _validate(sequences)
    n = len(seqs)
    # Stable sort: duplicates keep their input order.
    order = sorted(range(n), key=lambda i: sort_key(seqs[i]))

    # Growable node table (construction ids; renumbered to preorder below).
    # A node covers path positions [n_start, n_end) of its representative sequence n_rep.
    n_start = [0]
    n_end = [0]
    n_rep = [-1]
    n_children: list[list[int]] = [[]]
    n_ends: list[list[int]] = [[]]

    stack = [0]  # nodes on the path of the previous sorted sequence
    prev = None
    for k in order:
        s = seqs[k]
        ln = s.shape[0]
        l = 0 if prev is None else lcp(prev, s)
        while len(stack) > 1 and n_start[stack[-1]] >= l:
            stack.pop()
        top = stack[-1]
        if n_end[top] > l:  # n_start[top] < l < n_end[top]: split top at l
            low = len(n_start)
            n_start.append(l)
            n_end.append(n_end[top])
            n_rep.append(n_rep[top])
            n_children.append(n_children[top])
            n_ends.append(n_ends[top])
            n_end[top] = l
            n_children[top] = [low]
            n_ends[top] = []
        if l == ln:  # sorted order: l == len(s) only for an exact duplicate of prev
            n_ends[top].append(k)
        else:
            new = len(n_start)
            n_start.append(l)
            n_end.append(ln)
            n_rep.append(k)
            n_children.append([])
            n_ends.append([k])
            n_children[top].append(new)
            stack.append(new)
        prev = s

    # Renumber in preorder (children lists are already in lexicographic order).
    m = len(n_start)
    pre = np.empty(m, np.int64)  # preorder position -> construction id
    new_id = np.empty(m, np.int64)
    dfs = [0]
    pos = 0
    while dfs:
        v = dfs.pop()
        pre[pos] = v
        new_id[v] = pos
        pos += 1
        dfs.extend(reversed(n_children[v]))

    parent = np.full(m, -1, np.int32)
    children = []
    ends_at = []
    for v in pre:
        ch = tuple(int(new_id[c]) for c in n_children[v])
        for c in ch:
            parent[c] = new_id[v]
        children.append(ch)
        ends_at.append(tuple(n_ends[v]))
    start = np.asarray(n_start, np.int64)[pre]
    length = np.asarray(n_end, np.int64)[pre] - start
    offset = np.zeros(m, np.int64)
    np.cumsum(length[:-1], out=offset[1:])
    token_data = np.concatenate(
        [np.zeros((0,), np.int32)] + [seqs[n_rep[v]][n_start[v] : n_end[v]] for v in pre[1:]]
    ).astype(np.int32, copy=False)

    seq_node = np.empty(n, np.int32)
    for i, e in enumerate(ends_at):
        for k in e:
            seq_node[k] = i

    node_depth = np.zeros(m, np.int64)  # nodes on the root->i path, root excluded
    for i in range(1, m):
        node_depth[i] = node_depth[parent[i]] + 1
    num_children = np.fromiter((len(c) for c in children), np.int64, count=m)
    seq_lens = np.fromiter((s.shape[0] for s in seqs), np.int64, count=n)
    stats = TreeStats(
        num_sequences=n,
        num_tokens=int(seq_lens.sum()),
        tree_tokens=int(length.sum()),
        depth=int(node_depth.max()),
        longest_path=int(seq_lens.max()),
        num_forks=int((num_children >= 2).sum()),
        num_leaves=int((num_children[1:] == 0).sum()),
    )
    for a in (parent, start, length, offset, token_data, seq_node):
        a.flags.writeable = False
    return PrefixTree(
        parent=parent,
        start=start,
        length=length,
        offset=offset,
        token_data=token_data,
        children=tuple(children),
        ends_at=tuple(ends_at),
        seq_node=seq_node,
        stats=stats,
    )
