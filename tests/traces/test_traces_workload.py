"""Workload generator invariants: shared prompts, per-turn prefixes, scaled lengths, masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.batch import RolloutBatch
from dtarl.traces import (
    GroupSpec,
    ToolLatencySampler,
    TraceFormatError,
    build_workload,
    generate_workload,
    load_trace,
    sample_workload,
)
from dtarl.traces.workload import scale_len

BIG_VOCAB = 2**30  # makes accidental token collisions between independent draws negligible


def trie_tokens(tokens) -> int:
    """Reference: number of distinct non-empty prefixes = nodes of a token trie."""
    seen = set()
    for t in tokens:
        h = ()
        for x in t.tolist():
            h = (h, x)
            seen.add(h)
    return len(seen)


def assert_group_sharing(batch: RolloutBatch, info):
    for g in np.unique(info.group_ids):
        rows = np.flatnonzero(info.group_ids == g)
        p = int(info.prompt_lens[rows[0]])
        assert np.all(info.prompt_lens[rows] == p)
        first = batch.tokens[rows[0]][:p]
        for r in rows:
            np.testing.assert_array_equal(batch.tokens[r][:p], first)
            assert np.all(batch.loss_mask[r][:p] == 0)  # prompt never trained on
    for i, m in enumerate(batch.loss_mask):
        assert m[0] == 0
        assert batch.tokens[i].min() >= 1


# ----------------------------------------------------------------------------- synthetic runs


@pytest.mark.parametrize("scale", [1.0, 2.0, 0.5])
def test_single_turn_lengths_follow_trace(single_run, synth, scale):
    w = generate_workload(single_run, batch_size=3, step=0, seed=3, length_scale=scale)
    b, info = w.batch, w.info
    assert b.num_sequences == 12 and info.step == 0
    assert_group_sharing(b, info)
    groups = synth.SINGLE_STEPS[0]
    for i in range(b.num_sequences):
        inp, outs = groups[info.record_index[i]]
        p, o = scale_len(inp, scale, 1), scale_len(outs[info.sample_index[i]], scale, 1)
        assert info.prompt_lens[i] == p and info.response_lens[i] == o
        assert b.tokens[i].shape == (p + o,)
        np.testing.assert_array_equal(b.loss_mask[i], np.r_[np.zeros(p), np.ones(o)])
    # every group of the step appears once (sampling without replacement)
    assert sorted(set(info.record_index.tolist())) == [0, 1, 2]
    # truncation: responses equal to the run's longest response (9)
    expect = [
        groups[r][1][s] == 9 for r, s in zip(info.record_index, info.sample_index, strict=True)
    ]
    assert info.truncated.tolist() == expect


def test_distinct_groups_have_distinct_prompts(single_run):
    w = generate_workload(single_run, batch_size=3, step=0, seed=0, vocab_size=BIG_VOCAB)
    prompts = {tuple(w.batch.tokens[i][: w.info.prompt_lens[i]].tolist()) for i in range(12)}
    assert len(prompts) == 3
    assert trie_tokens(w.batch.tokens) == w.info.tree_tokens
    assert w.batch.num_tokens == w.info.dense_tokens


def test_determinism_and_seed_sensitivity(single_run, multi_run):
    for src in (single_run, multi_run):
        for mode in ("trajectory", "per_turn"):
            a = sample_workload(src, batch_size=2, seed=7, mode=mode)
            b = sample_workload(src, batch_size=2, seed=7, mode=mode)
            c = sample_workload(src, batch_size=2, seed=8, mode=mode)
            assert len(a.tokens) == len(b.tokens)
            for x, y in zip(a.tokens, b.tokens, strict=True):
                np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(a.advantages, b.advantages)
            assert any(
                x.shape != y.shape or not np.array_equal(x, y)
                for x, y in zip(a.tokens, c.tokens, strict=False)
            )


def test_n_sampling_subsample_and_resample(single_run):
    w = generate_workload(single_run, batch_size=2, n_sampling=2, step=1, seed=0)
    assert w.batch.num_sequences == 4
    w = generate_workload(single_run, batch_size=5, n_sampling=6, step=1, seed=0)
    assert w.batch.num_sequences == 30  # with replacement: 5 > 2 groups, 6 > 4 samples
    assert_group_sharing(w.batch, w.info)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_multi_turn_trajectory_mode(multi_run, synth, scale):
    w = generate_workload(multi_run, batch_size=2, seed=1, length_scale=scale)
    b, info = w.batch, w.info
    assert b.num_sequences == 6
    assert_group_sharing(b, info)
    step = synth.MULTI_STEP0
    for i in range(6):
        g = info.record_index[i]
        _, _, prompt, rle = [r for r in step if r[0] == g][info.sample_index[i]]
        p = scale_len(prompt, scale, 1)
        expect = [np.zeros(p)] + [np.full(scale_len(n, scale, 1), float(m)) for m, n in rle]
        np.testing.assert_array_equal(b.loss_mask[i], np.concatenate(expect))
        assert info.turn_index[i] == -1
    trunc = {(r[0], r[1]) for r in step if sum(n for _, n in r[3]) >= 60}
    got = {
        (int(info.record_index[i]), int(info.sample_index[i]))
        for i in np.flatnonzero(info.truncated)
    }
    assert got == trunc


def test_multi_turn_per_turn_mode(multi_run, synth):
    w = generate_workload(multi_run, batch_size=2, seed=1, mode="per_turn", vocab_size=BIG_VOCAB)
    b, info = w.batch, w.info
    n_turns = sum(sum(1 for m, _ in r[3] if m == 1) for r in synth.MULTI_STEP0)
    assert b.num_sequences == n_turns
    assert_group_sharing(b, info)
    for t in np.unique(info.trajectory_ids):
        rows = np.flatnonzero(info.trajectory_ids == t)
        assert info.turn_index[rows].tolist() == list(range(rows.size))
        for a, c in zip(rows[:-1], rows[1:], strict=True):
            # sample k is a strict prefix of sample k+1
            n = b.tokens[a].shape[0]
            assert b.tokens[c].shape[0] > n
            np.testing.assert_array_equal(b.tokens[c][:n], b.tokens[a])
        for r in rows:
            # loss only on this turn's newly generated tokens: one trailing run of ones
            m = b.loss_mask[r]
            ones = np.flatnonzero(m)
            assert ones.size > 0 and ones[-1] == m.size - 1
            assert np.all(np.diff(ones) == 1)
    assert trie_tokens(b.tokens) == info.tree_tokens
    # the trailing tool output of a truncated trajectory is not part of any per-turn sample
    traj = generate_workload(multi_run, batch_size=2, seed=1, vocab_size=BIG_VOCAB)
    assert info.tree_tokens == traj.info.tree_tokens - 48


def test_mode_and_argument_errors(single_run):
    with pytest.raises(ValueError, match="min_len=0"):
        sample_workload(single_run, batch_size=1, min_len=0)
    with pytest.raises(ValueError, match="length_scale=0"):
        sample_workload(single_run, batch_size=1, length_scale=0)
    with pytest.raises(ValueError, match="per_tree"):
        sample_workload(single_run, batch_size=1, mode="per_tree")
    with pytest.raises(ValueError, match="batch_size=0"):
        sample_workload(single_run, batch_size=0)
    with pytest.raises(TraceFormatError, match="no step 9"):
        sample_workload(single_run, batch_size=1, step=9)
    with pytest.raises(ValueError, match="fitted:math"):
        sample_workload("fitted:video", batch_size=1)


# ----------------------------------------------------------------------------- fitted


def test_fitted_sources(fitted_file, monkeypatch):
    monkeypatch.setenv("DTARL_POLYTRACE", str(fitted_file.parents[2]))
    w = generate_workload("fitted:math", batch_size=5, n_sampling=3, seed=0, vocab_size=BIG_VOCAB)
    assert w.batch.num_sequences == 15 and w.info.step is None
    assert_group_sharing(w.batch, w.info)
    assert 80 <= w.info.prompt_lens.min() and w.info.prompt_lens.max() <= 170
    assert trie_tokens(w.batch.tokens) == w.info.tree_tokens
    t = generate_workload("fitted:tool", batch_size=4, n_sampling=2, seed=0, mode="per_turn")
    assert_group_sharing(t.batch, t.info)
    # call counts 1 or 2 -> 1 or 2 per-turn samples per trajectory
    per_traj = np.bincount(t.info.trajectory_ids)
    assert set(per_traj.tolist()) <= {1, 2} and per_traj.size == 8
    a = sample_workload("fitted:tool", batch_size=4, n_sampling=2, seed=0, mode="per_turn")
    for x, y in zip(a.tokens, t.batch.tokens, strict=True):
        np.testing.assert_array_equal(x, y)
    monkeypatch.setenv("DTARL_POLYTRACE", str(fitted_file.parents[3] / "nowhere"))
    with pytest.raises(FileNotFoundError, match="DTARL_POLYTRACE"):
        sample_workload("fitted:math", batch_size=1)


# ----------------------------------------------------------------------------- property test

runs_st = st.lists(st.integers(1, 6), min_size=1, max_size=5).map(
    lambda ns: tuple((1 - (k % 2), n) for k, n in enumerate(ns))  # alternating 1,0,1,...
)
spec_st = st.builds(
    lambda p, rs: GroupSpec(prompt_len=p, responses=tuple(rs), truncated=(False,) * len(rs)),
    st.integers(1, 6),
    st.lists(runs_st, min_size=1, max_size=4),
)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(spec_st, min_size=1, max_size=4),
    mode=st.sampled_from(["trajectory", "per_turn"]),
    seed=st.integers(0, 2**16),
)
def test_build_workload_properties(specs, mode, seed):
    w = build_workload(specs, mode=mode, seed=seed, vocab_size=BIG_VOCAB)
    b, info = w.batch, w.info
    assert_group_sharing(b, info)
    assert b.num_tokens == info.dense_tokens
    assert trie_tokens(b.tokens) == info.tree_tokens
    trained = sum(float(m.sum()) for m in b.loss_mask)
    ones = sum(n for s in specs for r in s.responses for m, n in r if m == 1)
    if mode == "trajectory":
        assert trained == ones
        assert b.num_sequences == sum(len(s.responses) for s in specs)
    else:  # each model run is trained exactly once, in its own per-turn sample
        assert trained == ones
        assert b.num_sequences == sum(1 for s in specs for r in s.responses for m, _ in r if m)
    # GRPO advantages: zero mean within each group
    for g in np.unique(info.group_ids):
        traj = np.unique(info.trajectory_ids[info.group_ids == g])
        first = [np.flatnonzero(info.trajectory_ids == t)[0] for t in traj]
        assert abs(float(b.advantages[first].mean())) < 1e-5


# ----------------------------------------------------------------------------- tool latency


def test_tool_latency_sampler_synthetic(multi_run):
    s = ToolLatencySampler.from_trace(multi_run)
    observed = set(s.latencies_s.tolist())
    assert len(s.latencies_s) == 6  # tool runs in MULTI_STEP0
    x = s.sample(50, seed=3)
    np.testing.assert_array_equal(x, s.sample(50, seed=3))
    assert set(x.tolist()) <= observed
    assert not np.array_equal(x, s.sample(50, seed=4))
    assert np.all(np.diff(s.latencies_s) >= 0)
    with pytest.raises(ValueError, match="empty"):
        ToolLatencySampler(latencies_s=np.zeros(0))
    with pytest.raises(ValueError, match=">= 0"):
        ToolLatencySampler(latencies_s=np.array([1.0, -1.0]))


def test_tool_latency_sampler_rejects_single_turn(single_run):
    with pytest.raises(TraceFormatError, match="not a multi-turn trace"):
        ToolLatencySampler.from_trace(single_run)


# ----------------------------------------------------------------------------- shared traces


def test_shared_single_turn_batches(polytrace_root):
    run = load_trace(polytrace_root / "verl-video/profile/packed_length_log/20260609_033329")
    step = 3
    recs = list(run.iter_step(step))
    w = generate_workload(run, batch_size=4, step=step, seed=0, length_scale=0.05)
    assert w.batch.num_sequences == 32
    assert_group_sharing(w.batch, w.info)
    for i in range(32):
        rec = recs[w.info.record_index[i]]
        assert w.info.prompt_lens[i] == scale_len(rec.input, 0.05, 1)
        assert w.info.response_lens[i] == scale_len(rec.output[w.info.sample_index[i]], 0.05, 1)


def test_shared_search_r1_batches(polytrace_root):
    path = polytrace_root / "search_r1/profile/multiturn_workload_log/0617_0223"
    traj = generate_workload(path, batch_size=3, step=1, seed=2, length_scale=0.1)
    per = generate_workload(path, batch_size=3, step=1, seed=2, length_scale=0.1, mode="per_turn")
    assert traj.batch.num_sequences == 24
    assert_group_sharing(traj.batch, traj.info)
    assert_group_sharing(per.batch, per.info)
    # same seed -> same trajectories; per-turn samples are prefixes of the trajectory
    for i in range(per.batch.num_sequences):
        t = per.info.trajectory_ids[i]
        full = traj.batch.tokens[t]
        n = per.batch.tokens[i].shape[0]
        np.testing.assert_array_equal(per.batch.tokens[i], full[:n])
    assert per.info.tree_tokens <= traj.info.tree_tokens


def test_shared_fitted_and_latency(polytrace_root):
    b = sample_workload("fitted:math", batch_size=2, n_sampling=4, seed=0, length_scale=0.01)
    assert b.num_sequences == 8
    s = ToolLatencySampler.from_trace(
        polytrace_root / "search_r1/profile/multiturn_workload_log/0617_0223", steps=[0]
    )
    assert s.latencies_s.size > 1000
    assert 0.05 < float(s.quantile(0.5)) < 1.0  # search latency median is ~0.17 s
