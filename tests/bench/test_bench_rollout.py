"""``dtarl bench rollout`` at tiny shapes: the JSON schema, equal token counts for both
samplers, the PNG, the KV report, and the helpers by hand. No timing assertions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtarl import cli
from dtarl.bench import rollout as bench_rollout
from dtarl.model import ModelConfig


def test_static_active_by_hand():
    # Row b is active at decode step t while t < len_b - 1 (prefill draws token 0).
    np.testing.assert_array_equal(bench_rollout.static_active([1, 3, 4]), [2, 2, 1])
    assert bench_rollout.static_active([1, 1]).size == 0


def test_static_kv_bytes_by_hand():
    cfg = ModelConfig.tiny()  # 2 layers, 2 kv heads of 16, fp32
    # 2 (K, V) x L 2 x B 8 x S (16 + 32) x K 2 x D 16 x 4 bytes
    assert bench_rollout.static_kv_bytes(cfg, 8, 16, 32) == 2 * 2 * 8 * 48 * 2 * 16 * 4


def test_synthetic_workloads_are_capped_and_deterministic(tmp_path):
    cfg = bench_rollout.RolloutBenchConfig(prompts=4, group_size=8, max_new_tokens=64)
    a = bench_rollout.make_workloads(cfg, polytrace=tmp_path)  # no traces there
    b = bench_rollout.make_workloads(cfg, synthetic=True)
    assert [w.name for w in a] == list(bench_rollout.WORKLOADS)
    for wa, wb in zip(a, b, strict=True):
        np.testing.assert_array_equal(wa.lengths, wb.lengths)
        assert wa.lengths.shape == (32,)
        assert 1 <= wa.lengths.min() and wa.lengths.max() <= 64
        if wa.name != "uniform":
            assert "synthetic" in wa.source and str(tmp_path) in wa.source
    assert (a[-1].lengths == 64).all()
    with pytest.raises(ValueError, match="workloads"):
        bench_rollout.make_workloads(cfg, names=["nope"])


def test_bench_rollout_cli_tiny(tmp_path, capsys):
    out = tmp_path / "r.json"
    png = tmp_path / "active.png"
    args = [
        "bench",
        "rollout",
        "--model",
        "tiny",
        "--prompts",
        "2",
        "--group-size",
        "4",
        "--prompt-len",
        "8",
        "--max-new-tokens",
        "12",
        "--slots",
        "4",
        "--steps-per-call",
        "4",
        "--rounds",
        "1",
        "--kv-group",
        "4",
        "--kv-prompt",
        "32",
        "--kv-responses",
        "2",
        "8",
        "--png",
        str(png),
        "--json",
        str(out),
    ]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "| workload | sampler |" in text and "K/V bytes, G=4" in text
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and len(rows) == 2 * len(bench_rollout.WORKLOADS)
    for r in rows:
        assert {"workload", "sampler", "tokens_per_s", "seconds", "peak_kv_bytes"} <= set(r)
        assert r["sampler"] in ("static", "engine")
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["peak_kv_bytes"] > 0
    by = {(r["workload"], r["sampler"]): r for r in rows}
    assert {w for w, _ in by} == set(bench_rollout.WORKLOADS)
    for w in bench_rollout.WORKLOADS:
        static, engine = by[w, "static"], by[w, "engine"]
        assert static["generated_tokens"] == engine["generated_tokens"] > 0
        assert engine["compiles_while_timed"] == static["compiles_while_timed"] == 0
        # Prompt-shared K/V: the engine holds less than the static cache.
        assert engine["peak_kv_bytes"] < static["peak_kv_bytes"]
    assert by["uniform", "static"]["generated_tokens"] == 2 * 4 * 12
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    kv = json.loads(out.with_suffix(".kv.json").read_text())
    assert [k["response"] for k in kv] == [2, 8]
    cfg = ModelConfig.tiny()
    token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    for k in kv:
        # Engine: the prompt's first 31 rows once + 4 x response rows (the last prompt
        # token and all generated tokens but the last) at the end.
        assert k["engine_peak_bytes"] == (31 + 4 * k["response"]) * token_bytes
        assert k["static_bytes"] == bench_rollout.static_kv_bytes(cfg, 4, 32, 8)


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert cli.main(["bench", "rollout", "--slots", "0"]) == 2
    err = capsys.readouterr().err
    assert "RolloutBenchConfig.slots=0" in err and "Traceback" not in err
