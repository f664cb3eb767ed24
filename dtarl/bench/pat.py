"""``dtarl bench pat``: static tensor parallelism against PAT's adaptive TP during one
generation (PAT, arXiv 2605.23945; ``dtarl.rollout.pat``).

The D devices (8 simulated CPU devices by default: the command sets
``--xla_force_host_platform_device_count=8`` when XLA_FLAGS does not choose) run the
continuous engine as a (D/tp, tp) mesh. One generation: ``prompts`` groups of
``group_size`` samples with forced response lengths from a PolyTrace long-tail
distribution (``--trace``: verl_math (default), rllm or search_r1; each prompt's
lengths drawn from one trace group's own responses, scaled so the longest is
``max_new_tokens``; lognormal stand-ins without the traces), all admitted at once
(slots = prompts x G), greedy.

Configurations, side by side: static ``tp1``, ``tp2``, ``tp4``, ``tp8`` (those
dividing D and the kv heads) and ``pat``: starts at ``start_tp`` and lets the
controller (Algorithm 1, every ``check_every`` decode calls) switch the mesh and
compact the live requests, knowing only L_max = ``max_new_tokens`` as the paper's
does; ``pat_oracle`` is the same controller reading each request's exact forced
length (an upper bound, not a result). All of them run on ONE engine (built on the ``start_tp``
mesh): a static ``tpN`` generation starts after an idle reshard onto (D/N, N), which
moves nothing but the weights and compiles nothing. The profile is taken on that same
engine first (``dtarl.bench.pat_profile.profile_engine(..., engine=...)``: the grid is
the engine's own (slots, window) programs), so it compiles the programs the
generations run, PAT's merged-slot targets on the profiled levels included, and the
generations compile little more. Every configuration then runs one untimed generation
(it compiles what the profile did not: with ``--profile PATH``, everything), then
``rounds`` timed ones in alternating order; the median wall-clock seconds is
``latency_s``. The per-stage breakdown: ``decode_s`` (the engine's decode calls),
``switch_s`` (weight reshard), ``kv_s`` (K/V migrate or recompute), ``other_s``
(prefill, host scheduling, the rest). PAT's greedy tokens are checked against
``tp1``'s (``tokens_match_tp1``).

The predictor is checked twice: on held-out points inside the profile grid
(``mean_rel_error``; ``pat.leave_one_out``) and on every decode call of the timed
generations (its seconds predicted from the program it ran: slots, mesh, window;
``real_mean_rel_error`` over the static configurations' full calls, the calls that
ran ``steps_per_call`` steps like the profiled ones; ``real_all_mean_rel_error`` with
each generation's last, shorter call and PAT's calls too;
``real_generation_mean_rel_error`` over whole generations' decode seconds).
``profile_cv`` is the median coefficient of variation of identical profiled steps
over the minutes of profiling, ``generation_cv`` that of identical calls inside one
generation: on a shared machine the first is background load coming and going,
which the profile's fastest-step statistic leaves out.

``--profile PATH`` loads a saved profile instead of profiling. ``--replay-profile
PROFILE.json`` feeds the ``tp1`` generation's (B, T) trajectory to another saved
profile (e.g. one taken on a GPU machine) and prints the latency it PREDICTS there per
static TP and with PAT; that is a prediction, not a measurement.

On simulated CPU devices every "device" shares the same cores, so TP may never
pay off; then the controller does not switch, which is a valid result.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from dtarl.bench import pat_analytic, pat_profile, report
from dtarl.bench.darts_trace import TRACES
from dtarl.bench.rollout import synthetic_lengths, trace_lengths
from dtarl.errors import ConfigError
from dtarl.model import ModelConfig, init_model
from dtarl.parallel.mesh import make_mesh
from dtarl.rollout import pat
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import ContinuousConfig
from dtarl.timing import alternating, machine_info
from dtarl.traces import default_polytrace_root

CONFIGS = ("tp1", "tp2", "tp4", "tp8", "pat", "pat_oracle")


def pat_tiny() -> ModelConfig:
    """A tiny model with 8 kv heads (so TP 1, 2, 4 and 8 all split them)."""
    return ModelConfig.tiny(num_heads=8, num_kv_heads=8, head_dim=8, hidden_size=64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatBenchConfig:
    """What ``run`` measures (module docstring)."""

    prompts: int = 8
    group_size: int = 8
    prompt_len: int = 32
    max_new_tokens: int = 256
    steps_per_call: int = 8
    check_every: int = 2
    start_tp: int = 1
    tp_candidates: tuple[int, ...] = pat.TP_DEGREES
    rounds: int = 3
    seed: int = 0
    compile_reuse: int = 100
    trace: str = "verl_math"  # the PolyTrace run the lengths come from (TRACES)
    grid: pat_profile.ProfileGrid = dataclasses.field(default_factory=pat_profile.ProfileGrid)

    def __post_init__(self):
        for name in (
            "prompts",
            "group_size",
            "prompt_len",
            "max_new_tokens",
            "steps_per_call",
            "check_every",
            "rounds",
            "compile_reuse",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"PatBenchConfig.{name}={v!r}: must be an int >= 1")
        if self.trace not in TRACES:
            raise ConfigError(
                f"PatBenchConfig.trace={self.trace!r}: accepted values {sorted(TRACES)}"
            )
        if self.start_tp not in pat.TP_DEGREES:
            raise ValueError(f"PatBenchConfig.start_tp={self.start_tp}: one of {pat.TP_DEGREES}")

    @classmethod
    def quick(cls, **overrides) -> PatBenchConfig:
        """``--quick``: a smaller batch, shorter responses, one timed round, a CPU grid
        (3 slot levels per TP, 2 timed repeats)."""
        base = dict(
            prompts=8,
            group_size=4,
            prompt_len=16,
            max_new_tokens=128,
            rounds=1,
            grid=pat_profile.ProfileGrid.quick(),
        )
        base.update(overrides)
        return cls(**base)

    def engine_config(self) -> ContinuousConfig:
        """The engine every configuration runs on (and the profile's programs)."""
        n = self.prompts * self.group_size
        return ContinuousConfig(
            slots=n,
            groups=self.prompts,
            group_size=self.group_size,
            prompt_len=self.prompt_len,
            response_len=self.max_new_tokens,
            steps_per_call=self.steps_per_call,
            prefill_batch=self.prompts,
        )


def workload_lengths(
    cfg: PatBenchConfig, *, polytrace: str | os.PathLike | None = None, synthetic: bool = False
) -> tuple[np.ndarray, str]:
    """Forced response lengths ([prompts * G]) and where they come from."""
    root = Path(polytrace) if polytrace else default_polytrace_root()
    raw = None
    if not synthetic:
        raw = trace_lengths(
            TRACES[cfg.trace], root, prompts=cfg.prompts, group_size=cfg.group_size, seed=cfg.seed
        )
    if raw is None:
        n = cfg.prompts * cfg.group_size
        why = "--synthetic" if synthetic else f"no trace under {root}"
        return synthetic_lengths("math", n, cfg.max_new_tokens, cfg.seed), f"lognormal ({why})"
    scale = min(1.0, cfg.max_new_tokens / max(int(raw.max()), 1))
    lengths = np.clip(np.round(raw * scale).astype(np.int64), 1, cfg.max_new_tokens)
    return lengths, f"PolyTrace {cfg.trace} (each prompt's own group) x{scale:.4g}"


class CallRecorder:
    """An ``on_call`` hook that records each decode call that compiled nothing with the
    program it ran (slots, dp, tp, and the response window the engine recorded), to
    predict its seconds afterwards. ``then``: a hook to call after recording (e.g. PAT's
    controller, which may switch the mesh for the next call)."""

    def __init__(self, then: Callable | None = None):
        self.then = then
        self.reset()

    def reset(self) -> None:
        """Forgets the recorded calls (before a generation)."""
        self.rows: list[dict[str, Any]] = []
        self._seen = 0

    def __call__(self, engine, weights):
        v = engine.view()
        if len(v.decode_calls) == self._seen + 1:  # this call compiled nothing
            seconds, steps, _, window = v.decode_calls[-1]
            self.rows.append(
                dict(seconds=seconds, steps=steps, slots=v.slots, dp=v.dp, tp=v.tp, window=window)
            )
        self._seen = len(v.decode_calls)
        return None if self.then is None else self.then(engine, weights)


def predict_calls(
    predictor: pat.Predictor, rows: Sequence[dict[str, Any]], config: ContinuousConfig
) -> np.ndarray:
    """Each recorded call's predicted seconds: steps x the predicted seconds per step of
    its program (B = slots / dp, T = (Q M P + slots x window) / dp)."""
    cells = config.prompt_slots * config.group_size
    out = []
    for r in rows:
        t = (cells * config.prompt_len + r["slots"] * r["window"]) / r["dp"]
        out.append(r["steps"] * float(predictor.step_seconds(r["tp"], r["slots"] / r["dp"], t)))
    return np.asarray(out, np.float64)


def real_errors(
    predictor: pat.Predictor, rows: Sequence[dict[str, Any]], config: ContinuousConfig
) -> list[float]:
    """Relative error of each recorded call's predicted seconds (``predict_calls``)."""
    pred = predict_calls(predictor, rows, config)
    real = np.asarray([r["seconds"] for r in rows], np.float64)
    return (np.abs(pred - real) / np.maximum(real, 1e-12)).tolist()


def _sampler(model, cfg: PatBenchConfig, mesh) -> ContinuousSampler:
    return ContinuousSampler(
        model, cfg.engine_config(), temperature=0.0, max_new_tokens=cfg.max_new_tokens, mesh=mesh
    )


def run(
    cfg: PatBenchConfig | None = None,
    *,
    model_cfg: ModelConfig | None = None,
    profile: str | os.PathLike | None = None,
    profile_out: str | os.PathLike | None = None,
    replay_profile: str | os.PathLike | None = None,
    polytrace: str | os.PathLike | None = None,
    synthetic: bool = False,
    png: str | os.PathLike | None = None,
    analytic: bool = False,
    verbose: bool = True,
) -> dict[str, Any]:
    """Runs the benchmark (module docstring); returns ``rows`` (one per configuration,
    plus the predictor's), ``timeline`` (PAT's switches in its last timed run),
    ``profile`` (path or None), ``replay`` (when asked) and ``machine``."""
    cfg = cfg or PatBenchConfig()
    model_cfg = model_cfg or pat_tiny()
    say = print if verbose else (lambda *a, **k: None)
    devices = jax.devices()
    d = len(devices)
    if d < 2:
        raise pat.PatError(
            f"bench pat: {d} device; needs several (e.g. XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before JAX starts)"
        )
    tps = [t for t in cfg.tp_candidates if d % t == 0 and model_cfg.num_kv_heads % t == 0]
    if cfg.start_tp not in tps:
        raise pat.PatError(f"bench pat: start_tp={cfg.start_tp} is not among the TP degrees {tps}")
    model = init_model(model_cfg, seed=0)
    _, weights = nnx.split(model, nnx.Param)
    ccfg = cfg.engine_config()
    # One engine for every configuration and the profile: one program cache.
    sampler = _sampler(model, cfg, make_mesh(d // cfg.start_tp, cfg.start_tp))
    engine = sampler.engine
    compiled: list[tuple[int, int, int]] = []  # (dp, tp, slots) the profile compiled

    t_prof = time.perf_counter()
    if profile is not None:
        prof = pat.Profile.load(profile)
        if prof.devices != d:
            raise pat.PatError(
                f"bench pat: profile {profile} was taken on {prof.devices} devices, "
                f"this run has {d}"
            )
        say(f"pat bench: profile {profile} ({prof.device_kind}, {len(prof.decode)} points)")
        want = {k: int(v) for k, v in dataclasses.asdict(ccfg).items()}
        if prof.engine and prof.engine != want:
            say(
                f"  note: the profile timed the engine {prof.engine}, this run's is {want}: "
                "its calls are predicted by interpolation from other programs"
            )
    else:
        grid = dataclasses.replace(cfg.grid, engine=ccfg, tps=tuple(tps))
        say(f"pat bench: profiling {d} devices, (tp, slots) {grid.points(d)}")
        prof = pat_profile.profile_engine(model, weights, grid, engine=engine, say=say)
        compiled = [(d // tp, tp, n) for tp, n in grid.points(d)]
        if profile_out is not None:
            say(f"  wrote {prof.save(profile_out)}")
    profile_s = time.perf_counter() - t_prof
    predictor = pat.Predictor(prof)
    loo = pat.leave_one_out(prof)
    missing = [t for t in tps if t not in predictor.tps]
    if missing:
        raise pat.PatError(f"bench pat: profile lacks TP {missing} (has {list(predictor.tps)})")

    checked = None  # --analytic: the noise-free predictor check (dtarl.bench.pat_analytic)
    if analytic:
        g = dataclasses.replace(cfg.grid, engine=ccfg, tps=tuple(tps))
        held = pat_analytic.held_out_windows(ccfg.response_len)
        windows = sorted(set(held) | set(pat.decode_windows(ccfg.response_len)))
        points = pat_analytic.analytic_points(model, weights, g, engine, windows)
        checked = pat_analytic.check(
            pat_analytic.analytic_profile(model, weights, g, engine, rows=points),
            [r for r in points if r["l"] in held],
        )
        say(
            f"  analytic profile (a PREDICTION: XLA cost analysis + alpha-beta all-reduce): "
            f"held-out interpolation error {checked['mean_rel_error']:.2%} mean, "
            f"{checked['max_rel_error']:.2%} max over {checked['held_out_points']} points "
            "(goal <= 2%)"
        )
        for w in checked["windows"]:
            say(
                f"    window {w['window']} (not profiled): {w['mean_rel_error']:.2%} mean, "
                f"{w['max_rel_error']:.2%} max over {w['points']} points"
            )
        say(
            f"    {len(checked['windows'])} held-out windows: "
            f"{checked['window_mean_rel_error']:.2%} mean over {checked['window_points']} "
            f"points; inside the grid: {checked['t_error']:.2%} between windows, "
            f"{checked['b_error']:.2%} between B levels"
        )
    lengths, source = workload_lengths(cfg, polytrace=polytrace, synthetic=synthetic)
    rng = np.random.default_rng([cfg.seed, 11])
    prompts = [
        rng.integers(1, model_cfg.vocab_size, cfg.prompt_len).tolist() for _ in range(cfg.prompts)
    ]
    say(
        f"pat bench: {cfg.prompts} prompts x G={cfg.group_size}, prompt {cfg.prompt_len}; "
        f"lengths {source}: mean {lengths.mean():.1f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"max {lengths.max()}"
    )
    kwargs = dict(num_samples=cfg.group_size, seed=cfg.seed, forced_lengths=lengths.tolist())
    names = [f"tp{t}" for t in tps] + ["pat", "pat_oracle"]
    # "pat": Alg. 1 as the paper runs it, knowing only L_max (max_new_tokens);
    # "pat_oracle": reading each request's exact forced length (an upper bound).
    controllers = {
        n: pat.PatController(
            predictor,
            candidates=tps,
            check_every=cfg.check_every,
            compile_reuse=cfg.compile_reuse,
            l_max=cfg.max_new_tokens,
            oracle=n == "pat_oracle",
        )
        for n in ("pat", "pat_oracle")
    }
    for c in controllers.values():
        c.adopt(engine, compiled)
    recorders = {n: CallRecorder(controllers.get(n)) for n in names}

    def at(tp: int) -> None:
        """The idle engine onto (d / tp, tp) with every slot (moves the weights only)."""
        v = engine.view()
        if (v.dp, v.tp, v.slots) != (d // tp, tp, ccfg.slots):
            engine.reshard((d // tp, tp), weights, slots=ccfg.slots, mode="recompute")

    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    tokens: dict[str, Any] = {}

    def one(name: str) -> dict[str, Any]:
        controller = controllers.get(name)
        at(cfg.start_tp if controller else int(name[2:]))
        if controller:
            controller.begin()
        recorders[name].reset()
        traces = sampler.trace_count
        res = sampler.generate(weights, prompts, on_call=recorders[name], **kwargs)
        st = engine.stats()
        tl = controller.timeline if controller else []
        switch_s = sum(e["info"].get("weights_s", 0.0) for e in tl)
        kv_s = sum(e["info"].get("kv_s", 0.0) for e in tl)
        decode_s = float(sum(c[0] for c in st.calls))
        latency = float(res.stats["seconds"])
        tokens[name] = res.tokens
        return dict(
            latency_s=latency,
            decode_s=decode_s,
            switch_s=switch_s,
            kv_s=kv_s,
            other_s=latency - decode_s - switch_s - kv_s,
            switches=len(tl),
            decode_calls=int(st.decode_calls),
            compiled=sampler.trace_count - traces,
            timeline=[dict(e) for e in tl],
            calls=list(recorders[name].rows),
        )

    say("  warm-up generation per configuration (compiles what the profile did not)")
    warm = {n: one(n) for n in names}
    for r in range(cfg.rounds):
        for n in alternating(r, names):
            samples[n].append(one(n))
    rows = []
    for n in names:
        runs = samples[n]
        best = sorted(runs, key=lambda x: x["latency_s"])[len(runs) // 2]
        row = dict(
            config=n,
            latency_s=float(np.median([x["latency_s"] for x in runs])),
            **{k: best[k] for k in ("decode_s", "switch_s", "kv_s", "other_s", "switches")},
            latency_samples=[x["latency_s"] for x in runs],
            warm_latency_s=warm[n]["latency_s"],
            compiled_in_warmup=warm[n]["compiled"],
            compiled_after_warmup=int(sum(x["compiled"] for x in runs)),
            # The median run's recorded calls, their seconds as the profile predicts them.
            calls_s=float(sum(c["seconds"] for c in best["calls"])),
            calls_predicted_s=float(predict_calls(predictor, best["calls"], ccfg).sum()),
        )
        if n in controllers:
            row["timeline"] = best["timeline"]
            row["tokens_match_tp1"] = bool(
                "tp1" in tokens
                and all(np.array_equal(a, b) for a, b in zip(tokens[n], tokens["tp1"], strict=True))
            )
        rows.append(row)
    full, every, pat_errs, gens = [], [], [], []
    for n in names:
        for x in samples[n]:
            if x["calls"]:  # the generation's decode seconds, predicted call by call
                real = sum(c["seconds"] for c in x["calls"])
                pred = float(predict_calls(predictor, x["calls"], ccfg).sum())
                gens.append(abs(pred - real) / max(real, 1e-12))
            errs = real_errors(predictor, x["calls"], ccfg)
            every += errs
            if n in controllers:
                pat_errs += errs
            else:
                full += [
                    e
                    for e, c in zip(errs, x["calls"], strict=True)
                    if c["steps"] == cfg.steps_per_call
                ]
    cvs = [r["cv"] for r in prof.decode if "cv" in r]
    within = []  # CV of identical calls (same program, full) inside one timed generation
    for n in names:
        for x in samples[n]:
            same: dict[tuple, list[float]] = {}
            for c in x["calls"]:
                if c["steps"] == cfg.steps_per_call:
                    key = (c["dp"], c["tp"], c["slots"], c["window"])
                    same.setdefault(key, []).append(c["seconds"])
            within += [float(np.std(v) / np.mean(v)) for v in same.values() if len(v) >= 3]

    def mean(xs) -> float:
        return float(np.mean(xs)) if len(xs) else math.nan

    rows.append(
        dict(
            config="predictor",
            mean_rel_error=mean([e["rel_error"] for e in loo]),
            held_out_points=len(loo),
            held_out_t_error=mean([e["rel_error"] for e in loo if e["kind"] == "t"]),
            held_out_t_points=sum(e["kind"] == "t" for e in loo),
            held_out_b_error=mean([e["rel_error"] for e in loo if e["kind"] == "b"]),
            held_out_b_points=sum(e["kind"] == "b" for e in loo),
            real_mean_rel_error=mean(full),
            real_calls=len(full),
            real_all_mean_rel_error=mean(every),
            real_all_calls=len(every),
            real_pat_mean_rel_error=mean(pat_errs),
            real_generation_mean_rel_error=mean(gens),
            real_generations=len(gens),
            profile_cv=float(np.median(cvs)) if cvs else math.nan,
            generation_cv=float(np.median(within)) if within else math.nan,
            profile_s=profile_s,
        )
    )
    if checked is not None:
        rows.append(dict(config="analytic", **checked))
    result: dict[str, Any] = dict(
        rows=rows,
        config=dataclasses.asdict(cfg),
        model=dataclasses.asdict(model_cfg),
        workload=dict(source=source, lengths=lengths.tolist()),
        held_out=loo,
        calls={
            n: [
                [
                    dict(c, predicted=float(p))
                    for c, p in zip(
                        x["calls"], predict_calls(predictor, x["calls"], ccfg), strict=True
                    )
                ]
                for x in samples[n]
            ]
            for n in names
        },
        machine=machine_info(),
    )
    say("")
    say(format_table(rows))
    if replay_profile is not None:
        other = pat.Predictor(pat.Profile.load(replay_profile))
        at(1 if 1 in tps else tps[0])
        sampler.generate(weights, prompts, **kwargs)
        st = engine.stats()
        rep = pat.replay(
            other,
            st.active_per_step,
            st.context_per_step,
            check_every_steps=cfg.check_every * cfg.steps_per_call,
        )
        rep["profile"] = str(replay_profile)
        rep["device_kind"] = other.profile.device_kind
        result["replay"] = rep
        say("")
        say(format_replay(rep))
    if png is not None:
        result["png"] = str(plot(rows, png))
        say(f"\nwrote {png}")
    return result


_TIMES = ("latency_s", "decode_s", "switch_s", "kv_s", "other_s")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ("config", "latency s", "decode s", "switch s", "kv s", "other s", "switches")
    pred = next((r for r in rows if r["config"] == "predictor"), None)
    cells = [
        (r["config"], *(f"{r[k]:.3f}" for k in _TIMES), r["switches"])
        for r in rows
        if r["config"] not in ("predictor", "analytic")
    ]
    out = "\n".join(report.markdown(header, cells, compact=True))
    patrow = next((r for r in rows if r["config"] == "pat"), None)
    static = [r["latency_s"] for r in rows if r["config"].startswith("tp")]
    for r in rows:
        if r["config"] in ("pat", "pat_oracle") and static:
            who = "knows L_max only" if r["config"] == "pat" else "reads the forced lengths"
            out += (
                f"\n{r['config']} ({who}): {r['latency_s'] / min(static):.3f}x the best "
                f"static TP's latency (goal <= 1.02 for pat)"
            )
    if patrow is not None:
        if patrow["switches"] == 0:
            out += "\nPAT: the controller did not switch (no candidate's predicted gain paid)."
        for e in patrow.get("timeline", []):
            out += (
                f"\nPAT switch at call {e['call']} ({e['time_s']:.3f} s): (dp, tp, slots) "
                f"{tuple(e['src'])} -> {tuple(e['dst'])}, {e['mode']}, predicted gain "
                f"{e['predicted_gain_s']:.3f} s, took {e['seconds']:.3f} s"
            )
        if "tokens_match_tp1" in patrow:
            out += f"\nPAT greedy tokens identical to tp1: {patrow['tokens_match_tp1']}"
    if pred is not None:
        out += (
            f"\npredictor: held-out points inside the grid, mean relative error "
            f"{pred['mean_rel_error']:.1%} ({pred['held_out_points']} points: "
            f"{pred['held_out_t_error']:.1%} between windows, {pred['held_out_b_error']:.1%} "
            f"between slot levels); real decode calls {pred['real_mean_rel_error']:.1%} "
            f"({pred['real_calls']} full calls of the static runs), "
            f"{pred['real_all_mean_rel_error']:.1%} over all {pred['real_all_calls']} "
            f"calls (PAT's {pred['real_pat_mean_rel_error']:.1%}); the decode seconds of "
            f"whole generations {pred['real_generation_mean_rel_error']:.1%} "
            f"({pred['real_generations']} generations); timing noise (median CV of "
            f"identical steps) {pred['profile_cv']:.1%} over the profile, "
            f"{pred['generation_cv']:.1%} inside one generation"
        )
    return out


def format_replay(rep: dict[str, Any]) -> str:
    lines = [
        f"PREDICTION for {rep['device_kind']} (profile {rep['profile']}), replaying the "
        "tp1 generation's (B, T) trajectory; not a measurement:",
        "| config | predicted decode s |",
        "|---|---|",
    ]
    for tp, s in sorted(rep["static"].items()):
        lines.append(f"| tp{tp} | {s:.4f} |")
    lines.append(f"| pat (from tp{rep['start_tp']}) | {rep['pat']:.4f} |")
    best = min(rep["static"].values())
    lines.append(
        f"PREDICTED PAT vs best static: {1 - rep['pat'] / best:+.1%} latency reduction, "
        f"{len(rep['switches'])} switches {[(k, a, b) for k, a, b, _ in rep['switches']]}"
    )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """PNG: PAT's switch timeline (TP over time) and the per-stage latency breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r["config"] not in ("predictor", "analytic")]
    patrow = next(r for r in runs if r["config"] == "pat")
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6))
    tl = patrow.get("timeline", [])
    if tl:
        xs = [0.0] + [e["time_s"] for e in tl] + [patrow["latency_s"]]
        ys = [tl[0]["src"][1]] + [e["dst"][1] for e in tl]
        ax0.step(xs, ys + [ys[-1]], where="post", color="tab:orange")
        for e in tl:
            ax0.annotate(
                f"{e['dst'][2]} slots",
                (e["time_s"], e["dst"][1]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax0.set_title("PAT switch timeline", fontsize=9)
    else:
        ax0.text(0.5, 0.5, "no switch (TP does not pay here)", ha="center", va="center")
        ax0.set_title("PAT switch timeline: none", fontsize=9)
    ax0.set_xlabel("seconds into the generation")
    ax0.set_ylabel("TP")
    ax0.set_yscale("log", base=2)
    names = [r["config"] for r in runs]
    bottom = np.zeros(len(runs))
    for key, color in (
        ("decode_s", "tab:blue"),
        ("switch_s", "tab:red"),
        ("kv_s", "tab:purple"),
        ("other_s", "tab:gray"),
    ):
        vals = np.asarray([max(r[key], 0.0) for r in runs])
        ax1.bar(names, vals, bottom=bottom, color=color, label=key[:-2])
        bottom += vals
    ax1.set_ylabel("seconds (median run)")
    ax1.set_title("latency per stage", fontsize=9)
    ax1.legend(fontsize=7)
    return report.save_figure(fig, path, dpi=100)


def json_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``--json``: one object per configuration (``config``, ``latency_s``, ``switches``,
    the breakdown) and one ``{"config": "predictor", "mean_rel_error": ...}``; with a
    replay, one ``{"config": "replay", "label": "PREDICTION", ...}``."""
    out = report.json_rows(result["rows"])
    if "replay" in result:
        rep = dict(result["replay"])
        rep["static"] = {f"tp{k}": v for k, v in rep["static"].items()}
        out.append(dict(config="replay", **rep))
    return out


__all__ = [
    "CONFIGS",
    "TRACES",
    "CallRecorder",
    "PatBenchConfig",
    "format_replay",
    "format_table",
    "json_rows",
    "pat_tiny",
    "plot",
    "predict_calls",
    "real_errors",
    "run",
    "workload_lengths",
]
