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
builds its mesh (``dtarl.parallel.make_mesh``) and runs.

On a cluster, run the same target under the scheduler with these variables
set per process (or the ``initialize()`` arguments); unset ones fall back to
JAX's own detection (Slurm, Open MPI, TPU pods, ``JAX_COORDINATOR_ADDRESS``):

    DTARL_COORDINATOR_ADDRESS  host:port of process 0 (it serves the coordinator)
    DTARL_NUM_PROCESSES        number of processes
    DTARL_PROCESS_ID           this process, 0 .. num_processes - 1
    DTARL_LOCAL_DEVICE_IDS     optional, comma-separated local accelerator ids
    DTARL_INIT_TIMEOUT         seconds to wait for every process to join (60)
    DTARL_HEARTBEAT_TIMEOUT    seconds without a heartbeat before a process is
                               declared dead and the others abort (30)
    DTARL_SHUTDOWN_TIMEOUT     seconds the exit barrier waits (30)
    DTARL_CPU_COLLECTIVES      CPU collectives implementation (gloo)
    DTARL_PROGRESS_FILE        set by the launcher: the file ``report_progress``
                               touches (unset elsewhere: a no-op)

A run that fails after ``initialize`` leaves through ``os._exit`` so that it
never waits in JAX's shutdown barrier for peers that will not arrive.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

ENV_COORDINATOR = "DTARL_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "DTARL_NUM_PROCESSES"
ENV_PROCESS_ID = "DTARL_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "DTARL_LOCAL_DEVICE_IDS"
ENV_INIT_TIMEOUT = "DTARL_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "DTARL_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "DTARL_SHUTDOWN_TIMEOUT"
ENV_CPU_COLLECTIVES = "DTARL_CPU_COLLECTIVES"
ENV_PROGRESS_FILE = "DTARL_PROGRESS_FILE"

# The whole-run watchdog: seconds without progress from any rank before the launcher
# stops the run (see the module docstring), and the exit code it then returns.
DEFAULT_WATCHDOG = 1800.0
EXIT_WATCHDOG = 125

# A launched rank that fails because it lost a peer (a collective broke when another
# process died) exits with this code, so the launcher can name the rank that died
# first rather than the one whose collective noticed it (EX_TEMPFAIL).
EXIT_PEER_LOST = 75
# How a lost peer shows up in the collectives' errors: gloo on CPU raises ValueError,
# NCCL and JAX's coordination service XlaRuntimeError.
PEER_LOST_PATTERN = re.compile(
    r"gloo|nccl|connection|unavailable|deadline_exceeded|heartbeat|peer|socket|broken pipe",
    re.IGNORECASE,
)

__all__ = [
    "DistributedConfig",
    "DistributedInitError",
    "LaunchError",
    "LaunchResult",
    "initialize",
    "launch",
    "report_progress",
    "add_arguments",
    "main",
    "run",
]


class DistributedInitError(RuntimeError):
    """This process could not join the others (coordinator unreachable, timeout)."""


