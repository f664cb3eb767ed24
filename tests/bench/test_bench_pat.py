"""``dtarl bench pat`` at a tiny size: the JSON keys, the table, the PNG."""

from __future__ import annotations

import json

import jax
import pytest

from dtarl import cli
from dtarl.bench import pat as bench_pat
from dtarl.rollout import pat

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def synthetic_profile(path):
    """Small batches per DP group favour a large TP (so PAT switches); cheap K/V moves."""
    cfg = bench_pat.pat_tiny()
    dec, pre = [], []
    for tp in pat.TP_DEGREES:
        for b in (1, 2, 4, 8):
            for length in (8, 64, 512):
                t = b * (length + 16)
                sec = 1e-2 / tp + 1e-3 * b * tp + 1e-9 * t
                dec.append(dict(tp=tp, b=b, l=length, t=t, seconds=sec))
                pre.append(dict(tp=tp, b=b, l=length, t=b * length, seconds=1e-3 * b))
    model = dict(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        compute_dtype="float32",
    )
    return pat.Profile(
        model=model,
        device_kind="synthetic",
        platform="cpu",
        jax_version=jax.__version__,
        devices=8,
        mesh_axes=("dp", "tp"),
        token_cap=4096,
        window=16,
        decode=tuple(dec),
        prefill=tuple(pre),
        weight_bytes=10_000,
        weights_bytes_per_s=1e12,
        kv_bytes_per_s=1e12,
        compile_s=0.0,
    ).save(path)


