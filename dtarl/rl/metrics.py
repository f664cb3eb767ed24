"""Per-step metrics: pure summary functions (``step_metrics`` for a step's updates),
and a sink to the console (rich), JSONL and ``logging.backends`` (TensorBoard, W&B).

Metrics are computed under flat names and logged under verl's slash groups
(``dtarl.rl.logging_backends.METRIC_NAMES``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from dtarl.advantages import token_kl
from dtarl.batch import RolloutBatch
from dtarl.rl.config import AlgoSection, LoggingBackend, LoggingSection
from dtarl.rl.logging_backends import (
    TensorBoardSink,
    WandbSink,
    flat_record,
    logged_record,
    scalars,
)
from dtarl.rl.optim import UpdateResult
from dtarl.timing import compile_seconds


def length_stats(lengths: Sequence[int], prefix: str = "response_len") -> dict[str, float]:
    """mean / p90 / max of response lengths."""
    a = np.asarray(lengths, np.float64)
    if a.size == 0:
        return {f"{prefix}_mean": 0.0, f"{prefix}_p90": 0.0, f"{prefix}_max": 0.0}
    return {
        f"{prefix}_mean": float(a.mean()),
        f"{prefix}_p90": float(np.percentile(a, 90)),
        f"{prefix}_max": float(a.max()),
    }


def ratio_stats(
    logprobs: Sequence[np.ndarray],
    old_logprobs: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    advantages: np.ndarray,
    *,
    eps_low: float,
    eps_high: float,
    token_advantages: Sequence[np.ndarray] | None = None,
) -> dict[str, float]:
    """Importance ratio r_t = exp(logp_t - logp_old_t) over trained tokens, and clip fraction.

    A token is clipped when the clip is active in the surrogate:
    A_t >= 0 and r > 1 + eps_high, or A_t < 0 and r < 1 - eps_low, with A_t the
    per-token advantage where given (PPO/GAE), else the sequence's.
    """
    rs, clipped, total = [], 0.0, 0.0
    for i, (lp, old, m) in enumerate(zip(logprobs, old_logprobs, masks, strict=True)):
        sel = np.asarray(m) > 0
        if not sel.any():
            continue
        r = np.exp(np.asarray(lp, np.float64)[sel] - np.asarray(old, np.float64)[sel])
        rs.append(r)
        if token_advantages is not None:
            a = np.asarray(token_advantages[i], np.float64)[sel]
        else:
            a = np.full(r.shape, float(advantages[i]))
        hit = np.where(a >= 0, r > 1 + eps_high, r < 1 - eps_low)
        clipped += float(np.sum(hit))
        total += float(sel.sum())
    if not rs:
        return dict(ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0, clip_fraction=0.0)
    r = np.concatenate(rs)
    return dict(
        ratio_mean=float(r.mean()),
        ratio_max=float(r.max()),
        ratio_min=float(r.min()),
        clip_fraction=clipped / max(total, 1.0),
    )


def sampled_entropy(logprobs: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> float:
    """H ~= mean over trained tokens of -log pi(y_t): the Monte Carlo estimate of the
    policy's per-token entropy from the sampled tokens' logprobs (unbiased for the
    policy they were sampled from; the exact entropy of the logits is computed only
    when the loss needs it)."""
    num = den = 0.0
    for lp, m in zip(logprobs, masks, strict=True):
        sel = np.asarray(m) > 0
        num -= float(np.asarray(lp, np.float64)[sel].sum())
        den += float(sel.sum())
    return num / den if den else 0.0


def engine_metrics(stats: dict) -> dict:
    """What a step's engine stats add to its metrics: the engine auto ran (``chosen_engine``),
    the compiled programs so far (``trace_count``: it grows only when a batch needs a new
    shape bucket) and auto's tuning time for the step (``autotune_seconds``)."""
    out = {}
    if "chosen_engine" in stats:
        out["chosen_engine"] = stats["chosen_engine"]
    for key in ("trace_count", "autotune_seconds"):
        if key in stats:
            out[key] = stats[key]
    return out


