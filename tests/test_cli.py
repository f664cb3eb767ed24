"""The `dtarl` command: lists working subcommands, reports bad input in one line."""

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
