"""``dtarl train CONFIG [--set key=value ...]`` (thin: parse the config, call the trainer).

``dtarl.cli`` adds it with ``register(subparsers)``. Standalone:
``python -m dtarl.commands.train CONFIG [--set k=v ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from dtarl.rl.config import ConfigError, load_config, to_dict
from dtarl.rl.trainer import Trainer


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.set or ())
    except ConfigError as e:
        print(f"dtarl train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=1))
        return 0
    try:
        result = Trainer(cfg).run()
    except ConfigError as e:
        print(f"dtarl train: {e}", file=sys.stderr)
        return 2
    start = "-" if result.eval_start is None else f"{result.eval_start:.3f}"
    end = "-" if result.eval_end is None else f"{result.eval_end:.3f}"
    mid = "" if result.eval_rl_start is None else f" -> {result.eval_rl_start:.3f} (after SFT)"
    if result.eval_rl_start is not None and result.eval_end is not None:
        end_rl = f" (RL {result.eval_end - result.eval_rl_start:+.3f})"
    else:
        end_rl = ""
    me = jax.process_index()  # process i > 0 of a multi-process run logs to process_i/
    logs = cfg.out_dir if me == 0 else os.path.join(cfg.out_dir, f"process_{me}")
    print(
        f"done: {result.steps_done} steps in {result.seconds:.1f} s; greedy success rate "
        f"{start}{mid} -> {end}{end_rl}; metrics in {logs}/metrics.jsonl"
    )
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``train`` to an argparse subparsers object (sets ``func``; returns an exit code)."""
    p = subparsers.add_parser(
        "train",
        help="RL post-training (SFT warm-up, GRPO/DAPO/PPO) from a YAML config",
        description="Train with a YAML config of overrides; see configs/quickstart.yaml.",
    )
    p.add_argument("config", nargs="?", default=None, help="YAML file (defaults if omitted)")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set rollout.group_size=8 (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print the parsed config and exit")
    p.set_defaults(func=_train)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtarl")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
