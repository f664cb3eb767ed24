"""Fitted production distributions (``enhanced_task_distribution_parameters.json``).

Math: a 2-D Gaussian mixture over (input, output) lengths, plus scipy-style
``lognorm(s, loc, scale)`` marginals. Tool calling: a categorical over the
number of calls k (= model turns) and, per k, one multivariate Gaussian over
the features ``input_1..k, output_1..k, ...``. We read ``input_1`` as the
prompt, ``input_j`` (j >= 2) as the tool return appended before turn j, and
``output_j`` as the model tokens of turn j.

Sampling draws from these fits and clips to ``[1, max_len]``; the raw
(unclipped) samples are available for statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from dtarl.traces.records import TraceFormatError

# The paper's production limits: math outputs reach 32k; tool sessions have <= 10 turns.
MATH_MAX_LEN = 32_768
TOOL_MAX_LEN = 65_536


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogNormal:
    """scipy ``lognorm(s, loc, scale)``: X = loc + scale * exp(s * Z), Z ~ N(0, 1)."""

    s: float
    loc: float
    scale: float

    @property
    def mean(self) -> float:
        return self.loc + self.scale * float(np.exp(self.s**2 / 2))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.loc + self.scale * np.exp(self.s * rng.standard_normal(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GaussianMixture:
    """weights [C], means [C, D], covariances [C, D, D]."""

    weights: np.ndarray
    means: np.ndarray
    covariances: np.ndarray

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, D] raw samples (may be negative)."""
        comp = rng.choice(len(self.weights), size=n, p=self.weights)
        out = np.empty((n, self.means.shape[1]))
        for c in range(len(self.weights)):
            idx = np.flatnonzero(comp == c)
            if idx.size:
                out[idx] = _mvn(rng, self.means[c], self.covariances[c], idx.size)
        return out


def _mvn(rng: np.random.Generator, mean: np.ndarray, cov: np.ndarray, n: int) -> np.ndarray:
    """Multivariate normal via eigh (negative eigenvalues of a fitted covariance set to 0)."""
    w, v = np.linalg.eigh((cov + cov.T) / 2)
    a_DxD = v * np.sqrt(np.clip(w, 0, None))
    return mean + rng.standard_normal((n, mean.shape[0])) @ a_DxD.T


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathFit:
    input_lognorm: LogNormal
    output_lognorm: LogNormal
    joint: GaussianMixture
    n_samples: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolSequenceModel:
    """One Gaussian over the features of sessions with ``call_count`` calls."""

    call_count: int
    feature_names: tuple[str, ...]
    mean: np.ndarray
    covariance: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolFit:
    call_counts: np.ndarray  # [K] possible k
    call_probs: np.ndarray  # [K]
    models: dict[int, ToolSequenceModel]
    n_samples: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class FittedWorkload:
    path: Path
    math: MathFit
    tool: ToolFit

    @property
    def name(self) -> str:
        return "fitted/production"


def _req(obj, key: str, where: str, prefix: str):
    if not isinstance(obj, dict) or key not in obj:
        raise TraceFormatError(f"{where}: missing field '{prefix}{key}'")
    return obj[key]


def _arr(obj, key: str, where: str, prefix: str, ndim: int) -> np.ndarray:
    v = _req(obj, key, where, prefix)
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TraceFormatError(f"{where}: field '{prefix}{key}': not a numeric array") from e
    if a.ndim != ndim or not np.all(np.isfinite(a)):
        raise TraceFormatError(
            f"{where}: field '{prefix}{key}': expected a finite {ndim}-D array, got shape {a.shape}"
        )
    return a


def _lognorm(obj, where: str, prefix: str) -> LogNormal:
    if _req(obj, "type", where, prefix) != "lognorm":
        raise TraceFormatError(f"{where}: field '{prefix}type' = {obj['type']!r}: expected lognorm")
    p = _arr(obj, "parameters", where, prefix, 1)
    if p.shape != (3,) or p[0] <= 0 or p[2] <= 0:
        raise TraceFormatError(f"{where}: field '{prefix}parameters': expected [s>0, loc, scale>0]")
    return LogNormal(s=float(p[0]), loc=float(p[1]), scale=float(p[2]))


