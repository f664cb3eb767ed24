"""Generator fidelity: same-prompt correlation of fitted tool sessions, the fitted marginals and
the paper's percentiles, pooled steps and the DAPO filter."""

from __future__ import annotations

import numpy as np
import pytest

from dtarl.traces import GroupCorrelation, load_trace, measure_group_correlation
from dtarl.traces.fitted import load_fitted, sample_math_lengths
from dtarl.traces.loaders import ENV_VAR, FITTED_RELPATH
from dtarl.traces.workload import group_icc, intraclass_correlation, sample_group_specs

SEARCH_R1 = "search_r1/profile/multiturn_workload_log/0617_0223"


def _session_stats(specs):
    """Per group and sample: (turn count, model tokens, total input incl. the prompt)."""
    turns = [[sum(m for m, _ in r) for r in g.responses] for g in specs]
    toks = [[sum(n for m, n in r if m == 1) for r in g.responses] for g in specs]
    ins = [[g.prompt_len + sum(n for m, n in r if m == 0) for r in g.responses] for g in specs]
    return np.array(turns), np.array(toks), np.array(ins)


def test_intraclass_correlation_by_hand():
    # Groups identical inside, different across: ICC 1; identical group means: ICC < 0.
    assert intraclass_correlation([[1, 1], [3, 3], [5, 5]]) == pytest.approx(1.0)
    # MSB = 2 * var([2, 2], ddof=1) = 0, MSW = mean(var([1,3]), var([1,3])) = 2 -> -2 / 2.
    assert intraclass_correlation([[1, 3], [3, 1]]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="G >= 2, K >= 2"):
        intraclass_correlation([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"turns = 1.0: must be in \[0, 1\)"):
        GroupCorrelation(turns=1.0, lengths=0.0)


def test_fitted_tool_groups_match_search_r1_correlation(polytrace_root):
    # The trace's same-prompt ICCs (step 0) against 800 sampled groups of 8; tolerance 0.07
    # (the sampling noise of an ICC over 800 groups is ~0.02; the latents are set to match).
    run = load_trace(polytrace_root / SEARCH_R1)
    real_turns, real_toks = measure_group_correlation(run, [0])
    assert 0.15 < real_turns < 0.3 and 0.2 < real_toks < 0.4  # measured 0.21 / 0.32
    specs, _, _ = sample_group_specs("fitted:tool", batch_size=800, n_sampling=8, seed=5)
    turns, toks, _ = _session_stats(specs)
    got_turns, got_toks = group_icc(turns, toks)
    assert abs(got_turns - real_turns) < 0.07
    assert abs(got_toks - real_toks) < 0.07
    # Independent sessions (the old generator) show no same-prompt correlation.
    ind, _, _ = sample_group_specs(
        "fitted:tool",
        batch_size=800,
        n_sampling=8,
        seed=5,
        group_correlation=GroupCorrelation.independent(),
    )
    i_turns, i_toks = group_icc(*_session_stats(ind)[:2])
    assert abs(i_turns) < 0.03 and abs(i_toks) < 0.03


def test_fitted_samples_reproduce_the_papers_percentiles(polytrace_root):
    # Paper figures (polytrace/README.md): math outputs mean 9,839, p90 18,543; tool-use input
    # p90 2,802. Tolerance: 5% (math, 20k draws), 10% (tool, 6.4k sessions: a 10-component fit).
    fw = load_fitted(polytrace_root / FITTED_RELPATH)
    out = sample_math_lengths(fw.math, np.random.default_rng(0), 20_000)[:, 1]
    assert out.mean() == pytest.approx(9_839, rel=0.05)
    assert np.percentile(out, 90) == pytest.approx(18_543, rel=0.05)
    assert out.max() <= 32_768
    specs, _, _ = sample_group_specs("fitted:tool", batch_size=800, n_sampling=8, seed=1)
    turns, _, ins = _session_stats(specs)
    assert np.percentile(ins, 90) == pytest.approx(2_802, rel=0.10)
    # The copula keeps the fitted call-count marginal: frequencies within 0.02 of the JSON's.
    freq = np.bincount(turns.ravel(), minlength=11)[fw.tool.call_counts] / turns.size
    np.testing.assert_allclose(freq, fw.tool.call_probs, atol=0.02)


def test_fitted_tool_sessions_on_the_synthetic_fit(fitted_file, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(fitted_file.parents[2]))
    full = GroupCorrelation(turns=0.0, lengths=0.999999)
    specs, _, _ = sample_group_specs(
        "fitted:tool", batch_size=3, n_sampling=4, seed=0, group_correlation=full
    )
    for g in specs:
        # Fully shared length latents: sessions with the same call count are identical.
        by_k = {}
        for r in g.responses:
            by_k.setdefault(sum(m for m, _ in r), set()).add(r)
        assert all(len(v) == 1 for v in by_k.values())
        assert all(r[0][0] == 1 for r in g.responses)  # model tokens first, tools between


def test_pooled_steps_and_dapo_filter(single_run):
    # SINGLE_STEPS (conftest): step 0 prompts 5, 8, 3; step 1 prompts 4, 6.
    specs, _, used = sample_group_specs(single_run, batch_size=5, step=[0, 1], seed=0)
    assert used == (0, 1) and sorted(s.prompt_len for s in specs) == [3, 4, 5, 6, 8]
    specs, _, used = sample_group_specs(single_run, batch_size=5, step=range(0, 2), seed=0)
    assert used == (0, 1) and len(specs) == 5
    # DAPO: step 0 kept prompts 0 and 2 (prompt lengths 5 and 3).
    specs, _, _ = sample_group_specs(single_run, batch_size=2, step=0, dapo_filter=True)
    assert sorted(s.prompt_len for s in specs) == [3, 5]
    with pytest.raises(ValueError, match="no DAPO filter record for step 1"):
        sample_group_specs(single_run, batch_size=1, step=1, dapo_filter=True)
    with pytest.raises(ValueError, match="empty sequence of steps"):
        sample_group_specs(single_run, batch_size=1, step=[])
    with pytest.raises(ValueError, match="no step 7"):
        sample_group_specs(single_run, batch_size=1, step=[0, 7])
