"""``dtarl bench lora|scale|plan``: the size and cost benches (LoRA's bytes and step
time, the per-device memory report, host planning). Thin: parse arguments, call
``dtarl.bench``; ``dtarl.commands.bench`` registers them."""

from __future__ import annotations

import argparse

from dtarl.bench import lora as bench_lora
from dtarl.bench import plan as bench_plan
from dtarl.bench import report
from dtarl.bench import scale as bench_scale_compile
from dtarl.bench import scale_memory as bench_scale_memory
from dtarl.commands.bench_generation import simulated_devices
from dtarl.model import ModelConfig

__all__ = ["add_lora", "add_plan", "add_scale", "add_scale_memory_arguments", "scale_memory"]


# ----------------------------------------------------------------------------- lora


def add_lora(sub) -> None:
    p = sub.add_parser(
        "lora",
        help="LoRA vs full fine-tuning: per-device bytes (Qwen3) and CPU step time",
        description=bench_lora.__doc__,
    )
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", nargs="+", help="default: every projection")
    p.add_argument("--no-kl", dest="kl", action="store_false", help="no KL reference")
    p.add_argument("--shards", type=int, default=1, help="devices the state is split over")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per engine")
    p.add_argument(
        "--engines", nargs="*", default=list(bench_lora.ENGINES), help="(none: memory only)"
    )
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=_lora)


def _lora(args) -> int:
    from dtarl.lora import LoraConfig

    kw = dict(rank=args.rank, alpha=args.alpha)
    if args.targets:
        kw["targets"] = tuple(args.targets)
    res = bench_lora.run(
        LoraConfig(**kw), kl=args.kl, shards=args.shards, engines=args.engines, rounds=args.rounds
    )
    if args.json:
        report.write_json(args.json, res, say=print)
    return 0


# ----------------------------------------------------------------------------- scale


