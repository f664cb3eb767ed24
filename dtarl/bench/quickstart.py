"""``dtarl bench quickstart``: what GRPO adds over the SFT warm-up in the main job.

For each seed, ``configs/quickstart.yaml`` (or ``--config``) runs as ``dtarl train``
would, and the report gives the greedy success rate on the held-out problems after
the SFT warm-up (the RL phase's starting point) and after GRPO, their difference,
the run's wall-clock seconds and the 1-minute load average before and after it (the
machine is shared: a loaded machine slows the runs, not the success rates). The runs
go one after the other in this process (each its own ``Trainer``).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from dtarl.rl.config import TrainerConfig, load_config


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeedResult:
    seed: int
    before: float  # greedy success before training
    sft: float  # ... after the SFT warm-up
    grpo: float  # ... after the RL steps
    seconds: float  # the whole run: compile, SFT, RL, evaluations
    load_before: float  # 1-minute load average when the run started
    load_after: float

    @property
    def gain(self) -> float:
        return self.grpo - self.sft


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def seed_config(config: str, seed: int, out_dir: str, overrides=()) -> TrainerConfig:
    """The run of ``seed``: the config with its seed and a fresh ``out_dir/seed_<seed>``
    (no resume), no console."""
    sets = [*overrides, f"seed={seed}", f"out_dir={out_dir}/seed_{seed}", "console=false"]
    return load_config(config, [*sets, "resume.enabled=false"])


def run_seed(cfg: TrainerConfig) -> SeedResult:
    """One quickstart run (its config from ``seed_config``)."""
    from dtarl.rl.trainer import Trainer

    if not (cfg.sft.steps and cfg.eval.num_problems):
        raise ValueError(
            "dtarl bench quickstart needs an SFT warm-up and an evaluation set "
            f"(sft.steps={cfg.sft.steps}, eval.num_problems={cfg.eval.num_problems})"
        )
    load0, t0 = _load(), time.perf_counter()
    res = Trainer(cfg).run()
    return SeedResult(
        seed=cfg.seed,
        before=float(res.eval_start),
        sft=float(res.eval_rl_start),
        grpo=float(res.eval_end),
        seconds=time.perf_counter() - t0,
        load_before=load0,
        load_after=_load(),
    )


def format_table(rows: list[SeedResult], cores: int | None = None) -> str:
    """The per-seed table and the mean gain."""
    cores = os.cpu_count() if cores is None else cores
    lines = [
        f"greedy success on held-out problems ({cores} cores; load = 1-min load average)",
        f"{'seed':>4} {'before':>7} {'SFT':>7} {'GRPO':>7} {'gain':>7} {'seconds':>8} {'load':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r.seed:>4} {r.before:>7.3f} {r.sft:>7.3f} {r.grpo:>7.3f} {r.gain:>+7.3f} "
            f"{r.seconds:>8.1f} {r.load_before:>5.1f}-{r.load_after:<5.1f}"
        )
    gains = np.array([r.gain for r in rows])
    lines.append(
        f"mean gain {gains.mean():+.3f} (min {gains.min():+.3f}); mean "
        f"{np.mean([r.seconds for r in rows]):.1f} s per run"
    )
    return "\n".join(lines)


__all__ = ["SeedResult", "format_table", "run_seed", "seed_config"]
