"""``dtarl bench rollout|pat``: the generation benches (static sampler vs the continuous
engine, PAT's offline profile, static TP vs PAT's adaptive TP). Thin: parse arguments,
call ``dtarl.bench.rollout`` / ``pat`` / ``pat_profile``; ``dtarl.commands.bench``
registers them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from flax import nnx

from dtarl.bench import pat as bench_pat
from dtarl.bench import pat_profile, report
from dtarl.bench import rollout as bench_rollout
from dtarl.model import ModelConfig, init_model
from dtarl.rollout import pat

__all__ = ["add_pat", "add_rollout", "simulated_devices"]


# ----------------------------------------------------------------------------- rollout


def _overrides(args: argparse.Namespace, config_cls) -> dict:
    """The flags given (not None) that are fields of the bench's config dataclass."""
    names = [f.name for f in dataclasses.fields(config_cls)]
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def add_rollout(sub) -> None:
    p = sub.add_parser(
        "rollout",
        help="static sampler vs continuous-batching engine on trace response lengths",
        description=bench_rollout.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = bench_rollout.RolloutBenchConfig()
    p.add_argument(
        "--model",
        default="peer_tiny",
        help="peer_tiny (default: 4 layers, d 256, vocab 1024, as in issue #17) or a preset of "
        f"{ModelConfig.PRESETS}",
    )
    p.add_argument("--workloads", nargs="+", choices=bench_rollout.WORKLOADS, help="default: all")
    p.add_argument("--polytrace", help="PolyTrace root (default: ../shared/polytrace)")
    p.add_argument("--synthetic", action="store_true", help="lognormal stand-ins, no traces")
    p.add_argument("--prompts", type=int, help=f"prompt groups (default {d.prompts})")
    p.add_argument("--group-size", type=int, help=f"samples per prompt G (default {d.group_size})")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {d.prompt_len})")
    p.add_argument(
        "--max-new-tokens", type=int, help=f"longest response (default {d.max_new_tokens})"
    )
    p.add_argument("--slots", type=int, help=f"engine decode slots (default {d.slots})")
    p.add_argument(
        "--steps-per-call", type=int, help=f"engine steps per call (default {d.steps_per_call})"
    )
    p.add_argument("--rounds", type=int, help=f"timed rounds (default {d.rounds})")
    p.add_argument("--seed", type=int, help="lengths, prompts and sampling seed (default 0)")
    p.add_argument("--kv-group", type=int, help=f"KV report group size (default {d.kv_group})")
    p.add_argument("--kv-prompt", type=int, help=f"KV report prompt tokens (default {d.kv_prompt})")
    p.add_argument(
        "--kv-responses",
        type=int,
        nargs="+",
        help=f"KV report response lengths (default {list(d.kv_responses)})",
    )
    p.add_argument("--no-kv", dest="kv", action="store_false", help="skip the KV report")
    p.add_argument(
        "--quick", action="store_true", help="reduced workloads (under 3 minutes on 2 cores)"
    )
    p.add_argument(
        "--png", default="bench_out/rollout.png", help="active batch plot (default: %(default)s)"
    )
    p.add_argument(
        "--json",
        help="write the rows here (a list: workload, sampler, tokens_per_s, seconds, "
        "peak_kv_bytes, ...); the KV report goes to <stem>.kv.json",
    )
    p.add_argument(
        "--profile",
        metavar="OUT.json",
        help="instead of the comparison: PAT's offline profile of the engine on every device "
        "(8 simulated CPU devices unless XLA_FLAGS sets a count): decode latency of the "
        "engine's own programs per TP (B = slots per DP group, L = the response window), "
        "prefill, reshard and K/V-move bandwidths (dtarl.rollout.pat); the engine's shape "
        "from --slots, --prompts (prompt rows), --group-size, --prompt-len, "
        "--max-new-tokens, --steps-per-call (profile the shape the run will use); --quick: a "
        "CPU-sized engine and grid",
    )
    p.set_defaults(func=_rollout)


