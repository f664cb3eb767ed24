"""Multi-process runs through JAX's own multi-controller runtime.

Locally (P processes on this machine, e.g. fake CPU devices)::

    python -m dtarl.parallel.launch --nproc P [--devices-per-proc D] -- TARGET [ARGS...]
    dtarl launch --nproc P [--devices-per-proc D] -- TARGET [ARGS...]

TARGET is ``-m package.module`` or a dotted module name (run as ``__main__``),
a ``path/to/script.py``, or anything else: arguments of the ``dtarl`` command
(``-- bench partition --synthetic``). The launcher picks a free localhost port,
starts P copies of ``python -m dtarl.parallel.launch --worker -- TARGET ...``
with the environment below, prefixes their output with ``[rank r]``, and
fails fast: as soon as one rank exits non-zero it reports that rank, stops the
others (SIGTERM, then SIGKILL; after at most 2 s in which they may exit on their
own and log why, e.g. ``PeerLostError``) and returns its exit code. A rank whose
collective broke because another rank died (a lost peer, see ``lost_peer``)
exits with ``EXIT_PEER_LOST`` (75); the launcher then waits a moment for the
rank that died and names that one. A rank that never joins is caught the same
way (its siblings block in ``initialize`` until the launcher stops them, or
until ``--init-timeout``, whichever is first). Without the launcher (under a
scheduler) JAX's own bounds apply: ``initialize`` aborts a process whose peers
do not all join within the init timeout; once running, a collective with a dead
peer fails at once (gloo; dtarl's sharded engine raises ``PeerLostError``), and
a process whose peer stops heart-beating is aborted by JAX after the heartbeat
timeout (sooner when the coordinator, process 0, is the one that died).

A whole-run watchdog (``--watchdog SECONDS``, default ``DEFAULT_WATCHDOG`` = 1800;
0 disables it) stops every rank and fails the run (exit ``EXIT_WATCHDOG``, 125)
when no running rank has made progress for that long, naming each rank and how
long ago it last progressed. Progress is a real signal, not "the process is
alive": each rank gets its own file in ``DTARL_PROGRESS_FILE`` and
``report_progress()`` (a no-op outside the launcher) touches it; the trainer
calls it once per step and the worker once after joining. A line a rank
writes to stdout or stderr counts as progress too (targets that know nothing of
``report_progress``, e.g. ``dtarl bench``, would otherwise be killed while they
work and log; a rank stuck in a collective or a loop writes nothing);
``--no-output-progress`` makes only ``report_progress`` count. The default, 30
minutes, outlasts the slowest first step we expect (loading and compiling a
large model, auto's engine tuning, the evaluation before training) while
freeing a hung job's machines long before a cluster's wall-clock limit.

Each worker calls ``initialize()`` (below) before importing the target, so the
target's ``jax.devices()`` already lists every process's devices and it just
The coordinator listens on 127.0.0.1 unless ``--coordinator-address HOST:PORT``
names another address (it then listens there only; see
``dtarl.parallel.distributed``). A run over several hosts starts ``dtarl launch``
on each with the same ``--coordinator-address`` (host 0's), ``--nnodes N`` and its
own ``--node-rank``; its ranks are ``node_rank * nproc + i``. ``--nproc`` is at
most the local accelerator count (``--devices-per-proc`` each), or the CPU core
count on a CPU run, unless ``--allow-oversubscribe``; the target is checked
before any process starts.

Joining (``initialize``, the ``DTARL_*`` variables a scheduler sets instead) lives
in ``dtarl.parallel.distributed`` and is re-exported here. A run that fails after
``initialize`` leaves through ``os._exit`` so that it never waits in JAX's
shutdown barrier for peers that will not arrive; a rank that lost a peer says so
in one line (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from dtarl.parallel.distributed import (  # re-exported: this module's public names
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_CPU_COLLECTIVES,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_PROGRESS_FILE,
    ENV_SHUTDOWN_TIMEOUT,
    EXIT_PEER_LOST,
    PEER_LOST_PATTERN,
    DistributedConfig,
    DistributedInitError,
    check_address,
    initialize,
    lost_peer,
    report_progress,
)
from dtarl.parallel.targets import (
    LaunchError,
    check_capacity,
    check_target,
    local_capacity,
    worker_main,
)

# The whole-run watchdog: seconds without progress from any rank before the launcher
# stops the run (see the module docstring), and the exit code it then returns.
DEFAULT_WATCHDOG = 1800.0
EXIT_WATCHDOG = 125

__all__ = [
    "DistributedConfig",
    "DistributedInitError",
    "ENV_COORDINATOR",
    "ENV_COORDINATOR_BIND",
    "ENV_CPU_COLLECTIVES",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_INIT_TIMEOUT",
    "ENV_LOCAL_DEVICE_IDS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_PROGRESS_FILE",
    "ENV_SHUTDOWN_TIMEOUT",
    "EXIT_PEER_LOST",
    "PEER_LOST_PATTERN",
    "LaunchError",
    "LaunchResult",
    "check_target",
    "local_capacity",
    "initialize",
    "launch",
    "lost_peer",
    "report_progress",
    "add_arguments",
    "main",
    "run",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchResult:
    """Outcome of ``launch``: exit code, the first failing rank (or None), wall seconds."""

    returncode: int
    failed_rank: int | None
    returncodes: tuple[int | None, ...]
    seconds: float
    message: str


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def _xla_flags(existing: str, devices: int) -> str:
    flags = _DEVICE_COUNT_FLAG.sub("", existing).split()
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def rank_env(
    rank: int,
    nproc: int,
    coordinator: str,
    *,
    devices_per_proc: int | None = None,
    platform: str = "cpu",
    init_timeout: int = 60,
    heartbeat_timeout: int = 30,
    progress_file: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of launched rank ``rank`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(nproc),
            ENV_PROCESS_ID: str(rank),
            ENV_INIT_TIMEOUT: str(init_timeout),
            ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop(ENV_LOCAL_DEVICE_IDS, None)
    env.pop(ENV_PROGRESS_FILE, None)  # a launch inside a launched rank gets its own
    if progress_file is not None:
        env[ENV_PROGRESS_FILE] = progress_file
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        if devices_per_proc is not None:
            env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS", ""), devices_per_proc)
    elif devices_per_proc is not None:
        ids = range(rank * devices_per_proc, (rank + 1) * devices_per_proc)
        env[ENV_LOCAL_DEVICE_IDS] = ",".join(map(str, ids))
    return env


def _pump(stream, rank: int, out, on_line: Callable[[int], None] | None = None) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[rank {rank}] {line.decode(errors='replace')}")
        out.flush()
        if on_line is not None:
            on_line(rank)
    stream.close()


class _Progress:
    """When each rank last made progress (monotonic seconds): its progress file's
    mtime changed (``report_progress``) or, with ``output``, it wrote a line."""

    def __init__(self, directory: str, nproc: int, *, output: bool):
        self.files = [os.path.join(directory, f"rank{r}.progress") for r in range(nproc)]
        for fp in self.files:
            open(fp, "w").close()
        self.mtimes = [os.stat(fp).st_mtime_ns for fp in self.files]
        now = time.monotonic()
        self.start = now
        self.last = [now] * nproc
        self.progressed = [False] * nproc
        self.output = output

    def line(self, rank: int) -> None:
        if self.output:
            self.last[rank] = time.monotonic()
            self.progressed[rank] = True

    def poll(self) -> None:
        now = time.monotonic()
        for r, fp in enumerate(self.files):
            try:
                m = os.stat(fp).st_mtime_ns
            except OSError:  # the rank removed it: that is not progress
                continue
            if m != self.mtimes[r]:
                self.mtimes[r], self.last[r], self.progressed[r] = m, now, True

    def stalled(self, ranks: Sequence[int], limit: float) -> bool:
        now = time.monotonic()
        return bool(ranks) and all(now - self.last[r] > limit for r in ranks)

    def describe(self, ranks: Sequence[int]) -> str:
        now = time.monotonic()
        return "; ".join(
            f"rank {r} last progressed {now - self.last[r]:.1f} s ago"
            if self.progressed[r]
            else f"rank {r} made no progress since it started {now - self.start:.1f} s ago"
            for r in ranks
        )


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(
    target: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    platform: str = "cpu",
    host: str = "127.0.0.1",
    port: int | None = None,
    init_timeout: int = 60,
    heartbeat_timeout: int = 30,
    timeout: float | None = None,
    watchdog: float | None = DEFAULT_WATCHDOG,
    output_progress: bool = True,
    coordinator_address: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    allow_oversubscribe: bool = False,
    grace: float = 5.0,
    cause_wait: float = 2.0,
    stdout=None,
    stderr=None,
) -> LaunchResult:
    """Starts ``nproc`` local processes running ``target`` under ``jax.distributed``.

    Fails fast: the first rank to exit non-zero is reported and the others are
    stopped (after ``grace`` seconds SIGKILL). A rank that exits with
    ``EXIT_PEER_LOST`` only lost a peer; the launcher waits up to ``cause_wait``
    seconds for the rank that died to be reported instead (and, once a rank has
    failed, up to as long for the others to exit on their own, so that a survivor's
    ``PeerLostError`` reaches its log before the launcher stops it). ``timeout`` (seconds,
    None = none) bounds the whole run (exit 124). ``watchdog`` (seconds; 0 or None
    disables it) stops the run (exit ``EXIT_WATCHDOG``) when none of the running
    ranks made progress for that long: a ``report_progress()`` call or, with
    ``output_progress``, a line of output.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"nproc={nproc!r}: must be an int >= 1")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise LaunchError(f"devices_per_proc={devices_per_proc}: must be >= 1")
    if platform not in ("cpu", "gpu", "tpu"):
        raise LaunchError(f"platform={platform!r}: expected cpu, gpu or tpu")
    if watchdog is not None and not watchdog >= 0:
        raise LaunchError(f"watchdog={watchdog!r}: must be >= 0 seconds (0 disables it)")
    for name, v, lo in (("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise LaunchError(f"{name}={v!r}: must be an int >= {lo}")
    if node_rank >= nnodes:
        raise LaunchError(f"node_rank={node_rank}: must be in [0, {nnodes - 1}] (nnodes={nnodes})")
    if nnodes > 1 and coordinator_address is None:
        raise LaunchError(
            f"nnodes={nnodes}: a multi-host run needs --coordinator-address HOST:PORT (host "
            "0's address on the network the hosts share; the coordinator listens there only)"
        )
    if coordinator_address is not None:
        check_address(coordinator_address, "--coordinator-address", error=LaunchError)
    if not allow_oversubscribe:
        check_capacity(platform, nproc, devices_per_proc)
    check_target(target)
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    coordinator = coordinator_address or f"{host}:{port or free_port(host)}"
    cmd = [sys.executable, "-m", "dtarl.parallel.launch", "--worker", "--", *target]
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    exits: list[tuple[float, int, int]] = []  # (when, rank, code), in the order they exit
    lock = threading.Lock()
    progress_dir = tempfile.mkdtemp(prefix="dtarl-launch-")
    progress = _Progress(progress_dir, nproc, output=output_progress)
    last_poll = 0.0

    def waiter(p: subprocess.Popen, rank: int) -> None:
        code = p.wait()
        with lock:
            exits.append((time.monotonic(), rank, code))

    try:
        for r in range(nproc):
            env = rank_env(
                node_rank * nproc + r,
                nnodes * nproc,
                coordinator,
                devices_per_proc=devices_per_proc,
                platform=platform,
                init_timeout=init_timeout,
                heartbeat_timeout=heartbeat_timeout,
                progress_file=progress.files[r],
            )
            p = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: stop it with its children
            )
            procs.append(p)
            for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
                th = threading.Thread(
                    target=_pump, args=(stream, r, out, progress.line), daemon=True
                )
                th.start()
                pumps.append(th)
            threading.Thread(target=waiter, args=(p, r), daemon=True).start()
        failed, msg, code = None, "", 0
        first_bad = None
        while True:
            with lock:
                done = sorted(exits)
            # The cause is the first rank to exit non-zero other than with
            # EXIT_PEER_LOST (a collective broken by another rank's death); such a
            # rank is waited for up to cause_wait seconds before a peer-lost one is
            # reported instead. Once a rank failed, the others get those seconds to
            # exit on their own too: a survivor whose collective broke names what it
            # lost (PeerLostError) in its log before it is stopped.
            bad = [(r, c) for _, r, c in done if c != 0]
            if bad and first_bad is None:
                first_bad = time.monotonic()
            causes = [(r, c) for r, c in bad if c != EXIT_PEER_LOST]
            waited = bool(bad) and (len(done) == nproc or time.monotonic() - first_bad > cause_wait)
            if waited:
                bad = causes + [(r, c) for r, c in bad if c == EXIT_PEER_LOST]
                failed, c = bad[0]
                code = c if c > 0 else 128 - c  # killed by signal -c
                ended = {r for _, r, _ in done}
                running = [r for r in range(nproc) if r not in ended]
                later = [r for r, _ in bad[1:]]
                msg = (
                    f"dtarl launch: rank {failed} (pid {procs[failed].pid}) exited with code {c}"
                    + (" (it lost a peer)" if c == EXIT_PEER_LOST else "")
                    + (f"; ranks {later} failed too" if later else "")
                    + f"; stopping ranks {running}"
                )
                break
            if len(done) == nproc and not bad:
                msg = f"dtarl launch: all {nproc} ranks finished"
                break
            if watchdog and time.monotonic() - last_poll > min(0.25, watchdog / 4):
                last_poll = time.monotonic()
                progress.poll()
                ended = {r for _, r, _ in done}
                running = [r for r in range(nproc) if r not in ended]
                if progress.stalled(running, watchdog):
                    failed, code = running[0], EXIT_WATCHDOG
                    msg = (
                        f"dtarl launch: watchdog: no rank made progress for {watchdog:g} s "
                        f"(--watchdog {watchdog:g}; progress = report_progress()"
                        + (" or a line of output" if output_progress else "")
                        + f"): {progress.describe(running)}; stopping ranks {running}"
                    )
                    break
            if timeout is not None and time.monotonic() - t0 > timeout:
                ended = {r for _, r, _ in done}
                running = [r for r in range(nproc) if r not in ended]
                failed, code = (running[0] if running else None), 124
                msg = f"dtarl launch: timed out after {timeout:.0f} s; ranks {running} running"
                break
            time.sleep(0.05)
    except BaseException:
        _stop(procs, grace)
        shutil.rmtree(progress_dir, ignore_errors=True)
        raise
    _stop(procs, grace)
    shutil.rmtree(progress_dir, ignore_errors=True)
    for th in pumps:
        th.join(timeout=2.0)
    if code:
        print(msg, file=stderr, flush=True)
    return LaunchResult(
        returncode=code,
        failed_rank=failed,
        returncodes=tuple(p.returncode for p in procs),
        seconds=time.monotonic() - t0,
        message=msg,
    )


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, required=True, help="number of processes to start")
    p.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="CPU: fake devices per process; GPU/TPU: local device ids per process",
    )
    p.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="where the coordinator (rank 0) listens and the ranks reach it (default: "
        "127.0.0.1 and a free port); required with --nnodes > 1",
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts of a multi-host run (1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host, 0 .. nnodes - 1")
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="start more processes than local accelerators (or CPU cores on a CPU run)",
    )
    p.add_argument(
        "--init-timeout", type=int, default=60, help="seconds for every rank to join (60)"
    )
    p.add_argument(
        "--heartbeat-timeout", type=int, default=30, help="seconds before a silent rank is dead"
    )
    p.add_argument("--timeout", type=float, default=None, help="bound on the whole run (s)")
    p.add_argument(
        "--watchdog",
        type=float,
        default=DEFAULT_WATCHDOG,
        metavar="SECONDS",
        help="fail the run when no rank makes progress for this long "
        f"(default {DEFAULT_WATCHDOG:g}; 0 disables it)",
    )
    p.add_argument(
        "--output-progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count a rank's output lines as progress for the watchdog (default: yes; "
        "with --no-output-progress only report_progress() counts)",
    )
    p.add_argument("target", nargs=argparse.REMAINDER, help="-- TARGET [ARGS...]")


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through launch(), which stops the ranks


def run(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    try:
        res = launch(
            target,
            args.nproc,
            devices_per_proc=args.devices_per_proc,
            platform=args.platform,
            port=args.port,
            init_timeout=args.init_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            timeout=args.timeout,
            watchdog=args.watchdog,
            output_progress=args.output_progress,
            coordinator_address=args.coordinator_address,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            allow_oversubscribe=args.allow_oversubscribe,
        )
    except LaunchError as e:
        print(f"dtarl launch: {e}", file=sys.stderr)
        return 2
    return res.returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        rest = argv[1:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        worker_main(rest)
        return 0
    p = argparse.ArgumentParser(prog="python -m dtarl.parallel.launch")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
