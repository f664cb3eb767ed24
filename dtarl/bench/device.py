"""``dtarl bench device``: what only an accelerator can answer, in one command.

One run (<= 8 minutes on one H100/H200) of five sections, each timed on the device
it runs on, each written to the JSON and Markdown outputs as soon as it finishes (a
run stopped half-way keeps what it measured):

  ceilings   the two rates everything else is judged against: a bf16 matmul
             (8192^3 on random data) in TFLOP/s, and a device-to-device copy in
             GB/s (bytes read + written); plus the datasheet bf16 peak where the
             device kind is known.
  kernels    the Pallas chunk-attention kernel (``pallas_kernels.chunk_attention``)
             against ``jax.nn.dot_product_attention`` with XLA and cuDNN, bf16,
             head_dim 128, Qwen3-0.6B's heads (16 q / 8 kv), at prefix 4k and 16k
             and chunk 128 / 256 / 512: compile seconds, forward and forward +
             backward TFLOP/s of useful (visible-pair) work, as in
             ``pallas_kernels.bench``; then a small block-size sweep of the kernel.
  rollout    the continuous rollout engine vs the static sampler at the
             Qwen3-0.6B shape (bf16 compute): decode tokens/s on synthetic
             long-tailed lengths (``dtarl bench rollout``'s measurement).
  pat        the PAT profile's tp=1 curve on the one device: decode seconds per
             step against live slots (``dtarl.bench.pat_profile``).
  engines    every training engine's step at the Qwen3-0.6B shape with bf16
             compute and fp32 master weights, side by side (``dtarl bench train``'s
             measurement on one GRPO workload): step seconds, compile seconds,
             speed-up vs dense, measured / ideal, and MFU: the engine's useful
             FLOPs (dense: every sequence; tree engines: every tree node once) per
             second over the measured matmul ceiling and over the datasheet peak.

On a CPU ``--dry-run`` checks instead that every program lowers for the ``cuda``
and ``tpu`` platforms (no compile; nothing is timed): the Pallas kernels natively
(Triton for cuda, Mosaic for tpu, forward and backward), each training engine's
value-and-grad program and the rollout engine's prefill / decode / extend
programs on the tiny model (the XLA attention backend).

Outputs: ``--out DIR`` gets ``device.json`` and ``device.md``; ``--docs PATH``
splices the Markdown between the ``<!-- device-bench -->`` markers of that file
(``docs/benchmarks.md``), adding them at its end the first time.
``--render JSON --docs PATH`` does the splice from a saved run.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dtarl.bench import device_dry
from dtarl.bench.report import markdown, write_json

SECTIONS = ("ceilings", "kernels", "rollout", "pat", "engines")

# Dense bf16 tensor-core peak (vendor datasheets, SXM parts), TFLOP/s, by device_kind prefix.
DATASHEET_BF16_TFLOPS = {
    "NVIDIA H100": 989.4,
    "NVIDIA H200": 989.4,
    "NVIDIA A100": 312.0,
    "TPU v5 lite": 197.0,
    "TPU v5": 459.0,
    "TPU v4": 275.0,
    "TPU v6 lite": 918.0,
}

MARK_BEGIN = "<!-- device-bench:begin -->"
MARK_END = "<!-- device-bench:end -->"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceBenchConfig:
    """What a run measures. ``quick``: smaller shapes everywhere (a smoke run)."""

    prefixes: tuple[int, ...] = (4096, 16384)
    chunks: tuple[int, ...] = (128, 256, 512)
    heads: tuple[int, int] = (16, 8)
    head_dim: int = 128
    blocks: tuple[tuple[int, int], ...] = ((64, 64), (64, 128), (128, 64), (128, 128))
    iters: int = 10
    model: str = "qwen3_0p6b"
    layers: int | None = None  # None: the preset's depth
    engines: tuple[str, ...] = ("dense", "dfs", "prefix_reuse")
    workload: str = "grpo_G8_prompt>>resp"
    repeats: int = 3
    rollout_prompts: int = 8
    rollout_group: int = 8
    rollout_prompt_len: int = 256
    rollout_new_tokens: int = 512
    rollout_slots: int = 64
    rollout_workloads: tuple[str, ...] = ("math",)
    pat_levels: int = 3

    @classmethod
    def quick(cls) -> DeviceBenchConfig:
        return cls(
            prefixes=(256,),
            chunks=(64,),
            heads=(4, 2),
            head_dim=64,
            blocks=((32, 32),),
            iters=2,
            model="tiny",
            repeats=1,
            rollout_prompts=2,
            rollout_group=4,
            rollout_prompt_len=16,
            rollout_new_tokens=32,
            rollout_slots=8,
        )


def datasheet_peak(kind: str) -> float | None:
    """The datasheet bf16 peak (TFLOP/s) of a device kind, or None when unknown."""
    for prefix in sorted(DATASHEET_BF16_TFLOPS, key=len, reverse=True):
        if kind.startswith(prefix):
            return DATASHEET_BF16_TFLOPS[prefix]
    return None


def _median_seconds(fn, args, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model_config(cfg: DeviceBenchConfig, *, bf16: bool):
    from dtarl.model import ModelConfig

    m = ModelConfig.tiny() if cfg.model == "tiny" else ModelConfig.preset(cfg.model)
    over: dict[str, Any] = {}
    if cfg.layers is not None:
        over["num_layers"] = cfg.layers
    if bf16:
        over["compute_dtype"] = "bfloat16"
    return dataclasses.replace(m, **over) if over else m


# ----------------------------------------------------------------------------- sections


def ceilings(cfg: DeviceBenchConfig, log: Callable[[str], None]) -> dict:
    """Measured matmul and copy rates of this device, and its datasheet peak."""
    n = 8192 if jax.default_backend() != "cpu" else 512
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    t = _median_seconds(mm, (a, b), iters=10, warmup=3)
    matmul = 2.0 * n**3 / t / 1e12
    size = (1 << 30) if jax.default_backend() != "cpu" else (1 << 24)
    x = jnp.ones((size // 4,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)  # one read, one write of every byte
    tc = _median_seconds(copy, (x,), iters=10, warmup=3)
    kind = jax.devices()[0].device_kind
    row = dict(
        device_kind=kind,
        matmul_n=n,
        matmul_tflops=matmul,
        copy_bytes=2 * size,
        copy_gbps=2 * size / tc / 1e9,
        datasheet_bf16_tflops=datasheet_peak(kind),
    )
    log(
        f"ceilings on {kind}: bf16 matmul {n}^3 {matmul:.0f} TFLOP/s; copy "
        f"{row['copy_gbps']:.0f} GB/s; datasheet {row['datasheet_bf16_tflops']}"
    )
    return row


def _compile_seconds(fn, args) -> tuple[float, Any]:
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return time.perf_counter() - t0, compiled


def _attention_case(C: int, P: int, hq: int, hkv: int, d: int):
    from pallas_kernels.chunk_attention import chunk_attention

    S = P + C
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, C, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (1, S, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (1, S, hkv, d), jnp.bfloat16)
    start = jnp.full((1,), P, jnp.int32)
    kv_len = jnp.full((1,), S, jnp.int32)
    mask = (jnp.arange(S)[None, :] <= P + jnp.arange(C)[:, None])[None, None]
    pairs = C * P + C * (C + 1) // 2
    fwd_flops = 4.0 * pairs * d * hq

    def impl(name: str, block_q: int | None = None, block_k: int | None = None):
        if name == "pallas":
            kw = {} if block_q is None else dict(block_q=block_q, block_k=block_k)
            return lambda q, k, v: chunk_attention(q, k, v, start, kv_len, **kw)
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=name)

    return (q, k, v), fwd_flops, impl


def _time_attention(attn, args, fwd_flops: float, iters: int) -> dict:
    fwd = jax.jit(attn)
    grad = jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    )
    row: dict[str, Any] = {}
    try:
        row["fwd_compile_s"], cf = _compile_seconds(fwd, args)
        t = _median_seconds(cf, args, iters)
        row.update(fwd_ms=t * 1e3, fwd_tflops=fwd_flops / t / 1e12)
        row["bwd_compile_s"], cg = _compile_seconds(grad, args)
        t = _median_seconds(cg, args, iters)
        row.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * fwd_flops / t / 1e12)
    except Exception as e:  # noqa: BLE001 - an implementation may be unavailable here
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return row


def kernels(cfg: DeviceBenchConfig, log: Callable[[str], None]) -> dict:
    """The chunk-attention kernel vs XLA and cuDNN (module docstring)."""
    hq, hkv = cfg.heads
    impls = ("pallas", "xla", "cudnn") if jax.default_backend() == "gpu" else ("pallas", "xla")
    rows = []
    for P in cfg.prefixes:
        for C in cfg.chunks:
            args, flops, impl = _attention_case(C, P, hq, hkv, cfg.head_dim)
            for name in impls:
                r = dict(prefix=P, chunk=C, impl=name) | _time_attention(
                    impl(name), args, flops, cfg.iters
                )
                rows.append(r)
                log("  " + _kernel_line(r))
    sweep = []
    P, C = cfg.prefixes[0], cfg.chunks[len(cfg.chunks) // 2]
    args, flops, impl = _attention_case(C, P, hq, hkv, cfg.head_dim)
    for bq, bk in cfg.blocks:
        r = dict(prefix=P, chunk=C, impl="pallas", block_q=bq, block_k=bk)
        r |= _time_attention(impl("pallas", bq, bk), args, flops, cfg.iters)
        sweep.append(r)
        log(f"  blocks ({bq}, {bk}): " + _kernel_line(r))
    return dict(heads=cfg.heads, head_dim=cfg.head_dim, rows=rows, block_sweep=sweep)


def _kernel_line(r: dict) -> str:
    head = f"P={r['prefix']:6d} C={r['chunk']:4d} {r['impl']:7s}"
    if "error" in r and "fwd_ms" not in r:
        return f"{head} unavailable: {r['error']}"
    line = f"{head} fwd {r['fwd_tflops']:7.1f} TFLOP/s (compile {r['fwd_compile_s']:.1f} s)"
    if "fwdbwd_tflops" in r:
        line += f" | fwd+bwd {r['fwdbwd_tflops']:7.1f} TFLOP/s (compile {r['bwd_compile_s']:.1f} s)"
    elif "error" in r:
        line += f" | bwd unavailable: {r['error']}"
    return line


def rollout(cfg: DeviceBenchConfig, log: Callable[[str], None]) -> dict:
    """Continuous engine vs static sampler decode tokens/s at the model shape (bf16)."""
    from dtarl.bench import rollout as rb

    bench_cfg = rb.RolloutBenchConfig(
        prompts=cfg.rollout_prompts,
        group_size=cfg.rollout_group,
        prompt_len=cfg.rollout_prompt_len,
        max_new_tokens=cfg.rollout_new_tokens,
        slots=cfg.rollout_slots,
        rounds=2,
    )
    out = rb.run(
        model_cfg=_model_config(cfg, bf16=True),
        cfg=bench_cfg,
        synthetic=True,
        workloads=list(cfg.rollout_workloads),
        kv=False,
        verbose=False,
    )
    rows = [
        {k: r[k] for k in ("workload", "sampler", "tokens_per_s", "seconds", "generated_tokens")}
        | {"slot_utilisation": r["slot_utilisation"]}
        for r in out["rows"]
    ]
    for r in rows:
        log(
            f"  {r['workload']:12s} {r['sampler']:7s} {r['tokens_per_s']:9.0f} tok/s "
            f"({r['generated_tokens']} tokens in {r['seconds']:.2f} s)"
        )
    return dict(config=dataclasses.asdict(bench_cfg), rows=rows)


def pat(cfg: DeviceBenchConfig, log: Callable[[str], None]) -> dict:
    """The PAT profile's tp=1 curve: decode seconds per step vs live slots."""
    from flax import nnx

    from dtarl.bench.pat_profile import ProfileGrid, profile_engine
    from dtarl.model import init_model
    from dtarl.rollout.config import ContinuousConfig

    model = init_model(_model_config(cfg, bf16=True), seed=0)
    weights = nnx.split(model, nnx.Param)[1]
    slots = cfg.rollout_slots
    grid = ProfileGrid(
        engine=ContinuousConfig(
            slots=slots,
            groups=max(1, slots // cfg.rollout_group),
            group_size=cfg.rollout_group,
            prompt_len=min(64, cfg.rollout_prompt_len),
            response_len=cfg.rollout_new_tokens // 2,
            steps_per_call=8,
            prefill_batch=8,
        ),
        levels=cfg.pat_levels,
        repeats=2,
        tps=(1,),
    )
    profile = profile_engine(model, weights, grid, devices=jax.devices()[:1])
    rows = profile_rows(profile)
    for r in rows:
        log(
            f"  tp=1 slots {r['slots']:4d} context {r['context']:5d}: "
            f"{r['seconds_per_step'] * 1e3:8.3f} ms/step"
        )
    return dict(rows=rows)


def profile_rows(profile) -> list[dict]:
    """The tp=1 decode rows of a PAT ``Profile``: slots ``b``, context ``l``, seconds per step."""
    rows = [
        dict(slots=int(r["b"]), context=int(r["l"]), seconds_per_step=float(r["seconds"]))
        for r in profile.decode
        if int(r["tp"]) == 1
    ]
    return sorted(rows, key=lambda r: (r["context"], r["slots"]))


def engines(cfg: DeviceBenchConfig, log: Callable[[str], None], ceiling: float | None) -> dict:
    """Every engine's step at the model shape, bf16 compute, side by side (bench train)."""
    from dtarl.bench import train as tb
    from dtarl.engines.cost import dense_flops, tree_flops

    model_cfg = _model_config(cfg, bf16=True)
    wl = [w for w in tb.synthetic_workloads() if w.name == cfg.workload]
    if not wl:
        raise ValueError(f"engines: unknown workload {cfg.workload!r}")
    batch = wl[0].make()
    flops = dict(dense=dense_flops(model_cfg, batch), tree=tree_flops(model_cfg, batch))
    out = tb.run(
        model_cfg=model_cfg,
        engines=list(cfg.engines),
        workloads=[cfg.workload],
        repeats=cfg.repeats,
        log=lambda s: None,
    )
    peak = datasheet_peak(jax.devices()[0].device_kind)
    rows = []
    for name, e in out["workloads"][0]["engines"].items():
        useful = flops["dense"] if name.startswith("dense") else flops["tree"]
        rate = useful / e["step_seconds"] / 1e12
        rows.append(
            dict(
                engine=name,
                step_s=e["step_seconds"],
                compile_s=e["compile_seconds"],
                speedup_vs_dense=e.get("speedup_vs_dense"),
                measured_over_ideal=e.get("measured_over_ideal"),
                useful_tflops=rate,
                mfu_vs_matmul=rate / ceiling if ceiling else None,
                mfu_vs_datasheet=rate / peak if peak else None,
                peak_bytes=e.get("peak_bytes"),
            )
        )
        log("  " + _engine_line(rows[-1]))
    w = out["workloads"][0]
    return dict(
        model=cfg.model,
        layers=model_cfg.num_layers,
        workload=cfg.workload,
        sequences=w["sequences"],
        num_tokens=w["num_tokens"],
        tree_tokens=w["tree_tokens"],
        ideal_ratio=w["ideal_ratio"],
        dense_flops=flops["dense"],
        tree_flops=flops["tree"],
        rows=rows,
    )


def _engine_line(r: dict) -> str:
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    return (
        f"{r['engine']:13s} step {r['step_s'] * 1e3:8.1f} ms, compile {r['compile_s']:6.1f} s, "
        f"x dense {f(r['speedup_vs_dense'])}, meas/ideal {f(r['measured_over_ideal'])}, "
        f"{r['useful_tflops']:.1f} TFLOP/s, MFU {f(r['mfu_vs_datasheet'], 3)}"
    )


# ----------------------------------------------------------------------------- report


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def render(result: dict) -> str:
    """The Markdown of a run (the section ``--docs`` splices into docs/benchmarks.md)."""
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    m = result.get("machine", {})
    lines = [
        f"### Device benchmark: `{result.get('command', 'dtarl bench device')}`",
        "",
        f"Commit {result.get('commit', '?')}, device {m.get('device_kind', '?')} "
        f"({m.get('backend', '?')}, jax {m.get('jax', '?')}), {result.get('date', '?')}.",
        "",
    ]
    s = result.get("sections", {})
    if "ceilings" in s and "error" not in s["ceilings"]:
        c = s["ceilings"]
        lines += [
            f"Ceilings: bf16 matmul {c['matmul_n']}^3 **{c['matmul_tflops']:.0f} TFLOP/s** "
            f"(datasheet {c['datasheet_bf16_tflops']}); device copy "
            f"**{c['copy_gbps']:.0f} GB/s** (read + write).",
            "",
        ]
    if "kernels" in s and "rows" in s["kernels"]:
        k = s["kernels"]
        lines += [
            f"Chunk attention, bf16, heads {k['heads'][0]}/{k['heads'][1]}, head_dim "
            f"{k['head_dim']}, useful TFLOP/s (compile s):",
            "",
        ]
        lines += markdown(
            ["prefix", "chunk", "impl", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "compile fwd / bwd s"],
            [
                [
                    r["prefix"],
                    r["chunk"],
                    r["impl"],
                    f(r.get("fwd_tflops")),
                    f(r.get("fwdbwd_tflops")),
                    f"{f(r.get('fwd_compile_s'))} / {f(r.get('bwd_compile_s'))}"
                    if "error" not in r
                    else r["error"][:60],
                ]
                for r in k["rows"]
                + [r | {"impl": f"pallas {r['block_q']}x{r['block_k']}"} for r in k["block_sweep"]]
            ],
        )
        lines.append("")
    if "engines" in s and "rows" in s["engines"]:
        e = s["engines"]
        lines += [
            f"Engines at {e['model']} ({e['layers']} layers), bf16 compute / fp32 master, "
            f"workload {e['workload']}: {e['sequences']} sequences, {e['num_tokens']} tokens, "
            f"{e['tree_tokens']} tree tokens, ideal x{e['ideal_ratio']:.2f}:",
            "",
        ]
        lines += markdown(
            ["engine", "step ms", "compile s", "x dense", "meas/ideal", "TFLOP/s", "MFU"],
            [
                [
                    r["engine"],
                    f(r["step_s"] * 1e3),
                    f(r["compile_s"]),
                    f(r["speedup_vs_dense"], 2),
                    f(r["measured_over_ideal"], 2),
                    f(r["useful_tflops"]),
                    f(r["mfu_vs_datasheet"], 3),
                ]
                for r in e["rows"]
            ],
        )
        lines.append("")
    if "rollout" in s and "rows" in s["rollout"]:
        lines += ["Rollout decode at the model shape (bf16):", ""]
        lines += markdown(
            ["workload", "sampler", "tokens/s", "seconds", "slot use"],
            [
                [
                    r["workload"],
                    r["sampler"],
                    f(r["tokens_per_s"], 0),
                    f(r["seconds"], 2),
                    f(r["slot_utilisation"], 2),
                ]
                for r in s["rollout"]["rows"]
            ],
        )
        lines.append("")
    if "pat" in s and "rows" in s["pat"]:
        lines += ["PAT profile, tp=1: decode ms per step by live slots and context:", ""]
        lines += markdown(
            ["slots", "context", "ms/step"],
            [
                [r["slots"], r["context"], f(r["seconds_per_step"] * 1e3, 3)]
                for r in s["pat"]["rows"]
            ],
        )
        lines.append("")
    for name, sec in s.items():
        if "error" in sec:
            lines.append(f"Section `{name}` failed: {sec['error']}")
    if "dry_run" in result:
        d = result["dry_run"]
        lines += [f"Dry run: {len(d['rows']) - d['failed']} of {len(d['rows'])} lowerings ok", ""]
        lines += markdown(
            ["program", "platform", "result"],
            [
                [r["program"], r["platform"], "ok" if r["ok"] else r["error"][:80]]
                for r in d["rows"]
            ],
        )
    return "\n".join(lines).rstrip() + "\n"


def splice_docs(md: str, path: str | Path) -> Path:
    """Puts ``md`` between the device-bench markers of ``path`` (appended the first time)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    block = f"{MARK_BEGIN}\n{md.rstrip()}\n{MARK_END}"
    if MARK_BEGIN in text and MARK_END in text:
        text = re.sub(
            re.escape(MARK_BEGIN) + ".*?" + re.escape(MARK_END),
            lambda _: block,
            text,
            flags=re.S,
        )
    else:
        text = text.rstrip() + "\n\n## Device benchmark (`dtarl bench device`)\n\n" + block + "\n"
    path.write_text(text)
    return path


def run(
    *,
    cfg: DeviceBenchConfig | None = None,
    sections: Sequence[str] = SECTIONS,
    out: str | Path | None = None,
    docs: str | Path | None = None,
    dry: bool = False,
    command: str = "dtarl bench device",
    log: Callable[[str], None] = print,
) -> dict:
    """Runs the sections (or the dry run), writing outputs after each; returns the result."""
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"--sections: unknown {unknown}; accepted: {list(SECTIONS)}")
    cfg = cfg or DeviceBenchConfig()
    dev = jax.devices()[0]
    result: dict[str, Any] = dict(
        command=command,
        commit=_git_commit(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=dict(
            backend=jax.default_backend(),
            device_kind=dev.device_kind,
            devices=jax.device_count(),
            jax=jax.__version__,
        ),
        config=dataclasses.asdict(cfg),
        sections={},
    )

    def save() -> None:
        if out is not None:
            write_json(Path(out) / "device.json", result)
            (Path(out) / "device.md").write_text(render(result))

    if dry:
        result["dry_run"] = device_dry.dry_run(log)
        save()
        return result
    ceiling = None
    for name in sections:
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            if name == "engines":
                row = engines(cfg, log, ceiling)
            else:
                row = {"ceilings": ceilings, "kernels": kernels, "rollout": rollout, "pat": pat}[
                    name
                ](cfg, log)
        except Exception as e:  # noqa: BLE001 - a failed section must not lose the others
            traceback.print_exc()
            first = str(e).splitlines()[0][:300] if str(e) else ""
            row = dict(error=f"{type(e).__name__}: {first}")
        row["seconds"] = time.perf_counter() - t0
        if name == "ceilings" and "matmul_tflops" in row:
            ceiling = row["matmul_tflops"]
        result["sections"][name] = row
        log(f"   ({row['seconds']:.0f} s)")
        save()
    if docs is not None:
        splice_docs(render(result), docs)
    return result


def render_saved(json_path: str | Path, docs: str | Path) -> Path:
    """``--render``: splices a saved run's Markdown into ``docs``."""
    result = json.loads(Path(json_path).read_text())
    return splice_docs(render(result), docs)
