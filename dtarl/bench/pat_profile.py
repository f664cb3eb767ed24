"""PAT's offline profiler (``dtarl bench rollout --profile OUT.json``, ``dtarl bench pat``):
decode-step and prefill latency of the rollout engine on a sparse (B, L) grid per TP,
and the weight-reshard and K/V-move bandwidths, written as a ``dtarl.rollout.pat.Profile``
that the predictor and the controller read (see ``dtarl.rollout.pat``'s docstring).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl.model.decoder import Decoder
from dtarl.parallel.mesh import make_mesh, shard_params
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine
from dtarl.rollout.pat import TP_DEGREES, PatError, Profile
from dtarl.timing import compile_seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileGrid:
    """The profiler's sparse grid: B (requests per DP group) x L (prompt tokens per
    request), points with B * L <= ``token_cap``; ``window`` decode steps per point
    (``steps_per_call`` per call: use the engine's own, since a call's fixed host and
    dispatch cost is spread over its steps); ``repeats`` timed runs per point."""

    bs: tuple[int, ...] = (1, 2, 4, 8, 16)
    ls: tuple[int, ...] = (16, 64, 256, 1024)
    token_cap: int = 4096
    window: int = 32
    steps_per_call: int = 8
    repeats: int = 3
    tps: tuple[int, ...] = TP_DEGREES

    def __post_init__(self):
        for name in ("bs", "ls", "tps"):
            v = getattr(self, name)
            if not v or any(not isinstance(x, int) or x < 1 for x in v):
                raise PatError(f"ProfileGrid.{name}={v!r}: need ints >= 1")
        for name in ("token_cap", "window", "steps_per_call", "repeats"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PatError(f"ProfileGrid.{name}={v!r}: need an int >= 1")
        if self.window < 16:
            raise PatError(f"ProfileGrid.window={self.window}: need >= 16 (the engine's window)")

    @classmethod
    def quick(cls, **overrides) -> ProfileGrid:
        """A CPU-sized grid (``--quick``)."""
        base = dict(bs=(1, 16), ls=(16, 128), token_cap=2048, repeats=2)
        base.update(overrides)
        return cls(**base)

    def points(self) -> list[tuple[int, int]]:
        return [
            (b, ln) for b in sorted(self.bs) for ln in sorted(self.ls) if b * ln <= self.token_cap
        ]


def _tree_bytes(tree) -> int:
    return int(
        sum(
            np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes
            for x in jax.tree.leaves(tree)
        )
    )


class _Point:
    """One grid point's engine: B * dp slots, one member per prompt, prompt rows = L."""

    def __init__(self, model, weights, mesh, b: int, length: int, grid: ProfileGrid, seed: int):
        slots = b * mesh.shape["dp"]
        cfg = ContinuousConfig(
            slots=slots,
            groups=slots,
            group_size=1,
            prompt_len=length,
            response_len=grid.window,
            steps_per_call=grid.steps_per_call,
            prefill_batch=slots,
        )
        self.b, self.length, self.grid = b, length, grid
        self.engine = RolloutEngine(model, cfg, mesh=mesh)
        self.weights = self.engine.place(weights)
        rng = np.random.default_rng([seed, b, length])
        vocab = model.cfg.vocab_size
        self.prompts = [rng.integers(1, vocab, length).tolist() for _ in range(slots)]
        self.prefill: list[float] = []
        self.steps: list[float] = []
        c0 = compile_seconds()
        self.run()  # compiles the prefill bucket and the decode window
        self.compile_s = compile_seconds() - c0

    def run(self) -> tuple[float, list[float]]:
        """One prefill and ``window`` decode steps: (prefill seconds, seconds per step of
        every full call)."""
        eng, g = self.engine, self.grid
        for p in self.prompts:
            eng.submit(p, n=1, forced_lengths=[g.window], temperature=0.0)
        eng.stats(reset=True)
        t0 = time.perf_counter()
        eng.step(self.weights)  # admission, the prefill, the first decode call
        first = time.perf_counter() - t0
        eng.run(self.weights)
        calls = eng.stats()["calls"]
        pre = first - calls[0][0] if calls else first
        return pre, [sec / steps for sec, steps, *_ in calls if steps == g.steps_per_call]

    def timed(self) -> None:
        pre, per_step = self.run()
        self.prefill.append(pre)
        self.steps.extend(per_step)

    def result(self) -> tuple[float, float]:
        if not self.steps:
            raise PatError(
                f"profile: no full decode call at b={self.b}, l={self.length} "
                f"(window {self.grid.window}, steps_per_call {self.grid.steps_per_call})"
            )
        return float(np.median(self.steps)), float(np.median(self.prefill))


