"""Tests for dtarl.tree.trie: hand-computed trees and hypothesis properties vs. brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.tree.trie import build_tree


def _a(*xs):
    return np.array(xs, np.int32)


@st.composite
def sequence_sets(draw, max_n: int = 14):
    """Sets with heavy sharing: few distinct tokens (incl. int32 extremes), sequences built
    by extending a prefix of an earlier one, prefixes of earlier ones, exact duplicates."""
    vocab = draw(
        st.lists(
            st.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    tok = st.sampled_from(vocab)
    n = draw(st.integers(1, max_n))
    seqs: list[list[int]] = []
    for _ in range(n):
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


def _brute_force(seqs):
    """Node ends of the compressed trie from the set of distinct prefixes."""
    tuples = [tuple(s.tolist()) for s in seqs]
    prefixes = {t[:k] for t in tuples for k in range(1, len(t) + 1)}
    nxt: dict[tuple, set] = {}
    for p in prefixes:
        nxt.setdefault(p[:-1], set()).add(p[-1])
    ends = set(tuples)
    node_ends = {p for p in prefixes if p in ends or len(nxt.get(p, ())) >= 2}
    return prefixes, nxt, node_ends


def _check_tree(seqs, tree):
    m = tree.num_nodes
    prefixes, nxt, node_ends = _brute_force(seqs)
    tuples = [tuple(s.tolist()) for s in seqs]
    assert tree.parent[0] == -1 and tree.length[0] == 0 and tree.start[0] == 0
    assert tree.stats.tree_tokens == len(prefixes) == int(tree.length.sum())
    assert tree.token_data.shape == (len(prefixes),)
    # Offsets are contiguous in node order.
    np.testing.assert_array_equal(tree.offset[1:], np.cumsum(tree.length)[:-1])
    paths = {}
    for i in range(1, m):
        p = int(tree.parent[i])
        assert 0 <= p < i
        assert i in tree.children[p]
        assert tree.length[i] >= 1
        assert tree.start[i] == tree.start[p] + tree.length[p]
        path = tuple(tree.path_tokens(i).tolist())
        assert len(path) == tree.start[i] + tree.length[i]
        assert path[: tree.start[i]] == tuple(tree.path_tokens(p).tolist())
        assert path in node_ends
        paths[i] = path
    assert set(paths.values()) == node_ends  # one node per node end, none missing
    for i in range(m):
        firsts = [int(tree.node_tokens(c)[0]) for c in tree.children[i]]
        assert firsts == sorted(set(firsts))  # distinct and sorted
        if i > 0:
            assert sorted(firsts) == sorted(nxt.get(paths[i], ()))
        assert tree.is_leaf(i) == (i > 0 and not tree.children[i])
    # Sequences: exact reconstruction, ends_at / seq_node agree.
    assert tree.seq_node.shape == (len(seqs),)
    for k, s in enumerate(seqs):
        node = int(tree.seq_node[k])
        np.testing.assert_array_equal(tree.path_tokens(node), s)
        assert k in tree.ends_at[node]
    for i in range(m):
        e = tree.ends_at[i]
        assert list(e) == sorted(e)
        assert list(e) == [k for k, t in enumerate(tuples) if i > 0 and paths[i] == t]
    # Stats.
    st_ = tree.stats
    assert st_.num_sequences == len(seqs)
    assert st_.num_tokens == sum(len(s) for s in seqs)
    assert st_.longest_path == max(len(s) for s in seqs)
    assert st_.num_leaves == sum(1 for t in set(tuples) if t not in nxt)
    assert st_.num_forks == sum(1 for p, v in nxt.items() if len(v) >= 2)
    nodes_on_path = [sum(t[:k] in node_ends for k in range(1, len(t) + 1)) for t in tuples]
    assert st_.depth == max(nodes_on_path)
    assert st_.ideal_token_ratio == st_.num_tokens / st_.tree_tokens


@settings(max_examples=300, deadline=None)
@given(sequence_sets())
def test_matches_brute_force(seqs):
    _check_tree(seqs, build_tree(seqs))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_many_sequences_sharing_long_prefixes(groups, group_size, seed):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(groups):
        prompt = rng.integers(0, 3, rng.integers(1, 50))
        for _ in range(group_size):
            turn = rng.integers(0, 3, rng.integers(0, 20))
            seqs.append(np.concatenate([prompt, turn, rng.integers(0, 3, rng.integers(1, 10))]))
    _check_tree(seqs, build_tree(seqs))


def test_hand_computed_prefixes_and_duplicates():
    seqs = [_a(1, 2, 3), _a(1, 2), _a(1, 2, 3), _a(1, 4), _a(5)]
    t = build_tree(seqs)
    # root -> [1] -> [2] -> [3];  [1] -> [4];  root -> [5]
    np.testing.assert_array_equal(t.parent, [-1, 0, 1, 2, 1, 0])
    np.testing.assert_array_equal(t.start, [0, 0, 1, 2, 1, 0])
    np.testing.assert_array_equal(t.length, [0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(t.token_data, [1, 2, 3, 4, 5])
    assert t.children == ((1, 5), (2, 4), (3,), (), (), ())
    assert t.ends_at == ((), (), (1,), (0, 2), (3,), (4,))
    np.testing.assert_array_equal(t.seq_node, [3, 2, 3, 4, 5])
    s = t.stats
    assert (s.num_sequences, s.num_tokens, s.tree_tokens) == (5, 11, 5)
    assert (s.depth, s.longest_path, s.num_forks, s.num_leaves) == (3, 3, 2, 3)
    assert s.ideal_token_ratio == pytest.approx(11 / 5)


def test_hand_computed_grpo_group():
    prompt = [7, 8, 9]
    seqs = [_a(*prompt, 1, 2), _a(*prompt, 1, 3, 3), _a(*prompt, 4)]
    t = build_tree(seqs)
    # root -> [7 8 9] -> [1] -> {[2], [3 3]};  [7 8 9] -> [4]
    assert t.num_nodes == 6
    np.testing.assert_array_equal(t.length, [0, 3, 1, 1, 2, 1])
    np.testing.assert_array_equal(t.node_tokens(1), [7, 8, 9])
    np.testing.assert_array_equal(t.node_tokens(4), [3, 3])
    assert t.children == ((1,), (2, 5), (3, 4), (), (), ())
    s = t.stats
    assert (s.num_tokens, s.tree_tokens) == (15, 8)
    assert (s.depth, s.longest_path, s.num_forks, s.num_leaves) == (3, 6, 2, 3)


def test_single_sequence_and_one_token_sequences():
    t = build_tree([_a(3, 1, 4, 1, 5)])
    assert t.num_nodes == 2 and t.children == ((1,), ())
    assert (t.stats.depth, t.stats.num_forks, t.stats.num_leaves) == (1, 0, 1)
    assert t.stats.ideal_token_ratio == 1.0
    t = build_tree([_a(2), _a(1), _a(2), _a(-5)])
    assert t.children[0] == (1, 2, 3)
    np.testing.assert_array_equal(t.token_data, [-5, 1, 2])
    assert t.ends_at == ((), (3,), (1,), (0, 2))
    assert (t.stats.depth, t.stats.num_forks, t.stats.num_leaves) == (1, 1, 3)


def test_children_sorted_numerically_not_bytewise():
    # -1 < 0 < 255 < 256 < 2**31-1, though their little-endian bytes sort differently.
    firsts = [256, -1, 2**31 - 1, 0, 255, -(2**31)]
    t = build_tree([_a(x, 1) for x in firsts])
    got = [int(t.node_tokens(c)[0]) for c in t.children[0]]
    assert got == sorted(firsts)


def test_accepts_other_integer_dtypes_and_lists():
    t = build_tree([np.array([1, 2], np.int64), [1, 3], np.array([1], np.uint8)])
    assert t.token_data.dtype == np.int32
    assert t.stats.tree_tokens == 3 and t.stats.num_forks == 1


def test_arrays_are_read_only():
    t = build_tree([_a(1, 2)])
    with pytest.raises(ValueError):
        t.token_data[0] = 5


@pytest.mark.parametrize(
    "seqs, match",
    [
        ([], "at least one sequence"),
        ([_a(1), _a()], r"sequences\[1\] is empty"),
        ([np.zeros((2, 3), np.int32)], r"sequences\[0\] must be a 1-D array"),
        ([_a(1), np.array(4)], r"sequences\[1\] must be a 1-D array"),
        ([np.array([1.0, 2.0])], r"sequences\[0\] must hold integer"),
        ([np.array([2**40], np.int64)], r"sequences\[0\] has token ids .* int32"),
    ],
)
def test_bad_input_raises(seqs, match):
    with pytest.raises(ValueError, match=match):
        build_tree(seqs)
