"""``dtarl bench train|memory|partition|peer`` (thin: parse arguments, call ``dtarl.bench``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dtarl.bench import memory as bench_memory
from dtarl.bench import partition as bench_partition
from dtarl.bench import peer as bench_peer
from dtarl.bench import train as bench_train
from dtarl.model import ModelConfig
from dtarl.parallel.partition import FlopCost

# ----------------------------------------------------------------------------- train


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="time the training engines side by side (dense, dense+remat, dfs, ...)",
        description=bench_train.__doc__,
    )
    p.add_argument("--engines", nargs="+", help=f"subset of {bench_train.engine_names()}")
    p.add_argument("--workloads", nargs="+", help="subset of workload names (see the output)")
    p.add_argument("--polytrace", help="PolyTrace root (default: ../shared/polytrace)")
    p.add_argument("--length-scale", type=float, default=0.02, help="scale for trace lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-len", type=int, default=128)
    p.add_argument("--microbatch", type=int, default=8, help="dense microbatch (sequences)")
    p.add_argument("--model", default="tiny", help=f"preset, one of {ModelConfig.PRESETS}")
    p.add_argument("--quick", action="store_true", help="smaller workloads (about a minute)")
    p.add_argument(
        "--no-autotune",
        dest="autotune",
        action="store_false",
        help="auto picks by the calibrated cost model alone (no per-bucket timing)",
    )
    p.add_argument(
        "--tune-margin",
        type=float,
        help="auto times the candidates predicted within this factor of the best "
        "(default: AutoEngine.tune_margin)",
    )
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=_train)


def _train(args) -> int:
    cfg = ModelConfig.preset(args.model)
    res = bench_train.run(
        model_cfg=cfg,
        engines=args.engines,
        workloads=args.workloads,
        polytrace=args.polytrace,
        length_scale=args.length_scale,
        repeats=args.repeats,
        chunk_len=args.chunk_len,
        microbatch=args.microbatch,
        quick=args.quick,
        autotune=args.autotune,
        tune_margin=args.tune_margin,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- memory


def _add_memory(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="compiled peak memory of dense vs prefix_reuse; the capacity frontier",
        description=bench_memory.__doc__,
    )
    p.add_argument("--model", default="tiny", help=f"preset, one of {ModelConfig.PRESETS}")
    p.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (peak table)")
    p.add_argument("--response", type=int, default=96, help="response tokens (peak table)")
    p.add_argument("--microbatch", type=int, help="dense / suffix microbatch (default: G)")
    p.add_argument("--budget-mib", type=float, nargs="+", default=[64.0])
    p.add_argument("--frontier-group", type=int, default=8, help="G of the frontier's group")
    p.add_argument("--prompt-ratio", type=int, default=4, help="frontier prompt / response")
    p.add_argument("--max-response", type=int, default=4096)
    p.add_argument("--resolution", type=int, default=8)
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=_memory)


def _memory(args) -> int:
    res = bench_memory.run(
        model_cfg=ModelConfig.preset(args.model),
        group_sizes=args.group_sizes,
        prompt=args.prompt,
        response=args.response,
        microbatch=args.microbatch,
        budgets_mib=args.budget_mib,
        frontier_group=args.frontier_group,
        prompt_ratio=args.prompt_ratio,
        max_response=args.max_response,
        resolution=args.resolution,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(res, model=args.model), f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- partition


def _add_partition(sub) -> None:
    p = sub.add_parser("partition", help="DP partition: simulated makespan, balanced vs baselines")
    p.add_argument(
        "--polytrace",
        type=Path,
        default=None,
        metavar="DIR",
        help="PolyTrace directory (default: ../shared/polytrace if present, else synthetic)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results here")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="DP ranks to try")
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(bench_partition.DEFAULT_WORKLOADS),
        choices=list(bench_partition.WORKLOADS),
    )
    p.add_argument(
        "--costs",
        nargs="+",
        default=["tree_tokens", "flops"],
        choices=["tree_tokens", "flops"],
        help="cost models C(T_j) (tree_tokens is the paper's)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="first steps per workload (default 0 = every step)",
    )
    p.add_argument("--flop-b", type=float, default=FlopCost().b, help="FlopCost b (a = 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic", action="store_true", help="ignore traces; synthetic batches")
    m = bench_partition.MeasureConfig()
    p.add_argument(
        "--measure",
        action="store_true",
        help="also time each rank's sub-batch through the DFS engine (tiny model, CPU)",
    )
    p.add_argument(
        "--measure-scale", type=float, default=m.scale, help="length scale for --measure"
    )
    p.add_argument(
        "--measure-steps", type=int, default=m.steps, help="steps per workload to measure"
    )
    p.add_argument(
        "--measure-repeats", type=int, default=m.repeats, help="timed runs per rank (min)"
    )
    p.set_defaults(func=_partition)


def _partition(args: argparse.Namespace) -> int:
    if args.max_steps < 0:
        raise ValueError(f"--max-steps={args.max_steps}: must be >= 0 (0 = every step)")
    root = None if args.synthetic else (args.polytrace or bench_partition.default_root())
    t0 = time.perf_counter()
    result = bench_partition.run(
        root,
        tuple(args.ks),
        workloads=tuple(args.workloads),
        costs=tuple(args.costs),
        flop=FlopCost(a=1.0, b=args.flop_b),
        max_steps=args.max_steps or None,
        seed=args.seed,
        measure=bench_partition.MeasureConfig(
            scale=args.measure_scale, steps=args.measure_steps, repeats=args.measure_repeats
        )
        if args.measure
        else None,
    )
    steps = "all steps" if not args.max_steps else f"first {args.max_steps} steps"
    print(
        f"traces: {root if root else 'synthetic (no PolyTrace directory)'} ({steps} per "
        f"workload; {time.perf_counter() - t0:.1f} s)"
    )
    print(bench_partition.format_table(result))
    if args.measure:
        print(bench_partition.format_measured(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- peer


def _add_peer(sub) -> None:
    p = sub.add_parser(
        "peer",
        help="dtarl against Tunix (rollout, GRPO update) in alternating processes",
        description=bench_peer.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--parts",
        nargs="+",
        choices=list(bench_peer.PARTS),
        default=list(bench_peer.PARTS),
        help="what to compare (default: all)",
    )
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (processes each)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per process (median)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="short sequences, one round: a smoke test (still about 7 min on 2 cores: "
        "every process compiles, auto tunes)",
    )
    p.add_argument(
        "--python",
        help="interpreter for the measurement processes (default: this one); it needs "
        "dtarl importable and Tunix installed",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    p.set_defaults(func=_peer)


def _peer(args: argparse.Namespace) -> int:
    for name in ("rounds", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)}: must be >= 1")
    try:
        res = bench_peer.run(
            parts=args.parts,
            rounds=1 if args.quick else args.rounds,
            repeats=args.repeats,
            quick=args.quick,
            python=args.python,
        )
    except bench_peer.PeerMissing as e:
        print(f"dtarl: {e}", file=sys.stderr)
        return 2
    print()
    print(bench_peer.format_table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``bench`` with its ``train``, ``memory``, ``partition`` and ``peer`` subcommands
    (each sets ``func``; ``func(args)`` returns the exit code)."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks (engines, memory, DP partition, vs Tunix)"
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_train(sub)
    _add_memory(sub)
    _add_partition(sub)
    _add_peer(sub)
    return bench
