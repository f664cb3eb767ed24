"""Report, per-step statistics and the CLI hook."""

from __future__ import annotations

import argparse
import json

import matplotlib.axes
import numpy as np
import pytest

from dtarl.bench.simulate.production import validate_production
from dtarl.cli import main
from dtarl.commands.trace import register, replay_error
from dtarl.traces import load_trace
from dtarl.traces.report import Headline, cdf_xscale, write_report
from dtarl.traces.stats import LengthStats, multi_turn_step_stats, single_turn_step_stats


def test_length_stats_exact():
    s = LengthStats.of([1, 2, 3, 4, 100])
    assert (s.n, s.mean, s.p50, s.max) == (5, 22.0, 3.0, 100.0)
    assert np.isnan(LengthStats.of([]).mean)


def test_single_turn_step_stats_by_hand(single_run):
    run = load_trace(single_run)
    st = single_turn_step_stats(0, run.iter_step(0), run_max=9)
    # groups: (5,[3,7,2,9]) (8,[9,1,4,4]) (3,[6,6,9,2]); 12 outputs, three equal to 9
    assert st.truncation_rate == pytest.approx(3 / 12)
    assert st.tree.dense_tokens == 4 * (5 + 8 + 3) + (21 + 18 + 23)
    assert st.tree.tree_tokens == (5 + 8 + 3) + (21 + 18 + 23)
    np.testing.assert_allclose(st.intra_max_over_mean, [9 / 5.25, 9 / 4.5, 9 / 5.75])
    np.testing.assert_allclose(st.intra_std[1], np.std([9, 1, 4, 4]))
    assert st.sample_inputs.tolist() == [5] * 4 + [8] * 4 + [3] * 4


def test_multi_turn_step_stats_by_hand(multi_run):
    st = multi_turn_step_stats(0, load_trace(multi_run).iter_step(0))
    resp = [14, 2, 20, 60, 8, 6]
    assert st.tree.dense_tokens == 3 * 6 + 3 * 9 + sum(resp)
    assert st.tree.tree_tokens == 6 + 9 + sum(resp)
    # per-turn: samples end at each model run; tree = prompt + longest per-turn sample
    per_turn = [(10, 20), (8,), (11, 16, 26), (12, 21), (17,), (11, 15)]
    assert st.per_turn_tree.dense_tokens == sum(sum(p) for p in per_turn)
    assert st.per_turn_tree.tree_tokens == 6 + 9 + (14 + 2 + 20) + (12 + 8 + 6)
    assert st.turns.tolist() == [2, 1, 3, 2, 1, 2]
    assert st.tool_latency_s.size == 6
    assert st.truncation_rate == pytest.approx(1 / 6)


def test_headline_verdicts():
    assert Headline(quantity="q", paper=100, ours=105, source="s").verdict.startswith("agrees")
    assert Headline(quantity="q", paper=100, ours=120, source="s").verdict.startswith("disagrees")
    assert Headline(quantity="q", paper=100, ours=None, source="s").verdict.startswith("n/a")


def test_report_end_to_end_synthetic(single_run, multi_run, fitted_file, tmp_path):
    out = tmp_path / "rep"
    res = write_report(tmp_path, out, steps=[0])
    md = res.markdown.read_text()
    assert res.markdown == out / "report.md" and res.html.exists()
    assert "## synth/run1" in md and "## synth_mt/run2" in md
    assert "## Fitted production distributions" in md
    assert "Paper headline figures" in md and "DAPO dynamic sampling" in md
    assert "Reward timing" in md and "per-turn speedup" in md
    for p in res.plots:
        assert p.exists() and p.stat().st_size > 1000 and p.suffix == ".png"
        assert p.name in md
    names = {p.name for p in res.plots}
    assert {"synth_mt_run2_tool.png", "synth_run1_cdf.png", "synth_run1_box.png"} <= names
    section = md.split("## synth/run1")[1].split("##")[0]
    assert "\n| 0 | 3 | 12 |" in section and "\n| 1 | 2 | 8 |" not in section  # only step 0
    assert "<table>" in res.html.read_text()


def test_report_on_one_shared_step(polytrace_root, tmp_path):
    run = polytrace_root / "rllm/profile/packed_length_log/20260616_024512"
    res = write_report(run, tmp_path, steps=[0], html_output=False)
    md = res.markdown.read_text()
    assert res.html is None
    assert "rllm/20260616_024512" in md and "coding output mean" in md
    assert len(res.plots) == 4  # cdf, joint, box, reward
    row = [line for line in md.splitlines() if line.startswith("| 0 | 16 | 128 |")]
    assert len(row) == 1 and "16,000" in row[0]  # max response = the 16k cap
    coding = next(h for h in res.headlines if h.quantity == "coding output mean")
    assert coding.ours == pytest.approx(10419.6, abs=0.1)


