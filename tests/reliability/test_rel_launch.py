"""Issue #40 items 3, 9 (--nproc) and kill -9 during a 2-process step: the coordinator
listens on 127.0.0.1 only; --nproc and the target are checked before any process
starts; a survivor names the dead rank in one line."""

import ast
import re
import subprocess
import sys

import pytest
from faults import subprocess_env

from dtarl.cli import main as cli_main
from dtarl.parallel import launch as launch_lib
from dtarl.parallel.launch import DistributedConfig, LaunchError


def test_initialize_binds_the_coordinator_address(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    cfg = DistributedConfig(coordinator_address="127.0.0.1:4321", num_processes=2, process_id=0)
    launch_lib.initialize(cfg)
    assert calls[0]["coordinator_bind_address"] == "127.0.0.1:4321"  # not JAX's [::]:port
    launch_lib.initialize(cfg, bind_address="10.1.2.3:4321")
    assert calls[1]["coordinator_bind_address"] == "10.1.2.3:4321"


def test_multi_host_needs_an_explicit_address():
    with pytest.raises(LaunchError, match="needs --coordinator-address HOST:PORT"):
        launch_lib.launch(["-m", "json.tool"], 1, nnodes=2, node_rank=1)
    with pytest.raises(LaunchError, match=r"--coordinator-address='h': expected host:port"):
        launch_lib.launch(["-m", "json.tool"], 1, coordinator_address="h")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "100000"], r"--nproc 100000: 100000 exceed the \d+ CPU cores of this host"),
        (["--nproc", "1", "--", "nosuchcommand"], "is not a module, a script"),
        (["--nproc", "1", "--", "-m", "no_such_module_x"], "'no_such_module_x' is not importable"),
        (["--nproc", "1", "--", "missing.py"], "target script 'missing.py' does not exist"),
    ],
    ids=["nproc", "command", "module", "script"],
)
def test_checked_before_any_process_starts(capsys, args, message):
    tail = [] if "--" in args else ["--", "-m", "json.tool"]
    assert cli_main(["launch", *args, *tail]) == 2
    out = capsys.readouterr()
    assert "[rank" not in out.out + out.err  # nothing started
    err = out.err.strip()
    assert "\n" not in err
    assert re.search(message, err), err


# Rank 0 looks up its coordinator's listening socket in /proc/net/tcp{,6}; both ranks
# run one sharded prepare (a collective), rank 1 is SIGKILLed, rank 0's next prepare
# loses it.
STEP_THEN_KILL = """
import os, signal, sys
import jax
from flax import nnx
from dtarl.engines import DFSEngine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel import make_mesh
from dtarl.parallel.sharded import ShardedEngine
from dtarl.testing import grpo_groups

me = jax.process_index()
if me == 0:
    port = int(os.environ["DTARL_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
    listening = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(name).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                listening.append(local.rsplit(":", 1)[0])
    print("coordinator listens on", listening, flush=True)
cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
model = nnx.eval_shape(lambda: init_model(cfg, seed=0))
batch = grpo_groups(num_groups=2, group_size=2, prompt_len=4, response_len=(2, 4), seed=0)
sharded = ShardedEngine(DFSEngine(model, chunk_len=8), make_mesh(2, 1))
loss = ClippedSurrogateLoss.dapo()
sharded.prepare(batch, loss)
print("step done", flush=True)
if me == 1:
    os.kill(os.getpid(), signal.SIGKILL)
sharded.prepare(batch, loss)
print("unreachable", flush=True)
"""


def test_kill_during_a_two_process_step(tmp_path):
    (tmp_path / "step.py").write_text(STEP_THEN_KILL)
    proc = subprocess.run(
        [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2", "--devices-per-proc", "1"]
        + ["--init-timeout", "60", "--", str(tmp_path / "step.py")],
        capture_output=True,
        text=True,
        timeout=180,  # only against a hang
        env=subprocess_env(),
    )
    out, err = proc.stdout, proc.stderr
    # /proc/net/tcp{,6} hex: 127.0.0.1, ::ffff:127.0.0.1 or ::1 (JAX's default [::] is 0...0)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    (line,) = [ln for ln in out.splitlines() if "coordinator listens on" in ln]
    addrs = ast.literal_eval(line.split("listens on ", 1)[1])
    assert addrs and set(addrs) <= loopback, out + err[-3000:]
    assert "[rank 0] step done" in out and "[rank 1] step done" in out, err[-3000:]
    assert "unreachable" not in out
    lines = [ln for ln in err.splitlines() if ln.startswith("[rank 0]")]
    lost = [ln for ln in lines if "lost rank 1" in ln]
    assert len(lost) == 1 and "dtarl: rank 0 of 2: lost rank 1 (it died" in lost[0], err[-3000:]
    assert not any("Traceback" in ln for ln in lines), err[-3000:]
    assert "dtarl launch: rank 1" in err and "exited with code -9" in err
    assert proc.returncode == 128 + 9
