"""``dtarl bench rollout``: the static sampler and the continuous-batching engine side by side.

Both samplers generate the same requests: ``prompts`` prompts of ``prompt_len``
random tokens, ``group_size`` (G) samples each, every sample forced to an exact
length (stop tokens ignored), so both produce identical token counts and only
the schedule differs:

* ``static`` (``dtarl.rollout.Sampler``, the reference): one batch of all
  ``prompts x G`` rows (bucketed to a power of two); every row decodes until the
  longest is done. Its K/V cache is ``[L, B, P + R, K, D]`` for K and for V, so
  its peak K/V bytes are ``2 L B S K D itemsize`` (B rows bucket, S = prompt
  bucket + response bucket), read from the cache it built. Row b is active at
  decode step t while ``t < len_b - 1`` (prefill draws token 0); the batch is
  the full row bucket at every step, so its slot utilisation is mean active / B.
* ``engine`` (``dtarl.rollout.continuous.ContinuousSampler``): ``slots`` decode
  slots over a prompt-shared K/V pool; a finished request frees its slot and a
  waiting one is admitted. Peak K/V bytes are the rows the engine holds (each
  resident prompt once + every slot's response so far) at their largest, read
  call by call in an untimed run (``engine_peak_kv``); the allocated pool is
  reported beside them. Active batch and slot utilisation are the engine's
  (``stats()``) in the last timed call.

Workloads (response lengths only; token ids are random):

* ``math``, ``coding``: a step of the PolyTrace verl math (DAPO) and rllm coding
  runs, ``prompts`` groups of G responses, scaled so that the batch's longest
  response maps to ``max_new_tokens`` (never stretched).
* ``search_turns``: search_r1 multi-turn trajectories; member j of a group
  generates one model turn (drawn at random) of trajectory j: the per-turn
  generations of a tool-use rollout, scaled the same way.
* ``uniform``: every sample ``max_new_tokens`` long (the static sampler's best case).

Without the traces (``--synthetic``, or no PolyTrace folder) the trace workloads
are lognormal stand-ins, capped at ``max_new_tokens`` (``synthetic_lengths``),
and the output says so.

Timing: both samplers are warmed up first (the engine compiles every program
with ``RolloutEngine.warmup``; the static sampler runs one untimed generate of
the workload's shape, all workloads sharing one reserved shape), then timed in
interleaved rounds (``dtarl.timing.interleaved_rounds``: alternating order, one
``generate`` per turn, wall clock of the whole call including host work).
tokens/s = generated tokens / median seconds.

KV report: K/V bytes of one group of ``kv_group`` samples sharing a
``kv_prompt``-token prompt, for several response lengths: the static
sampler's cache (from its shapes) against the engine's measured peak.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from dtarl.bench import report
from dtarl.model import ModelConfig, init_model
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import (
    ContinuousConfig,
    Request,
    RolloutEngine,
    Status,
)
from dtarl.rollout.sampler import Sampler, SamplingParams
from dtarl.timing import Rounds, Settle, alternating, interleaved_rounds, machine_info
from dtarl.traces import default_polytrace_root
from dtarl.traces.workload import sample_group_specs
from dtarl.tree.plan import bucket

WORKLOADS = ("math", "coding", "search_turns", "uniform")

TRACE_RUNS = {
    "math": "verl/profile/packed_length_log/20260610_092349",
    "coding": "rllm/profile/packed_length_log/20260616_024512",
    "search_turns": "search_r1/profile/multiturn_workload_log/0617_0223",
}

# Synthetic stand-ins: lognormal (mean as a fraction of max_new_tokens, sigma),
# capped at max_new_tokens. sigma 0.75 gives p90 ~ 2x the mean (the math traces).
SYNTHETIC = {
    "math": (0.25, 0.75),
    "coding": (0.55, 0.6),
    "search_turns": (0.15, 0.8),
}


def peer_tiny() -> ModelConfig:
    """The tiny Qwen3 that the decode-speed comparison with Tunix uses (issue #17):
    4 layers, hidden 256, MLP 1024, 4 query / 2 kv heads of 64, vocab 1024, fp32."""
    return ModelConfig.tiny(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutBenchConfig:
    """What ``run`` measures.

    prompts / group_size: the batch is ``prompts`` groups of ``group_size`` samples.
    prompt_len: tokens of every prompt. max_new_tokens: the longest response.
    slots / steps_per_call: the engine's decode batch and tokens per device call.
    rounds: timed turns per sampler and workload.
    kv_group / kv_prompt / kv_responses: the KV report's group, prompt and
      response lengths.
    """

    prompts: int = 8
    group_size: int = 8
    prompt_len: int = 128
    max_new_tokens: int = 256
    slots: int = 32
    steps_per_call: int = 16
    rounds: int = 5
    seed: int = 0
    kv_group: int = 16
    kv_prompt: int = 512
    kv_responses: tuple[int, ...] = (16, 32, 64, 128)

    def __post_init__(self):
        for name in (
            "prompts",
            "group_size",
            "prompt_len",
            "max_new_tokens",
            "slots",
            "steps_per_call",
            "rounds",
            "kv_group",
            "kv_prompt",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RolloutBenchConfig.{name}={value!r}: must be an int >= 1")
        if not self.kv_responses or min(self.kv_responses) < 1:
            raise ValueError(
                f"RolloutBenchConfig.kv_responses={self.kv_responses!r}: need ints >= 1"
            )

    @classmethod
    def quick(cls, **overrides) -> RolloutBenchConfig:
        """The reduced run of ``--quick`` (every workload, smaller batches and lengths)."""
        base = dict(
            prompts=4,
            group_size=8,
            prompt_len=64,
            max_new_tokens=128,
            slots=16,
            rounds=3,
            kv_responses=(16, 32, 64),
        )
        base.update(overrides)
        return cls(**base)


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthWorkload:
    """Forced response lengths of one batch, prompt by prompt ([prompts * G])."""

    name: str
    lengths: np.ndarray
    source: str


def synthetic_lengths(name: str, n: int, max_new_tokens: int, seed: int = 0) -> np.ndarray:
    """Lognormal stand-in for a trace workload (``SYNTHETIC``), capped at ``max_new_tokens``."""
    frac, sigma = SYNTHETIC[name]
    mean = frac * max_new_tokens
    mu = np.log(mean) - sigma**2 / 2
    rng = np.random.default_rng([seed, 7])
    x = np.round(rng.lognormal(mu, sigma, n)).astype(np.int64)
    return np.clip(x, 1, max_new_tokens)


def _scale(raw: np.ndarray, max_new_tokens: int) -> tuple[np.ndarray, float]:
    """Longest -> ``max_new_tokens`` (never stretched); every length >= 1."""
    scale = min(1.0, max_new_tokens / max(int(raw.max()), 1))
    return np.clip(np.round(raw * scale).astype(np.int64), 1, max_new_tokens), scale


def trace_lengths(
    name: str, root: Path, *, prompts: int, group_size: int, seed: int = 0
) -> np.ndarray | None:
    """Unscaled response lengths ([prompts * G]) of a trace workload; None if absent."""
    path = root / TRACE_RUNS[name]
    if not path.is_dir():
        return None
    specs, _, _ = sample_group_specs(
        str(path), batch_size=prompts, n_sampling=group_size, step=None, seed=seed
    )
    if name != "search_turns":
        return np.array([sum(n for _, n in r) for s in specs for r in s.responses], np.int64)
    rng = np.random.default_rng([seed, 3])
    out = []
    for s in specs:
        for r in s.responses:
            turns = [n for m, n in r if m == 1] or [1]
            out.append(turns[rng.integers(len(turns))])
    return np.array(out, np.int64)


def make_workloads(
    cfg: RolloutBenchConfig,
    *,
    polytrace: str | os.PathLike | None = None,
    synthetic: bool = False,
    names: Sequence[str] | None = None,
) -> list[LengthWorkload]:
    """The benchmark's workloads (module docstring), in ``WORKLOADS`` order."""
    names = list(WORKLOADS if names is None else names)
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        raise ValueError(f"workloads: unknown {bad}; accepted: {list(WORKLOADS)}")
    root = Path(polytrace) if polytrace else default_polytrace_root()
    n = cfg.prompts * cfg.group_size
    out = []
    for name in names:
        if name == "uniform":
            lengths = np.full(n, cfg.max_new_tokens, np.int64)
            out.append(LengthWorkload(name=name, lengths=lengths, source="uniform"))
            continue
        raw = None
        if not synthetic:
            raw = trace_lengths(
                name, root, prompts=cfg.prompts, group_size=cfg.group_size, seed=cfg.seed
            )
        if raw is None:
            frac, sigma = SYNTHETIC[name]
            lengths = synthetic_lengths(name, n, cfg.max_new_tokens, cfg.seed)
            why = "--synthetic" if synthetic else f"no trace at {root / TRACE_RUNS[name]}"
            source = f"synthetic lognormal (mean {frac:g} x max, sigma {sigma:g}; {why})"
        else:
            lengths, scale = _scale(raw, cfg.max_new_tokens)
            source = f"PolyTrace {TRACE_RUNS[name].split('/')[0]} x{scale:.4g}"
        out.append(LengthWorkload(name=name, lengths=lengths, source=source))
    return out


# ----------------------------------------------------------------------------- K/V and batch


def static_kv_bytes(cfg: ModelConfig, rows: int, prompt_bucket: int, response_bucket: int) -> int:
    """The static sampler's K/V cache: 2 (K and V) x [L, B, P + R, K, D] x itemsize."""
    item = np.dtype(cfg.compute_dtype).itemsize
    s = prompt_bucket + response_bucket
    return 2 * cfg.num_layers * rows * s * cfg.num_kv_heads * cfg.head_dim * item


def static_active(lengths: Sequence[int]) -> np.ndarray:
    """Active rows of the static sampler at each decode step: row b at step t while
    ``t < len_b - 1`` (its prefill draws token 0; the loop runs max(len) - 1 steps)."""
    a = np.asarray(lengths, np.int64)
    t = np.arange(max(int(a.max()) - 1, 0))
    return (a[None, :] - 1 > t[:, None]).sum(axis=1)


# ----------------------------------------------------------------------------- the bench


def _prompts(vocab: int, count: int, length: int, seed: int):
    rng = np.random.default_rng([seed, 11])
    return [rng.integers(1, vocab, length).tolist() for _ in range(count)]


def measure_workload(
    w: LengthWorkload,
    *,
    cfg: RolloutBenchConfig,
    model_cfg: ModelConfig,
    weights,
    static: Sampler,
    engine: ContinuousSampler,
    prompts: list[list[int]],
) -> list[dict[str, Any]]:
    """Times both samplers on one workload; one row per sampler (``run``'s rows)."""
    lengths = [int(x) for x in w.lengths]
    g = cfg.group_size
    kwargs = dict(num_samples=g, seed=cfg.seed, forced_lengths=lengths)

    # Warm-up: one untimed call each (the static one through init/step, to read its cache).
    state, _ = static.init(weights, prompts, **kwargs)
    state = static.step(weights, state)
    rows = int(state.tokens.shape[0])
    static_peak = int(state.cache.k.nbytes + state.cache.v.nbytes)
    want = static_kv_bytes(
        model_cfg, rows, state.cache.k.shape[2] - state.tokens.shape[1], state.tokens.shape[1]
    )
    if static_peak != want:
        raise RuntimeError(f"static K/V bytes {static_peak} != 2 L B S K D itemsize = {want}")
    del state
    probe = engine_peak_kv(engine.engine, weights, prompts, lengths, g, cfg.seed)
    traces = dict(static=static.trace_count, engine=engine.trace_count)

    last: dict[str, Any] = {}

    def call(name, sampler):
        def run():
            last[name] = sampler.generate(weights, prompts, **kwargs)
            return last[name]

        return run

    timed = interleaved_rounds(
        {"static": call("static", static), "engine": call("engine", engine)},
        Rounds(rounds=cfg.rounds, order=alternating, settle=Settle.NEVER),
    )
    st = engine.engine.stats()
    compiled = dict(
        static=static.trace_count - traces["static"], engine=engine.trace_count - traces["engine"]
    )
    total = sum(lengths)
    made = {k: int(last[k].lengths.sum()) for k in last}
    if made != {"static": total, "engine": total}:
        raise RuntimeError(f"{w.name}: generated tokens {made} != forced total {total}")
    s_active = static_active(lengths)
    e_active = np.asarray(st.active_per_step, np.int64)
    out = []
    for name, active, batch, peak, alloc, steps in (
        (
            "static",
            s_active,
            rows,
            static_peak,
            static_peak,
            int(last["static"].stats["decode_steps"]),
        ),
        (
            "engine",
            e_active,
            cfg.slots,
            probe["peak_kv_bytes"],
            int(st.allocated_kv_bytes),
            int(st.decode_steps),
        ),
    ):
        t = timed[name]
        out.append(
            dict(
                workload=w.name,
                sampler=name,
                tokens_per_s=total / t.median,
                seconds=t.median,
                seconds_min=t.min,
                samples=list(t.seconds),
                peak_kv_bytes=peak,
                allocated_kv_bytes=alloc,
                slot_utilisation=float(active.mean() / batch) if active.size else 0.0,
                batch=batch,
                decode_steps=steps,
                generated_tokens=made[name],
                active_per_step=active.tolist(),
                source=w.source,
                compiles_while_timed=compiled[name],
            )
        )
    out[1]["throughput_vs_static"] = out[0]["seconds"] / out[1]["seconds"]
    out[1]["engine_reported_peak_kv_bytes"] = probe["engine_reported_peak_kv_bytes"]
    return out


def engine_peak_kv(
    engine: RolloutEngine,
    weights,
    prompts: Sequence[Sequence[int]],
    lengths: Sequence[int],
    group_size: int,
    seed: int = 0,
) -> dict[str, int]:
    """Runs the requests once on ``engine`` (untimed), call by call, and returns its
    peak live K/V bytes.

    ``peak_kv_bytes``: after every ``step``, the K/V rows written in the pool by
    the requests that held a slot during that decode call, those that finished in
    it included (the K/V the call ended with, before retirement): each of their
    prompts' ``len - 1`` rows once (the last prompt token is a response row) +
    ``length`` response rows per request (a request that generated n tokens has
    written n rows: its prompt's last token and its first n - 1 tokens).
    ``engine_reported_peak_kv_bytes``: ``stats().peak_kv_bytes``, for
    comparison: the engine samples ``kv_bytes()`` after retiring a call's
    finished requests, so it misses the call in which requests reach their end
    (0 when every request finishes within one call), and ``kv_bytes()`` counts
    ``length + 1`` rows per slot (one more than written).
    """
    cfg = engine.cfg
    token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    token_bytes *= np.dtype(cfg.compute_dtype).itemsize
    ended: list[Request] = []
    groups = []
    for i, prompt in enumerate(prompts):
        mine = [int(x) for x in lengths[i * group_size : (i + 1) * group_size]]
        groups.append(
            engine.submit(
                prompt,
                n=group_size,
                max_new_tokens=mine,
                forced_lengths=mine,
                seed=seed + i,
                on_finish=lambda request, reason: ended.append(request),
            )
        )
    reqs = [r for g in groups for r in g.requests]
    engine.stats(reset=True)
    peak = 0
    while engine.pending():
        ended.clear()
        engine.step(weights)
        held = [r for r in reqs if r.status is Status.RUNNING] + ended
        prompts_held = {id(r.group): r.group.prompt.size - 1 for r in held}
        rows = sum(r.length for r in held) + sum(prompts_held.values())
        peak = max(peak, rows * token_bytes)
    engine.run(weights)  # hands back the finished requests (nothing is left to step)
    reported = int(engine.stats(reset=True).peak_kv_bytes)
    return dict(peak_kv_bytes=peak, engine_reported_peak_kv_bytes=reported)


def kv_report(
    model, weights, model_cfg: ModelConfig, cfg: RolloutBenchConfig
) -> list[dict[str, Any]]:
    """K/V bytes of one group of ``kv_group`` samples sharing a ``kv_prompt``-token prompt,
    per response length: the static cache (its shapes) against the engine's measured peak."""
    g, p = cfg.kv_group, cfg.kv_prompt
    longest = max(cfg.kv_responses)
    engine = RolloutEngine(
        model,
        ContinuousConfig(
            slots=g,
            groups=1,
            group_size=g,
            prompt_len=p,
            response_len=longest,
            steps_per_call=cfg.steps_per_call,
        ),
    )
    prompt = _prompts(model_cfg.vocab_size, 1, p, cfg.seed + 1)
    out = []
    for r in sorted(cfg.kv_responses):
        peak = engine_peak_kv(engine, weights, prompt, [r] * g, g, cfg.seed)
        static = static_kv_bytes(model_cfg, bucket(g), bucket(p, 8), bucket(r, 8))
        out.append(
            dict(
                group=g,
                prompt=p,
                response=r,
                static_bytes=static,
                engine_peak_bytes=peak["peak_kv_bytes"],
                engine_reported_peak_bytes=peak["engine_reported_peak_kv_bytes"],
                engine_allocated_bytes=engine.allocated_kv_bytes(),
                ratio=peak["peak_kv_bytes"] / static,
            )
        )
    return out


def run(
    *,
    model_cfg: ModelConfig | None = None,
    cfg: RolloutBenchConfig | None = None,
    workloads: Sequence[str] | None = None,
    polytrace: str | os.PathLike | None = None,
    synthetic: bool = False,
    png: str | os.PathLike | None = None,
    kv: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """Runs the benchmark; returns ``rows`` (one per workload and sampler), ``kv``
    (the KV report), ``workloads`` (name, source, length stats) and ``machine``."""
    model_cfg = peer_tiny() if model_cfg is None else model_cfg
    cfg = RolloutBenchConfig() if cfg is None else cfg
    say = print if verbose else (lambda *a, **k: None)
    ws = make_workloads(cfg, polytrace=polytrace, synthetic=synthetic, names=workloads)
    model = init_model(model_cfg, seed=0)
    _, weights = nnx.split(model, nnx.Param)
    prompts = _prompts(model_cfg.vocab_size, cfg.prompts, cfg.prompt_len, cfg.seed)
    n = cfg.prompts * cfg.group_size
    static = Sampler(model, SamplingParams(max_new_tokens=cfg.max_new_tokens)).reserve(
        prompts=cfg.prompts, rows=n, prompt_len=cfg.prompt_len, response=cfg.max_new_tokens
    )
    engine = ContinuousSampler(
        model,
        ContinuousConfig(
            slots=cfg.slots,
            group_size=cfg.group_size,
            prompt_len=cfg.prompt_len,
            response_len=cfg.max_new_tokens,
            steps_per_call=cfg.steps_per_call,
        ),
        max_new_tokens=cfg.max_new_tokens,
    )
    engine.engine.warmup(weights, filtered=False)
    say(
        f"rollout bench: {cfg.prompts} prompts x G={cfg.group_size}, prompt {cfg.prompt_len}, "
        f"max new {cfg.max_new_tokens}; static rows {bucket(n)}, engine slots {cfg.slots} "
        f"({cfg.steps_per_call} steps/call); {cfg.rounds} interleaved rounds"
    )
    rows: list[dict[str, Any]] = []
    info = []
    for w in ws:
        a = w.lengths
        info.append(
            dict(
                name=w.name,
                source=w.source,
                tokens=int(a.sum()),
                mean=float(a.mean()),
                p90=float(np.percentile(a, 90)),
                max=int(a.max()),
                at_max=float((a == cfg.max_new_tokens).mean()),
            )
        )
        say(
            f"  {w.name}: {w.source}; lengths mean {a.mean():.1f}, p90 "
            f"{np.percentile(a, 90):.0f}, max {a.max()}, {int(a.sum())} tokens"
        )
        rows += measure_workload(
            w,
            cfg=cfg,
            model_cfg=model_cfg,
            weights=weights,
            static=static,
            engine=engine,
            prompts=prompts,
        )
    result: dict[str, Any] = dict(
        rows=rows,
        workloads=info,
        config=dataclasses.asdict(cfg),
        model=dataclasses.asdict(model_cfg),
        machine=machine_info(),
    )
    say("")
    say(format_table(rows))
    say(format_goals(rows))
    if kv:
        result["kv"] = kv_report(model, weights, model_cfg, cfg)
        say("")
        say(format_kv(result["kv"]))
    if png is not None:
        plot_active(rows, png)
        result["png"] = str(png)
        say(f"\nwrote {png}")
    return result


# ----------------------------------------------------------------------------- output


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table: per workload and sampler, tokens/s, seconds, K/V, utilisation."""
    header = (
        "workload | sampler | tokens | tokens/s | seconds (median) | engine / static | "
        "peak KV | allocated KV | batch | decode steps | slot utilisation"
    ).split(" | ")
    cells = [
        (
            r["workload"],
            r["sampler"],
            r["generated_tokens"],
            f"{r['tokens_per_s']:.0f}",
            f"{r['seconds']:.3f}",
            f"{r['throughput_vs_static']:.2f}x" if "throughput_vs_static" in r else "",
            _mib(r["peak_kv_bytes"]),
            _mib(r["allocated_kv_bytes"]),
            r["batch"],
            r["decode_steps"],
            f"{r['slot_utilisation']:.2f}",
        )
        for r in rows
    ]
    return "\n".join(report.markdown(header, cells))


def format_goals(rows: Sequence[dict[str, Any]]) -> str:
    """The issue's throughput goals, where their workloads ran."""
    ratio = {r["workload"]: r["throughput_vs_static"] for r in rows if r["sampler"] == "engine"}
    out = []
    for name, goal in (("math", 1.5), ("uniform", 0.95)):
        if name in ratio:
            met = "met" if ratio[name] >= goal else "NOT met"
            out.append(f"{name}: engine/static {ratio[name]:.2f}x (goal >= {goal}x: {met})")
    return "goals: " + "; ".join(out) if out else ""


def format_kv(kv: Sequence[dict[str, Any]]) -> str:
    g, p = kv[0]["group"], kv[0]["prompt"]
    lines = [
        f"K/V bytes, G={g} sharing a {p}-token prompt (goal: engine <= 1/8 of static)",
        "| response | static | engine peak | engine / static | engine allocated |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in kv:
        met = "" if r["ratio"] <= 1 / 8 else " (> 1/8)"
        lines.append(
            f"| {r['response']} | {_mib(r['static_bytes'])} | {_mib(r['engine_peak_bytes'])} | "
            f"{r['ratio']:.3f}{met} | {_mib(r['engine_allocated_bytes'])} |"
        )
    return "\n".join(lines)


def plot_active(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """PNG: active batch over decode steps for both samplers, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.4 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        for r in rows:
            if r["workload"] != name:
                continue
            color = "tab:blue" if r["sampler"] == "static" else "tab:orange"
            a = r["active_per_step"]
            ax.step(range(len(a)), a, where="post", color=color, label=f"{r['sampler']} active")
            ax.axhline(r["batch"], color=color, ls="--", lw=0.8, label=f"{r['sampler']} batch")
            if "throughput_vs_static" in r:
                ax.set_title(
                    f"{name}: engine/static throughput {r['throughput_vs_static']:.2f}x", fontsize=9
                )
        ax.set_ylim(bottom=0)
        ax.set_ylabel("active batch")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("decode step")
    return report.save_figure(fig, path, dpi=100)


def json_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``--json``: the timing rows (keys workload, sampler, tokens_per_s, seconds,
    peak_kv_bytes and more)."""
    return report.json_rows(result["rows"])


__all__ = [
    "WORKLOADS",
    "LengthWorkload",
    "RolloutBenchConfig",
    "format_goals",
    "format_kv",
    "format_table",
    "json_rows",
    "kv_report",
    "make_workloads",
    "measure_workload",
    "engine_peak_kv",
    "peer_tiny",
    "plot_active",
    "run",
    "static_active",
    "static_kv_bytes",
    "synthetic_lengths",
    "trace_lengths",
]
