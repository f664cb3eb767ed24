"""DFS child orders over a prefix tree, and what an order costs.

AREAL-DTA (paper §3.1) trains by a depth-first traversal: *push* a node
(forward its tokens against the stacked K/V of its ancestors and stack its
K/V), *visit* a leaf, *pop* a node (recompute its forward under a VJP and
backpropagate, accumulating its prefix's dK/dV). The set of stacks visited is
the same for every child order, so **peak stacked K/V tokens and total
forward/backward tokens do not depend on the order**. What the order changes
(paper §3.2, "longer uninterrupted push-pop segments", "balance the backward
pass segment lengths to avoid frequent short backward steps") is how the work
groups into device *steps*.

Step model (used by ``order_cost`` and optimised by ``DFSOrder.GREEDY``)
----------------------------------------------------------------------
The traversal emits, in order, one event per node:

* push of an internal node v: ``length[v]`` forward tokens;
* a leaf L ("cut tail": its K/V is never stacked, its forward is fused into
  its backward): ``length[L]`` backward tokens;
* pop of an internal node v: ``length[v]`` backward tokens.

Consecutive pushes form a downward chain (v, then its first child, ...) and are
merged into one *forward run*; a leaf and the pops that immediately follow it
form an upward chain (the leaf, its parent if the leaf was the last child, ...)
merged into one *backward run*. A run of T tokens is executed as
``ceil(T / chunk_len)`` steps of balanced size (sizes differ by at most one
token); with ``chunk_len=None`` each run is one step. Hence

* backward runs = number of leaves, for every order; their *lengths* depend
  on which child is visited **last** (its backward run continues into the
  parent's pop);
* forward runs = number of non-leaf children that are not visited first at
  their parent (+1 if the root's first child is internal); a parent's forward
  run continues into its **first** child only if that child is internal.

Letter legend: C = ``chunk_len``, h(c) = tokens of the forward run that enters
child c (c plus its chain of first children down to the first one whose first
child is a leaf; 0 for a leaf), t(c) = tokens of the backward run that leaves
c (c plus its chain of last children down to a leaf).
"""

from __future__ import annotations

import enum

import numpy as np

from dtarl.tree.trie import PrefixTree

# A backward step (recompute forward + VJP) costs roughly 2-3x a forward step of
# the same size, so saving a backward step is worth more. Weights are integers
# so the greedy's comparisons are exact.
_FORWARD_WEIGHT = 1
_BACKWARD_WEIGHT = 2


class DFSOrder(enum.Enum):
    """How the children of each node are ordered in the DFS."""

    LEXICOGRAPHIC = "lexicographic"  # by first token (tree.children as built)
    GREEDY = "greedy"  # AREAL-DTA §3.2 greedy, see ``child_order``


def _waste(t: int, chunk_len: int | None) -> int:
    """Numerator of ceil(t/C) - t/C (the saving of merging a run of t tokens), over C.

    With ``chunk_len=None`` every run is one step and merging saves one step: 1 (over 1).
    """
    if chunk_len is None:
        return 1
    return (-t) % chunk_len


