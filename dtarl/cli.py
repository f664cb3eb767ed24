"""The ``dtarl`` command: thin argparse front end over library functions.

Each subcommand module exposes ``register(subparsers)`` and sets ``func`` on its
parser; ``func(args)`` returns the exit code. Only working subcommands are listed.
Bad input exits with status 2 and one line naming what is wrong (set
``DTARL_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from dtarl.commands import bench as bench_cmd
from dtarl.commands import export as export_cmd
from dtarl.commands import launch as launch_cmd
from dtarl.commands import trace as trace_cmd
from dtarl.commands import train as train_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtarl",
        description="Fast RL post-training of LLMs in JAX: prefix-tree training and friends.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train_cmd.register(sub)
    bench_cmd.register(sub)  # adds `bench` with train / memory / partition / rollout
    launch_cmd.register(sub)
    export_cmd.register(sub)
    trace_cmd.register(sub)  # adds `trace` with report / sample / replay / simulate
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # A group without its subcommand: show that group's help.
        parser.parse_args((argv or sys.argv[1:]) + ["--help"])
        return 2
    try:
        return int(func(args) or 0)
    except ValueError as e:
        # dtarl's input errors (ConfigError, BatchError, CheckpointError, ...) are
        # ValueErrors whose message names the field: print it, not a traceback.
        if os.environ.get("DTARL_DEBUG"):
            raise
        print(f"dtarl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
