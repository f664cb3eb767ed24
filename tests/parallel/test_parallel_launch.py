"""Multi-process runs: 2 processes x 2 fake CPU devices equal one process; failures are fast.

The two-process test launches a worker script through ``dtarl.parallel.launch``
(gloo collectives on a free localhost port); each process writes its result to
a file in ``tmp_path`` and the test compares them with the single-process run.
"""

import io
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from dtarl.parallel import launch as launch_lib
from dtarl.parallel.launch import DistributedConfig, DistributedInitError, LaunchError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Shared by the worker processes and this test: same model, params and batch.
PROBLEM = """
import jax
import numpy as np
from flax import nnx

from dtarl.engines import AutoEngine, DFSConfig, DFSEngine, EngineConfig, RolloutBatch
from dtarl.engines.config import EngineKind
from dtarl.engines.cost import CostModel, EngineCoef
from dtarl.engines.prefix_reuse import PrefixReuseEngine
from dtarl.model import ModelConfig, init_model
from dtarl.losses import ClippedSurrogateLoss
from dtarl.testing import grpo_groups

LOSS = ClippedSurrogateLoss.dapo()


def deep_and_shallow_groups(rs):
    # Group 0: a prompt and 4 responses. Group 1: a prompt, 2 first turns, 2
    # second turns below each (a deep group: prefix_reuse runs it with DFS).
    p0, p1 = list(rs.randint(3, 256, 6)), list(rs.randint(3, 256, 6))
    shallow = [p0 + list(rs.randint(3, 256, rs.randint(3, 9))) for _ in range(4)]
    turns = [p1 + list(rs.randint(3, 256, 5)) for _ in range(2)]
    deep = [t + list(rs.randint(3, 256, rs.randint(3, 6))) for t in turns for _ in range(2)]
    return RolloutBatch.create(
        tokens=shallow + deep, advantages=rs.randn(8), group_ids=[0] * 4 + [1] * 4
    )


def problem(kind="dfs"):
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
    model = nnx.eval_shape(lambda: init_model(cfg, seed=0))
    _, abstract = nnx.split(model, nnx.Param)
    rs = np.random.RandomState(0)
    params = jax.tree.map(
        lambda a: (rs.standard_normal(a.shape) / np.sqrt(a.shape[0])).astype(a.dtype), abstract
    )
    if kind == "prefix_reuse_deep":  # one process gets the deep group, one the shallow
        return PrefixReuseEngine(model), params, deep_and_shallow_groups(rs)
    if kind == "auto":
        auto = AutoEngine(model, engine_config=EngineConfig(dfs=DFSConfig(chunk_len=8)))
        return auto, params, deep_and_shallow_groups(rs)
    batch = grpo_groups(num_groups=4, group_size=4, prompt_len=6, response_len=(3, 9), seed=0)
    return DFSEngine(model, chunk_len=8), params, batch


def favouring(kind):
    # A cost model under which ``kind`` is by far the cheapest engine.
    return CostModel(
        coefs={
            e: EngineCoef(seconds_per_flop=1e-15 if e == kind else 1e-3, seconds_per_step=0.0)
            for e in (k.value for k in EngineKind.auto_candidates())
        }
    )


def flat(tree):
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
        for path, v in jax.tree.leaves_with_path(tree)
    }
"""

WORKER = """
import os
import sys

import jax
import numpy as np

from dtarl.parallel import make_mesh
from dtarl.parallel.sharded import ShardedEngine, to_host

exec(open(sys.argv[2]).read())
assert jax.process_count() == 2 and jax.device_count() == 4, (
    jax.process_count(), jax.device_count())
engine, params, batch = problem(sys.argv[3])
if sys.argv[3] == "auto":  # the processes' own estimates disagree: process 0's pick rules
    engine.cost_model = favouring("dense" if jax.process_index() == 0 else "dfs")
# dp spans the processes, tp within one; groups stay whole (one per process).
sharded = ShardedEngine(engine, make_mesh(2, 2), keep_groups=sys.argv[3] != "dfs")
total, grads, aux = sharded.value_and_grad(params, batch, LOSS)
total, grads = to_host((total, grads))  # one gather for both
# Each process prepared only its own dp rank (dp spans the processes).
assert len(aux.stats["rank_stats"]) == 1, aux.stats["local_ranks"]
out = dict(flat(grads), __loss__=np.asarray(total), __local__=np.asarray(aux.stats["local_ranks"]))
out.update({f"__logp{i}__": lp for i, lp in enumerate(aux.logprobs)})
out["__chosen__"] = np.asarray(aux.stats["rank_stats"][0].get("chosen_engine", ""))
np.savez(os.path.join(sys.argv[1], f"rank{jax.process_index()}.npz"), **out)
print("rank", jax.process_index(), "loss", float(out["__loss__"]))
"""

