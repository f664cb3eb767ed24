"""``dtarl bench plan`` at tiny shapes: the stages it times, the plan's bytes, and its
argument checks (no timing is asserted)."""

from __future__ import annotations

import json

from dtarl import cli
from dtarl.bench import plan as bench_plan
from dtarl.tree import build_tree, compile_plan

TINY = ["--prompts", "3", "--group", "2", "--prompt-len", "16", "--response-len", "8"]
TINY += ["--max-response", "40", "--chunk-len", "8", "--model", "tiny", "--rounds", "1"]


def test_bench_plan_reports_every_stage_and_the_plan_bytes(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["bench", "plan", *TINY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for stage in ("trie", "order", "compile_plan", "compile_plan_reference", "padded"):
        assert stage in text
    res = json.loads(out.read_text())
    assert res["sequences"] == 6 and set(res["seconds_per_1k"]) == set(res["seconds"])
    b = res["bytes"]
    assert 0 < b["filled"] <= b["padded"] and 0 < b["compact"]


def test_plan_bytes_count_the_real_entries():
    seqs = bench_plan.grpo_sequences(
        prompts=2, group=3, prompt_len=12, response_len=6, max_response=30, vocab=50
    )
    assert len(seqs) == 6 and all(s.shape[0] >= 3 for s in seqs)
    plan = compile_plan(build_tree(seqs), chunk_len=4, rows=2, wide=3)
    b = bench_plan.plan_bytes(plan)
    real = int((plan.seg >= 0).sum())
    per_step = 3 * plan.op.nbytes + plan.slots.nbytes + plan.slot_seg.nbytes
    assert b["filled"] == per_step + 5 * 4 * real
    assert b["padded"] == per_step + 5 * plan.seg.nbytes


def test_bench_plan_rejects_bad_sizes(capsys):
    assert cli.main(["bench", "plan", "--prompts", "0"]) == 2
    assert "--prompts=0: must be >= 1" in capsys.readouterr().err
