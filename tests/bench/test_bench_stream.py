"""``dtarl bench stream`` at a tiny size: both arms run, the JSON rows' keys, the table
and its CPU caveat. No timing assertions."""

from __future__ import annotations

import json
import re

import pytest

from dtarl import cli
from dtarl.bench import stream as bench_stream


def test_bench_stream_cli_tiny(tmp_path, capsys):
    out = tmp_path / "stream.json"
    args = ["bench", "stream", "--workloads", "grpo_kl", "--rounds", "1", "--prompts", "2"]
    args += ["--group-size", "2", "--max-new-tokens", "8", "--chunk", "4", "--layers", "1"]
    args += ["--set", "rollout.warmup=false", "--set", "algo.engine=dense"]
    args += ["--out-dir", str(tmp_path / "runs"), "--json", str(out)]
    assert cli.main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["workload"], r["arm"]) for r in rows] == [("grpo_kl", "off"), ("grpo_kl", "on")]
    off, on = rows
    assert on["streamed"] == ["ref"] and off["streamed"] == []
    for r in rows:
        keys = ("step_seconds", "step_cpu_seconds", "rollout_seconds")
        for key in (*keys, "post_rollout_forward_seconds"):
            assert isinstance(r[key], float) and r[key] >= 0, key
        assert r["steps"] == 1 and r["skipped"] == 0 and 1 <= r["response_len_mean"] <= 8
        assert len(r["series"]["step_seconds"]) == 1
        assert (
            r["moved_seconds"]
            == off["post_rollout_forward_seconds"] - (on["post_rollout_forward_seconds"])
        )
    assert on["stream_tokens"] > 0 and on["stream_lag_tokens"] >= 0
    assert off["stream_tokens"] is None and off["stream_seconds"] is None  # not streamed
    text = capsys.readouterr().out
    for arm in ("off", "on"):
        assert re.search(rf"^grpo_kl +{arm} +\d", text, re.M), arm
    assert "share the same cores" in text and "No speedup is claimed" in text


def test_step_verdict_needs_separated_ranges():
    def res(off, on):
        return {"arms": {a: {"series": {"step_seconds": v}} for a, v in (("off", off), ("on", on))}}

    assert bench_stream.step_verdict(res([1.0, 1.2], [0.5, 0.9])).startswith("faster")
    assert bench_stream.step_verdict(res([1.0, 1.2], [1.3, 1.4])).startswith("slower")
    assert bench_stream.step_verdict(res([1.0, 1.2], [0.9, 1.1])).startswith("no difference")


def test_bench_stream_config_errors():
    with pytest.raises(ValueError, match="workloads=\\['sft'\\]"):
        bench_stream.StreamBenchConfig(workloads=("sft",))
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        bench_stream.StreamBenchConfig(chunk=0)
    assert cli.main(["bench", "stream", "--rounds", "0"]) == 2
