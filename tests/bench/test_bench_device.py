"""dtarl bench device: the dry run's cross-platform lowering, and the report it writes."""

from __future__ import annotations

import json

import pytest

from dtarl.bench import device, device_dry


def test_dry_run_lowers_the_kernels_for_cuda_and_tpu():
    res = device_dry.dry_run(lambda s: None, parts=("kernels",))
    got = {(r["program"], r["platform"]): r for r in res["rows"]}
    assert set(got) == {
        (f"chunk_attention {d}", p) for d in ("fwd", "bwd") for p in ("cuda", "tpu")
    }
    assert res["failed"] == 0, [r for r in res["rows"] if not r["ok"]]
    # Natively lowered: a Triton call for cuda and a Mosaic call for tpu, not interpret mode.
    assert all(r["chars"] > 1000 for r in res["rows"])


def test_dry_run_reports_a_program_that_fails_to_lower(monkeypatch):
    import importlib

    # The package re-exports the function under the module's name: fetch the module.
    ca = importlib.import_module("pallas_kernels.chunk_attention")

    def broken(*a, **k):
        raise RuntimeError("no lowering for this")

    monkeypatch.setattr(ca, "chunk_attention", broken)
    res = device_dry.dry_run(lambda s: None, platforms=("cuda",), parts=("kernels",))
    assert res["failed"] == 2
    assert all("no lowering for this" in r["error"] for r in res["rows"])


def test_unknown_parts_and_sections_name_the_accepted_values(tmp_path):
    with pytest.raises(ValueError, match="accepted"):
        device_dry.dry_run(lambda s: None, parts=("kernel",))
    with pytest.raises(ValueError, match="'engines'"):
        device.run(sections=("engine",), out=tmp_path)


def test_render_and_splice_keep_one_block_and_name_failures(tmp_path):
    result = {
        "command": "dtarl bench device",
        "commit": "abc1234",
        "date": "2026-11-27",
        "machine": {"backend": "gpu", "device_kind": "NVIDIA H200", "jax": "0.11.2"},
        "sections": {
            "ceilings": {
                "matmul_n": 8192,
                "matmul_tflops": 780.0,
                "copy_gbps": 4300.0,
                "datasheet_bf16_tflops": 989.4,
            },
            "pat": {"rows": [{"slots": 8, "context": 64, "seconds_per_step": 0.004}]},
            "engines": {"error": "XlaRuntimeError: out of memory"},
        },
    }
    md = device.render(result)
    assert "780 TFLOP/s" in md and "NVIDIA H200" in md and "abc1234" in md
    assert "| 8 | 64 | 4.000 |" in md
    assert "Section `engines` failed: XlaRuntimeError: out of memory" in md
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro\n")
    device.splice_docs(md, docs)
    saved = tmp_path / "device.json"
    saved.write_text(json.dumps(result | {"commit": "def5678"}))
    device.render_saved(saved, docs)
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n")
    assert text.count(device.MARK_BEGIN) == 1 and text.count(device.MARK_END) == 1
    assert "def5678" in text and "abc1234" not in text


def test_datasheet_peak_by_device_kind():
    assert device.datasheet_peak("NVIDIA H200") == 989.4
    assert device.datasheet_peak("TPU v5 lite") == 197.0
    assert device.datasheet_peak("cpu") is None
