"""``dtarl launch --nproc 2 -- train ...``: rank 1 killed (SIGKILL) mid-run after it has
trained a step. The launcher names rank 1's death and exits non-zero, and rank 0 names
the cause (``PeerLostError``) in its log: its broken collective noticed the loss, not
JAX's heartbeat (which would abort it with JAX's own message, and is set longer than
the test waits). No wall-time assertion: the machine is shared; the structure (exit
codes, messages) says what happened, and the timeouts only bound a hang.

(``test_parallel_launch.test_mid_run_death_raises_peer_lost`` checks the same at the
engine level, without the launcher, for either process dying.)
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # two training processes under the launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# SFT steps only: no sampler to compile, a step is one sharded dense update (dp = 2,
# one device per process); more steps than the test will ever see.
SETS = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=500",
    "sft.batch_size=2",
    "steps=1",
    "algo.engine=dense",
    "eval.num_problems=0",
    "console=false",
    "resume=false",
    "checkpoint_every=0",
]
HEARTBEAT = 200  # seconds: longer than the test waits after the kill (WAIT)
WAIT = 120  # seconds the test waits for the launcher after the kill


def _children(pid: int) -> dict[int, int]:
    """{DTARL_PROCESS_ID: pid} of the launcher's worker processes (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"DTARL_PROCESS_ID" in env:
            out[int(env[b"DTARL_PROCESS_ID"])] = int(name)
    return out


def _steps_logged(path) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if json.loads(line).get("phase") == "sft")
    except (OSError, ValueError):
        return 0


def test_killed_rank_is_named_and_the_survivor_names_the_lost_peer(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2"]
    cmd += ["--devices-per-proc", "1", "--init-timeout", "60"]
    cmd += ["--heartbeat-timeout", str(HEARTBEAT), "--timeout", "400", "--", "train"]
    cmd += [a for s in [*SETS, f"out_dir={tmp_path}"] for a in ("--set", s)]
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    try:
        # Rank 1 has made progress: its step is logged (the trainer's report_progress
        # for the launcher's watchdog comes just before the step's log record).
        log1 = tmp_path / "process_1" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while _steps_logged(log1) < 1 and launcher.poll() is None:
            assert time.monotonic() < deadline, "rank 1 made no progress in 120 s"
            time.sleep(0.1)
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        ranks = _children(launcher.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        out, err = launcher.communicate(timeout=WAIT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert f"dtarl launch: rank 1 (pid {ranks[1]}) exited with code -9" in err, err[-3000:]
    # Rank 0's broken collective names the lost peer before the launcher stops it.
    assert "[rank 0] " in err and "PeerLostError: process 0 of 2" in err, err[-3000:]
    assert "ranks [0] failed too" in err, err[-3000:]
    assert "detected fatal" not in err, err[-3000:]  # not JAX's heartbeat abort
    assert _steps_logged(tmp_path / "metrics.jsonl") >= 1  # rank 0 was training too
