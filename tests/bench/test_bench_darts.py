"""``dtarl bench darts`` at tiny shapes: both arms from one SFT warm-up, the JSON rows'
schema, the table and the PNG. No timing assertions."""

from __future__ import annotations

import json

import pytest

from dtarl import cli
from dtarl.bench import darts as bench_darts

TINY = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    # 8 slots in both arms (GRPO's 2 x 4 candidates; DARTS' extra ones queue): one set
    # of decode programs for both arms' engines, not one per slot count.
    "rollout.slots=8",
    # The dense engine: the dfs engine's reserved program is most of this test's
    # compile time and is covered by its own tests; what is checked here is the bench.
    "algo.engine=dense",
    "sft.batch_size=8",
    "task.max_verbosity=2",
    "mesh.dp=1",
]


def test_bench_darts_cli_tiny(tmp_path, capsys):
    out, png = tmp_path / "darts.json", tmp_path / "darts.png"
    args = ["bench", "darts", "--steps", "2", "--seeds", "0", "--sft-steps", "2"]
    args += ["--eval-every", "1", "--eval-problems", "4", "--out-dir", str(tmp_path / "runs")]
    args += ["--png", str(png), "--json", str(out)]
    for o in TINY:
        args += ["--set", o]
    assert cli.main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["arm"], r["seed"]) for r in rows] == [("grpo", 0), ("darts", 0)]
    for r in rows:
        for key in ("step_seconds", "final_success", "mean_response_len", "rollout_seconds"):
            assert isinstance(r[key], float), key
        assert r["step_seconds"] > 0 and 0 <= r["final_success"] <= 1
        assert 1 <= r["mean_response_len"] <= 12
        assert r["steps"] == 2 and len(r["series"]["step_seconds"]) == 2
        # Evaluated before RL, after step 1 (eval_every) and at the end.
        assert [s for s, _ in r["eval_curve"]] == [0, 1, 2]
        # Both arms start from the same SFT weights and evaluation problems.
        assert r["eval_curve"][0][1] == rows[0]["eval_curve"][0][1]
    grpo, darts = rows
    assert all(x is None for x in grpo["series"]["darts_m_total"])  # no DARTS: null
    assert grpo["m_total"] is None and grpo["cost_error_median"] is None
    assert all(x >= 2 * 4 for x in darts["series"]["darts_m_total"])  # >= M N
    assert 0 <= darts["decode_steps_match"] <= 1
    for key in ("early_stop_groups", "dual_end_groups"):
        assert 0 <= darts[key] <= 2 and len(darts["series"][f"darts_{key}"]) == 2
    assert png.exists() and png.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "speedup grpo/darts" in text and "SFT warm-up: 2 steps" in text
    assert "early-stopped / dual-end groups per step" in text


def test_summarize_and_config_checks():
    runs = [
        dict(arm=arm, seed=s, step_seconds=t, rollout_seconds=t / 2, train_seconds=t / 2,
             mean_response_len=10.0, p90_response_len=20.0, max_response_len=40.0,
             tree_token_ratio=1.5, final_success=ok)
        for arm, s, t, ok in [("grpo", 0, 2.0, 0.5), ("grpo", 1, 2.0, 0.7),
                              ("darts", 0, 1.0, 0.6), ("darts", 1, 1.0, 0.6)]
    ]  # fmt: skip
    s = bench_darts.summarize(runs)
    assert s["speedup"]["step_seconds"] == pytest.approx(2.0)
    assert s["grpo"]["final_success"] == pytest.approx(0.6)
    assert s["grpo"]["final_success_std"] == pytest.approx(0.1)
    assert s["success_gap"] == pytest.approx(0.0) and s["success_within_spread"]
    with pytest.raises(ValueError, match="skip_steps"):
        bench_darts.DartsBenchConfig(steps=2, skip_steps=2)
    with pytest.raises(ValueError, match="repeats"):
        bench_darts.DartsBenchConfig(seeds=(1, 1))
    q = bench_darts.DartsBenchConfig.quick()
    assert len(q.seeds) == 3 and q.steps < bench_darts.DartsBenchConfig().steps
