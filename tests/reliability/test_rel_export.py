"""Issue #40 items 1 (export side), 7 and 8 (export): a corrupt step, a protected or
foreign target, an unwritable target are refused in one line; NaN is never exported."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from faults import data_files, flip, subprocess_env
from flax import nnx

from dtarl.cli import main as cli_main
from dtarl.commands.export import ExportError, export_checkpoint
from dtarl.model import ModelConfig, init_model
from dtarl.model.hf import EXPORT_MARKER, load_hf, save_hf


def test_corrupt_step_is_not_exported(two_steps, capsys):
    flip(data_files(two_steps / "step_00000002")[0], 64)
    run_dir = two_steps.parent
    assert cli_main(["export", str(run_dir), "--hf", str(run_dir.parent / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "step_00000002: corrupt checkpoint, not exported" in err
    assert not (run_dir.parent / "out").exists()


@pytest.mark.parametrize(
    "target, why",
    [
        ("step", "it is inside the checkpoints being exported"),
        ("checkpoints", "it is or contains the checkpoints being exported"),
        ("run", "it is or contains the (checkpoints being exported|run directory)"),
        ("cwd", "it is or contains the current directory"),
    ],
)
def test_force_never_replaces_the_run_or_the_cwd(two_steps, tmp_path, monkeypatch, target, why):
    """Item 7: --force replaced a checkpoint step, the run directory or the cwd."""
    run_dir = two_steps.parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "work.txt").write_text("keep")
    monkeypatch.chdir(elsewhere)
    out = {
        "step": two_steps / "step_00000001",
        "checkpoints": two_steps,
        "run": run_dir,
        "cwd": elsewhere,
    }[target]
    with pytest.raises(ExportError, match=rf"^--hf .*: {why}"):
        export_checkpoint(run_dir, out, step=1, force=True)
    assert (two_steps / "step_00000001").is_dir() and (elsewhere / "work.txt").exists()


def test_force_replaces_only_a_previous_export(two_steps, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match=f"no {EXPORT_MARKER} .*not made by dtarl export"):
        export_checkpoint(two_steps.parent, foreign, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    (foreign / EXPORT_MARKER).write_text("x")  # a previous export: the target check passes
    with pytest.raises(ExportError, match="the run.s config does not load"):
        export_checkpoint(two_steps.parent, foreign, force=True)


def test_unwritable_target_is_one_line(two_steps, capsys):
    assert cli_main(["export", str(two_steps.parent), "--hf", "/proc/x/y"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dtarl: error: --hf /proc/x/y: cannot be written") and "\n" not in err


def test_nonfinite_weights_are_not_exported(tmp_path):
    model = init_model(ModelConfig.tiny(num_layers=1), seed=0)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    new = [
        (p, v.replace(v[...].at[0].set(jnp.nan)) if p[-1] == "down_proj" else v) for p, v in flat
    ]
    nnx.update(model, nnx.from_flat_state(new))
    with pytest.raises(ValueError, match="parameter layers/0/mlp/down_proj holds NaN or inf"):
        save_hf(model, tmp_path / "hf")
    assert not os.path.exists(tmp_path / "hf")


KILLED_EXPORT = """
import os, signal, sys
from dtarl.model import ModelConfig, init_model
from dtarl.model import hf

real_save_file = hf.save_file


def save_then_die(tensors, path, **kw):
    real_save_file(tensors, path, **kw)
    print("wrote", os.path.basename(path), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies mid-export, before the rename


hf.save_file = save_then_die
hf.save_hf(init_model(ModelConfig.tiny(num_layers=1), seed=1), sys.argv[1])
"""


def test_kill_during_export_keeps_the_previous_export(tmp_path):
    """kill -9 while ``dtarl export`` writes: the previous export stays whole (the new one
    is written to a temporary directory and renamed into place only when complete)."""
    out = tmp_path / "export"
    save_hf(init_model(ModelConfig.tiny(num_layers=1), seed=0), out)
    (out / EXPORT_MARKER).write_text("previous")
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == -9 and "wrote model.safetensors" in proc.stdout, proc.stderr[-2000:]
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    load_hf(out)  # still a loadable checkpoint
    leftovers = [n for n in os.listdir(tmp_path) if n != "export"]
    assert all(n.startswith(".export.tmp-") for n in leftovers), leftovers
