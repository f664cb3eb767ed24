"""``dtarl bench ...``: the benchmark subcommands (thin:
parse arguments, call ``dtarl.bench``); rollout and pat are in
``dtarl.commands.bench_generation``."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dtarl.bench import darts as bench_darts
from dtarl.bench import darts_trace as bench_darts_trace
from dtarl.bench import memory as bench_memory
from dtarl.bench import partition as bench_partition
from dtarl.bench import peer as bench_peer
from dtarl.bench import report
from dtarl.bench import stalls as bench_stalls
from dtarl.bench import stream as bench_stream
from dtarl.bench import train as bench_train
from dtarl.commands import bench_device, bench_generation, bench_quickstart, bench_scale
from dtarl.commands.bench_generation import simulated_devices
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
    p.add_argument(
        "--mesh",
        type=_mesh_arg,
        help="run every engine sharded on a mesh, e.g. dp=4,tp=2 (dp x tp <= the devices)",
    )
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=_train)


def _mesh_arg(text: str) -> tuple[int, int]:
    """``dp=4,tp=2`` (tp defaults to 1) as (dp, tp)."""
    vals = {"tp": 1}
    for part in text.split(","):
        key, _, val = part.partition("=")
        key = key.strip()
        if key not in ("dp", "tp") or not val.strip().isdigit() or int(val) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: expected dp=N[,tp=M] with integers >= 1, e.g. dp=4,tp=2"
            )
        vals[key] = int(val)
    if "dp" not in vals:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: dp=N is required, e.g. dp=4,tp=2")
    return vals["dp"], vals["tp"]


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
        mesh=args.mesh,
    )
    if args.json:
        print()
        report.write_json(args.json, res, default=str, say=print)
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
        print()
        report.write_json(args.json, dict(res, model=args.model), say=print)
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
        report.write_json(args.json, result, say=print)
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
        "Tunix and dtarl's dependencies installed (the workers import the dtarl that "
        "runs this command: its directory goes first on their PYTHONPATH)",
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
        report.write_json(args.json, res, say=print)
    return 0


# ----------------------------------------------------------------------------- darts


def _add_darts(sub) -> None:
    p = sub.add_parser(
        "darts",
        help="GRPO with and without DARTS from one SFT checkpoint, over seeds",
        description=bench_darts.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = bench_darts.DartsBenchConfig()
    p.add_argument("--config", default=d.config, help="trainer YAML (default: %(default)s)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every run (repeatable)",
    )
    p.add_argument("--seeds", type=int, nargs="+", help=f"RL seeds (default {list(d.seeds)})")
    p.add_argument("--steps", type=int, help=f"RL steps per run (default {d.steps}; quick 30)")
    p.add_argument("--eval-every", type=int, help=f"greedy eval period (default {d.eval_every})")
    p.add_argument("--eval-problems", type=int, help=f"eval set size (default {d.eval_problems})")
    p.add_argument("--sft-steps", type=int, help="SFT warm-up steps (default: the config's)")
    p.add_argument(
        "--skip-steps", type=int, help=f"first steps left out of step time (default {d.skip_steps})"
    )
    p.add_argument("--quick", action="store_true", help="30 RL steps, 3 seeds (< 10 min, 2 cores)")
    p.add_argument("--out-dir", default="bench_out/darts", help="run directories (%(default)s)")
    p.add_argument(
        "--compile-cache",
        help="persistent JAX compilation cache shared by the runs (default: a temporary one)",
    )
    p.add_argument("--png", default="bench_out/darts.png", help="length/success plot (%(default)s)")
    p.add_argument(
        "--json",
        help="write one object per (arm, seed): arm, seed, step_seconds, final_success, "
        "mean_response_len, ...; with --trace one per (arm, round, step): trace, arm, round, "
        "rollout_s, train_s, step_s, generated_tokens, cancelled_tokens, kept_len_mean",
    )
    t = p.add_argument_group(
        "trace lengths (--trace: dtarl.bench.darts_trace; the trainer options above are unused)"
    )
    td = bench_darts_trace.TraceBenchConfig()
    t.add_argument(
        "--trace",
        help=f"one of {sorted(bench_darts_trace.TRACES)}: each prompt's candidate lengths "
        "drawn from its own trace group, real engine with forced lengths, then training",
    )
    t.add_argument("--prompts", type=int, help=f"prompts per step N (default {td.prompts})")
    t.add_argument("--group-size", type=int, help=f"M (default {td.group_size})")
    t.add_argument("--pool", type=int, help=f"distinct prompts drawn from (default {td.pool})")
    t.add_argument("--max-new-tokens", type=int, help=f"length cap (default {td.max_new_tokens})")
    t.add_argument("--rounds", type=int, help=f"interleaved rounds (default {td.rounds})")
    t.add_argument("--trace-steps", type=int, help=f"steps per arm and round ({td.steps})")
    t.add_argument(
        "--warmup-steps", type=int, help="untimed steps per arm (default: a pool epoch, >= 2)"
    )
    t.add_argument("--slots", type=int, help="rollout engine slots (default N x M)")
    t.add_argument(
        "--lambda",
        dest="lam",
        type=_lambda_arg,
        help=f"relative lambda ({td.lam}), or 'auto': rho / 1.5 for the trace's length spread "
        "rho (M* = 1.5 M N, the paper's observed average budget)",
    )
    t.add_argument("--polytrace", help="PolyTrace root (default: ../shared/polytrace)")
    p.set_defaults(func=_darts)


def _lambda_arg(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number > 0 or 'auto'") from None


def _darts_trace(args: argparse.Namespace) -> int:
    names = {"prompts": "prompts", "group_size": "group_size", "pool": "pool",
             "max_new_tokens": "max_new_tokens", "rounds": "rounds", "trace_steps": "steps",
             "warmup_steps": "warmup_steps", "slots": "slots", "lam": "lam"}  # fmt: skip
    over = {v: getattr(args, k) for k, v in names.items() if getattr(args, k) is not None}
    if args.seeds:
        over["seed"] = args.seeds[0]
    make = bench_darts_trace.TraceBenchConfig
    cfg = (make.quick if args.quick else make)(trace=args.trace, **over)
    res = bench_darts_trace.run(cfg, polytrace=args.polytrace)
    print()
    print(f"machine: {res['machine']}")
    print(bench_darts_trace.format_table(res))
    if args.json:
        report.write_json(args.json, bench_darts_trace.json_rows(res), say=print)
    return 0


def _darts(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _darts_trace(args)
    fields = ("steps", "eval_every", "eval_problems", "sft_steps", "skip_steps")
    over = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    if args.seeds is not None:
        over["seeds"] = tuple(args.seeds)
    over.update(config=args.config, overrides=tuple(args.overrides))
    make = bench_darts.DartsBenchConfig.quick if args.quick else bench_darts.DartsBenchConfig
    cfg = make(**over)
    cache = args.compile_cache or tempfile.mkdtemp(prefix="dtarl-darts-cache-")
    try:
        res = bench_darts.run(cfg, out_dir=args.out_dir, compile_cache=cache)
    finally:
        if args.compile_cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    print()
    print(bench_darts.format_table(res))
    if args.png:
        print(f"wrote {bench_darts.plot(res, args.png)}")
    if args.json:
        report.write_json(args.json, bench_darts.json_rows(res), say=print)
    return 0


# ----------------------------------------------------------------------------- stream


def _add_stream(sub) -> None:
    p = sub.add_parser(
        "stream",
        help="RL steps with and without token-level streaming (GRPO + KL, PPO), side by side",
        description=bench_stream.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = bench_stream.StreamBenchConfig()
    p.add_argument(
        "--workloads", nargs="+", help=f"subset of {list(bench_stream.WORKLOADS)} (default: all)"
    )
    p.add_argument("--rounds", type=int, help=f"timed steps per arm (default {d.rounds}; quick 3)")
    p.add_argument("--prompts", type=int, help=f"prompts per step (default {d.prompts_per_step})")
    p.add_argument("--group-size", type=int, help=f"samples per prompt (default {d.group_size})")
    p.add_argument(
        "--max-new-tokens", type=int, help=f"response cap (default {d.max_new_tokens}; quick 96)"
    )
    p.add_argument("--chunk", type=int, help=f"rollout.streaming.chunk (default {d.chunk})")
    p.add_argument("--layers", type=int, help=f"tiny model layers (default {d.num_layers})")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="trainer config override for every run (repeatable)",
    )
    p.add_argument("--quick", action="store_true", help="3 timed steps per arm (~5 min, 2 cores)")
    p.add_argument("--out-dir", help="run directories (default: a temporary one)")
    p.add_argument("--json", help="write one object per (workload, arm)")
    p.set_defaults(func=_stream)


def _stream(args: argparse.Namespace) -> int:
    names = dict(
        rounds="rounds",
        prompts="prompts_per_step",
        group_size="group_size",
        max_new_tokens="max_new_tokens",
        chunk="chunk",
        layers="num_layers",
    )
    over = {f: getattr(args, a) for a, f in names.items() if getattr(args, a) is not None}
    over.update(
        workloads=bench_stream.workload_names(args.workloads), overrides=tuple(args.overrides)
    )
    make = bench_stream.StreamBenchConfig.quick if args.quick else bench_stream.StreamBenchConfig
    try:
        cfg = make(**over)
    except ValueError as e:
        print(f"dtarl bench stream: {e}", file=sys.stderr)
        return 2
    out = args.out_dir or tempfile.mkdtemp(prefix="dtarl-stream-")
    try:
        res = bench_stream.run(cfg, out_dir=out)
    finally:
        if args.out_dir is None:
            shutil.rmtree(out, ignore_errors=True)
    print(bench_stream.format_table(res))
    if args.json:
        report.write_json(args.json, bench_stream.json_rows(res), say=print)
    return 0


# ----------------------------------------------------------------------------- stalls


def _add_stalls(sub) -> None:
    p = sub.add_parser(
        "stalls",
        help="a training run's compile and autotune seconds per phase and per program",
        description=bench_stalls.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", default=None, help="trainer YAML (defaults if omitted)")
    p.add_argument("--steps", type=int, help="RL steps (default: the config's)")
    p.add_argument("--sft-steps", type=int, help="SFT warm-up steps (default: the config's)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (repeatable), e.g. --set rollout.prompts_per_step=16",
    )
    p.add_argument("--out-dir", help="the run's out_dir (default: a temporary folder)")
    p.add_argument("--top", type=int, default=15, help="programs listed (by compile seconds)")
    p.add_argument("--json", help="write the report here")
    p.set_defaults(func=_stalls)


def _stalls(args: argparse.Namespace) -> int:
    for name in ("steps", "sft_steps"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ValueError(f"--{name.replace('_', '-')}={v}: must be >= 0")
    res = bench_stalls.run(
        args.config,
        steps=args.steps,
        sft_steps=args.sft_steps,
        overrides=args.overrides,
        out_dir=args.out_dir,
    )
    print()
    print(bench_stalls.format_report(res, top=args.top))
    if args.json:
        report.write_json(args.json, res, say=print)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``bench`` with its ``train``, ``memory``, ``partition``, ``rollout``, ``peer``,
    ``darts``, ``pat``, ``stream``, ``stalls``, ``plan``, ``quickstart`` and ``device``
    subcommands (each sets ``func``;
    ``func(args)`` returns the exit code)."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks (train engines, memory, DP partition, rollout, vs Tunix, DARTS, PAT, "
        "streaming, stalls, plan, the quickstart's SFT vs GRPO, device)",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_train(sub)
    _add_memory(sub)
    bench_scale.add_lora(sub)
    _add_partition(sub)
    bench_generation.add_rollout(sub)
    _add_peer(sub)
    _add_darts(sub)
    bench_generation.add_pat(sub)
    _add_stream(sub)
    _add_stalls(sub)
    bench_device.add_device(sub)
    bench_scale.add_plan(sub)
    bench_quickstart.add_quickstart(sub)
    bench_scale.add_scale(sub)
    return bench


__all__ = ["register", "simulated_devices"]
