"""``dtarl bench quickstart [--seeds 0,1,2]``: the main job's SFT and GRPO greedy
success per seed (``dtarl.bench.quickstart``)."""

from __future__ import annotations

import argparse
import json
import os

from dtarl.bench import quickstart as bench_quickstart
from dtarl.errors import ConfigError

_DEFAULT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs",
    "quickstart.yaml",
)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds: give at least one seed, e.g. 0,1,2")
    return seeds


def add_quickstart(sub) -> None:
    p = sub.add_parser(
        "quickstart",
        help="the main job over seeds: greedy success after SFT and after GRPO",
        description=bench_quickstart.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=_DEFAULT, help="trainer YAML (default: quickstart.yaml)")
    p.add_argument("--seeds", type=_seeds, default=[0, 1, 2], help="e.g. 0,1,2 (the default)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every run (repeatable)",
    )
    p.add_argument("--out-dir", default="bench_out/quickstart", help="runs (%(default)s)")
    p.add_argument("--json", help="also write the rows as a JSON list to this file")
    p.set_defaults(func=_quickstart)


def _quickstart(args: argparse.Namespace) -> int:
    rows = []
    for seed in args.seeds:
        try:
            cfg = bench_quickstart.seed_config(args.config, seed, args.out_dir, args.overrides)
        except ConfigError as e:
            print(f"dtarl bench quickstart: {e}")
            return 2
        r = bench_quickstart.run_seed(cfg)
        print(
            f"seed {seed}: SFT {r.sft:.3f} -> GRPO {r.grpo:.3f} ({r.gain:+.3f}) in "
            f"{r.seconds:.1f} s",
            flush=True,
        )
        rows.append(r)
    print(bench_quickstart.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**vars(r), "gain": r.gain} for r in rows], f, indent=1)
    return 0


__all__ = ["add_quickstart"]