def step_metrics(
    batch: RolloutBatch,
    updates: Sequence[UpdateResult],
    algo: AlgoSection | None = None,
    *,
    last_batch: RolloutBatch | None = None,
) -> dict[str, Any]:
    """Metrics of one step's ``updates`` (in order; the last may be a skipped one) on ``batch``.

    Always: the last update's loss, gradient norm and engine stats; the summed train
    time and tokens/s; ``skipped`` (and ``skip_reason``). An RL step (``algo`` given)
    adds ``autotune_seconds`` summed over its updates (0 for a fixed engine), the
    importance ratios and clip fraction of the last update's logprobs against the
    sampler's (``ratio_stats``), and ``kl``: the k3 estimate against the reference
    policy when the batch has one, else against the sampling policy. With minibatches
    (``algo.minibatches``) ``last_batch`` is the last update's sub-batch, which the
    ratios and the kl are measured on.
    """
    last = updates[-1]
    stats = last.aux.stats
    if algo is not None:
        tune = sum(float(u.aux.stats.get("autotune_seconds", 0.0)) for u in updates)
        stats = stats | {"autotune_seconds": tune}
    seconds = sum(u.seconds for u in updates)
    passes = algo.updates_per_batch if algo is not None else 1
    m: dict[str, Any] = dict(
        loss=last.loss,
        grad_norm=last.grad_norm,
        engine=last.engine,
        **engine_metrics(stats),
        train_seconds=seconds,
        train_tokens_per_s=batch.num_tokens * passes / max(seconds, 1e-9),
        skipped=int(not last.applied),
    )
    if not last.applied:
        m["skip_reason"] = last.skip_reason
    if algo is None:
        return m
    logprobs = last.aux.logprobs
    batch = batch if last_batch is None else last_batch
    m.update(
        ratio_stats(
            logprobs,
            batch.old_logprobs,
            batch.loss_mask,
            batch.advantages,
            eps_low=algo.clip_eps,
            eps_high=algo.eps_high,
            token_advantages=batch.token_advantages,
        )
    )
    m["entropy"] = sampled_entropy(logprobs, batch.loss_mask)
    against = batch.ref_logprobs if batch.ref_logprobs is not None else batch.old_logprobs
    kls = [
        token_kl(lp, rf, mk) for lp, rf, mk in zip(logprobs, against, batch.loss_mask, strict=True)
    ]
    m["kl"] = float(np.mean(kls))
    return m


