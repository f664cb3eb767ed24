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
profile's goal of <= 4% stays for real hardware). XLA's cost analysis counts the
body of the decode program's step loop once, so the seconds are per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dtarl.bench.pat_profile import ProfileGrid, Profiler, tree_bytes
from dtarl.rollout import pat
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


def analytic_profile(
    model, weights, grid: ProfileGrid, engine: RolloutEngine, machine: Machine | None = None
) -> pat.Profile:
    """The analytic ``Profile`` of ``grid`` on ``engine`` (idle, on a mesh of its
    devices; left on its first mesh)."""
    m = machine or Machine()
    c = grid.engine
    devs = list(engine.mesh.devices.flat)
    d, kv = len(devs), model.cfg.num_kv_heads
    tps = [t for t in grid.tps if d % t == 0 and kv % t == 0]
    first = tuple(int(x) for x in engine.mesh.devices.shape)
    prof = Profiler(engine, weights, 0)
    cells = c.prompt_slots * c.group_size * c.prompt_len
    windows = sorted({int(x) for x in _windows(c.response_len)})
    dec: list[dict[str, Any]] = []
    for tp, s in dataclasses.replace(grid, tps=tuple(tps)).points(d):
        dp = d // tp
        prof.move_to(dp, tp, s)
        for w in windows:
            cost = program_cost(engine, weights, w)
            sec = step_seconds(
                cost, tp=tp, b=s // dp, hidden=model.cfg.hidden_size,
                layers=model.cfg.num_layers, machine=m,
            )  # fmt: skip
            dec.append(dict(tp=tp, b=s // dp, l=w, t=(cells + s * w) / dp, seconds=sec, **cost))
    prof.move_to(*first, c.slots)
    pre = [dict(tp=r["tp"], b=r["b"], l=c.prompt_len, t=r["b"] * c.prompt_len, seconds=r["seconds"])
           for r in dec if r["l"] == windows[0]]  # fmt: skip
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


def _windows(response_len: int):
    from dtarl.rollout.config import decode_windows

    return decode_windows(response_len)


def check(profile: pat.Profile) -> dict[str, Any]:
    """Held-out interpolation error on the analytic profile (``pat.leave_one_out``)."""
    loo = pat.leave_one_out(profile)
    errs = [e["rel_error"] for e in loo]
    return dict(
        label="PREDICTION (analytic profile)",
        held_out_points=len(loo),
        mean_rel_error=float(np.mean(errs)) if errs else float("nan"),
        max_rel_error=float(np.max(errs)) if errs else float("nan"),
        t_error=float(np.mean([e["rel_error"] for e in loo if e["kind"] == "t"] or [np.nan])),
        b_error=float(np.mean([e["rel_error"] for e in loo if e["kind"] == "b"] or [np.nan])),
    )


__all__ = ["Machine", "analytic_profile", "check", "program_cost", "step_seconds"]