def child_order(
    tree: PrefixTree, order: DFSOrder, *, chunk_len: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Per node, the order in which its children are visited.

    ``LEXICOGRAPHIC`` returns ``tree.children`` (sorted by first token; its
    preorder visits the sequences in sorted order).

    ``GREEDY`` reads the paper's §3.2 heuristic in the step model of this
    module's docstring and minimises, node by node bottom-up, the weighted step
    count ``forward_steps + 2 * backward_steps``. At a node v with children
    ``c_1..c_k`` (k >= 2) it picks

    * a **last** child b (any child): its backward run t(b) continues into v's
      pop instead of ending at b, saving ``ceil(t(b)/C) - t(b)/C`` backward
      steps (amortised; exactly one step when ``chunk_len`` is None);
    * a **first** child f (internal, != b, optional): v's forward run continues
      into f's forward run h(f), saving ``ceil(h(f)/C) - h(f)/C`` forward steps
      (one step when ``chunk_len`` is None);

    maximising ``1 * saving_f + 2 * saving_b``; ties go to the longer
    uninterrupted chains (larger t(b), then larger h(f)), then to the
    lexicographic order (b as late, f as early as possible). The other
    children go between them: **leaves first** (contiguous, so a plan may batch
    sibling leaves against the same prefix K/V), then the remaining internal
    children, each group lexicographic. The order is thus
    ``[f] + leaves + internal + [b]``; when no internal child is available for
    f, the leaves come first. Then t(v) = len(v) + t(b) and
    h(v) = len(v) + h(first child).

    Guarantees with ``chunk_len=None``: every node with an internal child
    visits an internal child first, so GREEDY has the fewest forward runs (and
    steps) of any order, and the same number of backward steps (one per leaf).

    Args:
      tree: the prefix tree.
      order: which order.
      chunk_len: the maximum step size in tokens (None: unchunked). Only GREEDY uses it.
    """
    if chunk_len is not None and (not isinstance(chunk_len, int | np.integer) or chunk_len < 1):
        raise ValueError(f"chunk_len must be a positive int or None; got {chunk_len!r}")
    if order is DFSOrder.LEXICOGRAPHIC:
        return tree.children
    if order is not DFSOrder.GREEDY:
        raise ValueError(f"order must be a DFSOrder; got {order!r}")

    m = tree.num_nodes
    length = tree.length.tolist()
    head = [0] * m  # h(v); 0 for leaves (cut tail: no forward run)
    tail = [0] * m  # t(v)
    out: list[tuple[int, ...]] = [()] * m
    # Node ids are a preorder (parent < child), so a reverse sweep is bottom-up.
    for v in range(m - 1, -1, -1):
        cs = tree.children[v]
        if not cs:
            tail[v] = length[v]
            continue
        if len(cs) == 1:
            ordered = cs
        else:
            ordered = _greedy_children(cs, head, tail, tree.children, chunk_len)
        out[v] = ordered
        head[v] = length[v] + head[ordered[0]]
        tail[v] = length[v] + tail[ordered[-1]]
    return tuple(out)


def _greedy_children(cs, head, tail, children, chunk_len):
    pos = {c: j for j, c in enumerate(cs)}
    internal = [c for c in cs if children[c]]
    # Top-2 candidates for each slot suffice: the two slots conflict on at most one child.
    last_c = sorted(cs, key=lambda c: (-_waste(tail[c], chunk_len), -tail[c], -pos[c]))[:2]
    first_c = sorted(internal, key=lambda c: (-_waste(head[c], chunk_len), -head[c], pos[c]))[:2]
    best_key, best = None, None
    for b in last_c:
        for f in [None, *first_c]:
            if f == b:
                continue
            score = _BACKWARD_WEIGHT * _waste(tail[b], chunk_len)
            if f is not None:
                score += _FORWARD_WEIGHT * _waste(head[f], chunk_len)
            key = (
                score,
                tail[b],
                -1 if f is None else head[f],
                pos[b],
                1 if f is None else -pos[f],
            )
            if best_key is None or key > best_key:
                best_key, best = key, (f, b)
    f, b = best
    rest = [c for c in cs if c != f and c != b]
    middle = [c for c in rest if not children[c]] + [c for c in rest if children[c]]
    return tuple(([] if f is None else [f]) + middle + [b])


def _check_order(tree: PrefixTree, children_order) -> None:
    if len(children_order) != tree.num_nodes:
        raise ValueError(
            f"children_order has {len(children_order)} entries; the tree has {tree.num_nodes} nodes"
        )
    for v, (got, want) in enumerate(zip(children_order, tree.children, strict=True)):
        if len(got) != len(want) or sorted(got) != sorted(want):
            raise ValueError(
                f"children_order[{v}] = {tuple(got)} is not a permutation of the children {want}"
            )


def dfs_preorder(tree: PrefixTree, children_order) -> np.ndarray:
    """Node ids in visit (push) order, root excluded: [M - 1] int32."""
    _check_order(tree, children_order)
    out = np.empty(tree.num_nodes - 1, np.int32)
    stack = list(reversed(children_order[0]))
    k = 0
    while stack:
        v = stack.pop()
        out[k] = v
        k += 1
        stack.extend(reversed(children_order[v]))
    return out


def _events(tree: PrefixTree, children_order):
    """(node, kind) in traversal order; kind 0 = push internal, 1 = leaf, 2 = pop internal."""
    events = []
    stack = [(c, False) for c in reversed(children_order[0])]
    while stack:
        v, done = stack.pop()
        if done:
            events.append((v, 2))
        elif not children_order[v]:
            events.append((v, 1))
        else:
            events.append((v, 0))
            stack.append((v, True))
            stack.extend((c, False) for c in reversed(children_order[v]))
    return events


def _split(total: int, chunk_len: int | None) -> list[int]:
    k = 1 if chunk_len is None else -(-total // chunk_len)
    q, r = divmod(total, k)
    return [q + 1] * r + [q] * (k - r)


def order_cost(tree: PrefixTree, children_order, chunk_len: int | None = None) -> dict:
    """Measurable cost of a DFS child order in the step model (module docstring).

    Returns a dict with

    * ``num_steps``, ``forward_steps``, ``backward_steps``: device steps after
      merging runs and chunking each run into ``ceil(T / chunk_len)`` balanced steps;
    * ``forward_runs``, ``backward_runs``: maximal push chains / leaf+pop chains
      (``backward_runs`` == number of leaves for every order);
    * ``switches``: direction changes (forward <-> backward) between consecutive steps;
    * ``forward_step_tokens``, ``backward_step_tokens``: [steps] int64 sizes, in order;
    * ``min_backward_step``, ``mean_backward_step``: backward step sizes;
    * ``short_backward_steps``: backward steps shorter than half of ``chunk_len``
      (of ``longest_path`` when ``chunk_len`` is None);
    * ``mean_prefix_tokens``: mean over steps of the K/V prefix a step attends to
      (path position of its first token);
    * ``leaf_groups``: maximal runs of consecutive leaf visits that are siblings
      (each could be one batched step sharing the parent's K/V);
    * ``peak_stack_tokens``: max K/V tokens stacked (deepest internal node's end;
      leaves are never stacked). The same for every order;
    * ``per_node_steps``: steps without run merging, ``sum ceil(len/C)`` over pushes,
      pops and leaves. The same for every order: the baseline the merging improves.
    """
    if chunk_len is not None and (not isinstance(chunk_len, int | np.integer) or chunk_len < 1):
        raise ValueError(f"chunk_len must be a positive int or None; got {chunk_len!r}")
    _check_order(tree, children_order)
    length = tree.length
    start = tree.start
    # Runs: [direction (0 fwd, 1 bwd), tokens, path position of the first token].
    runs: list[list[int]] = []
    leaf_groups = 0
    prev_kind, prev_leaf_parent = None, None
    for v, kind in _events(tree, children_order):
        n = int(length[v])
        if kind == 0:
            if prev_kind == 0:
                runs[-1][1] += n
            else:
                runs.append([0, n, int(start[v])])
        elif kind == 1:
            runs.append([1, n, int(start[v])])
            p = int(tree.parent[v])
            if not (prev_kind == 1 and prev_leaf_parent == p):
                leaf_groups += 1
            prev_leaf_parent = p
        else:  # a pop always follows the last child's backward run
            runs[-1][1] += n
            runs[-1][2] = int(start[v])
        prev_kind = kind

    fwd_sizes, bwd_sizes, prefixes, dirs = [], [], [], []
    for d, t, p in runs:
        sizes = _split(t, chunk_len)
        (fwd_sizes if d == 0 else bwd_sizes).extend(sizes)
        # Forward chunks run top-down from p; backward chunks bottom-up, ending at p.
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        prefixes.extend((p + offs).tolist() if d == 0 else (p + offs[::-1]).tolist())
        dirs.extend([d] * len(sizes))

    internal = np.array([bool(c) for c in tree.children])
    internal[0] = False
    c = chunk_len
    steps_per_node = np.ones_like(length[1:]) if c is None else -(-length[1:] // c)
    per_node = np.where(internal[1:], 2, 1) * steps_per_node  # push + pop, or one leaf step
    bwd = np.asarray(bwd_sizes, np.int64)
    short_thr = (c if c is not None else tree.stats.longest_path) / 2
    dirs_a = np.asarray(dirs)
    return {
        "num_steps": len(fwd_sizes) + len(bwd_sizes),
        "forward_steps": len(fwd_sizes),
        "backward_steps": len(bwd_sizes),
        "forward_runs": sum(1 for r in runs if r[0] == 0),
        "backward_runs": sum(1 for r in runs if r[0] == 1),
        "switches": int((dirs_a[1:] != dirs_a[:-1]).sum()),
        "forward_step_tokens": np.asarray(fwd_sizes, np.int64),
        "backward_step_tokens": bwd,
        "min_backward_step": int(bwd.min()),
        "mean_backward_step": float(bwd.mean()),
        "short_backward_steps": int((bwd < short_thr).sum()),
        "mean_prefix_tokens": float(np.mean(prefixes)),
        "leaf_groups": leaf_groups,
        "peak_stack_tokens": int((start + length)[internal].max(initial=0)),
        "per_node_steps": int(per_node.sum()),
    }
