"""Joining JAX's multi-controller runtime: ``initialize`` and its settings.

Every process of a run (started by ``dtarl launch`` or by a scheduler) calls
``initialize()`` before any JAX computation. Its arguments come from these
variables (or the ``DistributedConfig`` fields); unset ones fall back to JAX's
own detection (Slurm, Open MPI, TPU pods, ``JAX_COORDINATOR_ADDRESS``):

    DTARL_COORDINATOR_ADDRESS  host:port of process 0 (it serves the coordinator)
    DTARL_COORDINATOR_BIND     host:port the coordinator listens on (default: the
                               coordinator address itself, never every interface)
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

The coordinator (process 0) is an unauthenticated gRPC service, so it listens
only on the address it is reached at (``jax.distributed.initialize``'s
``coordinator_bind_address``; JAX's own default is ``[::]:port``, every
interface): 127.0.0.1 for a single-host run, the explicit ``HOST:PORT`` of a
multi-host one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping

ENV_COORDINATOR = "DTARL_COORDINATOR_ADDRESS"
ENV_COORDINATOR_BIND = "DTARL_COORDINATOR_BIND"
ENV_NUM_PROCESSES = "DTARL_NUM_PROCESSES"
ENV_PROCESS_ID = "DTARL_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "DTARL_LOCAL_DEVICE_IDS"
ENV_INIT_TIMEOUT = "DTARL_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "DTARL_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "DTARL_SHUTDOWN_TIMEOUT"
ENV_CPU_COLLECTIVES = "DTARL_CPU_COLLECTIVES"
ENV_PROGRESS_FILE = "DTARL_PROGRESS_FILE"

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


class DistributedInitError(RuntimeError):
    """This process could not join the others (coordinator unreachable, timeout)."""


def check_address(addr: str, name: str, *, error: type[Exception] = ValueError) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) split into (host, port); ``error`` names ``name``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise error(f"{name}={addr!r}: expected host:port with a port in [1, 65535]")
    return host.strip("[]"), int(port)


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
    bind_address: str | None = None  # where process 0 listens; None: coordinator_address
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
        for name in ("coordinator_address", "bind_address"):
            addr = getattr(self, name)
            if addr is not None:
                check_address(addr, name, error=DistributedInitError)

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
            bind_address=env.get(ENV_COORDINATOR_BIND) or None,
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
            # process 0's gRPC service listens there only (JAX's default: every interface)
            coordinator_bind_address=cfg.bind_address or cfg.coordinator_address,
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