def add_scale(sub) -> None:
    p = sub.add_parser(
        "scale",
        help="a real model's shape: per-device memory of a GRPO step (compiled, not run), "
        "or with --compile the compile and step seconds of every engine per depth",
        description=(bench_scale_memory.__doc__ or "") + "\n" + (bench_scale_compile.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile and step seconds of every engine and the rollout warm-up at each "
        "--layers depth (dtarl.bench.scale) instead of the memory report",
    )
    add_scale_memory_arguments(p)
    p.add_argument("--repeats", type=int, default=2, help="--compile: timed steps after the first")
    p.add_argument(
        "--no-rollout", dest="rollout", action="store_false", help="--compile: skip the rollout"
    )
    p.add_argument("--logits-chunk", type=int, help="--compile: the model's logits_chunk")
    p.set_defaults(func=_scale)


def add_scale_memory_arguments(p) -> None:
    """The arguments of ``dtarl bench scale`` (defaults per mode: ``MEMORY`` / ``COMPILE``)."""
    m = bench_scale_memory
    p.add_argument(
        "--model", nargs="+", choices=m.MODELS, help="default qwen3_8b (--compile: qwen3_0p6b)"
    )
    p.add_argument(
        "--mesh",
        nargs="+",
        default=["dp=1,fsdp=8,tp=1"],
        help="one or more dp=..,fsdp=..,tp=.. (their product: the simulated devices)",
    )
    p.add_argument("--engine", "--engines", dest="engine", nargs="+", help="default: every engine")
    p.add_argument(
        "--group", type=int, help="GRPO group size G (one group; default 8, --compile 4)"
    )
    p.add_argument("--prompt", type=int, help="prompt tokens (default 1024, --compile 64)")
    p.add_argument("--response", type=int, help="response tokens (default 1024, --compile 32)")
    p.add_argument(
        "--layers",
        help="compile at this depth (default: the model's); --compile: depths, e.g. 7,28",
    )
    p.add_argument(
        "--extrapolate",
        type=int,
        nargs=2,
        metavar=("L1", "L2"),
        help="compile at depths L1 and L2 and extrapolate bytes linearly to the model's depth "
        "(rough: under the layer scan the peak is not linear in depth; prefer full depth)",
    )
    p.add_argument("--device-memory", type=float, metavar="GiB", help="per-device budget")
    p.add_argument(
        "--fsdp-gather",
        choices=["step", "layer"],
        default="layer",
        help="memory report: FSDP gathers the whole model before the step, or each layer "
        "inside the layer scan (mesh.fsdp_gather; default layer)",
    )
    p.add_argument(
        "--remat",
        choices=["none", "full", "dots_saveable", "offload"],
        help="the layers' rematerialisation, memory report and --compile (default: the "
        "preset's, none)",
    )
    p.add_argument(
        "--lora",
        type=int,
        nargs="+",
        default=[0],
        metavar="RANK",
        help="LoRA ranks, a row each (0: full fine-tuning; default 0), e.g. --lora 0 16; "
        "memory report only",
    )
    p.add_argument(
        "--lora-fused",
        action="store_true",
        help="LoRA rows: also compile merge + step + adapter gradients as one program "
        "(dtarl.lora.fused_step) and report its peak (fused_peak_bytes)",
    )
    p.add_argument(
        "--lora-base-dtype",
        choices=bench_scale_memory.BASE_DTYPES,
        help="LoRA rows: the frozen base's dtype (default float32, the full rows' master "
        "weights; bfloat16: the trainer with model.param_dtype bfloat16)",
    )
    p.add_argument("--json", help="write the rows here")


MEMORY = dict(model=["qwen3_8b"], group=8, prompt=1024, response=1024)
COMPILE = dict(model=["qwen3_0p6b"], group=4, prompt=64, response=32, layers="7,28")


def _defaults(args: argparse.Namespace, defaults: dict) -> None:
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def _scale(args: argparse.Namespace) -> int:
    if args.compile:
        return scale_compile(args)
    _defaults(args, MEMORY)
    if args.layers is not None:
        try:
            args.layers = int(args.layers)
        except ValueError:
            raise bench_scale_memory.ConfigError(
                f"--layers {args.layers!r}: one depth >= 1 (several only with --compile)"
            ) from None
    if args.engine is None:
        args.engine = list(bench_scale_memory.ENGINES)
    bad = [e for e in args.engine if e not in bench_scale_memory.ENGINES]
    if bad:
        raise bench_scale_memory.ConfigError(
            f"--engine {bad}: accepted {list(bench_scale_memory.ENGINES)}"
        )
    return scale_memory(args)


def scale_compile(args: argparse.Namespace) -> int:
    """``dtarl bench scale --compile``: compile and step seconds per depth."""
    _defaults(args, COMPILE)
    if getattr(args, "lora", [0]) != [0]:
        raise bench_scale_memory.ConfigError(
            f"--lora {args.lora} is for the memory report; --compile times full fine-tuning "
            "only (drop --lora, or drop --compile)"
        )
    if len(args.model) != 1:
        raise bench_scale_memory.ConfigError(f"--compile takes one --model, got {args.model}")
    try:
        layers = [int(x) for x in str(args.layers).split(",") if x.strip()]
    except ValueError:
        raise bench_scale_memory.ConfigError(
            f"--layers {args.layers!r}: expected depths like 7,28"
        ) from None
    result = bench_scale_compile.run_compile(
        model=args.model[0],
        layers=layers,
        engines=args.engine or bench_scale_compile.ENGINES,
        group=args.group,
        prompt=args.prompt,
        response=args.response,
        repeats=args.repeats,
        rollout=args.rollout,
        logits_chunk=args.logits_chunk,
        remat=args.remat,
    )
    if args.json:
        report.write_json(args.json, result, say=print)
    return 0


def scale_memory(args: argparse.Namespace) -> int:
    """``dtarl bench scale`` without ``--compile``: the memory report."""
    m = bench_scale_memory
    meshes = [m.parse_mesh(t) for t in args.mesh]
    need = max(x["dp"] * x["fsdp"] * x["tp"] for x in meshes)
    simulated_devices(need)
    import jax

    have = len(jax.devices())
    for t, x in zip(args.mesh, meshes, strict=True):
        if x["dp"] * x["fsdp"] * x["tp"] > have:
            m.parse_mesh(t, have)  # raises, naming the axes and the accepted values
    for name in ("group", "prompt", "response"):
        if getattr(args, name) < 1:
            raise m.ConfigError(f"--{name}={getattr(args, name)}: must be >= 1")
    m.check_ranks(args.lora)
    rows = m.run(
        args.model,
        meshes,
        args.engine,
        group=args.group,
        prompt=args.prompt,
        response=args.response,
        layers=args.layers,
        extrapolate_from=tuple(args.extrapolate) if args.extrapolate else None,
        device_memory_gib=args.device_memory,
        fsdp_gather=args.fsdp_gather,
        remat=args.remat,
        lora_ranks=args.lora,
        lora_fused=args.lora_fused,
        lora_base_dtype=args.lora_base_dtype,
    )
    if args.json:
        report.write_json(args.json, m.json_rows(rows), say=print)
    return 0


# ----------------------------------------------------------------------------- plan


def add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="DFS host planning: trie, order and plan seconds per 1k sequences, plan bytes",
        description=bench_plan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=2048, help="median response length")
    p.add_argument("--max-response", type=int, default=16384)
    p.add_argument("--chunk-len", type=int, default=128)
    p.add_argument("--model", default="qwen3_0p6b", help=f"preset, one of {ModelConfig.PRESETS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="do not time the pure-Python reference compiler beside compile_plan",
    )
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    for name in ("prompts", "group", "prompt_len", "response_len", "max_response"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    for name in ("chunk_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    res = bench_plan.run(
        prompts=args.prompts,
        group=args.group,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        max_response=args.max_response,
        chunk_len=args.chunk_len,
        model=args.model,
        rounds=args.rounds,
        reference=args.reference,
    )
    print(bench_plan.format_report(res))
    if args.json:
        report.write_json(args.json, res, say=print)
    return 0