DIES = """
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

multihost_utils.process_allgather(np.ones(4))  # one collective both ranks complete
print("rank", jax.process_index(), "ran one step")
if jax.process_index() == 1:
    sys.exit(3)  # dies mid-run
# Rank 0 waits for a collective that rank 1 never enters.
multihost_utils.process_allgather(np.ones(4))
print("unreachable: the collective returned")
"""

# Rank 1's collective "notices" a lost peer before the cause, rank 0, exits. (Rank 0
# is the cause: were it the noticer, its exit would take the coordinator down and JAX
# would abort rank 1 before it could exit on its own.)
NOTICED_FIRST = """
import sys
import time

import jax

if jax.process_index() == 1:
    raise ValueError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")
time.sleep(0.5)
sys.exit(3)
"""

# Without the launcher (as under a scheduler): both processes run one sharded
# prepare (its shape agreement is a collective), then the victim is SIGKILLed and
# the survivor's next prepare must fail with PeerLostError, not hang.
MID_RUN = """
import os
import signal
import sys

from dtarl.parallel.launch import DistributedConfig, initialize

pid, port, victim = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=pid, init_timeout=30, heartbeat_timeout=5))
import jax
from flax import nnx

from dtarl.engines import DFSEngine
from dtarl.model import ModelConfig, init_model
from dtarl.parallel import make_mesh
from dtarl.parallel.sharded import PeerLostError, ShardedEngine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.testing import grpo_groups

cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
model = nnx.eval_shape(lambda: init_model(cfg, seed=0))
batch = grpo_groups(num_groups=4, group_size=4, prompt_len=6, response_len=(3, 9), seed=0)
sharded = ShardedEngine(DFSEngine(model, chunk_len=8), make_mesh(2, 1))
loss = ClippedSurrogateLoss.dapo()
prep = sharded.prepare(batch, loss)
print("process", pid, "prepared ranks", prep.local_ranks, flush=True)
if pid == victim:
    os.kill(os.getpid(), signal.SIGKILL)  # crash mid-run, no cleanup
try:
    sharded.prepare(batch, loss)
except PeerLostError as e:
    print("PeerLostError:", e, file=sys.stderr, flush=True)
    os._exit(5)
print("unreachable: prepare returned")
"""

# The watchdog's targets: plain Python, no JAX.
HANGS = """
import time

from dtarl.parallel.launch import report_progress

report_progress()
print("rank started", flush=True)
time.sleep(120)  # hangs: no progress, no output
print("unreachable: slept through the watchdog")
"""