def test_cli_register(single_run, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="dtarl")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["trace", "sample", str(single_run), "--batch-size", "2"])
    assert args.func(args) == 0
    assert "sequences 8, groups 2" in capsys.readouterr().out
    out = tmp_path / "r"
    args = parser.parse_args(
        ["trace", "report", str(single_run), "--out", str(out), "--steps", "1", "--no-html"]
    )
    assert args.func(args) == 0
    assert (out / "report.md").exists() and not (out / "report.html").exists()
    assert "wrote" in capsys.readouterr().out


def _search_like_run(multi_run, root, steps=(0, 1)):
    """The ``multi_run`` trajectories as a search_r1-style run (task folder ``search_r1``)
    whose turns record ``generated_text_token_len`` = completion - 1 (the tool-call
    markup) and step-dependent engine latencies."""
    d = root / "search_r1" / "profile" / "multiturn_workload_log" / "run3"
    d.mkdir(parents=True)
    src = (multi_run / "multiturn_workload_step_0.jsonl").read_text().splitlines()
    for step in steps:
        rows = []
        for line in src:
            row = json.loads(line)
            row["step"] = step
            for k, t in enumerate(row["turns"]):
                t["generated_text_token_len"] = t["completion_tokens"] - 1
                t["engine_latency_s"] = 0.2 + 0.05 * t["completion_tokens"] + 0.01 * k + step
            rows.append(json.dumps(row))
        (d / f"multiturn_workload_step_{step}.jsonl").write_text("\n".join(rows) + "\n")
    return d


def test_cdf_axis_is_log_for_long_tailed_lengths():
    rng = np.random.default_rng(0)
    assert cdf_xscale(rng.lognormal(6.0, 1.5, 2000)) == "log"
    assert cdf_xscale(rng.uniform(100, 400, 2000)) == "linear"
    assert cdf_xscale([0, 0]) == "linear"


def test_report_search_output_is_generated_text_and_end_to_end_error_computed(
    multi_run, tmp_path, capsys
):
    run = _search_like_run(multi_run, tmp_path / "data")
    out = tmp_path / "rep"
    rc = main(["trace", "report", str(run), "--out", str(out), "--no-html"])
    assert rc == 0
    md = (out / "report.md").read_text()
    trajs = list(load_trace(run).iter_step(0))
    comp = [t.completion_tokens for tr in trajs for t in tr.turns]
    heads = {h.split(":")[0].strip(): h for h in capsys.readouterr().out.splitlines()}
    # search output = generated_text_token_len (completion - 1), not completion_tokens
    assert f"ours {np.mean(comp) - 1:,.1f}" in heads["search output mean"]
    rep = validate_production(run, reward=False)
    err = 100 * (1 - rep.makespan_accuracy)
    assert f"ours {err:,.1f}" in heads["replay end-to-end latency error (%)"]
    row = next(ln for ln in md.splitlines() if ln.startswith("| replay end-to-end"))
    assert f"makespan error {err:.1f}%" in row and "fit steps' mean makespan" in row


def test_end_to_end_error_says_why_with_one_step(multi_run, tmp_path):
    run = _search_like_run(multi_run, tmp_path / "data", steps=(0,))
    e = replay_error(str(run))
    assert e.error_pct is None and "need >= 2" in e.source


def test_report_draws_long_tailed_output_cdf_on_a_log_axis(tmp_path, monkeypatch):
    d = tmp_path / "tail" / "profile" / "packed_length_log" / "run"
    d.mkdir(parents=True)
    outs = [[3, 4, 5, 4], [5, 4, 3, 400]]  # max 400 >= 5 x median 4
    rows = [
        dict(
            step=0,
            rank=0,
            dp_rank=0,
            tp_rank=0,
            local_index=i,
            input=7 + i,
            output=o,
            n_sampling=4,
            validate=False,
        )
        for i, o in enumerate(outs)
    ]
    (d / "packed_lengths_step_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scales = []
    real = matplotlib.axes.Axes.set_xscale
    monkeypatch.setattr(
        matplotlib.axes.Axes, "set_xscale", lambda ax, v, **k: (scales.append(v), real(ax, v, **k))
    )
    md = write_report(d, tmp_path / "rep", html_output=False).markdown.read_text()
    assert "input on a linear axis, output on a log axis" in md
    assert scales[:2] == ["linear", "log"]  # the CDF plot's two panels