_CONSOLE_KEYS = (
    ("reward_mean", "reward", "{:.3f}"),
    ("success_rate", "success", "{:.2f}"),
    ("eval_success_rate", "eval", "{:.2f}"),
    ("loss", "loss", "{:.4f}"),
    ("response_len_mean", "len", "{:.1f}"),
    ("kl", "kl", "{:.4f}"),
    ("clip_fraction", "clip", "{:.3f}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("rollout_tokens_per_s", "roll tok/s", "{:.0f}"),
    ("train_tokens_per_s", "train tok/s", "{:.0f}"),
    ("tree_token_ratio", "tree x", "{:.2f}"),
)


def format_line(m: dict[str, Any]) -> str:
    parts = [f"{m.get('phase', '?'):>3} {m.get('step', 0):>4}"]
    for key, label, fmt in _CONSOLE_KEYS:
        v = m.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            parts.append(f"{label} {fmt.format(v)}")
    if m.get("skipped"):
        parts.append(f"SKIPPED ({m.get('skip_reason', '')})")
    return " | ".join(parts)


class MetricsLogger:
    """Writes one record per step to ``out_dir/metrics.jsonl`` (appending, so resumes
    continue the file), the console (a rich progress bar plus a line per step) and
    the ``logging.backends`` (TensorBoard in ``out_dir/tb``, W&B in ``out_dir/wandb``),
    under the logged names (``logging_backends.logged_record``). ``config``: the run's
    config as a dict, W&B's run config."""

    def __init__(
        self,
        out_dir: str,
        *,
        total_steps: int,
        console: bool = True,
        logging: LoggingSection | None = None,
        config: dict[str, Any] | None = None,
        log_every: int = 1,
    ):
        logging = LoggingSection() if logging is None else logging
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._file = open(self.path, "a")
        self.log_every = max(1, log_every)
        self._sinks = []
        if logging.has(LoggingBackend.TENSORBOARD):
            self._sinks.append(TensorBoardSink(os.path.join(out_dir, "tb")))
        if logging.has(LoggingBackend.WANDB):
            sink = WandbSink(
                out_dir, project=logging.project, name=logging.run_name, config=config or {}
            )
            self._sinks.append(sink)
        self._progress = None
        self._console = None
        if console:
            self._console = Console()
            self._progress = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
            )
            self._task = self._progress.add_task("training", total=total_steps)
            self._progress.start()

    def print(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text)

    @classmethod
    def for_process(
        cls,
        out_dir: str,
        *,
        total_steps: int,
        console: bool,
        logging: LoggingSection | None = None,
        config: dict[str, Any] | None = None,
    ) -> MetricsLogger:
        """This process's logger: ``out_dir`` for process 0, ``out_dir/process_i`` with
        no console and JSONL only for process i > 0."""
        me = jax.process_index()
        return cls(
            out_dir if me == 0 else os.path.join(out_dir, f"process_{me}"),
            total_steps=total_steps,
            console=console and me == 0,
            logging=logging if me == 0 else None,
            config=config,
        )

    def log(self, metrics: dict[str, Any], *, advance: bool = True) -> None:
        rec = {k: _jsonable(v) for k, v in logged_record(metrics).items()}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        step = int(metrics.get("global_step", metrics.get("step", 0)))
        values = scalars(rec)
        for sink in self._sinks:
            sink.write(step, values)
        if self._progress is not None:
            if advance:
                self._progress.advance(self._task)
            if step % self.log_every == 0 or metrics.get("skipped"):
                self._console.print(format_line(metrics))

    def skip_to(self, completed: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if not self._file.closed:
            self._file.close()


def _jsonable(v):
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: str, *, flat: bool = False) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl (a run directory or the file): its records under the
    logged names, or with ``flat`` under the flat names (``StepInfo.metrics``'s)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [flat_record(r) for r in recs] if flat else recs


def truncate_metrics(path: str, step: int) -> None:
    """Drops the records of metrics.jsonl at ``path`` written after the checkpoint of
    global ``step`` (a killed run's last steps, which the resumed run logs again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    recs = []
    for line in lines:
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            recs.append(None)  # a line cut short by the kill
    # Everything up to the checkpointed step's own record; eval records logged
    # after it (e.g. after the warm-up, or the final eval) belong to later steps.
    ends = [
        i
        for i, r in enumerate(recs)
        if r is not None and r.get("phase") != "eval" and r.get("global_step") == step
    ]
    if ends:
        keep = lines[: ends[-1] + 1]
    else:
        keep = [
            line
            for line, r in zip(lines, recs, strict=True)
            if r is not None
            and (r.get("global_step", 0), r.get("phase") == "eval") <= (step, False)
        ]
    if keep == lines:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def mesh_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """A sharded update's layout (``ShardedEngine`` stats): ``dp``, ``fsdp``, ``tp``, the
    partition method, the candidate that won (``partition_winner``: the balanced cut's
    order or the baseline with the lower makespan), the cost model it was priced with
    (``partition_cost_model``: the running engine's kind, or "fallback:FlopCost"), and
    the rank loads under that cost model (FLOPs, not measured time): ``rank_load_max``
    (the makespan), ``rank_load_mean`` and ``load_balance`` = max / mean.
    ``work_balance``: max / mean of the ranks' padded work as the engine counts it
    (``features``), when this process prepared every rank. Empty for a single-device
    update."""
    if "rank_loads" not in stats:
        return {}
    loads = np.asarray(stats["rank_loads"], np.float64)
    out = dict(
        dp=int(stats["dp"]),
        tp=int(stats["tp"]),
        fsdp=int(stats.get("fsdp", 1)),
        partition_method=stats["partition_method"],
        partition_winner=stats.get("partition_winner", ""),
        partition_cost_model=stats.get("partition_cost_model", ""),
        rank_load_max=float(loads.max()),
        rank_load_mean=float(loads.mean()),
        load_balance=float(stats["load_balance"]),
    )
    work = np.asarray(stats.get("rank_work_flops", []), np.float64)
    if work.size == int(stats["dp"]) * int(stats.get("fsdp", 1)) and work.mean() > 0:
        out["work_balance"] = float(work.max() / work.mean())
    return out


def pat_metrics(timeline: list[dict[str, Any]], start_tp: int) -> dict[str, Any]:
    """A rollout's PAT switches (``PatController.timeline``, from tp ``start_tp``):
    ``pat_switches``, ``pat_switch_seconds`` and ``pat_final_tp``."""
    return dict(
        pat_switches=len(timeline),
        pat_switch_seconds=float(sum(e["seconds"] for e in timeline)),
        pat_final_tp=timeline[-1]["dst"][1] if timeline else start_tp,
    )


class CompileTotals:
    """A step's ``compile_seconds`` (what JAX spent tracing, lowering and compiling during
    it: every program, ``dtarl.timing.compile_seconds``) and ``autotune_seconds`` (auto's
    tuning in it; its timed calls include compiling the candidates, so the two overlap),
    and both summed over the steps of this process (``*_total``)."""

    def __init__(self):
        self.compile = self.autotune = 0.0
        compile_seconds()  # starts JAX's compile-time events

    def start(self) -> float:
        return compile_seconds()

    def add(self, m: dict[str, Any], start: float) -> None:
        """Adds the step's (begun at ``start``) to its metrics ``m``."""
        m["compile_seconds"] = compile_seconds() - start
        m.setdefault("autotune_seconds", 0.0)
        self.compile += m["compile_seconds"]
        self.autotune += m["autotune_seconds"]
        m["compile_seconds_total"] = self.compile
        m["autotune_seconds_total"] = self.autotune


__all__ = [
    "CompileTotals",
    "MetricsLogger",
    "engine_metrics",
    "format_line",
    "length_stats",
    "mesh_metrics",
    "pat_metrics",
    "ratio_stats",
    "read_metrics",
    "sampled_entropy",
    "step_metrics",
    "truncate_metrics",
]
