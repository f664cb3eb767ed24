"""Skill of a latency model: its held-out accuracy beside a baseline that knows nothing.

The baseline predicts, for every held-out item, the mean of the same quantity over the
fit steps (one constant per figure). A model "carries skill" on a figure only when its
accuracy beats that baseline's; otherwise the figure says no more than the fit steps'
mean did (e.g. a step makespan that barely changes from step to step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def accuracy(pred, real) -> float:
    """1 - mean relative error (the paper's replay accuracy)."""
    pred, real = np.asarray(pred, np.float64), np.asarray(real, np.float64)
    if pred.shape != real.shape or real.size == 0:
        raise ValueError(f"accuracy: shapes {pred.shape} vs {real.shape} (need equal, non-empty)")
    if np.any(real <= 0):
        raise ValueError("accuracy: real values must be > 0 (relative error)")
    return float(1.0 - np.mean(np.abs(pred - real) / real))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Skill:
    """One figure: the model's held-out accuracy and the fit-mean baseline's.

    baseline_value: the constant the baseline predicts (mean over the fit steps).
    """

    figure: str
    model: float
    baseline: float
    baseline_value: float

    @property
    def carries_skill(self) -> bool:
        return self.model > self.baseline

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), carries_skill=self.carries_skill)


def skill(figure: str, model_accuracy: float, fit_values, real) -> Skill:
    """``Skill`` of a figure whose held-out values are ``real``: the baseline predicts
    ``mean(fit_values)`` for every one of them."""
    fit = np.asarray(fit_values, np.float64).reshape(-1)
    if fit.size == 0:
        raise ValueError(f"{figure}: no fit-step values for the mean baseline")
    m = float(fit.mean())
    real = np.asarray(real, np.float64).reshape(-1)
    return Skill(
        figure=figure,
        model=float(model_accuracy),
        baseline=accuracy(np.full(real.shape, m), real),
        baseline_value=m,
    )


def skill_table(rows: Sequence[Skill]) -> list[str]:
    """Lines of a table: each figure's accuracy beside the baseline's, and which carry skill."""
    if not rows:
        return []
    out = [
        "skill: accuracy of the model vs a baseline predicting the fit steps' mean",
        "  figure                         model  baseline  skill",
    ]
    for r in rows:
        verdict = "yes" if r.carries_skill else "no (the fit mean does as well)"
        out.append(
            f"  {r.figure:<29}{r.model:>7.1%}  {r.baseline:>8.1%}  {verdict} "
            f"({100 * (r.model - r.baseline):+.1f} pts)"
        )
    carry = [r.figure for r in rows if r.carries_skill]
    out.append(f"  figures with skill: {', '.join(carry) if carry else 'none'}")
    return out


__all__ = ["Skill", "accuracy", "skill", "skill_table"]