# Makes progress (report_progress calls, or output lines) every 0.2 s for 5 s.
WORKS = """
import sys
import time

from dtarl.parallel.launch import report_progress

t0 = time.monotonic()
while time.monotonic() - t0 < 5.0:
    if sys.argv[1] == "report":
        report_progress()
    else:
        print("working", flush=True)
    time.sleep(0.2)
print("done after 5 s")
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


# The plain dfs case runs end to end in tests/rl/test_trainer_mesh.py (a 2-process
# ``dtarl train`` equals the 1-process run), so only the harder agreements run here.
@pytest.mark.parametrize("kind", ["prefix_reuse_deep", "auto"])
def test_two_processes_equal_one(tmp_path, capsys, kind):
    """prefix_reuse_deep: the process with the deep group grows the inner DFS
    engine's buckets, and the other must agree on them for one program. auto: the
    two processes' cost models favour different engines (dense on process 0, dfs
    on 1); both must run process 0's pick, and match it run on one process."""
    (tmp_path / "problem.py").write_text(PROBLEM)
    (tmp_path / "worker.py").write_text(WORKER)
    res = launch_lib.launch(
        [str(tmp_path / "worker.py"), str(tmp_path), str(tmp_path / "problem.py"), kind],
        2,
        devices_per_proc=2,
        init_timeout=60,
        timeout=240,
    )
    out = capsys.readouterr()
    assert res.returncode == 0, out.out[-3000:] + out.err[-3000:]
    assert "[rank 0] rank 0 loss" in out.out and "[rank 1] rank 1 loss" in out.out

    ns: dict = {}
    exec(PROBLEM, ns)
    engine, params, batch = ns["problem"](kind)
    if kind == "auto":
        engine = engine.engines["dense"]  # process 0's pick, run alone
    total, grads, aux = engine.value_and_grad(params, batch, ns["LOSS"])
    if kind == "prefix_reuse_deep":
        assert aux.stats["deep_sequences"] == 4  # the deep group ran through DFS
    ref = ns["flat"](jax.tree.map(np.asarray, grads))
    local = []
    for rank in (0, 1):
        got = dict(np.load(tmp_path / f"rank{rank}.npz"))
        local += got.pop("__local__").tolist()
        assert str(got.pop("__chosen__")) == ("dense" if kind == "auto" else ""), rank
        np.testing.assert_allclose(got.pop("__loss__"), float(total), rtol=1e-6)
        for i, lp in enumerate(aux.logprobs):
            np.testing.assert_allclose(got.pop(f"__logp{i}__"), lp, atol=1e-5, rtol=0)
        assert sorted(got) == sorted(ref)
        for name, g in ref.items():
            err = np.linalg.norm(got[name] - g) / max(np.linalg.norm(g), 1e-30)
            assert err <= 1e-5, (rank, name, err)
    assert sorted(local) == [0, 1]  # the two processes split the dp ranks