def _bandwidths(weights, model_cfg, meshes: dict[int, Any]) -> tuple[float, float]:
    """(weight bytes/s, K/V bytes per source rank/s): ``jax.device_put`` of the weights
    and of a K/V-shaped array between the shardings of the smallest and largest TP."""
    lo, hi = min(meshes), max(meshes)
    w_lo = shard_params(weights, meshes[lo])
    w_hi = shard_params(weights, meshes[hi])
    jax.block_until_ready((w_lo, w_hi))
    nbytes = _tree_bytes(w_lo)
    kv_shape = (8 * meshes[lo].shape["dp"], 256, model_cfg.num_kv_heads, model_cfg.head_dim)
    kv = np.zeros(kv_shape, np.dtype(model_cfg.compute_dtype))
    spec = P("dp", None, "tp", None)
    kv_lo = jax.device_put(kv, NamedSharding(meshes[lo], spec))
    kv_hi = jax.device_put(kv, NamedSharding(meshes[hi], spec))
    jax.block_until_ready((kv_lo, kv_hi))
    wt, kt = [], []
    for src, dst, tp_src in ((w_lo, meshes[hi], lo), (w_hi, meshes[lo], hi)) * 2:
        t0 = time.perf_counter()
        jax.block_until_ready(shard_params(src, dst))
        wt.append(time.perf_counter() - t0)
        a, m = (kv_lo, meshes[hi]) if tp_src == lo else (kv_hi, meshes[lo])
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(a, NamedSharding(m, spec)))
        kt.append((kv.nbytes / tp_src, time.perf_counter() - t0))
    weights_bw = nbytes / max(float(np.median(wt)), 1e-9)
    kv_bw = float(np.median([b / max(s, 1e-9) for b, s in kt]))
    return weights_bw, kv_bw


def profile_engine(
    model: Decoder,
    weights,
    grid: ProfileGrid | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
) -> Profile:
    """Profiles the rollout engine on ``devices`` (default: all) for every TP of
    ``grid.tps`` that divides the devices and the kv heads (module docstring).

    Per point: an engine of B * dp slots (one member per prompt, prompt rows = L)
    and one untimed run (its compile seconds are recorded). Then ``repeats`` rounds,
    each timing every point once (the order alternates between rounds, so a slow
    stretch of the machine is spread over all points): one prefill and ``window``
    forced decode steps. Decode = the median seconds per step of the calls that ran
    ``steps_per_call`` steps; prefill = the first scheduling round's seconds less
    its decode call's."""
    grid = grid or ProfileGrid()
    devs = list(jax.devices() if devices is None else devices)
    d, kv_heads = len(devs), model.cfg.num_kv_heads
    tps = [tp for tp in grid.tps if tp in TP_DEGREES and d % tp == 0 and kv_heads % tp == 0]
    if not tps:
        raise PatError(
            f"profile: no TP of {grid.tps} divides the {d} devices and the {kv_heads} kv heads"
        )
    meshes = {tp: make_mesh(d // tp, tp, devices=devs) for tp in tps}
    points = {}
    for tp in tps:  # compile every point first ...
        for b, length in grid.points():
            points[tp, b, length] = _Point(model, weights, meshes[tp], b, length, grid, seed)
    keys = list(points)
    for r in range(grid.repeats):  # ... then time them in rounds (the order alternates)
        for k in keys if r % 2 == 0 else keys[::-1]:
            points[k].timed()
    dec, pre = [], []
    for (tp, b, length), pt in points.items():
        step_s, pre_s = pt.result()
        dec.append(dict(tp=tp, b=b, l=length, t=b * (length + grid.window), seconds=step_s))
        pre.append(dict(tp=tp, b=b, l=length, t=b * length, seconds=pre_s))
        if say:
            say(
                f"  tp={tp} B={b} L={length}: decode {step_s * 1e3:.3f} ms/step, "
                f"prefill {pre_s * 1e3:.2f} ms, compile {pt.compile_s:.2f} s"
            )
    compiles = [pt.compile_s for pt in points.values()]
    del points
    weights_bw, kv_bw = _bandwidths(weights, model.cfg, meshes)
    dev = devs[0]
    return Profile(
        model={
            k: (v if isinstance(v, int | float | str | bool) or v is None else str(v))
            for k, v in dataclasses.asdict(model.cfg).items()
        },
        device_kind=str(getattr(dev, "device_kind", dev.platform)),
        platform=dev.platform,
        jax_version=jax.__version__,
        devices=d,
        mesh_axes=("dp", "tp"),
        token_cap=grid.token_cap,
        window=grid.window,
        decode=tuple(dec),
        prefill=tuple(pre),
        weight_bytes=_tree_bytes(weights),
        weights_bytes_per_s=weights_bw,
        kv_bytes_per_s=kv_bw,
        compile_s=float(np.median(compiles)),
        steps_per_call=grid.steps_per_call,
        notes=f"grid {dataclasses.asdict(grid)}",
    )


__all__ = ["ProfileGrid", "profile_engine"]
