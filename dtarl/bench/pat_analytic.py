"""A noise-free check of PAT's predictor (PAT, arXiv 2605.23945): an ANALYTIC profile,
a prediction and labelled so, in the ``Profile`` format of ``dtarl.bench.pat_profile``.

Per grid point (tp, slots) and response window, the engine's own decode program is
lowered and compiled for that mesh and slot count (nothing runs) and XLA's cost
analysis of the partitioned program gives its FLOPs and bytes accessed per device.
A step's seconds are a roofline plus an alpha-beta model of the TP all-reduces::

    seconds = max(flops / F, bytes / W) + (tp > 1) * 2 L (2 (tp - 1) alpha
                                                          + 2 (tp - 1) / tp  m beta)

with m = B x hidden x 4 bytes (one activation row per request of the DP group, two
all-reduces per layer: attention and MLP outputs, ring algorithm). F, W, alpha and
beta are nominal constants (``Machine``), not this machine's: the profile is a
model of a machine, and since it has no timing noise, how well the predictor's
piecewise-linear interpolation reproduces held-out grid points
(``pat.leave_one_out``) measures the interpolation alone (goal <= 2%; the timed
profile's goal of <= 4% stays for real hardware). The profile holds the engine's decode
windows (R/4, R/2, R); the check also computes the analytic points at the windows
k R / 8 between them that the profile does not hold (``held_out_windows``: 3R/8, 5R/8,
3R/4, 7R/8) and predicts each from the profile, reporting the error per window. XLA's
cost analysis counts the body of the decode program's step loop once, so the seconds
are per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtarl.bench.pat_profile import ProfileGrid, Profiler, tree_bytes
from dtarl.rollout import pat
from dtarl.rollout.config import decode_windows
from dtarl.rollout.engine import RolloutEngine
from dtarl.rollout.pool import slot_arrays
from dtarl.rollout.programs import ProgramKey, ProgramKind


@dataclasses.dataclass(frozen=True)
class Machine:
    """Nominal machine constants of the analytic model (an accelerator-like default)."""

    flops_per_s: float = 1e12
    bytes_per_s: float = 1e11
    alpha_s: float = 5e-6
    beta_s_per_byte: float = 1 / 5e10


def program_cost(engine: RolloutEngine, weights, window: int) -> dict[str, float]:
    """FLOPs and bytes accessed (per device) of the engine's decode program at its
    current mesh and slot count, compiled, not run."""
    c = engine.config
    w = engine.place(weights)
    slots = slot_arrays(engine.scheduler.mirror, engine._placement())
    key = ProgramKey(
        kind=ProgramKind.DECODE,
        mesh=engine.mesh,
        slots=engine.slots,
        steps=c.steps_per_call,
        filtered=False,
        window=window,
    )
    fn = engine.programs.get(key)
    ca = fn.lower(w, engine.pool.arrays, slots, engine._table_device()).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)))


def step_seconds(cost: dict[str, float], *, tp: int, b: int, hidden: int, layers: int,
                 machine: Machine) -> float:  # fmt: skip
    """The roofline + all-reduce seconds of one decode step (module docstring)."""
    m = machine
    s = max(cost["flops"] / m.flops_per_s, cost["bytes"] / m.bytes_per_s)
    if tp > 1:
        msg = b * hidden * 4
        s += 2 * layers * (2 * (tp - 1) * m.alpha_s + 2 * (tp - 1) / tp * msg * m.beta_s_per_byte)
    return s


def held_out_windows(response_len: int) -> list[int]:
    """The windows k R / 8 strictly between the engine's smallest and largest decode
    window that are not engine windows (R = 256: 96, 160, 192, 224): the check's
    held-out windows, which the profile does not hold."""
    ws = decode_windows(response_len)
    lo, hi = min(ws), max(ws)
    return sorted(
        {w for k in range(1, 8) if lo < (w := k * response_len // 8) < hi and w not in ws}
    )


def analytic_points(
    model,
    weights,
    grid: ProfileGrid,
    engine: RolloutEngine,
    windows: Sequence[int],
    machine: Machine | None = None,
) -> list[dict[str, Any]]:
    """The analytic decode rows ``{tp, b, l, t, seconds, flops, bytes}`` of every grid
    point (tp, slots) at each window in ``windows`` (``engine`` idle on a mesh of its
    devices; left on its first mesh)."""
    m = machine or Machine()
    c = grid.engine
    devs = list(engine.mesh.devices.flat)
    d, kv = len(devs), model.cfg.num_kv_heads
    tps = [t for t in grid.tps if d % t == 0 and kv % t == 0]
    first = tuple(int(x) for x in engine.mesh.devices.shape)
    prof = Profiler(engine, weights, 0)
    cells = c.prompt_slots * c.group_size * c.prompt_len
    dec: list[dict[str, Any]] = []
    for tp, s in dataclasses.replace(grid, tps=tuple(tps)).points(d):
        dp = d // tp
        prof.move_to(dp, tp, s)
        for w in sorted({int(x) for x in windows}):
            cost = program_cost(engine, weights, w)
            sec = step_seconds(
                cost, tp=tp, b=s // dp, hidden=model.cfg.hidden_size,
                layers=model.cfg.num_layers, machine=m,
            )  # fmt: skip
            dec.append(dict(tp=tp, b=s // dp, l=w, t=(cells + s * w) / dp, seconds=sec, **cost))
    prof.move_to(*first, c.slots)
    return dec


def analytic_profile(
    model, weights, grid: ProfileGrid, engine: RolloutEngine, machine: Machine | None = None,
    rows: Sequence[dict[str, Any]] | None = None,
) -> pat.Profile:  # fmt: skip
    """The analytic ``Profile`` of ``grid`` on ``engine`` at the engine's decode windows
    (``rows``: ``analytic_points`` already computed; those at other windows are left
    out)."""
    m = machine or Machine()
    c = grid.engine
    windows = decode_windows(c.response_len)
    if rows is None:
        rows = analytic_points(model, weights, grid, engine, windows, m)
    dec = [dict(r) for r in rows if r["l"] in windows]
    d = engine.mesh.devices.size
    pre = [dict(tp=r["tp"], b=r["b"], l=c.prompt_len, t=r["b"] * c.prompt_len, seconds=r["seconds"])
           for r in dec if r["l"] == min(windows)]  # fmt: skip
    return pat.Profile(
        model={
            k: v if isinstance(v, int | float | str | bool) or v is None else str(v)
            for k, v in dataclasses.asdict(model.cfg).items()
        },  # fmt: skip
        device_kind=f"ANALYTIC PREDICTION ({m})",
        platform="analytic",
        jax_version=jax.__version__,
        devices=d,
        mesh_axes=("dp", "tp"),
        token_cap=int(np.ceil(max(r["t"] for r in dec))),
        window=c.response_len,
        decode=tuple(dec),
        prefill=tuple(pre),
        weight_bytes=tree_bytes(weights),
        weights_bytes_per_s=m.bytes_per_s,
        kv_bytes_per_s=m.bytes_per_s,
        compile_s=0.0,
        steps_per_call=c.steps_per_call,
        engine={k: int(v) for k, v in dataclasses.asdict(c).items()},
        notes="analytic: XLA cost analysis (flops, bytes accessed) + alpha-beta all-reduce",
    )


def check(profile: pat.Profile, held_out: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Held-out interpolation error on the analytic profile: each row of ``held_out``
    (analytic points at windows the profile does not hold, ``held_out_windows``)
    predicted from the profile, per window and in all; and ``pat.leave_one_out``'s
    points inside the grid (between windows of one B: ``t_error``; between B levels:
    ``b_error``). ``mean_rel_error``: over every held-out point of both kinds."""
    loo = pat.leave_one_out(profile)
    predictor = pat.Predictor(profile)
    scale = profile.decode_scale
    between = []
    for r in held_out:
        pred = float(predictor.step_seconds(r["tp"], r["b"], r["t"])) / scale
        between.append(dict(r, predicted=pred, rel_error=abs(pred - r["seconds"]) / r["seconds"]))
    per_window = [
        dict(
            window=w,
            points=len(errs),
            mean_rel_error=float(np.mean(errs)),
            max_rel_error=float(np.max(errs)),
        )
        for w in sorted({r["l"] for r in between})
        if (errs := [r["rel_error"] for r in between if r["l"] == w])
    ]
    errs = [e["rel_error"] for e in loo] + [r["rel_error"] for r in between]

    def mean(xs):
        return float(np.mean(xs)) if xs else float("nan")

    return dict(
        label="PREDICTION (analytic profile)",
        held_out_points=len(errs),
        mean_rel_error=mean(errs),
        max_rel_error=float(np.max(errs)) if errs else float("nan"),
        t_error=mean([e["rel_error"] for e in loo if e["kind"] == "t"]),
        b_error=mean([e["rel_error"] for e in loo if e["kind"] == "b"]),
        windows=per_window,
        window_points=len(between),
        window_mean_rel_error=mean([r["rel_error"] for r in between]),
    )


__all__ = [
    "Machine",
    "analytic_points",
    "analytic_profile",
    "check",
    "held_out_windows",
    "program_cost",
    "step_seconds",
]