def test_bench_pat_cli_tiny(tmp_path, capsys):
    prof = synthetic_profile(tmp_path / "prof.json")
    out, png = tmp_path / "pat.json", tmp_path / "pat.png"
    args = ["bench", "pat", "--quick", "--synthetic", "--profile", str(prof)]
    args += ["--prompts", "2", "--group-size", "4", "--prompt-len", "8"]
    args += ["--max-new-tokens", "16", "--steps-per-call", "2", "--check-every", "1"]
    args += ["--replay-profile", str(prof), "--png", str(png), "--json", str(out)]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "| config | latency s |" in text and "PREDICTION" in text
    rows = json.loads(out.read_text())
    by = {r["config"]: r for r in rows}
    assert set(by) == {"tp1", "tp2", "tp4", "tp8", "pat", "pat_oracle", "predictor", "replay"}
    for name in ("tp1", "tp2", "tp4", "tp8", "pat", "pat_oracle"):
        r = by[name]
        assert r["latency_s"] > 0 and r["decode_s"] > 0
        assert r["switches"] == (len(r["timeline"]) if name.startswith("pat") else 0)
        # Timed runs compile nothing: the warm-up run compiled every program, PAT's too.
        assert r["compiled_after_warmup"] == 0
    assert by["pat"]["switches"] >= 1 and by["pat"]["tokens_match_tp1"] is True
    assert by["pat_oracle"]["tokens_match_tp1"] is True
    assert "pat (knows L_max only)" in text and "pat_oracle (reads the forced" in text
    assert by["pat"]["timeline"][0]["src"][1] == 1
    p = by["predictor"]
    # The synthetic profile is linear in T per B (1e-9 s per token): held out inside the
    # grid, the middle window of each (tp, B) curve (16 points) is exact; the middle B
    # levels (2 and 4: 24 points) are off only where T is held flat below a curve.
    assert p["mean_rel_error"] < 1e-3 and p["held_out_t_error"] < 1e-9
    assert p["held_out_t_points"] == 16 and p["held_out_b_points"] == 24
    assert p["held_out_points"] == 40 and p["real_calls"] > 0 and p["real_all_calls"] > 0
    assert by["replay"]["label"] == "PREDICTION"
    assert set(by["replay"]["static"]) == {"tp1", "tp2", "tp4", "tp8"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_pat_refuses_a_profile_of_other_devices(tmp_path, capsys):
    path = synthetic_profile(tmp_path / "p.json")
    d = json.loads(path.read_text())
    d["devices"] = 4
    for table in ("decode", "prefill"):
        d[table] = [r for r in d[table] if r["tp"] <= 4]
    path.write_text(json.dumps(d))
    assert cli.main(["bench", "pat", "--synthetic", "--profile", str(path)]) == 2
    assert "taken on 4 devices, this run has 8" in capsys.readouterr().err


def test_bench_pat_trace_names_the_accepted_values():
    from dtarl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trace='math': accepted values \['rllm', 'search_r1'"):
        bench_pat.PatBenchConfig(trace="math")
    assert bench_pat.PatBenchConfig(trace="rllm").trace == "rllm"


def test_analytic_step_seconds_by_hand():
    from dtarl.bench.pat_analytic import Machine, step_seconds

    m = Machine(flops_per_s=1e9, bytes_per_s=1e8, alpha_s=1e-6, beta_s_per_byte=1e-9)
    cost = dict(flops=2e6, bytes=1e5)  # compute-bound: 2 ms vs 1 ms
    assert step_seconds(cost, tp=1, b=4, hidden=8, layers=2, machine=m) == pytest.approx(2e-3)
    # tp 4: 2 layers x 2 all-reduces of 4 x 8 x 4 = 128 bytes, ring: 6 alpha + 1.5 m beta
    want = 2e-3 + 2 * 2 * (6 * 1e-6 + 1.5 * 128 * 1e-9)
    assert step_seconds(cost, tp=4, b=4, hidden=8, layers=2, machine=m) == pytest.approx(want)


def test_analytic_check_reports_each_held_out_window():
    import sys
    from pathlib import Path

    from dtarl.bench.pat_analytic import check, held_out_windows

    sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
    from test_pat import make_profile

    # The windows k R / 8 between the engine's R/4 .. R that it does not decode with.
    assert held_out_windows(256) == [96, 160, 192, 224]
    assert held_out_windows(64) == [24, 40, 48, 56]

    def step(tp, b, t):  # piecewise linear in T between the profile's windows 8, 64, 512
        return 1e-3 * tp + 1e-4 * b + 1e-6 * t

    prof = make_profile(step)
    # Held out at window 36 (between 8 and 64) on the curve: no error; at window 288 a
    # point 10% above the line: 1/11 relative error of the prediction.
    held = [
        dict(tp=2, b=4, l=36, t=4 * (36 + 16), seconds=step(2, 4, 4 * (36 + 16))),
        dict(tp=2, b=4, l=288, t=4 * (288 + 16), seconds=1.1 * step(2, 4, 4 * (288 + 16))),
        dict(tp=4, b=16, l=288, t=16 * (288 + 16), seconds=step(4, 16, 16 * (288 + 16))),
    ]
    got = check(prof, held)
    assert [w["window"] for w in got["windows"]] == [36, 288]
    assert [w["points"] for w in got["windows"]] == [1, 2]
    assert got["windows"][0]["mean_rel_error"] == pytest.approx(0, abs=1e-12)
    assert got["windows"][1]["max_rel_error"] == pytest.approx(0.1 / 1.1, 1e-9)
    assert got["windows"][1]["mean_rel_error"] == pytest.approx(0.1 / 1.1 / 2, 1e-9)
    assert got["window_points"] == 3
    assert got["window_mean_rel_error"] == pytest.approx(0.1 / 1.1 / 3, 1e-9)
    # leave_one_out's points count in the overall mean too (all exact on linear data).
    assert got["held_out_points"] == 3 + len(pat.leave_one_out(prof))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_bandwidths_time_no_compile(monkeypatch):
    """The switch bandwidths time moves whose programs are compiled: the first pass of
    each direction (it compiles the jitted identities) is untimed, so no timed interval
    holds a backend compile (they used to: a 0.3 MB/s "bandwidth" under load)."""
    import time

    from flax import nnx

    from dtarl.bench import pat_profile
    from dtarl.model import ModelConfig, init_model
    from dtarl.parallel.mesh import make_mesh
    from dtarl.rollout.compiles import compile_count

    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=8, head_dim=8)
    weights = nnx.split(init_model(cfg, seed=0), nnx.Param)[1]
    marks, real = [], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: (marks.append(compile_count()), real())[1])
    w_bw, kv_bw = pat_profile.bandwidths(weights, cfg, {1: make_mesh(8, 1), 8: make_mesh(1, 8)})
    monkeypatch.setattr(time, "perf_counter", real)
    assert w_bw > 0 and kv_bw > 0
    # 2 untimed moves (3 clock reads each: the last one is not read), then 4 timed ones
    # of 4 reads: (start, end) of the weights, (start, end) of the K/V.
    assert len(marks) == 2 * 3 + 4 * 4
    timed = marks[6:]
    for k in range(0, len(timed), 2):
        assert timed[k] == timed[k + 1], f"a compile inside timed interval {k // 2}"
