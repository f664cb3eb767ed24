"""Issue #40 items 1, 2 and kill -9 mid-write: corrupt steps are never used; a run
resumes from the newest intact one; NaN/inf parameters are never saved."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from faults import TINY_TRAINER, data_files, flip, restored_w, small_tree, subprocess_env

from dtarl.errors import CheckpointError
from dtarl.rl import integrity
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import OnCorrupt, load_config
from dtarl.rl.trainer import Trainer


def step_dir(d, step):
    return os.path.join(d, f"step_{step:08d}")


def test_manifest_written_after_commit(two_steps):
    for step in (1, 2):
        doc = integrity.read_manifest(step_dir(two_steps, step))
        assert doc["step"] == step and doc["config_sha256"] == integrity.config_hash({"x": 1})
        assert any(rel.startswith("state/") for rel in doc["files"])
        assert integrity.verify(step_dir(two_steps, step)) is None


def test_flipped_bytes_are_detected_and_skipped(two_steps, caplog):
    """Case 1: 8 flipped bytes in the largest data file were restored silently."""
    flip(data_files(step_dir(two_steps, 2))[0], 8, offset=16)
    mgr = CheckpointManager(two_steps)
    assert mgr.latest_step() == 1
    assert "skipping checkpoint" in caplog.text and "step_00000002" in caplog.text
    assert "does not match its checksum" in caplog.text
    with pytest.raises(CheckpointError, match=r"step_00000002: corrupt checkpoint, not used"):
        mgr.restore(2, small_tree())
    np.testing.assert_array_equal(restored_w(mgr, 1), np.arange(4096, dtype=np.float32))


def _truncate(d):
    fp = data_files(d)[0]
    with open(fp, "r+b") as f:
        f.truncate(os.path.getsize(fp) // 2)


def _delete(d):
    os.remove(data_files(d)[0])


def _empty_metadata(d):
    open(os.path.join(d, "meta", "metadata"), "w").close()


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_truncate, "bytes, the manifest says"),
        (_delete, "is missing"),
        (_empty_metadata, "meta/metadata has 0 bytes"),
    ],
    ids=["truncated", "deleted", "empty-metadata"],
)
def test_bad_latest_step_falls_back(two_steps, caplog, damage, reason):
    """Case 2: one bad latest step gave a TensorStore traceback and no fallback."""
    damage(step_dir(two_steps, 2))
    mgr = CheckpointManager(two_steps)
    assert mgr.latest_step() == 1
    assert reason in caplog.text
    np.testing.assert_array_equal(restored_w(mgr, 1), np.arange(4096, dtype=np.float32))


def test_on_corrupt_error_stops_with_one_line(two_steps):
    flip(data_files(step_dir(two_steps, 2))[0], 8)
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(two_steps, on_corrupt="error").latest_step()
    assert "\n" not in str(e.value) and "resume.on_corrupt=error" in str(e.value)
    cfg = load_config(None, ["resume.on_corrupt=error"])
    assert cfg.resume.on_corrupt is OnCorrupt.ERROR
    with pytest.raises(ValueError, match="resume.on_corrupt='later'"):
        load_config(None, ["resume.on_corrupt=later"])


def test_no_intact_step_is_an_error_not_a_fresh_start(two_steps):
    for step in (1, 2):
        _delete(step_dir(two_steps, step))
    with pytest.raises(CheckpointError, match="none of the saved steps"):
        CheckpointManager(two_steps).latest_step()


def test_planted_file_fails_verification(two_steps):
    with open(os.path.join(step_dir(two_steps, 2), "state", "extra"), "w") as f:
        f.write("x")
    assert "state/extra is not in the manifest" in integrity.verify(step_dir(two_steps, 2))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_parameters_are_never_saved(tmp_path, bad):
    """Case 1 (second half): NaN in down_proj was re-saved and exported with rc 0."""
    tree = small_tree()
    tree["params"]["down_proj"] = jnp.array([1.0, bad])
    with CheckpointManager(tmp_path / "c") as mgr:
        with pytest.raises(CheckpointError, match="leaf 'params/down_proj' holds NaN or inf"):
            mgr.save(1, tree)
    assert not os.path.exists(tmp_path / "c" / "step_00000001")


KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp
from dtarl.rl.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1], keep=5)
mgr.save(1, {"params": {"w": jnp.ones(1000)}}, {"config": {}})
mgr.wait()
big = {"params": {"w": jnp.arange(4_000_000, dtype=jnp.float32)}}
mgr.save(2, big, {"config": {}})  # async: the write is in flight when save returns
print("saving", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_during_checkpoint_write(tmp_path):
    d = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == -9 and "saving" in proc.stdout, proc.stderr[-2000:]
    mgr = CheckpointManager(d)
    # Step 2 is uncommitted, or committed without a manifest (skipped), or, if the
    # write beat the kill, committed with its manifest: never half of it.
    latest = mgr.latest_step()
    assert latest in (1, 2)
    if latest == 1:
        tree, meta = mgr.restore(1, {"params": {"w": np.zeros(1000, np.float32)}})
        assert meta["step"] == 1 and float(tree["params"]["w"].sum()) == 1000.0
    else:
        tree, _ = mgr.restore(2, {"params": {"w": np.zeros(4_000_000, np.float32)}})
        np.testing.assert_array_equal(tree["params"]["w"], np.arange(4_000_000, dtype=np.float32))
    # The next save of step 2 replaces whatever the kill left.
    with CheckpointManager(d, keep=5) as m2:
        m2.save(2, {"params": {"w": jnp.ones(1000)}}, {"config": {}})
    assert CheckpointManager(d).latest_step() == 2
    assert json.load(open(os.path.join(step_dir(d, 2), integrity.MANIFEST)))["step"] == 2


def test_trainer_resumes_from_the_newest_intact_step(tmp_path, caplog):
    """Case 1 end to end: the trainer's resume skips the corrupt step 2, names it, and
    restores step 1 (on main it resumed from the corrupt step with rc 0)."""
    t = Trainer(load_config(None, [*TINY_TRAINER, f"out_dir={tmp_path}"]))
    t.opt_state = t.sft_opt.init(t.params)
    for step in (1, 2):
        t.state = t.state.replace(step=np.asarray(step, np.int64))
        t.save_checkpoint()
    t.ckpt.wait()
    flip(data_files(step_dir(tmp_path / "checkpoints", 2))[0], 8, offset=16)
    t.state = t.state.replace(step=np.asarray(0, np.int64))
    assert t.try_resume() and t.step == 1
    assert "skipping checkpoint" in caplog.text and "step_00000002" in caplog.text
