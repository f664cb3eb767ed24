"""``dtarl bench device``: the accelerator benchmark (``dtarl.bench.device``). Thin:
parse arguments, call ``dtarl.bench.device.run``; ``dtarl.commands.bench`` registers it."""

from __future__ import annotations

import argparse
import dataclasses

from dtarl.bench import device as bench_device

__all__ = ["add_device"]


def add_device(sub) -> None:
    p = sub.add_parser(
        "device",
        help="kernels, engines (MFU), rollout and PAT's tp=1 curve on an accelerator; "
        "--dry-run on a CPU checks every program lowers for cuda and tpu",
        description=bench_device.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sections",
        nargs="+",
        default=list(bench_device.SECTIONS),
        metavar="NAME",
        help=f"sections to run, in order (default: all of {list(bench_device.SECTIONS)})",
    )
    p.add_argument("--dry-run", action="store_true", help="lower every program for cuda/tpu only")
    p.add_argument("--quick", action="store_true", help="tiny shapes everywhere (a smoke run)")
    p.add_argument("--model", help="model preset of the engine/rollout/pat sections")
    p.add_argument("--layers", type=int, help="override the preset's depth")
    p.add_argument("--engines", nargs="+", help="training engines (default dense dfs prefix_reuse)")
    p.add_argument("--out", help="folder for device.json and device.md (written per section)")
    p.add_argument("--docs", help="splice the Markdown into this file (docs/benchmarks.md)")
    p.add_argument("--render", metavar="JSON", help="only splice a saved device.json into --docs")
    p.set_defaults(func=_device)


def _device(args: argparse.Namespace) -> int:
    if args.render:
        if not args.docs:
            raise ValueError("--render needs --docs PATH (the file to splice the table into)")
        print(f"wrote {bench_device.render_saved(args.render, args.docs)}")
        return 0
    cfg = bench_device.DeviceBenchConfig.quick() if args.quick else bench_device.DeviceBenchConfig()
    over = {}
    if args.model:
        over["model"] = args.model
    if args.layers is not None:
        if args.layers < 1:
            raise ValueError(f"--layers={args.layers}: must be >= 1")
        over["layers"] = args.layers
    if args.engines:
        over["engines"] = tuple(args.engines)
    cfg = dataclasses.replace(cfg, **over)
    res = bench_device.run(
        cfg=cfg,
        sections=args.sections,
        out=args.out,
        docs=args.docs,
        dry=args.dry_run,
    )
    if args.dry_run:
        return 1 if res["dry_run"]["failed"] else 0
    return 0
