"""Issue #40 item 6: a second ``dtarl train`` on the same out_dir resumed from the first
run's checkpoint while it still ran. Now ``out_dir/.lock`` is held for the run's life."""

import os
import socket
import subprocess
import sys
import types

import pytest
from faults import subprocess_env

from dtarl.errors import ConfigError
from dtarl.rl.config import load_config
from dtarl.rl.runlock import RunLock, hold
from dtarl.rl.trainer import Trainer

HOLDER = """
import sys, time
from dtarl.rl.runlock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """``tmp_path/run`` locked by another process (killed at the end)."""
    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert p.stdout.readline().strip() == "locked"
        yield out, p
    finally:
        p.kill()
        p.wait()


def test_second_run_fails_naming_the_holder(held):
    out, p = held
    pid = p.pid
    cfg = load_config(None, [f"out_dir={out}"])
    stub = types.SimpleNamespace(cfg=cfg, _run=lambda max_steps: pytest.fail("ran unlocked"))
    with pytest.raises(ConfigError) as e:
        Trainer.run(stub)  # the hook: Trainer.run takes the lock before anything else
    msg = str(e.value)
    assert f"pid {pid} on host {socket.gethostname()}" in msg and "\n" not in msg
    assert "is in use by another run" in msg


def test_lock_is_released_when_the_holder_dies(held):
    out, p = held
    p.kill()  # kill -9
    p.wait()
    with hold(out) as lock:  # kill -9 leaves the file, not the lock
        assert open(lock.path).read().startswith(f"pid {os.getpid()} ")
    with RunLock(out):  # released on exit: taken again at once
        pass


def test_out_dir_that_cannot_exist_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"out_dir='/proc/x': cannot be used as the run dir"):
        RunLock("/proc/x").acquire()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be used as the run directory"):
        RunLock(tmp_path / "file").acquire()
