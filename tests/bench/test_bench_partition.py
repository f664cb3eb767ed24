"""The DP partition bench (``dtarl bench partition``): synthetic smoke run and CLI,
summaries by hand, the real prefix structure, and trace steps read through
``dtarl.traces``."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from dtarl.bench import partition as bp
from dtarl.commands.bench import register
from dtarl.parallel.partition import PartitionMethod, tree_tokens
from dtarl.traces.loaders import load_trace


def test_bench_synthetic_smoke_and_cli(tmp_path):
    res = bp.run(None, ks=(2,), workloads=("coding", "search"), max_steps=1)
    assert res["config"]["synthetic"]
    assert {r["variant"] for r in res["rows"]} == {
        f"{m.value}/{u}" for m in PartitionMethod for u in ("sequences", "groups")
    }
    by = {(r["workload"], r["step"], r["k"], r["cost"], r["variant"]): r for r in res["rows"]}
    for (wl, step, k, cname, v), r in by.items():
        assert r["makespan"] >= r["ideal_makespan"] * (1 - 1e-12)  # C(T)/K is a lower bound
        assert r["makespan"] == r["candidates"][r["winner"]]
        if not v.startswith("balanced/"):
            assert r["winner"] == v.split("/")[0]
            continue
        if r["winner"].startswith("balanced/"):  # a contiguous cut won
            assert r["duplicated_tokens"] <= r["duplication_bound"]
        for m in PartitionMethod:  # never worse than a baseline on the same units
            assert (
                r["makespan"] <= by[wl, step, k, cname, m.value + v[len("balanced") :]]["makespan"]
            )
    # No HEADLINE_SETS entry is complete: the average is over the workloads run.
    head = res["headline"]["tree_tokens"]["coding+search"]
    assert set(head) == {"sequences", "groups", "areal"}
    summ = {(s["workload"], s["cost"]): s["variants"] for s in res["summary"]}
    areal = [
        summ["coding", "tree_tokens"]["greedy_tokens/groups"]["pct_lower"],
        summ["search", "tree_tokens"]["greedy_tokens/sequences"]["pct_lower"],
    ]
    assert head["areal"]["mean"] == pytest.approx(np.mean(areal))
    assert head["areal"]["meets_target"] == (head["areal"]["mean"] >= bp.TARGET_PCT)
    text = bp.format_table(res)
    assert "average over coding+search" in text and "balanced/sequences" in text
    assert "won (steps)" in text

    parser = argparse.ArgumentParser(prog="dtarl")
    register(parser.add_subparsers(dest="cmd"))
    out = tmp_path / "p.json"
    args = parser.parse_args(
        ["bench", "partition", "--synthetic", "--ks", "2", "--workloads", "coding"]
        + ["--costs", "tree_tokens", "--max-steps", "1", "--json", str(out)]
    )
    args.func(args)
    got = json.loads(out.read_text())
    assert got["config"]["ks"] == [2] and got["config"]["costs"] == ["tree_tokens"]
    with pytest.raises(ValueError, match="costs="):
        bp.run(None, ks=(2,), workloads=("coding",), costs=("time",), max_steps=1)


def test_bench_summary_pairs_steps_by_hand():
    def row(variant, step, makespan, dup=0, winner=None):
        return dict(workload="math", k=2, cost="tree_tokens", variant=variant, step=step) | dict(
            makespan=makespan,
            mean_load=makespan / 2,
            imbalance=1.0,
            duplicated_tokens=dup,
            duplication_bound=10,
            global_tree_tokens=100,
            ideal_makespan=40.0,
            seconds=0.0,
            winner=winner or variant.split("/")[0],
        )

    def row_b(step, makespan, winner, dup=0):
        return row("balanced/sequences", step, makespan, dup=dup, winner=winner)

    rows = [row_b(0, 50, "greedy_tree", dup=5), row_b(1, 60, "balanced/blocks")]
    rows += [row_b(2, 50, "balanced/blocks")]
    rows += [row("greedy_tokens/sequences", 0, 100, dup=30), row("greedy_tokens/sequences", 1, 80)]
    rows += [row("greedy_tokens/sequences", 2, 50)]
    (s,) = bp.summarise(rows)
    assert s["variants"]["balanced/sequences"]["wins"] == {"balanced/blocks": 2, "greedy_tree": 1}
    assert bp.format_wins({"balanced/blocks": 2, "greedy_tree": 1}) == "blocks 2, g_tree 1"
    g = s["variants"]["greedy_tokens/sequences"]
    # (100-50)/100, (80-60)/80, (50-50)/50
    assert g["pct_lower"] == pytest.approx((50.0 + 25.0 + 0.0) / 3)
    assert g["ideal_pct_lower"] == pytest.approx((60.0 + 50.0 + 20.0) / 3)
    assert g["dup_over_bound_max"] == 3.0 and g["dup_pct"] == pytest.approx(10.0)
    assert s["variants"]["balanced/sequences"]["pct_lower"] == 0.0


def test_bench_builds_real_prefix_structure():
    sb = bp.StepBatch(workload="math", step=0, prompt_lens=(5, 3), response_lens=((4, 2), (1,)))
    seqs, gids = bp.build_sequences(sb)
    assert [len(s) for s in seqs] == [9, 7, 4] and gids.tolist() == [0, 0, 1]
    # Siblings share exactly the prompt; groups share nothing (w.h.p. with a 32k vocab).
    assert tree_tokens(seqs) == 5 + 4 + 2 + 4
    # Per-turn samples: trajectory 0 has turns ending at 2 and 6, trajectory 1 at 2.
    turns = bp.StepBatch(
        workload="search",
        step=0,
        prompt_lens=(5,),
        response_lens=((6, 2),),
        turn_ends=(((2, 6), (2,)),),
    )
    seqs, gids = bp.build_sequences(turns)
    assert [len(s) for s in seqs] == [7, 11, 7] and gids.tolist() == [0, 0, 0]
    np.testing.assert_array_equal(seqs[0], seqs[1][:7])  # a turn's sample prefixes the next
    assert tree_tokens(seqs) == 5 + 6 + 2


def test_bench_per_turn_lengths_match_trace_records():
    """The per-turn samples of a real Search-R1 step agree with dtarl.traces' reading."""
    root = bp.default_root()
    if root is None:
        pytest.skip("no PolyTrace directory (../shared/polytrace)")
    run = load_trace(root / bp.MULTITURN_RUNS["search"])
    step = run.steps[0]
    by_group: dict[int, list] = {}
    for t in run.iter_step(step):
        by_group.setdefault(t.prompt_group_id, []).append(t)
    want = [n for g in sorted(by_group) for t in by_group[g] for n in t.per_turn_lens]
    (sb,) = [s for s in bp.load_steps(root, "search") if s.step == step]
    seqs, _ = bp.build_sequences(sb)
    assert [len(s) for s in seqs] == want
    (tr,) = [s for s in bp.load_steps(root, "search_traj") if s.step == step]
    seqs, _ = bp.build_sequences(tr)
    assert [len(s) for s in seqs] == [t.sequence_len for g in sorted(by_group) for t in by_group[g]]