def test_dead_rank_fails_fast(tmp_path):
    """Rank 1 exits mid-run; the launcher stops on that exit (not on its timeout or
    watchdog) and names rank 1. No wall-time assertion: this machine is shared, so
    "fast" is structural, what ended the run; the subprocess timeout only bounds a hang."""
    (tmp_path / "dies.py").write_text(DIES)
    proc = subprocess.run(
        [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2", "--devices-per-proc", "1"]
        + ["--init-timeout", "30", "--", str(tmp_path / "dies.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 1" in proc.stderr and "exited with code 3" in proc.stderr, proc.stderr[-3000:]
    assert "; stopping ranks [" in proc.stderr, proc.stderr[-3000:]
    assert "timed out" not in proc.stderr and "watchdog" not in proc.stderr
    assert "[rank 0] rank 0 ran one step" in proc.stdout
    assert "unreachable" not in proc.stdout


def test_launcher_names_the_cause_not_the_rank_that_noticed(tmp_path):
    """A rank failing on a lost peer exits with EXIT_PEER_LOST; the launcher waits
    (cause_wait) for the rank that really failed and reports that one."""
    (tmp_path / "noticed.py").write_text(NOTICED_FIRST)
    proc = subprocess.run(
        [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2", "--devices-per-proc", "1"]
        + ["--init-timeout", "30", "--", str(tmp_path / "noticed.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 0 (pid" in proc.stderr and "exited with code 3; ranks [1] failed too" in (
        proc.stderr
    ), proc.stderr[-3000:]


def test_lost_peer_classification():
    class PeerLostError(RuntimeError):
        pass

    assert launch_lib.lost_peer(PeerLostError("x"))
    try:
        try:
            raise ValueError("UNKNOWN: Gloo AllGather failed: Connection reset by peer")
        except ValueError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as e:
        assert launch_lib.lost_peer(e)
    assert not launch_lib.lost_peer(ValueError("k=3: must be in [1, 2]"))
    assert not launch_lib.lost_peer(KeyboardInterrupt())


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-dies", "coordinator-dies"])
def test_mid_run_death_raises_peer_lost(tmp_path, victim):
    """No launcher: a process killed after a completed sharded prepare makes the other one
    fail within seconds: PeerLostError (naming itself) on its next collective, or JAX's
    own abort when the coordinator died and its service noticed first. "Within seconds"
    is not timed (a shared machine): the survivor's exit code and message say what
    stopped it, and the communicate timeout only bounds a hang."""
    (tmp_path / "mid_run.py").write_text(MID_RUN)
    port = str(launch_lib.free_port())
    env = dict(_env(), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = launch_lib._xla_flags(env.get("XLA_FLAGS", ""), 1)
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "mid_run.py"), str(pid), port, str(victim)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for pid in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    survivor = 1 - victim
    out, err = outs[survivor]
    assert procs[victim].returncode == -9  # SIGKILL
    for pid in (0, 1):
        assert f"process {pid} prepared ranks ({pid},)" in outs[pid][0], outs[pid][1][-3000:]
    assert "unreachable" not in out
    peer_lost = f"PeerLostError: process {survivor} of 2: agreeing on the per-rank shapes"
    if victim == 1:  # the coordinator lives on: the broken collective is what the survivor sees
        assert procs[survivor].returncode == 5 and peer_lost in err, err[-3000:]
    else:
        # The coordinator's death can also reach the survivor first through JAX's
        # coordination service, which then aborts it with its own message.
        jax_abort = "Terminating process because the JAX distributed service detected fatal"
        assert (procs[survivor].returncode == 5 and peer_lost in err) or (
            procs[survivor].returncode == -6 and jax_abort in err
        ), err[-3000:]


def test_never_joined_peer_aborts_within_init_timeout():
    """Without the launcher, JAX's init timeout bounds the wait for a peer that never
    starts: DEADLINE_EXCEEDED names it (not timed: the subprocess timeout bounds a hang)."""
    code = (
        "from dtarl.parallel.launch import DistributedConfig, free_port, initialize\n"
        "initialize(DistributedConfig(coordinator_address=f'127.0.0.1:{free_port()}',"
        " num_processes=2, process_id=0, init_timeout=2))\n"
        "print('joined')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert proc.returncode != 0 and "joined" not in proc.stdout
    assert "process 0 of 2 joining the coordinator" in proc.stderr
    assert "DEADLINE_EXCEEDED" in proc.stderr


# ------------------------------------------------------------------------ config / argv


def test_config_from_env():
    cfg = DistributedConfig.from_env(
        {
            "DTARL_COORDINATOR_ADDRESS": "10.0.0.1:1234",
            "DTARL_NUM_PROCESSES": "4",
            "DTARL_PROCESS_ID": "3",
            "DTARL_LOCAL_DEVICE_IDS": "0,1",
            "DTARL_INIT_TIMEOUT": "5",
        }
    )
    assert cfg.coordinator_address == "10.0.0.1:1234"
    assert (cfg.num_processes, cfg.process_id, cfg.local_device_ids) == (4, 3, (0, 1))
    assert cfg.init_timeout == 5 and cfg.configured
    assert not DistributedConfig.from_env({}).configured
    assert launch_lib.initialize(DistributedConfig()) is None  # nothing configured: no-op
    with pytest.raises(DistributedInitError, match="DTARL_NUM_PROCESSES='x'"):
        DistributedConfig.from_env({"DTARL_NUM_PROCESSES": "x"})
    with pytest.raises(DistributedInitError, match=r"process_id=2: must be in \[0, 1\]"):
        DistributedConfig(num_processes=2, process_id=2)
    with pytest.raises(DistributedInitError, match="host:port"):
        DistributedConfig(coordinator_address="localhost")


def test_rank_env_sets_devices_and_coordinator():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo=1"}
    env = launch_lib.rank_env(1, 2, "127.0.0.1:5", devices_per_proc=2, base=base)
    assert env["DTARL_PROCESS_ID"] == "1" and env["DTARL_NUM_PROCESSES"] == "2"
    assert env["XLA_FLAGS"].split() == ["--foo=1", "--xla_force_host_platform_device_count=2"]
    gpu = launch_lib.rank_env(1, 2, "h:5", devices_per_proc=4, platform="gpu", base={})
    assert gpu["DTARL_LOCAL_DEVICE_IDS"] == "4,5,6,7"


def test_launch_bad_arguments():
    with pytest.raises(LaunchError, match="nproc=0"):
        launch_lib.launch(["x.py"], 0)
    with pytest.raises(LaunchError, match="no target"):
        launch_lib.launch([], 2)
    with pytest.raises(LaunchError, match="devices_per_proc=0"):
        launch_lib.launch(["x.py"], 2, devices_per_proc=0)


def test_register_adds_launch_subcommand():
    import argparse

    from dtarl.commands import launch as launch_cmd

    parser = argparse.ArgumentParser(prog="dtarl")
    launch_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["launch", "--nproc", "2", "--", "-m", "pkg.mod", "--flag"])
    assert args.nproc == 2 and args.target[-3:] == ["-m", "pkg.mod", "--flag"]
    assert callable(args.func)
    assert args.watchdog == launch_lib.DEFAULT_WATCHDOG and args.output_progress
    args = parser.parse_args(["launch", "--nproc", "2", "--watchdog", "0", "--no-output-progress"])
    assert args.watchdog == 0 and not args.output_progress


# ------------------------------------------------------------------------ watchdog


def test_watchdog_stops_a_run_without_progress(tmp_path):
    """Both ranks start, report once and hang: the launcher stops them after the
    watchdog's 8 s (not the targets' 120 s), exits EXIT_WATCHDOG and names every rank
    with how long ago it last made progress."""
    (tmp_path / "hangs.py").write_text(HANGS)
    proc = subprocess.run(
        [sys.executable, "-m", "dtarl.parallel.launch", "--nproc", "2", "--devices-per-proc", "1"]
        + ["--init-timeout", "30", "--watchdog", "8", "--timeout", "100"]
        + ["--", str(tmp_path / "hangs.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    # EXIT_WATCHDOG, not --timeout's 124: the watchdog stopped the 120 s sleepers.
    assert proc.returncode == launch_lib.EXIT_WATCHDOG, proc.stderr[-3000:]
    assert "[rank 0] rank started" in proc.stdout and "[rank 1] rank started" in proc.stdout
    assert "unreachable" not in proc.stdout
    assert "dtarl launch: watchdog: no rank made progress for 8 s" in proc.stderr
    ages = dict(re.findall(r"rank (\d) last progressed ([\d.]+) s ago", proc.stderr))
    assert sorted(ages) == ["0", "1"], proc.stderr[-3000:]
    assert all(float(a) >= 8 for a in ages.values()), ages
    assert "stopping ranks [0, 1]" in proc.stderr


@pytest.mark.parametrize(
    "how,output_progress,code",
    [("report", False, 0), ("print", True, 0), ("print", False, launch_lib.EXIT_WATCHDOG)],
    ids=["report_progress", "output-lines", "output-not-counted"],
)
def test_watchdog_spares_a_run_that_progresses(tmp_path, how, output_progress, code):
    """A rank making progress every 0.2 s for 5 s outlives a 3 s watchdog. Output lines
    count unless output_progress=False; then a rank that only prints is stopped."""
    (tmp_path / "works.py").write_text(WORKS)
    out, err = io.StringIO(), io.StringIO()
    res = launch_lib.launch(
        [str(tmp_path / "works.py"), how],
        1,
        watchdog=3.0,
        output_progress=output_progress,
        timeout=60,
        stdout=out,
        stderr=err,
    )
    assert res.returncode == code, err.getvalue()[-3000:]
    if code == 0:
        assert "[rank 0] done after 5 s" in out.getvalue()
    else:
        assert "done after 5 s" not in out.getvalue()
        assert "no rank made progress for 3 s" in res.message
        assert "or a line of output" not in res.message
        assert re.search(r"rank 0 last progressed [\d.]+ s ago", res.message), res.message


def test_report_progress_touches_the_rank_file(tmp_path, monkeypatch):
    monkeypatch.delenv(launch_lib.ENV_PROGRESS_FILE, raising=False)
    launch_lib.report_progress()  # not under the launcher: a no-op
    fp = tmp_path / "rank0.progress"
    monkeypatch.setenv(launch_lib.ENV_PROGRESS_FILE, str(fp))
    launch_lib.report_progress()
    assert fp.exists()
    os.utime(fp, (0, 0))
    launch_lib.report_progress()
    assert fp.stat().st_mtime > 0
    env = launch_lib.rank_env(0, 2, "h:5", progress_file="/x/p", base={"DTARL_PROGRESS_FILE": "y"})
    assert env["DTARL_PROGRESS_FILE"] == "/x/p"
    assert "DTARL_PROGRESS_FILE" not in launch_lib.rank_env(0, 2, "h:5", base={"a": "b"})
    with pytest.raises(LaunchError, match="watchdog=-1"):
        launch_lib.launch(["x.py"], 1, watchdog=-1)
