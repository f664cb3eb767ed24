"""Every notebook's jupytext source runs end to end (tiny sizes), and its .ipynb twin is
in sync with it and has no outputs."""

import glob
import os
import runpy

import matplotlib
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.py")))


def test_there_are_notebooks():
    names = [os.path.basename(p) for p in SOURCES]
    assert names == ["01_quickstart.py", "02_tree_training.py", "03_polytrace.py"]


@pytest.mark.parametrize("path", SOURCES, ids=os.path.basename)
def test_ipynb_is_generated_and_stripped(path):
    jupytext = pytest.importorskip("jupytext")
    ipynb = path[:-3] + ".ipynb"
    assert os.path.exists(ipynb), f"run: jupytext --to ipynb {path}"
    nb = jupytext.read(ipynb)
    src = jupytext.read(path)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert code == [c.source for c in src.cells if c.cell_type == "code"], (
        f"{ipynb} is out of date; run: jupytext --to ipynb {path}"
    )
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.get("outputs") and c.get("execution_count") is None
    # No placeholder links: Colab installs the local checkout, guarded to Colab.
    assert not any("OWNER" in c.source or "colab.research" in c.source for c in nb.cells)
    (install,) = [c for c in code if '"google.colab" in sys.modules' in c]
    assert '"pip", "install", "-q", "-e", src' in install and "DTARL_SRC" in install


def _quickstart_trained(ns):
    cfg, result = ns["cfg"], ns["result"]
    assert result.steps_done == cfg.sft.steps + cfg.steps
    assert len(ns["rl"]) == cfg.steps and np.isfinite(ns["reward"]).all()


def _every_engine_ran_and_agrees(ns):
    """The fast run's engines all ran (none dropped out) and give dense's loss."""
    assert list(ns["results"]) == ["dense", "dfs", "auto"]
    dense = ns["results"]["dense"][0]
    for kind, (value, _, _) in ns["results"].items():
        assert value == pytest.approx(dense, rel=1e-5, abs=1e-7), kind


def _polytrace_workload(ns):
    if ns["HAVE_TRACES"]:  # the traces are data, not in every checkout
        assert ns["batch"].num_sequences > 0 and ns["report"].markdown


CHECKS = {
    "01_quickstart.py": _quickstart_trained,
    "02_tree_training.py": _every_engine_ran_and_agrees,
    "03_polytrace.py": _polytrace_workload,
}


@pytest.mark.slow
@pytest.mark.parametrize("path", SOURCES, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch, tmp_path):
    """Runs end to end, and what it computed is what it says (``CHECKS``)."""
    matplotlib.use("Agg")
    monkeypatch.setenv("DTARL_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ns = runpy.run_path(path, run_name="__main__")
    CHECKS[os.path.basename(path)](ns)