# ------------------------------------------------------------------------ measured bench


def test_bench_measured_helpers():
    """Scaling and the measured summary (the timed runs themselves are exercised by the CLI)."""
    sb = bp.StepBatch(workload="math", step=0, prompt_lens=(64, 3), response_lens=((128, 1), (40,)))
    small = bp.scale_step(sb, 1 / 32)
    assert small.prompt_lens == (2, 1) and small.response_lens == ((4, 1), (1,))
    assert small.turn_ends is None
    # Turn ends scale too; ends that collapse onto one length are kept once.
    mt = bp.StepBatch(
        workload="search",
        step=0,
        prompt_lens=(64,),
        response_lens=((128, 40),),
        turn_ends=(((32, 40, 128), (40,)),),
    )
    assert bp.scale_step(mt, 1 / 32).turn_ends == (((1, 4), (1,)),)
    with pytest.raises(ValueError, match="scale=0"):
        bp.MeasureConfig(scale=0)
    with pytest.raises(ValueError, match="repeats=0"):
        bp.MeasureConfig(repeats=0)
    rows = []
    for variant, t, sim, won in (
        ("balanced/sequences", 1.0, 10, "karmarkar_karp"),
        ("greedy_tokens/groups", 2.0, 20, "greedy_tokens"),
    ):
        timing = dict(measured_max_s=t, sim_makespan=sim, winner=won)
        rows.append(dict(workload="math", k=2, variant=variant) | timing)
    (s,) = bp.summarise_measured(rows)
    assert s["variants"]["balanced/sequences"]["wins"] == {"karmarkar_karp": 1}
    g = s["variants"]["greedy_tokens/groups"]
    assert g["measured_pct_lower"] == pytest.approx(50.0)
    assert g["sim_pct_lower"] == pytest.approx(50.0)
    text = bp.format_measured({"measured_summary": [s], "config": {"measure": {"scale": 1 / 32}}})
    assert "greedy_tokens/groups" in text and "kk 1" in text
