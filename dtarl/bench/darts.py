"""``dtarl bench darts``: GRPO with and without DARTS from one SFT checkpoint.

The workload is ``configs/darts_verbose.yaml`` (``task.kind: verbose_arithmetic``:
scratchpads of random verbosity, so response lengths are long-tailed within a
prompt). The bench

1. runs the config's SFT warm-up once (``steps=0``, seed of the config) and keeps
   its params in memory: every RL run starts from exactly these weights;
2. for each seed, runs GRPO (``arm="grpo"``, ``algo.darts.enabled=false``) and
   GRPO + DARTS (``arm="darts"``) for ``steps`` RL steps from those params
   (``Trainer.params`` set before ``run``; ``sft.steps=0``, no resume), arms
   interleaved so that machine load hits both alike;
3. reads each run's history: per RL step the wall clock of the step alone
   (``step_seconds``: rollout + rewards + advantages + update, no evaluation),
   its ``rollout_seconds`` and ``train_seconds``, the training group's response
   lengths (``response_len_mean/p90/max``; with DARTS the selected M per prompt,
   ``darts_generated_len_mean`` the generated candidates'), ``tree_token_ratio``
   and the greedy ``eval_success_rate`` every ``eval_every`` steps (plus before
   RL and at the end).

Timing: ``step_seconds`` of a run is the mean over its RL steps that compiled
nothing: the first ``skip_steps`` (tracing and compiling, or loading from the
compilation cache, the rollout and training programs) and any step whose training
engine traced a new program (``trace_count`` grew) are left out and reported
(``compile_steps``, ``compile_seconds``; ``step_seconds_all`` is the plain mean).
With ``compile_cache`` set, all runs share one persistent JAX compilation cache,
so a shape compiles once per bench, not once per run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dtarl.bench import report
from dtarl.rl.config import load_config
from dtarl.rl.trainer import Trainer

ARMS = ("grpo", "darts")
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "darts_verbose.yaml")

# Per-step series kept in the results (history keys; absent ones are NaN).
SERIES = (
    "step_seconds",
    "rollout_seconds",
    "train_seconds",
    "response_len_mean",
    "response_len_p90",
    "response_len_max",
    "tree_token_ratio",
    "num_tokens",
    "tree_tokens",
    "success_rate",
    "darts_m_total",
    "darts_m_star",
    "darts_early_stop_groups",
    "darts_dual_end_groups",
    "darts_generated_len_mean",
    "darts_cancelled_tokens",
    "darts_cost_error",
    "darts_decode_steps",
    "darts_decode_steps_predicted",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DartsBenchConfig:
    """What to compare. ``overrides`` (``key=value``) apply to ``config`` for every run."""

    config: str = DEFAULT_CONFIG
    overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 100  # RL steps per run
    eval_every: int = 10
    eval_problems: int = 64
    sft_steps: int | None = None  # None: the config's sft.steps
    skip_steps: int = 1  # first RL steps left out of the step time (compilation)

    def __post_init__(self):
        if not self.seeds:
            raise ValueError("seeds=() must name at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds} has repeats")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if not 0 <= self.skip_steps < self.steps:
            raise ValueError(f"skip_steps={self.skip_steps} must be in [0, steps={self.steps})")
        if self.eval_every < 0 or self.eval_problems < 1:
            raise ValueError(
                f"eval.every={self.eval_every} must be >= 0 and "
                f"eval.num_problems={self.eval_problems} >= 1"
            )
        if self.sft_steps is not None and self.sft_steps < 0:
            raise ValueError(f"sft_steps={self.sft_steps} must be >= 0")

    @classmethod
    def quick(cls, **overrides) -> DartsBenchConfig:
        """Fewer steps of the same comparison, still 3 seeds (under 10 minutes on 2 cores)."""
        base = dict(steps=30, eval_every=10, eval_problems=32)
        return cls(**(base | overrides))


def _load(bench: DartsBenchConfig, extra: Sequence[str]):
    return load_config(bench.config, list(bench.overrides) + list(extra))


def sft_params(bench: DartsBenchConfig, out_dir: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """The SFT warm-up, once: (params, info with its seconds and greedy success)."""
    extra = [
        "steps=0",
        f"out_dir={os.path.join(out_dir, 'sft')}",
        "resume=false",
        "console=false",
        "eval.every=0",
        f"eval.num_problems={bench.eval_problems}",
    ]
    if bench.sft_steps is not None:
        extra.append(f"sft.steps={bench.sft_steps}")
    cfg = _load(bench, extra)
    t0 = time.perf_counter()
    res = Trainer(cfg).run()
    info = dict(
        sft_steps=cfg.sft.steps,
        seconds=time.perf_counter() - t0,
        success_before=res.eval_start,
        success_after=res.eval_end,
    )
    return res.params, info


def run_arm(
    bench: DartsBenchConfig, params, *, arm: str, seed: int, out_dir: str | os.PathLike
) -> dict[str, Any]:
    """One RL run from ``params``: its per-step series, eval curve and summary numbers."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r} must be one of {ARMS}")
    cfg = _load(
        bench,
        [
            f"seed={seed}",
            "sft.steps=0",
            f"steps={bench.steps}",
            f"out_dir={os.path.join(out_dir, f'{arm}_seed{seed}')}",
            "resume=false",
            "console=false",
            f"eval.every={bench.eval_every}",
            f"eval.num_problems={bench.eval_problems}",
            f"algo.darts.enabled={'true' if arm == 'darts' else 'false'}",
        ],
    )
    trainer = Trainer(cfg)
    trainer.params = jax.tree.map(lambda x: x, params)  # the shared SFT weights
    t0 = time.perf_counter()
    res = trainer.run()
    seconds = time.perf_counter() - t0
    rl = [h for h in res.history if h.get("phase") == "rl"]
    series = {k: [float(h.get(k, np.nan)) for h in rl] for k in SERIES}
    evals = [(0, res.eval_start)]
    evals += [(h["step"] + 1, h["eval_success_rate"]) for h in rl if "eval_success_rate" in h]
    evals.append((bench.steps, res.eval_end))
    # Compile steps: the first ``skip_steps`` and any whose training engine traced a
    # new program (``trace_count`` grew); the step time is the mean of the others.
    traces = [h.get("trace_count", 0) for h in rl]
    compiled = [
        i < bench.skip_steps or (i > 0 and traces[i] > traces[i - 1]) for i in range(len(rl))
    ]
    timed = [i for i, c in enumerate(compiled) if not c] or list(range(len(rl)))

    def mean(key: str) -> float:
        return float(np.nanmean([series[key][i] for i in timed]))

    return dict(
        arm=arm,
        seed=seed,
        step_seconds=mean("step_seconds"),
        rollout_seconds=mean("rollout_seconds"),
        train_seconds=mean("train_seconds"),
        first_step_seconds=series["step_seconds"][0],
        step_seconds_all=float(np.mean(series["step_seconds"])),
        compile_steps=int(sum(compiled)),
        compile_seconds=float(np.sum(np.asarray(series["step_seconds"])[compiled])),
        **_darts_numbers(series, arm),
        final_success=float(res.eval_end),
        start_success=float(res.eval_start),
        mean_response_len=float(np.mean(series["response_len_mean"])),
        p90_response_len=float(np.mean(series["response_len_p90"])),
        max_response_len=float(np.max(series["response_len_max"])),
        tree_token_ratio=float(np.mean(series["tree_token_ratio"])),
        num_tokens=float(np.nanmean(series["num_tokens"])),
        tree_tokens=float(np.nanmean(series["tree_tokens"])),
        steps=len(rl),
        skipped_steps=int(sum(h.get("skipped", 0) for h in rl)),
        run_seconds=seconds,
        eval_curve=[[int(s), float(r)] for s, r in evals],
        series=series,
    )


