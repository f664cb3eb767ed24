"""Logged metric names (verl's slash groups) and the optional backends.

A step's metrics are computed under short flat names (``loss``, ``grad_norm``,
``reward_mean``, ...: the keys of ``StepInfo.metrics`` and ``TrainResult.history``,
the Python API). Every backend (``metrics.jsonl``, TensorBoard, W&B) writes them
under the names of ``METRIC_NAMES``, grouped as verl groups them; a metric not in
the table keeps its name, and a record's bookkeeping keys (``phase``, ``step``,
``global_step``, ...) are never renamed. ``read_metrics(path, flat=True)`` reads a
file back under the flat names.

TensorBoard writes through ``tensorboardX`` (``pip install 'dtarl[tensorboard]'``)
into ``OUT_DIR/tb``; W&B through ``wandb`` (``pip install 'dtarl[wandb]'``) into
``OUT_DIR/wandb`` (``WANDB_MODE=offline`` keeps the run local; ``wandb sync`` uploads
it later).
"""

from __future__ import annotations

import math
import os
from typing import Any

# flat name -> logged name
METRIC_NAMES: dict[str, str] = {
    # the policy update
    "loss": "actor/pg_loss",
    "grad_norm": "actor/grad_norm",
    "kl": "actor/kl",
    "entropy": "actor/entropy",
    "clip_fraction": "actor/clip_fraction",
    "ratio_mean": "actor/ratio/mean",
    "ratio_max": "actor/ratio/max",
    "ratio_min": "actor/ratio/min",
    "lr": "actor/lr",
    # rewards and advantages
    "score_mean": "critic/score/mean",
    "reward_mean": "critic/rewards/mean",
    "reward_std": "critic/rewards/std",
    "success_rate": "critic/success_rate",
    "advantage_abs_mean": "critic/advantages/abs_mean",
    "reward_errors": "critic/reward_errors",
    # responses
    "response_len_mean": "response_length/mean",
    "response_len_p90": "response_length/p90",
    "response_len_max": "response_length/max",
    "truncated_fraction": "response_length/clip_ratio",
    "turns_mean": "response_length/turns_mean",
    # time
    "step_seconds": "timing/step_s",
    "rollout_seconds": "timing/rollout_s",
    "reward_seconds": "timing/reward_s",
    "post_rollout_forward_seconds": "timing/forward_s",
    "train_seconds": "timing/update_s",
    "compile_seconds": "timing/compile_s",
    "compile_seconds_total": "timing/compile_s_total",
    "autotune_seconds": "timing/autotune_s",
    "autotune_seconds_total": "timing/autotune_s_total",
    # throughput and shapes
    "rollout_tokens": "perf/rollout_tokens",
    "rollout_tokens_per_s": "perf/rollout_tokens_per_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
    "tree_token_ratio": "perf/tree_token_ratio",
    "trace_count": "perf/trace_count",
    # dynamic sampling
    "generation_batches": "batch/generation_batches",
    "kept_fraction": "batch/kept_fraction",
    "groups_short": "batch/groups_short",
    "skipped_total": "batch/skipped_total",
    # evaluation (the Trainer also logs the val/ names themselves)
    "eval_success_rate": "val/pass@1",
}

# Keys of a record that say which step it is: never renamed.
BOOKKEEPING = ("phase", "step", "global_step", "after", "skipped", "skip_reason", "engine")

_FLAT = {v: k for k, v in METRIC_NAMES.items()}


def logged_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` under their logged names (a logged name present in ``metrics``
    itself wins over a flat alias of it: ``val/pass@1`` over ``eval_success_rate``)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        name = METRIC_NAMES.get(k, k)
        if name != k and name in metrics:
            continue
        out[name] = v
    return out


def flat_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A logged record under the flat names (``logged_record``'s inverse)."""
    return {_FLAT.get(k, k): v for k, v in rec.items()}


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, bookkeeping keys left out."""
    return {
        k: float(v)
        for k, v in rec.items()
        if k not in BOOKKEEPING
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class TensorBoardSink:
    """Scalars to ``log_dir`` as TensorBoard event files (``tensorboardX``)."""

    def __init__(self, log_dir: str):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars to a Weights & Biases run in ``out_dir/wandb`` (``WANDB_MODE=offline``
    keeps it local)."""

    def __init__(self, out_dir: str, *, project: str, name: str | None, config: dict):
        import wandb

        self.run = wandb.init(
            project=project,
            name=name or os.path.basename(os.path.abspath(out_dir)),
            dir=out_dir,
            config=config,
            reinit="create_new",
        )
        self.run.define_metric("*", step_metric="global_step")

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"global_step": step, **values})

    def close(self) -> None:
        self.run.finish()


__all__ = [
    "BOOKKEEPING",
    "METRIC_NAMES",
    "TensorBoardSink",
    "WandbSink",
    "flat_record",
    "logged_record",
    "scalars",
]