def simulated_devices(n: int = 8) -> None:
    """Asks XLA for ``n`` host (CPU) devices unless XLA_FLAGS already sets a count; it takes
    effect only if JAX has not started its backend yet (the commands call it first)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _profile(args: argparse.Namespace, model: ModelConfig) -> int:
    simulated_devices()
    # The profiled programs are the engine's: its shape from the rollout flags given.
    grid = pat_profile.ProfileGrid.quick() if args.quick else pat_profile.ProfileGrid()
    shape = dict(
        slots=args.slots,
        groups=args.prompts,
        group_size=args.group_size,
        prompt_len=args.prompt_len,
        response_len=args.max_new_tokens,
        steps_per_call=args.steps_per_call,
    )
    engine = dataclasses.replace(grid.engine, **{k: v for k, v in shape.items() if v})
    grid = dataclasses.replace(
        grid, engine=dataclasses.replace(engine, prefill_batch=engine.prompt_slots)
    )
    t0 = time.perf_counter()
    m = init_model(model, seed=0)
    prof = pat_profile.profile_engine(m, nnx.split(m, nnx.Param)[1], grid, say=print)
    path = prof.save(args.profile)
    errs = pat.leave_one_out(prof)
    held = (
        f"held-out mean relative error {sum(e['rel_error'] for e in errs) / len(errs):.1%} "
        f"({len(errs)} points inside the grid)"
        if errs
        else "no point inside the grid to hold out (3 windows or 3 slot levels needed)"
    )
    cvs = sorted(r["cv"] for r in prof.decode if "cv" in r)
    print(
        f"profile: {len(prof.decode)} decode points, {prof.devices} x {prof.device_kind}; "
        f"{held}; timing noise (median CV) {cvs[len(cvs) // 2] if cvs else 0:.1%}; weights "
        f"{prof.weights_bytes_per_s / 1e9:.2f} GB/s, K/V {prof.kv_bytes_per_s / 1e9:.2f} GB/s "
        f"per rank; compile {prof.compile_s:.2f} s"
    )
    print(f"total {time.perf_counter() - t0:.1f} s\nwrote {path}")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    model = (
        bench_rollout.peer_tiny() if args.model == "peer_tiny" else ModelConfig.preset(args.model)
    )
    if args.profile:
        return _profile(args, model)
    over = _overrides(args, bench_rollout.RolloutBenchConfig)
    if "kv_responses" in over:
        over["kv_responses"] = tuple(over["kv_responses"])
    make = (
        bench_rollout.RolloutBenchConfig.quick if args.quick else bench_rollout.RolloutBenchConfig
    )
    t0 = time.perf_counter()
    res = bench_rollout.run(
        model_cfg=model,
        cfg=make(**over),
        workloads=args.workloads,
        polytrace=args.polytrace,
        synthetic=args.synthetic,
        png=args.png,
        kv=args.kv,
    )
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        report.write_json(args.json, bench_rollout.json_rows(res), say=print)
        if "kv" in res:
            report.write_json(Path(args.json).with_suffix(".kv.json"), res["kv"], say=print)


# ----------------------------------------------------------------------------- pat


def add_pat(sub) -> None:
    p = sub.add_parser(
        "pat",
        help="static TP 1/2/4/8 vs PAT's adaptive TP during generation (8 simulated devices)",
        description=bench_pat.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = bench_pat.PatBenchConfig()
    for name, what in (
        ("prompts", "prompt groups"),
        ("group_size", "samples per prompt G"),
        ("prompt_len", "prompt tokens"),
        ("max_new_tokens", "longest response"),
        ("steps_per_call", "engine decode steps per call"),
        ("check_every", "controller check period, decode calls"),
        ("start_tp", "PAT's initial TP"),
        ("rounds", "timed rounds"),
        ("seed", "lengths and prompts seed"),
    ):
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=int, help=f"{what} (default {getattr(d, name)})")
    p.add_argument("--polytrace", help="PolyTrace root (default: ../shared/polytrace)")
    p.add_argument(
        "--trace",
        help=f"PolyTrace run of the lengths, one of {sorted(bench_pat.TRACES)} (default "
        f"{d.trace}; each prompt's lengths from one trace group)",
    )
    p.add_argument("--synthetic", action="store_true", help="lognormal lengths, no traces")
    p.add_argument("--profile", help="use this saved profile instead of profiling first")
    p.add_argument(
        "--profile-out",
        default="bench_out/pat_profile.json",
        help="where the profile taken is saved (default: %(default)s)",
    )
    p.add_argument(
        "--replay-profile",
        metavar="PROFILE.json",
        help="also PREDICT the latency on the machine of this saved profile from the tp1 "
        "generation's (B, T) trajectory (a prediction, labelled so)",
    )
    p.add_argument("--quick", action="store_true", help="small run (under 5 minutes on 2 cores)")
    p.add_argument(
        "--analytic",
        action="store_true",
        help="also the noise-free predictor check: an analytic profile (XLA cost analysis + "
        "alpha-beta all-reduces, a PREDICTION) and the interpolation's held-out error on it",
    )
    p.add_argument("--png", default="bench_out/pat.png", help="timeline plot (%(default)s)")
    p.add_argument(
        "--json",
        help="write objects with config (tp1, tp2, tp4, tp8, pat, pat_oracle), latency_s, "
        "switches, the breakdown, and {config: predictor, mean_rel_error}",
    )
    p.set_defaults(func=_pat)


def _pat(args: argparse.Namespace) -> int:
    simulated_devices()
    over = _overrides(args, bench_pat.PatBenchConfig)
    make = bench_pat.PatBenchConfig.quick if args.quick else bench_pat.PatBenchConfig
    t0 = time.perf_counter()
    res = bench_pat.run(
        make(**over),
        profile=args.profile,
        profile_out=None if args.profile else args.profile_out,
        replay_profile=args.replay_profile,
        polytrace=args.polytrace,
        synthetic=args.synthetic,
        png=args.png,
        analytic=args.analytic,
    )
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        report.write_json(args.json, bench_pat.json_rows(res), default=str, say=print)
    return 0
