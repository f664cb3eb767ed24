"""The `dtarl` command: lists working subcommands, reports bad input in one line."""

import json
import subprocess
import sys

import pytest

from dtarl import cli


def test_help_lists_the_working_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("train", "bench", "launch", "trace"):
        assert command in out


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert cli.main(["bench", "train", "--engines", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--engines: unknown ['nope']" in err and "Traceback" not in err


def test_entry_point_runs_as_module():
    out = subprocess.run(
        [sys.executable, "-m", "dtarl.cli", "trace", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "replay" in out.stdout


def test_bench_memory_tables(capsys, tmp_path):
    """`dtarl bench memory` on tiny shapes: the peak table and the frontier (compiles
    only). Every frontier row fits its budget; dense is the gain's baseline."""
    path = tmp_path / "memory.json"
    args = ["bench", "memory", "--group-sizes", "4", "--prompt", "32", "--response", "8"]
    args += ["--budget-mib", "6", "--frontier-group", "4", "--max-response", "24"]
    assert cli.main([*args, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Compiled peak memory" in out and "Capacity frontier" in out
    res = json.loads(path.read_text())
    (peak,) = res["peaks"]
    assert peak["G"] == 4 and peak["tokens"] == 4 * 40
    assert 0 < peak["suffix_phase_MiB"] <= peak["prefix_reuse_MiB"]
    assert [r["engine"] for r in res["frontier"]] == ["dense", "prefix_reuse"]
    for r in res["frontier"]:
        assert r["peak_MiB"] <= 6 and r["total_tokens"] == 4 * 5 * r["response_len"]
    assert res["frontier"][0]["gain"] == 1.0
    assert res["frontier"][1]["response_len"] < 24  # found by the budget, not the cap
    assert cli.main(["bench", "memory", "--budget-mib", "0"]) == 2
    assert "--budget-mib=[0.0]: each must be > 0" in capsys.readouterr().err
    assert cli.main(["bench", "memory", "--frontier-group", "0"]) == 2
    assert "--frontier-group=0: must be >= 1" in capsys.readouterr().err
