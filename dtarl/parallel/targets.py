"""What ``dtarl launch`` starts and checks: the target, the host's capacity, the worker.

``check_target`` and ``local_capacity`` run in the launcher before any process
starts; ``worker_main`` is the entry of each launched process (``python -m
dtarl.parallel.launch --worker -- TARGET``): it joins the runtime
(``dtarl.parallel.distributed.initialize``), runs TARGET as ``__main__`` and exits
hard on failure (``os._exit``: never wait in JAX's shutdown barrier for peers
that will not arrive). A rank whose collective broke on a lost peer prints one
line naming it and exits with ``EXIT_PEER_LOST``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import os
import re
import runpy
import sys
import traceback
from collections.abc import Sequence

from dtarl.parallel.distributed import (
    EXIT_PEER_LOST,
    DistributedConfig,
    initialize,
    lost_peer,
    report_progress,
)


class LaunchError(ValueError):
    """Bad launcher arguments."""


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
        if lost_peer(e):  # one line naming what was lost; the launcher names the cause
            print(_peer_lost_line(e), file=sys.stderr)
            code = EXIT_PEER_LOST
        else:
            traceback.print_exc()
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # Skip JAX's atexit shutdown barrier: the peers may never reach it.
        os._exit(code)
    sys.exit(0)


def _peer_lost_line(exc: BaseException) -> str:
    cfg = DistributedConfig.from_env()
    me, n = cfg.process_id, cfg.num_processes
    lost = f"rank {1 - me}" if n == 2 and me in (0, 1) else "a peer"
    first = (str(exc).strip().splitlines() or [""])[0][:400]
    return (
        f"dtarl: rank {me} of {n}: lost {lost} (it died or was stopped; see its log), "
        f"stopping: {type(exc).__name__}: {first}"
    )


# --------------------------------------------------------------------------- launcher


def local_capacity(platform: str) -> int | None:
    """How many processes this host can run without oversubscribing: its accelerators
    (``/dev/nvidia<N>`` or ``CUDA_VISIBLE_DEVICES``; ``/dev/accel<N>``/``/dev/vfio`` for
    TPUs) or, on CPU, its usable cores. None when it cannot be counted."""
    if platform == "cpu":
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:
            return os.cpu_count()
    if platform == "gpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
        found = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    else:
        found = glob.glob("/dev/accel[0-9]*") or [
            p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit()
        ]
    return len(found) or None


def check_capacity(platform: str, nproc: int, devices_per_proc: int | None) -> None:
    have = local_capacity(platform)
    per = 1 if platform == "cpu" else (devices_per_proc or 1)
    what = "CPU cores" if platform == "cpu" else f"local {platform.upper()}s"
    if have is None:
        raise LaunchError(
            f"--nproc {nproc}: cannot count the {what} of this host; pass "
            "--allow-oversubscribe to start them anyway"
        )
    if nproc * per > have:
        need = f"{nproc}" if per == 1 else f"{nproc} x {per} devices"
        raise LaunchError(
            f"--nproc {nproc}: {need} exceed the {have} {what} of this host; accepted: "
            f"--nproc in [1, {max(have // per, 1)}], or pass --allow-oversubscribe"
        )


def check_target(target: Sequence[str]) -> None:
    """Raises ``LaunchError`` when ``target`` cannot run (checked before any process starts)."""
    if not target:
        raise LaunchError("no target: give `-- -m module ...`, `-- script.py ...` or dtarl args")
    head, rest = target[0], list(target[1:])
    if head == "-m":
        if not rest:
            raise LaunchError("`-m` needs a module name")
        if not _find_module(rest[0]):
            raise LaunchError(f"target module {rest[0]!r} is not importable (-m {rest[0]})")
    elif head.endswith(".py"):
        if not os.path.isfile(head):
            raise LaunchError(f"target script {head!r} does not exist")
    elif "." in head and "/" not in head and _find_module(head):
        return
    else:
        entry = _console_script("dtarl")
        if entry is None:
            raise LaunchError(
                f"target {head!r} is not a module or script, and the `dtarl` command "
                "is not installed to run it as a dtarl command"
            )
        commands = _dtarl_commands(entry)
        if commands and head not in commands:
            raise LaunchError(
                f"target {head!r} is not a module, a script (.py) or a dtarl command; "
                f"dtarl commands: {sorted(commands)}"
            )


def _dtarl_commands(entry) -> set[str]:
    """The subcommands of the ``dtarl`` console script (its module's ``build_parser``)."""
    build = getattr(sys.modules.get(getattr(entry, "__module__", "")), "build_parser", None)
    if build is None:
        return set()
    for action in build()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


worker_main = _worker

__all__ = ["LaunchError", "check_capacity", "check_target", "local_capacity", "worker_main"]
