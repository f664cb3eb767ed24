"""``dtarl bench peer``: argument parsing, the missing-Tunix message, the table.

Nothing here needs Tunix or times anything (CI does not install the ``peer`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

import dtarl
from dtarl import cli
from dtarl.bench import peer


def _parse(*argv):
    return cli.build_parser().parse_args(["bench", "peer", *argv])


def test_defaults():
    a = _parse()
    assert a.parts == ["rollout", "update", "iteration"]
    assert (a.rounds, a.repeats, a.quick, a.python, a.json) == (2, 3, False, None, None)


def test_options(tmp_path):
    a = _parse(
        "--parts", "rollout", "--rounds", "4", "--repeats", "1", "--quick",
        "--python", "/x/python", "--json", str(tmp_path / "o.json"),
    )  # fmt: skip
    assert a.parts == ["rollout"] and a.rounds == 4 and a.repeats == 1 and a.quick
    assert a.python == "/x/python" and a.json == tmp_path / "o.json"


def test_unknown_part_is_rejected():
    with pytest.raises(SystemExit):
        _parse("--parts", "everything")


def test_rounds_must_be_positive(capsys):
    assert cli.main(["bench", "peer", "--rounds", "0"]) == 2
    assert "--rounds=0" in capsys.readouterr().err


def test_help_states_the_asymmetries(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "peer", "--help"])
    out = capsys.readouterr().out
    for words in ("repeats the prompt", "extra decode call", "Python overhead", "autotune"):
        assert words in out


def _no_tunix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tunix" else real(name, *a)
    )


def test_missing_tunix_names_the_extra(monkeypatch, capsys):
    _no_tunix(monkeypatch)
    with pytest.raises(peer.PeerMissing, match=r"pip install -e \.\[peer\]"):
        peer.require_tunix()
    assert cli.main(["bench", "peer", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e .[peer]" in err and "google-tunix" in err


def test_missing_tunix_in_another_interpreter(monkeypatch):
    class Done:
        returncode = 1

    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(peer.PeerMissing, match=r"/other/python.*pip install -e \.\[peer\]"):
        peer.check_python("/other/python")


def test_table_and_json(monkeypatch, tmp_path, capsys):
    """The command's output from fake worker results (no processes are started)."""
    monkeypatch.setattr(peer, "check_python", lambda python: None)
    secs = {"tunix_rollout": 1.0, "dtarl_static": 2.0, "dtarl_engine": 0.5}

    def fake(name, w, repeats, python=None):
        return dict(seconds=secs[name], times=[secs[name]] * repeats, compile_s=0.0)

    monkeypatch.setattr(peer, "run_worker", fake)
    path = tmp_path / "peer.json"
    assert cli.main(["bench", "peer", "--parts", "rollout", "--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| Tunix rollout | dtarl static | dtarl engine |" in out
    assert "| 1.00 s | 2.00 s | 0.50 s | 0.50x | 2.00x |" in out
    res = json.loads(path.read_text())
    assert set(res["workloads"]) == {w.name for w in peer.QUICK_WORKLOADS}
    ratios = next(iter(res["workloads"].values()))["ratios"]
    assert ratios == {"tunix_rollout/dtarl_static": [0.5], "tunix_rollout/dtarl_engine": [2.0]}


def test_workers_import_the_commands_dtarl(monkeypatch):
    """Every measurement process (in any ``--python``) gets this dtarl's directory first
    on PYTHONPATH, so it measures the dtarl that runs the command."""
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    root = os.path.dirname(os.path.dirname(os.path.abspath(dtarl.__file__)))
    assert peer.worker_env()["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