class LaunchError(ValueError):
    """Bad launcher arguments."""


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedInitError(f"{name}={raw!r}: expected an integer") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Arguments of ``jax.distributed.initialize`` (None = let JAX detect them)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    init_timeout: int = 60
    heartbeat_timeout: int = 30
    shutdown_timeout: int = 30
    cpu_collectives: str = "gloo"

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise DistributedInitError(f"num_processes={self.num_processes}: must be >= 1")
        if self.process_id is not None and self.num_processes is not None:
            if not 0 <= self.process_id < self.num_processes:
                raise DistributedInitError(
                    f"process_id={self.process_id}: must be in [0, {self.num_processes - 1}]"
                )
        for name in ("init_timeout", "heartbeat_timeout", "shutdown_timeout"):
            if getattr(self, name) < 1:
                raise DistributedInitError(f"{name}={getattr(self, name)}: must be >= 1 second")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise DistributedInitError(
                f"coordinator_address={self.coordinator_address!r}: expected host:port"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistributedConfig:
        """Reads the ``DTARL_*`` variables (see the module docstring)."""
        env = os.environ if env is None else env
        ids = env.get(ENV_LOCAL_DEVICE_IDS)
        kw = {}
        for field, name in (
            ("init_timeout", ENV_INIT_TIMEOUT),
            ("heartbeat_timeout", ENV_HEARTBEAT_TIMEOUT),
            ("shutdown_timeout", ENV_SHUTDOWN_TIMEOUT),
        ):
            v = _int_env(env, name)
            if v is not None:
                kw[field] = v
        if env.get(ENV_CPU_COLLECTIVES):
            kw["cpu_collectives"] = env[ENV_CPU_COLLECTIVES]
        return cls(
            coordinator_address=env.get(ENV_COORDINATOR) or None,
            num_processes=_int_env(env, ENV_NUM_PROCESSES),
            process_id=_int_env(env, ENV_PROCESS_ID),
            local_device_ids=tuple(int(x) for x in ids.split(",")) if ids else None,
            **kw,
        )

    @property
    def configured(self) -> bool:
        return self.num_processes is not None or self.coordinator_address is not None


def initialize(config: DistributedConfig | None = None, **overrides) -> DistributedConfig | None:
    """Joins the multi-process JAX runtime (``jax.distributed.initialize``).

    ``config`` defaults to ``DistributedConfig.from_env()``; keyword overrides
    replace its fields. Returns None (single process, nothing done) when neither
    a process count nor a coordinator is configured. Idempotent. Must run before
    any JAX computation. CPU collectives are set to gloo so that CPU devices of
    different processes can all-reduce.

    When the processes do not all join within ``init_timeout`` seconds JAX
    aborts this process (SIGABRT, exit 134, "DEADLINE_EXCEEDED ... RegisterTask");
    once running, a peer silent for ``heartbeat_timeout`` seconds aborts the
    others the same way. Errors JAX raises as exceptions (bad address, ...)
    become ``DistributedInitError`` naming this process and the coordinator.
    """
    cfg = DistributedConfig.from_env() if config is None else config
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    if "jax" not in sys.modules and (not cfg.configured or cfg.num_processes == 1):
        # Nothing to join and JAX not loaded (so not initialized either): a launched
        # single-process target does not pay for importing JAX here.
        return cfg if cfg.configured else None
    import jax

    if jax.distributed.is_initialized():
        return cfg
    if not cfg.configured:
        return None
    if cfg.num_processes == 1:
        return cfg
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    who = f"process {cfg.process_id} of {cfg.num_processes}"
    # JAX aborts the process (SIGABRT, "DEADLINE_EXCEEDED ... RegisterTask") when the
    # others do not join in time; say beforehand what that would mean.
    print(
        f"dtarl: {who} joining the coordinator at {cfg.coordinator_address} (waits at most "
        f"{cfg.init_timeout} s; an abort with DEADLINE_EXCEEDED means a process died or never "
        "started)",
        file=sys.stderr,
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids else None,
            initialization_timeout=cfg.init_timeout,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout,
            shutdown_timeout_seconds=cfg.shutdown_timeout,
        )
    except Exception as e:  # XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
        raise DistributedInitError(
            f"{who}: could not join the coordinator at {cfg.coordinator_address} within "
            f"{cfg.init_timeout} s (a process died, never started, or the address is "
            f"unreachable; set {ENV_INIT_TIMEOUT} to wait longer): {type(e).__name__}: {e}"
        ) from e
    return cfg


def report_progress() -> None:
    """Tells ``dtarl launch``'s watchdog that this rank made progress (e.g. finished a
    step): touches the rank's ``DTARL_PROGRESS_FILE``. One ``utime`` call; a no-op
    when the variable is unset (not under the launcher). A failed touch (the
    launcher's directory gone) is ignored: the watchdog then sees no progress and
    fails the run loudly, which is where such a fault belongs."""
    path = os.environ.get(ENV_PROGRESS_FILE)
    if not path:
        return
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            with open(path, "a"):
                pass
        except OSError:
            pass
    except OSError:
        pass


# --------------------------------------------------------------------------- worker


def _run_target(target: Sequence[str]) -> None:
    """Runs TARGET (module, script or dtarl command) as ``__main__`` in this process."""
    if not target:
        raise LaunchError("no target: give `-- -m module ...`, `-- script.py ...` or dtarl args")
    head, rest = target[0], list(target[1:])
    if head == "-m":
        if not rest:
            raise LaunchError("`-m` needs a module name")
        sys.argv = [rest[0], *rest[1:]]
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif head.endswith(".py"):
        if not os.path.isfile(head):
            raise LaunchError(f"script {head!r} does not exist")
        sys.argv = [head, *rest]
        runpy.run_path(head, run_name="__main__")
    elif "." in head and "/" not in head and _find_module(head):
        sys.argv = [head, *rest]
        runpy.run_module(head, run_name="__main__", alter_sys=True)
    else:
        entry = _console_script("dtarl")
        if entry is None:
            raise LaunchError(
                f"target {head!r} is not a module or script, and the `dtarl` command "
                "is not installed to run it as a dtarl command"
            )
        sys.argv = ["dtarl", *target]
        code = entry(list(target))
        if code:
            raise SystemExit(code)


def _console_script(name: str):
    """The function behind the installed console script ``name``, or None.

    Resolved through the package metadata, so the launcher (a library module) never
    imports the CLI that drives it.
    """
    for ep in importlib.metadata.entry_points(group="console_scripts", name=name):
        return ep.load()
    return None


def _find_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def lost_peer(exc: BaseException) -> bool:
    """True when ``exc`` (or its cause chain) is a collective that broke on a lost peer."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ == "PeerLostError" or (
            isinstance(exc, Exception) and PEER_LOST_PATTERN.search(f"{type(exc).__name__} {exc}")
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _worker(target: Sequence[str]) -> None:
    """Entry of each launched process: join the runtime, run the target, exit hard on failure.

    Exit codes: the target's own, 1 for an uncaught error, ``EXIT_PEER_LOST`` for an
    error that means another process died (see ``lost_peer``).
    """
    code = 0
    try:
        initialize()
        report_progress()  # joined the others
        _run_target(target)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        traceback.print_exc()
        code = EXIT_PEER_LOST if lost_peer(e) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # Skip JAX's atexit shutdown barrier: the peers may never reach it.
        os._exit(code)
    sys.exit(0)


# --------------------------------------------------------------------------- launcher


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
    if not target:
        raise LaunchError("no target: give `-- -m module ...`, `-- script.py ...` or dtarl args")
    if watchdog is not None and not watchdog >= 0:
        raise LaunchError(f"watchdog={watchdog!r}: must be >= 0 seconds (0 disables it)")
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    coordinator = f"{host}:{port or free_port(host)}"
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
                r,
                nproc,
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
        _worker(rest)
        return 0
    p = argparse.ArgumentParser(prog="python -m dtarl.parallel.launch")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