def _darts_numbers(series: dict[str, list[float]], arm: str) -> dict[str, float]:
    """The DARTS arm's budget and shaping per step (means), and the cost model's
    held-out error (mean and median over the steps that had a prediction)."""
    keys = ("m_total", "early_stop_groups", "dual_end_groups")
    if arm != "darts":
        return {
            k: float("nan")
            for k in (*keys, "cost_error_mean", "cost_error_median", "decode_steps_match")
        }
    err = np.asarray(series["darts_cost_error"], np.float64)
    err = err[np.isfinite(err)]
    out = {k: float(np.nanmean(series[f"darts_{k}"])) for k in keys}
    out["cost_error_mean"] = float(err.mean()) if err.size else float("nan")
    out["cost_error_median"] = float(np.median(err)) if err.size else float("nan")
    # steps whose decode step count the cost model's schedule predicted exactly
    got = np.asarray(series["darts_decode_steps"], np.float64)
    out["decode_steps_match"] = float(np.mean(got == series["darts_decode_steps_predicted"]))
    return out


def run(
    bench: DartsBenchConfig,
    *,
    out_dir: str | os.PathLike = "bench_out/darts",
    compile_cache: str | os.PathLike | None = None,
    log=print,
) -> dict[str, Any]:
    """SFT once, then both arms for every seed. Returns ``{sft, runs, summary}``."""
    if compile_cache is not None:
        jax.config.update("jax_compilation_cache_dir", os.fspath(compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    params, sft = sft_params(bench, out_dir)
    log(
        f"SFT warm-up: {sft['sft_steps']} steps in {sft['seconds']:.1f} s, greedy success "
        f"{sft['success_before']:.3f} -> {sft['success_after']:.3f}"
    )
    runs = []
    for seed in bench.seeds:
        for arm in ARMS:
            r = run_arm(bench, params, arm=arm, seed=seed, out_dir=out_dir)
            log(
                f"  {arm:5s} seed {seed}: {r['step_seconds']:.3f} s/step "
                f"(rollout {r['rollout_seconds']:.3f}, train {r['train_seconds']:.3f}), "
                f"len {r['mean_response_len']:.1f}, success {r['start_success']:.3f} -> "
                f"{r['final_success']:.3f} ({r['run_seconds']:.1f} s)"
            )
            runs.append(r)
    return dict(
        sft=sft,
        runs=runs,
        summary=summarize(runs),
        seconds=time.perf_counter() - t0,
        load_avg_start=load0,
        load_avg_end=os.getloadavg()[0],
        cpus=os.cpu_count(),
        bench=dataclasses.asdict(bench),
    )


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: means over seeds (success also its std and range); the grpo/darts ratios."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        s = np.asarray([r["final_success"] for r in rs])

        def avg(key: str, rs=rs) -> float:  # a key a run lacks counts as NaN
            return float(np.mean([r.get(key, np.nan) for r in rs]))

        out[arm] = dict(
            seeds=len(rs),
            step_seconds_std=float(np.std([r["step_seconds"] for r in rs])),
            max_response_len=float(np.max([r["max_response_len"] for r in rs])),
            **{
                k: avg(k)
                for k in (
                    "step_seconds",
                    "rollout_seconds",
                    "train_seconds",
                    "mean_response_len",
                    "p90_response_len",
                    "tree_token_ratio",
                    "num_tokens",
                    "tree_tokens",
                    "step_seconds_all",
                    "compile_steps",
                    "m_total",
                    "early_stop_groups",
                    "dual_end_groups",
                    "cost_error_mean",
                    "cost_error_median",
                    "decode_steps_match",
                )
            },
            final_success=float(s.mean()),
            final_success_std=float(s.std()),
            final_success_min=float(s.min()),
            final_success_max=float(s.max()),
        )
    if "grpo" in out and "darts" in out:
        g, d = out["grpo"], out["darts"]
        out["speedup"] = {
            k: g[k] / d[k] if d[k] > 0 else float("nan")
            for k in ("step_seconds", "rollout_seconds", "train_seconds")
        }
        spread = max(g["final_success_std"], d["final_success_std"])
        out["success_gap"] = d["final_success"] - g["final_success"]
        out["success_within_spread"] = bool(abs(out["success_gap"]) <= spread)
    return out


def format_table(res: dict[str, Any]) -> str:
    """The per-arm table, the speedup line and the machine load."""
    s = res["summary"]
    columns = [report.Column(title="arm", width=6, align="<")] + [
        report.Column(title=t, width=w)
        for t, w in (
            ("seeds", 5), ("step s", 14), ("rollout s", 10), ("train s", 9), ("len mean", 8),
            ("len p90", 8), ("len max", 7), ("final success", 22), ("tree ratio", 10),
        )
    ]  # fmt: skip
    cells = [
        [
            arm,
            str(a["seeds"]),
            f"{a['step_seconds']:.3f} ± {a['step_seconds_std']:.3f}",
            f"{a['rollout_seconds']:.3f}",
            f"{a['train_seconds']:.3f}",
            f"{a['mean_response_len']:.1f}",
            f"{a['p90_response_len']:.1f}",
            f"{a['max_response_len']:.0f}",
            f"{a['final_success']:.3f} ± {a['final_success_std']:.3f} "
            f"[{a['final_success_min']:.2f},{a['final_success_max']:.2f}]",
            f"{a['tree_token_ratio']:.3f}",
        ]
        for arm, a in ((arm, s[arm]) for arm in ARMS if arm in s)
    ]
    lines = report.text_table(columns, cells, rule=True)
    for arm in ARMS:
        if arm in s:
            a = s[arm]
            extra = (
                f", mean M_total {a['m_total']:.0f}, early-stopped / dual-end groups per "
                f"step {a['early_stop_groups']:.1f} / {a['dual_end_groups']:.1f}, cost model "
                f"held-out error mean {a['cost_error_mean']:.2f} median "
                f"{a['cost_error_median']:.2f}, decode steps predicted exactly on "
                f"{a['decode_steps_match']:.0%} of steps"
                if arm == "darts"
                else ""
            )
            lines.append(
                f"{arm}: mean over all steps incl. compile {a['step_seconds_all']:.3f} s/step "
                f"({a['compile_steps']:.1f} compile steps per run left out above{extra}); "
                f"trained tokens per step {a['num_tokens']:.0f} (tree {a['tree_tokens']:.0f})"
            )
    if "speedup" in s:
        sp = s["speedup"]
        lines.append(
            f"speedup grpo/darts: step {sp['step_seconds']:.2f}x, rollout "
            f"{sp['rollout_seconds']:.2f}x, train {sp['train_seconds']:.2f}x; final success "
            f"gap darts - grpo {s['success_gap']:+.3f} "
            f"({'within' if s['success_within_spread'] else 'outside'} the seeds' spread)"
        )
    if "load_avg_start" in res:
        lines.append(
            f"machine: {res['cpus']} CPUs, load average {res['load_avg_start']:.1f} at start, "
            f"{res['load_avg_end']:.1f} at end; total {res['seconds']:.0f} s"
        )
    return "\n".join(lines)


def json_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One object per (arm, seed): ``arm``, ``seed``, ``step_seconds``, ``final_success``,
    ``mean_response_len``, then the rest of the run's numbers and series. NaN (a
    metric the arm does not have, e.g. ``m_total`` of grpo) becomes None (JSON null)."""
    return report.json_rows(res["runs"], nan_to_null=True)


def plot(res: dict[str, Any], path: str | os.PathLike) -> Path:
    """Response length (mean, p90) and greedy success vs RL step, both arms (seed mean,
    each seed faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_len, ax_ok) = plt.subplots(1, 2, figsize=(11, 4))
    colours = dict(grpo="tab:blue", darts="tab:orange")
    for arm in ARMS:
        rs = [r for r in res["runs"] if r["arm"] == arm]
        if not rs:
            continue
        c = colours[arm]
        for r in rs:
            x = np.arange(1, len(r["series"]["response_len_mean"]) + 1)
            ax_len.plot(x, r["series"]["response_len_mean"], color=c, alpha=0.2, lw=0.8)
            e = np.asarray(r["eval_curve"], float)
            ax_ok.plot(e[:, 0], e[:, 1], color=c, alpha=0.2, lw=0.8)
        n = min(len(r["series"]["response_len_mean"]) for r in rs)
        x = np.arange(1, n + 1)
        mean = np.mean([r["series"]["response_len_mean"][:n] for r in rs], axis=0)
        p90 = np.mean([r["series"]["response_len_p90"][:n] for r in rs], axis=0)
        ax_len.plot(x, mean, color=c, lw=2, label=f"{arm} mean")
        ax_len.plot(x, p90, color=c, lw=1.5, ls="--", label=f"{arm} p90")
        curves = [np.asarray(r["eval_curve"], float) for r in rs]
        m = min(len(e) for e in curves)
        ax_ok.plot(
            curves[0][:m, 0],
            np.mean([e[:m, 1] for e in curves], axis=0),
            color=c,
            lw=2,
            marker="o",
            label=arm,
        )
    ax_len.set(xlabel="RL step", ylabel="response length (tokens)", title="training group length")
    ax_ok.set(xlabel="RL step", ylabel="greedy success", title="eval success", ylim=(0, 1))
    ax_len.legend(fontsize=8)
    ax_ok.legend(fontsize=8)
    return report.save_figure(fig, path, dpi=110)


__all__ = [
    "ARMS",
    "DartsBenchConfig",
    "format_table",
    "json_rows",
    "plot",
    "run",
    "run_arm",
    "sft_params",
    "summarize",
]