def load_fitted(path: str | os.PathLike) -> FittedWorkload:
    """Parses and validates the fitted-distribution JSON (errors name file:line and field)."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from e
    where = f"{p}:1"
    m = _req(d, "math_task", where, "")
    g = _req(m, "gmm_parameters", where, "math_task.")
    pre = "math_task.gmm_parameters."
    w = _arr(g, "weights", where, pre, 1)
    mu = _arr(g, "means", where, pre, 2)
    cov = _arr(g, "covariances", where, pre, 3)
    if mu.shape != (w.shape[0], 2) or cov.shape != (w.shape[0], 2, 2):
        raise TraceFormatError(
            f"{where}: field '{pre}means/covariances': shapes do not match weights"
        )
    if np.any(w < 0) or not np.isclose(w.sum(), 1.0, atol=1e-3):
        raise TraceFormatError(f"{where}: field '{pre}weights' must be >= 0 and sum to 1")
    info = d.get("extraction_info", {})
    math = MathFit(
        input_lognorm=_lognorm(
            _req(m, "input_distribution", where, "math_task."),
            where,
            "math_task.input_distribution.",
        ),
        output_lognorm=_lognorm(
            _req(m, "output_distribution", where, "math_task."),
            where,
            "math_task.output_distribution.",
        ),
        joint=GaussianMixture(weights=w / w.sum(), means=mu, covariances=cov),
        n_samples=int(info.get("total_math_samples", 0)),
    )
    t = _req(d, "tool_calling_task", where, "")
    counts = _req(t, "call_count_distribution", where, "tool_calling_task.")
    seq = _req(t, "sequence_models", where, "tool_calling_task.")
    ks, ns, models = [], [], {}
    for k_str, n in sorted(counts.items(), key=lambda kv: int(kv[0])):
        k = int(k_str)
        pre = f"tool_calling_task.sequence_models.{k_str}."
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TraceFormatError(
                f"{where}: field 'tool_calling_task.call_count_distribution.{k_str}' = {n!r}: "
                "expected a count >= 0"
            )
        sm = _req(seq, k_str, where, "tool_calling_task.sequence_models.")
        names = tuple(_req(sm, "feature_names", where, pre))
        mean = _arr(sm, "mean_vector", where, pre, 1)
        c = _arr(sm, "covariance_matrix", where, pre, 2)
        need = [f"input_{j}" for j in range(1, k + 1)] + [f"output_{j}" for j in range(1, k + 1)]
        missing = [f for f in need if f not in names]
        if missing or mean.shape != (len(names),) or c.shape != (len(names), len(names)):
            raise TraceFormatError(
                f"{where}: field '{pre}feature_names/mean_vector/covariance_matrix': "
                f"inconsistent (missing {missing[:2]}, mean {mean.shape}, cov {c.shape})"
            )
        ks.append(k)
        ns.append(n)
        models[k] = ToolSequenceModel(call_count=k, feature_names=names, mean=mean, covariance=c)
    probs = np.asarray(ns, np.float64)
    tool = ToolFit(
        call_counts=np.asarray(ks, np.int64),
        call_probs=probs / probs.sum(),
        models=models,
        n_samples=int(info.get("total_tool_calling_samples", probs.sum())),
    )
    return FittedWorkload(path=p, math=math, tool=tool)


def sample_math_lengths(
    fit: MathFit, rng: np.random.Generator, n: int, *, clip: bool = True
) -> np.ndarray:
    """[n, 2] (input, output) lengths from the joint GMM, rounded, clipped to [1, 32768]."""
    x = np.rint(fit.joint.sample(rng, n))
    return np.clip(x, 1, MATH_MAX_LEN).astype(np.int64) if clip else x


def _std_normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def sample_tool_session(
    fit: ToolFit,
    rng: np.random.Generator,
    *,
    z_count: float | None = None,
    z_features: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One session: (inputs [k], outputs [k]) with k ~ call-count distribution.

    inputs[0] is the prompt, inputs[j] the tool return appended before turn j;
    outputs[j] the model tokens of turn j. Rounded and clipped to [1, 65536].

    ``z_count`` / ``z_features``: standard-normal latents to use instead of fresh
    draws (a Gaussian copula: k is the call-count quantile at Phi(z_count), the
    (output_1..k, input_1..k) are mean + L z with L the Cholesky factor of their
    covariance (``_turn_factor``); ``z_features`` needs >= 2k entries, the first
    ones are used).
    The marginals are unchanged; sharing part of the latents across the samples
    of a group correlates them (``dtarl.traces.workload.GroupCorrelation``).
    """
    if z_count is None:
        k = int(rng.choice(fit.call_counts, p=fit.call_probs))
    else:
        cdf = np.cumsum(fit.call_probs)
        j = int(np.searchsorted(cdf, _std_normal_cdf(float(z_count)) * cdf[-1], side="right"))
        k = int(fit.call_counts[min(j, len(cdf) - 1)])
    m = fit.models[k]
    if z_features is None:
        x = _mvn(rng, m.mean, m.covariance, 1)[0]
        idx = {f: i for i, f in enumerate(m.feature_names)}
        ins = np.array([x[idx[f"input_{j}"]] for j in range(1, k + 1)])
        outs = np.array([x[idx[f"output_{j}"]] for j in range(1, k + 1)])
    else:
        mean, chol = _turn_factor(m)
        if len(z_features) < mean.shape[0]:
            raise ValueError(
                f"z_features has {len(z_features)} entries; the {k}-call model needs "
                f"{mean.shape[0]}"
            )
        x = mean + chol @ np.asarray(z_features[: mean.shape[0]], np.float64)
        outs, ins = x[:k], x[k:]
    ins = np.clip(np.rint(ins), 1, TOOL_MAX_LEN).astype(np.int64)
    outs = np.clip(np.rint(outs), 1, TOOL_MAX_LEN).astype(np.int64)
    return ins, outs


def _turn_factor(m: ToolSequenceModel) -> tuple[np.ndarray, np.ndarray]:
    """Mean and lower Cholesky factor of (output_1..k, input_1..k), the marginal of the model's
    Gaussian the sessions use, in that canonical order: latent j drives output j+1 first, so
    the latents mean the same thing for every k (what lets a group share them)."""
    idx = {f: i for i, f in enumerate(m.feature_names)}
    k = m.call_count
    sel = [idx[f"output_{j}"] for j in range(1, k + 1)] + [
        idx[f"input_{j}"] for j in range(1, k + 1)
    ]
    mean = m.mean[sel]
    cov = m.covariance[np.ix_(sel, sel)]
    cov = (cov + cov.T) / 2
    jitter = 1e-9 * max(float(np.trace(cov)) / len(sel), 1e-12)
    for _ in range(8):
        try:
            return mean, np.linalg.cholesky(cov + jitter * np.eye(len(sel)))
        except np.linalg.LinAlgError:
            jitter *= 100
    w, v = np.linalg.eigh(cov)  # not positive definite even with jitter: symmetric root
    return mean, v * np.sqrt(np.clip(w, 0, None))


def tool_feature_dim(fit: ToolFit) -> int:
    """Size of a full latent draw: 2 k_max (outputs and inputs of the longest session)."""
    return 2 * int(max(fit.models))
