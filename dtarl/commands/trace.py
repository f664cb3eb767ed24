"""``dtarl trace ...`` subcommands (thin: parse arguments, call library functions).

The lead wires ``register(subparsers)`` into ``dtarl``'s argparse parser:

    dtarl trace report PATH [--out DIR] [--steps 0 1 2] [--no-html]
    dtarl trace sample SOURCE --batch-size B [--n-sampling G] [--step K] [--seed S]
                       [--length-scale X] [--mode trajectory|per_turn]
    dtarl trace replay [SOURCE ...] [--engines dense dfs] [--repeats 7] [--max-len 256]
                       [--rollout-engine continuous|static] [--reward-times RUN]
                       [--tool-clock simulated|sleep] [--tool-time-scale X]
                       [--inference-passes 0|1|2] [--no-reward]
                       [--batch-sizes 2 4 8] [--max-response-lens 1000 3000]
                       [--steps 0 1 2] [--out DIR]
    dtarl trace simulate [SOURCE ...] --profile PROFILE.json --joint [--out DIR]
    dtarl trace simulate [SOURCE ...] --profile PROFILE.json [--calibrate [--no-rollout]]
                       [--engines dense dfs prefix_reuse auto] [--validate REPLAY.json]
                       [--devices N --dp D --tp T] [--out DIR]
    dtarl trace validate [--rollout RUN] [--reward RUN] [--fit-steps 0 1 2] [--test-steps 3 4]
                       [--no-reward] [--out DIR]

Without SOURCEs, replay / simulate use the real-trace suite (``DEFAULT_SUITE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from dtarl.bench.replay import (
    ReplayConfig,
    WorkloadSpec,
    auto_length_scale,
    default_suite,
    load_replay_json,
    plot_stages,
    replay,
)
from dtarl.bench.report import write_json
from dtarl.bench.simulate import (
    ClusterSpec,
    CostProfile,
    calibrate_and_replay,
    predict_workload,
    profile_engines,
    validate,
)
from dtarl.bench.simulate.production import validate_production
from dtarl.model import ModelConfig
from dtarl.timing import QuietGate
from dtarl.traces.loaders import RunKind, RunTrace, find_traces
from dtarl.traces.report import ReplayError, write_report
from dtarl.traces.workload import generate_workload

_TRACES = "a trace file, a run directory or a folder of traces"


def check_report_path(path: str) -> None:
    """Raises ``ValueError`` (one line, naming the file) when ``path`` holds no trace
    records to report on: missing, no trace files, an empty trace file."""
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory (expected {_TRACES})")
    traces = find_traces(path)  # an unknown file name is a ValueError naming the names
    if not traces:
        raise ValueError(f"{path}: no PolyTrace files found (expected {_TRACES})")
    for t in traces:
        for fp in getattr(t, "step_files", {}).values():
            if os.path.getsize(fp) == 0:
                raise ValueError(f"{fp}: empty trace file (no records); remove it or re-export it")


def replay_error(path: str) -> ReplayError | None:
    """The end-to-end latency error of ``dtarl trace validate`` on the first multi-turn run
    below ``path`` (held-out steps; the rollout makespan, tools on each trajectory's
    timeline), with the per-turn error and the fit-mean baseline in ``source``; None
    without a multi-turn run, an uncomputed error (``source`` says why) when it has too
    few steps."""
    runs = [t for t in find_traces(path) if isinstance(t, RunTrace)]
    run = next((t for t in runs if t.kind is RunKind.MULTI_TURN and t.step_files), None)
    if run is None:
        return None
    try:
        rep = validate_production(run.path, reward=False)
    except ValueError as e:
        return ReplayError(error_pct=None, source=f"`dtarl trace validate` on {run.name}: {e}")
    span = next(k for k in rep.skill if k.figure == "step makespan")
    return ReplayError(
        error_pct=100.0 * (1.0 - rep.makespan_accuracy),
        source=(
            f"`dtarl trace validate` on {run.name}: held-out steps {list(rep.test_steps)} "
            f"(fit {list(rep.fit_steps)}); rollout makespan error "
            f"{100 * (1 - rep.makespan_accuracy):.1f}%, per-turn "
            f"{100 * (1 - rep.turn_accuracy):.1f}%; predicting the fit steps' mean "
            "makespan errs by "
            f"{100 * (1 - span.baseline):.1f}% ("
            + ("the model carries skill" if span.carries_skill else "no skill over it")
            + ")"
        ),
    )


def _report(args: argparse.Namespace) -> int:
    check_report_path(args.path)
    try:
        res = write_report(
            args.path,
            args.out,
            steps=args.steps,
            html_output=not args.no_html,
            replay_error=replay_error(args.path),
        )
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{args.path}: a trace file is not UTF-8 text (byte {e.start}: {e.reason}); "
            "expected JSON lines"
        ) from None
    print(f"wrote {res.markdown} ({len(res.plots)} plots)")
    for h in res.headlines:
        print(
            f"  {h.quantity}: paper {h.paper:,} vs ours "
            f"{'-' if h.ours is None else f'{h.ours:,.1f}'} -> {h.verdict}"
        )
    return 0


def _sample(args: argparse.Namespace) -> int:

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


def _workload_specs(args: argparse.Namespace) -> list:
    """WorkloadSpecs from SOURCE arguments, or the default real-trace suite."""

    if not args.sources:
        specs = default_suite(max_len=args.max_len, seed=args.seed)
        if not specs:
            raise SystemExit(
                "no PolyTrace data found for the default suite; pass SOURCE paths or set "
                "$DTARL_POLYTRACE to the polytrace folder"
            )
        return specs
    specs = []
    for i, src in enumerate(args.sources):
        scale = args.length_scale
        if scale is None:
            scale = auto_length_scale(
                src,
                batch_size=args.batch_size,
                max_len=args.max_len or 256,
                n_sampling=args.n_sampling,
                step=args.step,
                seed=args.seed,
            )
        name = src.rstrip("/").split("/")[-1] if not src.startswith("fitted:") else src
        specs.append(
            WorkloadSpec(
                name=f"{i}:{name}"[:14],
                source=src,
                batch_size=args.batch_size,
                n_sampling=args.n_sampling,
                step=args.step,
                seed=args.seed,
                length_scale=scale,
                mode=args.mode,
            )
        )
    return specs


def _replay(args: argparse.Namespace) -> int:

    cfg = ReplayConfig(
        engines=tuple(args.engines),
        repeats=args.repeats,
        warmup=args.warmup,
        tool_clock=args.tool_clock,
        tool_time_scale=args.tool_time_scale,
        tool_latency_source=args.tool_latencies,
        rollout=not args.no_rollout,
        rollout_repeats=args.rollout_repeats,
        quiet_cores=args.quiet_cores or None,
        quiet_budget_s=args.quiet_budget,
        inference_passes=args.inference_passes,
        reward=not args.no_reward,
        reward_source=args.reward_times,
        rollout_engine=args.rollout_engine,
    )
    specs = sweep_specs(_workload_specs(args), args.batch_sizes, args.max_response_lens, args.steps)
    res = replay(specs, cfg, log=print)
    out = Path(args.out)
    js = res.save(out / "replay.json")
    png = res.plot(out / "replay.png")
    stages_png = plot_stages(res, out / "stages.png", kind=cfg.engines[0])
    print(res.table())
    for w in res.workloads:
        r = w.rollout
        roll = (
            r.status
            if r.seconds is None
            else (
                f"{r.seconds:.2f}s, {r.generated_tokens} tokens, {r.tokens_per_s:.0f} tok/s "
                f"(compile {r.compile_s:.1f}s, {r.status})"
            )
        )
        step = w.rollout_step_s()
        timeline = "" if step is None else f"; rollout with tools (slowest trajectory) {step:.2f}s"
        d = r.detail
        if d.get("engine") == "continuous":
            roll += (
                f" [continuous engine: {d['decode_calls']} decode calls, {d['extends']} tool "
                f"turns extended in place, {d['engine_s']:.3f}s in the engine, "
                f"{d['idle_s']:.3f}s idle waiting for tools]"
            )
        rew = w.reward
        reward = (
            f"{rew.seconds:.2f} {rew.units} over {rew.ranks} ranks ({rew.source})"
            if rew.status == "ok"
            else rew.status
        )
        print(
            f"{w.spec.name}: rollout {roll}; tool ({w.tool.clock} clock) "
            f"{w.tool.seconds:.2f} {w.tool.units} over {w.tool.calls} calls ({w.tool.status})"
            f"{timeline}; reward {reward}"
        )
    print(f"wrote {js}, {png} and {stages_png}")
    return 0


def sweep_specs(specs, batch_sizes=None, max_response_lens=None, steps=None) -> list:
    """Every spec at every (step, batch size, max response length) of the sweep (same length
    scale as the spec, so the sweep's points share one unit system); none given: ``specs``."""
    if not batch_sizes and not max_response_lens and not steps:
        return list(specs)
    out = []
    for s in specs:
        for st in steps or [s.step]:
            for b in batch_sizes or [s.batch_size]:
                for cap in max_response_lens or [s.max_response_len]:
                    name = (
                        s.name
                        + ("" if not steps else f"/s{st}")
                        + f"/b{b}"
                        + ("" if cap is None else f"/L{cap}")
                    )
                    out.append(
                        dataclasses.replace(
                            s, name=name, step=st, batch_size=b, max_response_len=cap
                        )
                    )
    return out


def _cluster(args: argparse.Namespace):

    dp, tp = args.dp, args.tp
    devices = args.devices if args.devices is not None else dp * tp
    return ClusterSpec(
        devices=devices,
        dp=dp,
        tp=tp,
        throughput_scale=args.throughput_scale,
        interconnect_bytes_per_s=args.interconnect_gbps * 1e9,
        interconnect_latency_s=args.latency_us * 1e-6,
        partition=args.partition,
    )


def _print_profile(prof, repeats: int) -> None:
    print(
        f"calibration points (min / median of >= {repeats} interleaved rounds; "
        "bg = other processes' cores during the fastest call):"
    )
    for pt in prof.points:
        bg = "-" if pt.background_cores is None else f"{pt.background_cores:.2f}"
        print(f"  {pt.kind:<13}{pt.name:<28}{pt.measured_s:>9.4f}s {pt.median_s:>9.4f}s bg {bg}")
    for k, c in prof.engines.items():
        print(
            f"{k}: {c.lin_s_per_flop:.3e} s/lin-FLOP, {c.attn_s_per_flop:.3e} s/attn-FLOP, "
            f"{c.step_s * 1e3:.3f} ms/step, {c.const_s * 1e3:.2f} ms/call "
            f"(fit error mean {c.fit_mape:.1f}%, max {c.fit_max_ape:.1f}%)"
        )
    if prof.auto is not None:
        a = prof.auto
        print(
            f"auto choice: {a.s_per_token * 1e6:.3f} us/token + {a.const_s * 1e3:.3f} ms "
            f"(fit error {a.fit_mape:.1f}%)"
        )
    if prof.rollout is not None:
        r = prof.rollout
        print(
            f"rollout: {r.prefill_s_per_flop:.3e} s/prefill-FLOP, "
            f"{r.decode_lin_s_per_flop:.3e} s/decode-lin-FLOP, "
            f"{r.decode_attn_s_per_flop:.3e} s/decode-attn-FLOP, "
            f"{r.decode_step_s * 1e3:.3f} ms/decode step, "
            f"{r.call_s * 1e3:.2f} ms/call (fit error mean {r.fit_mape:.1f}%, max "
            f"{r.fit_max_ape:.1f}%)"
        )


def _simulate_joint(args: argparse.Namespace) -> int:
    """--joint: calibrate and replay in the same timing rounds, save both, validate."""

    out = Path(args.out)
    kinds = args.engines or ["dense", "dfs", "prefix_reuse", "auto"]
    cfg = ReplayConfig(
        engines=tuple(kinds),
        repeats=args.repeats,
        rollout=not args.no_rollout,
        rollout_repeats=args.repeats,
        tool_time_scale=args.tool_time_scale,
        quiet_cores=args.quiet_cores or None,
        quiet_budget_s=args.quiet_budget,
    )
    prof, res = calibrate_and_replay(_workload_specs(args), kinds, cfg, log=print)
    prof.save(args.profile)
    _print_profile(prof, args.repeats)
    res.save(out / "replay.json")
    print(res.table())
    rep = validate(prof, json.loads(json.dumps(res.to_dict())), target=args.target)
    write_json(out / "validation.json", rep.to_dict())
    rep.plot(out / "validation.png")
    print(rep.table())
    print(f"wrote {args.profile}, {out / 'replay.json'}, {out / 'validation.json'}")
    return 0


def _simulate(args: argparse.Namespace) -> int:

    out = Path(args.out)
    if args.joint:
        return _simulate_joint(args)
    if args.calibrate:
        kinds = args.engines or ["dense", "dfs", "prefix_reuse", "auto"]

        gate = QuietGate(cores=args.quiet_cores or None, budget_s=args.quiet_budget)
        prof = profile_engines(
            tuple(kinds), repeats=args.repeats, rollout=not args.no_rollout, gate=gate, log=print
        )
        prof.save(args.profile)
        _print_profile(prof, args.repeats)
        print(f"wrote {args.profile}")
    try:
        prof = CostProfile.load(args.profile)
        replay_json = load_replay_json(args.validate) if args.validate else None
    except FileNotFoundError as e:  # one-line CLI error (dtarl.cli prints ValueErrors)
        raise ValueError(str(e)) from None
    if replay_json is not None:
        rep = validate(prof, replay_json, engines=args.engines, target=args.target)
        write_json(out / "validation.json", rep.to_dict())
        rep.plot(out / "validation.png")
        print(rep.table())
        print(f"wrote {out / 'validation.json'} and {out / 'validation.png'}")
    if args.sources or not (args.calibrate or args.validate):
        cluster = _cluster(args)
        model = ModelConfig.preset(args.model) if args.model else None
        rows = []
        for spec in _workload_specs(args):
            p = predict_workload(
                spec,
                prof,
                cluster,
                engines=args.engines,
                model=model,
                tool_time_scale=args.tool_time_scale,
            )
            rows.append(dict(spec=spec.to_dict(), prediction=p.to_dict()))
            parts = ", ".join(
                f"{k} {'-' if p.step_s(k) is None else f'{p.step_s(k):.3f}s'} "
                f"(train {e.train_s:.3f}s"
                + (f" as {e.program}" if e.program != k else "")
                + f", all-reduce {e.allreduce_s * 1e3:.2f}ms)"
                for k, e in p.engines.items()
            )
            roll = "not modelled" if p.rollout_s is None else f"{p.rollout_s:.3f}s"
            units = "replay s" if p.tool_in_step_units else "production s, not in the step"
            inf = "-" if p.inference_s is None else f"{p.inference_s:.3f}s"
            print(
                f"{spec.name}: rollout {roll}; tool {p.tool_s:.2f}s, reward {p.reward_s:.2f}s "
                f"({units}); inference {inf}; {parts}"
            )
        path = write_json(out / "simulate.json", dict(kind="dtarl.trace.simulate", workloads=rows))
        print(f"wrote {path}")
    return 0


def _validate(args: argparse.Namespace) -> int:

    rep = validate_production(
        args.rollout,
        fit_steps=args.fit_steps,
        test_steps=args.test_steps,
        reward_trace=args.reward,
        reward_fit_steps=args.reward_fit_steps,
        reward_test_steps=args.reward_test_steps,
        reward=not args.no_reward,
    )
    print(rep.table())
    out = Path(args.out)
    js = write_json(out / "production.json", rep.to_dict())
    png = rep.plot(out / "production.png")
    print(f"wrote {js} and {png}")
    return 0


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "sources",
        nargs="*",
        help="trace paths or 'fitted:math'/'fitted:tool' (default: the real-trace suite)",
    )
    p.add_argument("--batch-size", type=int, default=4, help="prompt groups per workload")
    p.add_argument("--n-sampling", type=int, default=None)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length-scale", type=float, default=None, help="default: from --max-len")
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="auto length scale: longest sequence -> this many tokens (default 256 / per suite)",
    )
    p.add_argument("--mode", choices=("trajectory", "per_turn"), default="trajectory")
    p.add_argument("--repeats", type=int, default=7, help="timed interleaved rounds (min, median)")
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="time calls when other processes use fewer CPU cores than this (0: no wait)",
    )
    p.add_argument(
        "--quiet-budget", type=float, default=120.0, help="seconds of waiting for quiet, in all"
    )


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``trace`` (report, sample, replay, simulate, validate) to a subparsers.

    Each leaf parser sets ``func`` (call it as ``args.func(args)``; returns an exit code).
    """
    trace = subparsers.add_parser(
        "trace", help="PolyTrace workloads: reports, sampling, replay, simulation"
    )
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

    rpl = sub.add_parser(
        "replay", help="time the rollout/tool/train stages of real workloads per engine"
    )
    _add_workload_args(rpl)
    rpl.add_argument(
        "--engines", nargs="+", default=["dense", "dfs"], help="make_engine kinds to time"
    )
    rpl.add_argument("--warmup", type=int, default=1, help="untimed calls (compile)")
    rpl.add_argument("--tool-clock", choices=("simulated", "sleep"), default="simulated")
    rpl.add_argument(
        "--tool-time-scale",
        type=float,
        default=None,
        help="production -> replay seconds for tool latencies (default: none; tools are "
        "reported apart, no end-to-end total)",
    )
    rpl.add_argument("--tool-latencies", default=None, help="multi-turn trace for latencies")
    rpl.add_argument("--rollout-repeats", type=int, default=3, help="timed rollouts (min, median)")
    rpl.add_argument("--no-rollout", action="store_true", help="skip the rollout stage")
    rpl.add_argument(
        "--inference-passes",
        type=int,
        default=1,
        choices=(0, 1, 2),
        help="forward-only logprob passes per step (old / reference policy)",
    )
    rpl.add_argument("--no-reward", action="store_true", help="skip the sampled reward stage")
    rpl.add_argument(
        "--reward-times",
        default=None,
        help="run whose reward_timings_step_<k>.jsonl to draw from (default: the workload's "
        "own run; a workload without them reports none)",
    )
    rpl.add_argument(
        "--rollout-engine",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: the RolloutEngine, each trajectory continuing after its own tool "
        "wait; static: the reference Sampler, one generate call per turn",
    )
    rpl.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help="sweep: prompt groups"
    )
    rpl.add_argument(
        "--steps", type=int, nargs="+", default=None, help="sweep: trace steps (stage shares)"
    )
    rpl.add_argument(
        "--max-response-lens",
        type=int,
        nargs="+",
        default=None,
        help="sweep: response budget in trace tokens (responses cut, before the length scale)",
    )
    rpl.add_argument("--out", default="trace_replay", help="output directory")
    rpl.set_defaults(func=_replay)

    sim = sub.add_parser(
        "simulate", help="predict step time on a described cluster from a cost profile"
    )
    _add_workload_args(sim)
    sim.add_argument(
        "--engines",
        nargs="+",
        default=None,
        help="engine kinds (calibrate default: dense dfs prefix_reuse auto; otherwise: the "
        "profile's)",
    )
    sim.add_argument("--profile", required=True, help="cost profile JSON (made by --calibrate)")
    sim.add_argument("--calibrate", action="store_true", help="profile this machine first")
    sim.add_argument(
        "--joint",
        action="store_true",
        help="calibrate and replay SOURCEs (default: the suite) in the same timing rounds, then "
        "validate (writes --profile and OUT/replay.json)",
    )
    sim.add_argument("--no-rollout", action="store_true", help="calibrate without the sampler")
    sim.add_argument("--validate", default=None, help="replay JSON to compare predictions with")
    sim.add_argument(
        "--target", type=float, default=0.10, help="relative error target of --validate"
    )
    sim.add_argument(
        "--tool-time-scale",
        type=float,
        default=None,
        help="production -> simulated seconds for tool latencies (default: none; no step total)",
    )
    sim.add_argument("--devices", type=int, default=None, help="default dp x tp")
    sim.add_argument("--dp", type=int, default=1)
    sim.add_argument("--tp", type=int, default=1)
    sim.add_argument("--throughput-scale", type=float, default=1.0)
    sim.add_argument("--interconnect-gbps", type=float, default=50.0, help="GB/s")
    sim.add_argument("--latency-us", type=float, default=10.0)
    sim.add_argument(
        "--partition",
        default="balanced",
        choices=("balanced", "greedy_tokens", "greedy_tree", "karmarkar_karp"),
    )
    sim.add_argument("--model", default=None, help="model preset for FLOPs (default: profile's)")
    sim.add_argument("--out", default="trace_simulate", help="output directory")
    sim.set_defaults(func=_simulate)

    val = sub.add_parser(
        "validate",
        help="fit the traces' production latencies on some steps, predict the held-out ones",
    )
    val.add_argument("--rollout", default=None, help="multi-turn run (default: shared search_r1)")
    val.add_argument("--reward", default=None, help="run with reward timings (default: rllm)")
    val.add_argument("--fit-steps", type=int, nargs="+", default=None, help="default: 1st half")
    val.add_argument("--test-steps", type=int, nargs="+", default=None, help="default: the rest")
    val.add_argument("--reward-fit-steps", type=int, nargs="+", default=None)
    val.add_argument("--reward-test-steps", type=int, nargs="+", default=None)
    val.add_argument("--no-reward", action="store_true", help="rollout only")
    val.add_argument("--out", default="trace_validate", help="output directory (JSON + PNG)")
    val.set_defaults(func=_validate)
    return trace
