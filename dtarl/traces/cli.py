"""``dtarl trace ...`` subcommands (thin: parse arguments, call library functions).

The lead wires ``register(subparsers)`` into ``dtarl``'s argparse parser:

    dtarl trace report PATH [--out DIR] [--steps 0 1 2] [--no-html]
    dtarl trace sample SOURCE --batch-size B [--n-sampling G] [--step K] [--seed S]
                       [--length-scale X] [--mode trajectory|per_turn]
"""

from __future__ import annotations

import argparse

import numpy as np


def _report(args: argparse.Namespace) -> int:
    from dtarl.traces.report import write_report

    res = write_report(args.path, args.out, steps=args.steps, html_output=not args.no_html)
    print(f"wrote {res.markdown} ({len(res.plots)} plots)")
    for h in res.headlines:
        print(
            f"  {h.quantity}: paper {h.paper:,} vs ours "
            f"{'-' if h.ours is None else f'{h.ours:,.1f}'} -> {h.verdict}"
        )
    return 0


def _sample(args: argparse.Namespace) -> int:
    from dtarl.traces.workload import generate_workload

    w = generate_workload(
        args.source,
        batch_size=args.batch_size,
        n_sampling=args.n_sampling,
        step=args.step,
        seed=args.seed,
        length_scale=args.length_scale,
        mode=args.mode,
    )
    b, info = w.batch, w.info
    lens = b.lengths
    print(f"source {info.source} step {info.step} mode {info.mode.value}")
    print(
        f"sequences {b.num_sequences}, groups {len(np.unique(info.group_ids))}, "
        f"tokens {b.num_tokens:,} (mean {lens.mean():.1f}, max {lens.max()})"
    )
    print(
        f"trained tokens {int(sum(m.sum() for m in b.loss_mask)):,}, "
        f"truncated {info.truncated.mean():.1%}"
    )
    print(
        f"dense {info.dense_tokens:,} vs tree {info.tree_tokens:,} tokens: ideal speedup "
        f"{info.dense_tokens / max(info.tree_tokens, 1):.2f}x"
    )
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``trace`` with ``report`` and ``sample`` to an argparse subparsers object.

    Each leaf parser sets ``func`` (call it as ``args.func(args)``; returns an exit code).
    """
    trace = subparsers.add_parser("trace", help="PolyTrace workloads: reports, batch sampling")
    sub = trace.add_subparsers(dest="trace_command", required=True)

    rep = sub.add_parser("report", help="characterization report (Markdown/HTML + PNG plots)")
    rep.add_argument("path", help="run directory, trace file, fitted JSON or PolyTrace folder")
    rep.add_argument("--out", default="trace_report", help="output directory")
    rep.add_argument("--steps", type=int, nargs="+", default=None, help="only these steps")
    rep.add_argument("--no-html", action="store_true", help="Markdown only")
    rep.set_defaults(func=_report)

    smp = sub.add_parser("sample", help="sample a training batch and print its stats")
    smp.add_argument("source", help="trace path, 'fitted:math' or 'fitted:tool'")
    smp.add_argument("--batch-size", type=int, required=True, help="prompt groups")
    smp.add_argument("--n-sampling", type=int, default=None, help="sequences per group")
    smp.add_argument("--step", type=int, default=None)
    smp.add_argument("--seed", type=int, default=0)
    smp.add_argument("--length-scale", type=float, default=1.0)
    smp.add_argument("--mode", choices=("trajectory", "per_turn"), default="trajectory")
    smp.set_defaults(func=_sample)
    return trace
