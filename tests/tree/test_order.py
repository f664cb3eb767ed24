"""Tests for dtarl.tree.order: valid DFS orders, the greedy's documented choices, order_cost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.tree.order import DFSOrder, child_order, dfs_preorder, order_cost
from dtarl.tree.trie import build_tree


@st.composite
def sequence_sets(draw, max_n: int = 14):
    """Shared-prefix sets: few tokens, extensions/prefixes/duplicates of earlier sequences."""
    tok = st.integers(0, draw(st.integers(1, 4)) - 1)
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_n))):
        kinds = ["fresh", "extend", "extend", "prefix", "dup"]
        kind = draw(st.sampled_from(kinds)) if seqs else "fresh"
        if kind == "fresh":
            s = draw(st.lists(tok, min_size=1, max_size=8))
        else:
            base = draw(st.sampled_from(seqs))
            if kind == "extend":
                cut = draw(st.integers(0, len(base)))
                s = base[:cut] + draw(st.lists(tok, min_size=1 if cut == 0 else 0, max_size=6))
            elif kind == "prefix":
                s = base[: draw(st.integers(1, len(base)))]
            else:
                s = list(base)
        seqs.append(s)
    return [np.array(s, np.int32) for s in seqs]


def _a(*xs):
    return np.array(xs, np.int32)


def _node(tree, *path):
    """The node whose root->node path is exactly ``path``."""
    for i in range(tree.num_nodes):
        if tuple(tree.path_tokens(i).tolist()) == path:
            return i
    raise KeyError(path)


def _check_order(tree, order):
    assert len(order) == tree.num_nodes
    for v in range(tree.num_nodes):
        assert sorted(order[v]) == sorted(tree.children[v])
        assert len(order[v]) == len(set(order[v]))
    pre = dfs_preorder(tree, order)
    assert pre.shape == (tree.num_nodes - 1,)
    assert sorted(pre.tolist()) == list(range(1, tree.num_nodes))
    seen = {0}
    for v in pre.tolist():
        assert int(tree.parent[v]) in seen  # parents before children
        seen.add(v)
    # Preorder = DFS: each node's subtree is contiguous, children in the given order.
    pos = {v: k for k, v in enumerate(pre.tolist())}
    for v in range(tree.num_nodes):
        ks = [pos[c] for c in order[v]]
        assert ks == sorted(ks)


@settings(max_examples=200, deadline=None)
@given(sequence_sets(), st.sampled_from([None, 1, 2, 3, 5, 8]))
def test_orders_are_valid_and_costs_consistent(seqs, chunk_len):
    tree = build_tree(seqs)
    internal = [v for v in range(1, tree.num_nodes) if tree.children[v]]
    costs = {}
    for o in DFSOrder:
        order = child_order(tree, o, chunk_len=chunk_len)
        _check_order(tree, order)
        c = order_cost(tree, order, chunk_len)
        costs[o] = c
        # Token conservation: forwards cover the internal nodes, backwards every node.
        assert c["forward_step_tokens"].sum() == tree.length[internal].sum()
        assert c["backward_step_tokens"].sum() == tree.stats.tree_tokens
        assert c["backward_runs"] == tree.stats.num_leaves
        assert c["num_steps"] == c["forward_steps"] + c["backward_steps"]
        assert c["num_steps"] <= c["per_node_steps"]
        if chunk_len is not None:
            assert c["backward_step_tokens"].max() <= chunk_len
            assert c["forward_step_tokens"].max(initial=0) <= chunk_len
        assert (c["backward_step_tokens"] >= 1).all()
    lex, greedy = costs[DFSOrder.LEXICOGRAPHIC], costs[DFSOrder.GREEDY]
    # Order-invariant quantities.
    for k in ("peak_stack_tokens", "per_node_steps", "backward_runs"):
        assert lex[k] == greedy[k]
    if chunk_len is None:
        # Documented guarantee: the fewest forward runs of any order, same backward steps.
        assert greedy["forward_steps"] <= lex["forward_steps"]
        assert greedy["backward_steps"] == lex["backward_steps"] == tree.stats.num_leaves
        order = child_order(tree, DFSOrder.GREEDY)
        for v in range(tree.num_nodes):
            if any(tree.children[c] for c in order[v]):
                assert tree.children[order[v][0]], "an internal child must be visited first"


@settings(max_examples=100, deadline=None)
@given(sequence_sets())
def test_lexicographic_preorder_visits_sequences_sorted(seqs):
    tree = build_tree(seqs)
    pre = dfs_preorder(tree, child_order(tree, DFSOrder.LEXICOGRAPHIC))
    visited = [tuple(tree.path_tokens(v).tolist()) for v in pre.tolist() if tree.ends_at[v]]
    assert visited == sorted({tuple(s.tolist()) for s in seqs})
    assert child_order(tree, DFSOrder.LEXICOGRAPHIC) == tree.children


def test_greedy_internal_first_then_leaves_then_longest_tail_last():
    # root -> P=[9] -> {A=[1 1 1] leaf, B=[2 2] -> {[5], [6 6 6 6 6]}, D=[3] leaf}
    seqs = [_a(9, 1, 1, 1), _a(9, 2, 2, 5), _a(9, 2, 2, 6, 6, 6, 6, 6), _a(9, 3)]
    tree = build_tree(seqs)
    p, a, b, d = (_node(tree, *x) for x in [(9,), (9, 1, 1, 1), (9, 2, 2), (9, 3)])
    b5, b6 = _node(tree, 9, 2, 2, 5), _node(tree, 9, 2, 2, 6, 6, 6, 6, 6)
    greedy = child_order(tree, DFSOrder.GREEDY)
    assert tree.children[p] == (a, b, d)
    # B first (P's forward step continues into B), then the leaf D, and A last:
    # t(A) = 3 is the longest backward chain among the rest (t(D) = 1).
    assert greedy[p] == (b, d, a)
    assert greedy[b] == (b5, b6)  # longest tail last; equal to lexicographic here
    lex = order_cost(tree, tree.children, None)
    gr = order_cost(tree, greedy, None)
    assert (lex["forward_runs"], gr["forward_runs"]) == (2, 1)  # [P] | [B]  vs  [P B]
    assert (lex["num_steps"], gr["num_steps"]) == (6, 5)
    assert lex["backward_steps"] == gr["backward_steps"] == 4
    # Greedy: push [P B]; leaf 5; leaf 66666 + pop B; leaf 3; leaf 111 + pop P.
    np.testing.assert_array_equal(gr["forward_step_tokens"], [3])
    np.testing.assert_array_equal(gr["backward_step_tokens"], [1, 7, 1, 4])
    assert gr["switches"] == 1


def test_greedy_fills_backward_chunks():
    # root -> P=[9 9] -> {Y=[1]*5 leaf, X=[2]*7 leaf}. chunk_len 4.
    seqs = [_a(9, 9, 1, 1, 1, 1, 1), _a(9, 9, *[2] * 7)]
    tree = build_tree(seqs)
    p, y, x = _node(tree, 9, 9), _node(tree, 9, 9, 1, 1, 1, 1, 1), _node(tree, 9, 9, *[2] * 7)
    assert tree.children[p] == (y, x)
    # Unchunked: the longer chain goes last (= lexicographic here).
    assert child_order(tree, DFSOrder.GREEDY)[p] == (y, x)
    # chunk_len 4: Y (5 tokens) wastes 3 of its second step, X (7) wastes 1; Y goes last so
    # Y + P = 7 tokens fill two steps: X 7 -> [4 3], Y+P 7 -> [4 3]
    # (lexicographic: Y 5 -> [3 2], X+P 9 -> [3 3 3]).
    greedy = child_order(tree, DFSOrder.GREEDY, chunk_len=4)
    assert greedy[p] == (x, y)
    gr = order_cost(tree, greedy, 4)
    lex = order_cost(tree, tree.children, 4)
    np.testing.assert_array_equal(gr["backward_step_tokens"], [4, 3, 4, 3])
    np.testing.assert_array_equal(lex["backward_step_tokens"], [3, 2, 3, 3, 3])
    assert (gr["backward_steps"], lex["backward_steps"]) == (4, 5)
    assert gr["min_backward_step"] == 3 and lex["min_backward_step"] == 2


def test_greedy_leaves_first_when_the_internal_child_should_close_the_backward_chain():
    # root -> P=[9] -> {L1=[1]*4 leaf, N=[2]*4 -> {[5], [6]}, L2=[3]*4 leaf}. chunk_len 4.
    seqs = [_a(9, 1, 1, 1, 1), _a(9, 2, 2, 2, 2, 5), _a(9, 2, 2, 2, 2, 6), _a(9, 3, 3, 3, 3)]
    tree = build_tree(seqs)
    p = _node(tree, 9)
    l1, n, l2 = tree.children[p]
    assert tree.is_leaf(l1) and not tree.is_leaf(n) and tree.is_leaf(l2)
    # Leaves fill whole steps (4 tokens); N's chain [6]+N = 5 tokens wastes 3: merging it into
    # P's pop saves a backward step, worth more than merging P's forward into N.
    greedy = child_order(tree, DFSOrder.GREEDY, chunk_len=4)
    assert greedy[p] == (l1, l2, n)
    gr, lex = order_cost(tree, greedy, 4), order_cost(tree, tree.children, 4)
    np.testing.assert_array_equal(gr["backward_step_tokens"], [4, 4, 1, 3, 3])
    np.testing.assert_array_equal(lex["backward_step_tokens"], [4, 1, 3, 2, 3, 2])
    assert gr["forward_steps"] == lex["forward_steps"] == 2
    # Unchunked, an internal child goes first instead: P's forward continues into N.
    assert child_order(tree, DFSOrder.GREEDY)[p][0] == n


def test_greedy_equals_lexicographic_on_symmetric_grpo_group():
    prompt = [4, 4, 4]
    seqs = [_a(*prompt, r, r + 1, r + 2) for r in (5, 1, 3, 2)]
    tree = build_tree(seqs)
    for c in (None, 2, 16):
        assert child_order(tree, DFSOrder.GREEDY, chunk_len=c) == tree.children


def test_leaf_groups_and_peak_stack_hand_computed():
    # root -> [1 2] -> {[3] leaf, [4 4] -> {[7], [8]}, [5] leaf}
    seqs = [_a(1, 2, 3), _a(1, 2, 4, 4, 7), _a(1, 2, 4, 4, 8), _a(1, 2, 5)]
    tree = build_tree(seqs)
    lex = order_cost(tree, tree.children, None)
    gr = order_cost(tree, child_order(tree, DFSOrder.GREEDY), None)
    assert lex["peak_stack_tokens"] == gr["peak_stack_tokens"] == 4  # [1 2 4 4]; leaves unstacked
    assert lex["leaf_groups"] == 3  # [3] | [7 8] | [5]
    assert gr["leaf_groups"] == 2  # [7 8] | [3 5]: order ([4 4], [3], [5])
    assert lex["per_node_steps"] == gr["per_node_steps"] == 2 * 2 + 4


def test_bad_arguments():
    tree = build_tree([_a(1, 2), _a(1, 3)])
    with pytest.raises(ValueError, match="chunk_len"):
        child_order(tree, DFSOrder.GREEDY, chunk_len=0)
    with pytest.raises(ValueError, match="order must be a DFSOrder"):
        child_order(tree, "greedy")
    bad = list(tree.children)
    bad[1] = (bad[1][0], bad[1][0])
    with pytest.raises(ValueError, match=r"children_order\[1\]"):
        dfs_preorder(tree, tuple(bad))
    with pytest.raises(ValueError, match="entries"):
        order_cost(tree, tree.children[:-1])
