"""PAT's offline profiler (``dtarl bench rollout --profile OUT.json``, ``dtarl bench pat``):
decode-step and prefill latency of the rollout engine's own programs per TP, and the
weight-reshard and K/V-move bandwidths, written as a ``dtarl.rollout.pat.Profile`` that
the predictor and the controller read (see ``dtarl.rollout.pat``'s docstring).

*The grid is the engine's program set.* A decode program's cost depends on its shape
(slots, mesh, response window, the prompt pool), not on how many of its slots are still
active, so the profiler times exactly the programs a generation runs: for one engine
config (``ProfileGrid.engine``: Q prompt rows, M members, P prompt rows, R response
rows, S slots at most), per TP, B = slots per DP group on the levels the engine's slot
merge reaches (``merged_slots``: dp * 2^k up to S; ``levels`` of them, always the
smallest and the largest), and the L axis is the response window of the call
(``decode_windows(R)``: R/4, R/2, R). One point's T is the rows one DP group's program
reads per step, (Q M P + slots x window) / dp. A generation that profiles the engine
it then runs on (``profile_engine(..., engine=E)``) compiles nothing more: the profile
compiled every program of the grid, on that engine.

*The recompute's calls* (``Profile.kv_calls``): a switch with ``mode="recompute"``
rebuilds the K/V with the engine's prefill calls (prefill_batch prompts each, padded to
a prompt bucket) and extend calls (extend_batch requests each, padded to a response
bucket; ``dtarl.rollout.engine.recompute_calls``). Per TP, on the idle engine at its
full slot count, the profiler times ONE call of each bucket (prompt buckets 16, 32, ...
up to P; response buckets up to R) through the engine's own call paths: the fastest of
max(5, repeats) after a compiling one. The predictor sums them over the calls a switch
makes (``Predictor.recompute_seconds``), plus the recompute's fixed part (``kind``
"pool": the old pool freed and the empty one created, nothing rebuilt), the fastest
K/V seconds of the idle recompute reshards onto S slots of that TP that the profiler
makes between its points anyway.
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
from dtarl.parallel.mesh import make_mesh, param_shardings, shard_params
from dtarl.rollout.config import ContinuousConfig, length_buckets
from dtarl.rollout.engine import RolloutEngine
from dtarl.rollout.pat import TP_DEGREES, PatError, Profile
from dtarl.rollout.reshard import transfer
from dtarl.timing import compile_seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileGrid:
    """What the profiler times (module docstring). ``engine``: the engine config whose
    programs are profiled (its ``steps_per_call`` too: a call's fixed host and
    dispatch cost is spread over its steps). ``levels``: B levels per TP (0: every
    level ``merged_slots`` reaches; otherwise the smallest, the largest and evenly
    spaced ones between). ``repeats``: timed generations per point (each one prefill
    and R forced decode steps)."""

    engine: ContinuousConfig = dataclasses.field(
        default_factory=lambda: ContinuousConfig(
            slots=64,
            groups=8,
            group_size=8,
            prompt_len=32,
            response_len=256,
            steps_per_call=8,
            prefill_batch=8,
        )
    )
    levels: int = 0
    repeats: int = 3
    tps: tuple[int, ...] = TP_DEGREES

    def __post_init__(self):
        if not isinstance(self.engine, ContinuousConfig):
            raise PatError(f"ProfileGrid.engine={self.engine!r}: need a ContinuousConfig")
        if not self.tps or any(not isinstance(x, int) or x < 1 for x in self.tps):
            raise PatError(f"ProfileGrid.tps={self.tps!r}: need ints >= 1")
        if not isinstance(self.levels, int) or self.levels < 0:
            raise PatError(f"ProfileGrid.levels={self.levels!r}: need an int >= 0 (0: all)")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise PatError(f"ProfileGrid.repeats={self.repeats!r}: need an int >= 1")
        c = self.engine
        if c.slots > c.prompt_slots * c.group_size:
            raise PatError(
                f"ProfileGrid.engine: slots={c.slots} > groups x group_size = "
                f"{c.prompt_slots} x {c.group_size}: the profile admits every slot at once"
            )

    @classmethod
    def quick(cls, **overrides) -> ProfileGrid:
        """A CPU-sized grid (``--quick``): 3 B levels per TP, 2 timed repeats."""
        base = dict(
            engine=ContinuousConfig(
                slots=32,
                groups=8,
                group_size=4,
                prompt_len=16,
                response_len=128,
                steps_per_call=8,
                prefill_batch=8,
            ),
            levels=3,
            repeats=2,
        )
        base.update(overrides)
        return cls(**base)

    def slot_levels(self, dp: int) -> list[int]:
        """Slot counts profiled at ``dp`` DP groups: dp * 2^k below the engine's slots, and
        the slots (``levels`` of them when > 0)."""
        cap = self.engine.slots
        if cap % dp:
            raise PatError(
                f"ProfileGrid.engine.slots={cap} is not a multiple of dp={dp}: the slots "
                "must spread evenly over the DP groups of every profiled TP"
            )
        chain, n = [], dp
        while n < cap:
            chain.append(n)
            n *= 2
        chain.append(cap)
        if self.levels == 0 or self.levels >= len(chain):
            return chain
        idx = np.unique(np.round(np.linspace(0, len(chain) - 1, self.levels)).astype(int))
        return [chain[i] for i in idx]

    def points(self, devices: int) -> list[tuple[int, int]]:
        """(tp, slots) per point."""
        return [
            (tp, s) for tp in self.tps if devices % tp == 0 for s in self.slot_levels(devices // tp)
        ]


def tree_bytes(tree) -> int:
    return int(
        sum(
            np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes
            for x in jax.tree.leaves(tree)
        )
    )


class Profiler:
    """Runs the points on one engine, resharded (idle) between them."""

    def __init__(self, engine: RolloutEngine, weights, seed: int):
        self.engine, self.weights = engine, weights
        c = engine.config
        self.rng = np.random.default_rng([seed, 7])
        vocab = engine.cfg.vocab_size
        self.prompts = [
            self.rng.integers(1, vocab, c.prompt_len).tolist() for _ in range(c.prompt_slots)
        ]
        # (tp, slots) -> {"steps": {window: [s/step]}, "prefill": [s], "calls": [(s, steps)]}
        self.data: dict[tuple[int, int], dict[str, Any]] = {}
        # tp -> kv_s of the idle recompute reshards onto (tp, config.slots): a recompute's
        # fixed part (the old pool freed, the empty one created; nothing to rebuild)
        self.pool: dict[int, list[float]] = {}

    def move_to(self, dp: int, tp: int, slots: int) -> None:
        """Moves the idle engine to (dp, tp) and ``slots`` slots (``move_idle``: the
        weights move and the empty pool is re-created, nothing compiles); a move at the
        full slot count records its K/V seconds (the recompute's fixed part)."""
        info = self.engine.move_idle((dp, tp), self.weights, slots=slots)
        if info is not None and slots == self.engine.config.slots:
            self.pool.setdefault(tp, []).append(info["kv_s"])

    def run(self, dp: int, tp: int, slots: int, *, timed: bool) -> None:
        """One generation at the point: ``slots`` requests (spread over the prompt rows,
        up to M each) forced to R tokens, admitted and prefilled at the engine's full
        slot count, then (when ``slots`` is smaller) merged into ``slots`` slots, then
        decoded to the end."""
        e, c = self.engine, self.engine.config
        self.move_to(dp, tp, c.slots)
        w = e.place(self.weights)
        q = min(c.prompt_slots, slots)
        counts = [slots // q + (i < slots % q) for i in range(q)]
        for i, n in enumerate(counts):
            e.submit(self.prompts[i], n=n, forced_lengths=[c.response_len] * n, temperature=0.0)
        e.stats(reset=True)
        t0 = time.perf_counter()
        e.step(w)  # admission, the prefill, the first decode call (at full slots)
        first = time.perf_counter() - t0
        calls0 = list(e.stats().calls)
        skip = len(calls0)
        if slots < c.slots:
            w, _ = e.reshard((dp, tp), w, slots=slots, mode="migrate")
        else:
            skip = 0
        e.run(w)
        if not timed:
            return
        d = self.data.setdefault((tp, slots), dict(steps={}, prefill=[], calls=[]))
        if calls0:  # the first call compiled nothing: the rest of the round is the prefill
            d["prefill"].append(first - calls0[0][0])
        for sec, steps, _, window in e.stats().calls[skip:]:
            d["calls"].append((sec, steps, window))
            if steps == c.steps_per_call:
                d["steps"].setdefault(window, []).append(sec / steps)


def _time_kv_calls(engine: RolloutEngine, weights, tp: int, repeats: int) -> list[dict]:
    """``kv_calls`` rows at ``tp`` (the idle engine on its mesh): one prefill call per
    prompt bucket, one extend call per response bucket, each filled (prefill_batch
    prompts, extend_batch requests of bucket-many rows) through the engine's own call
    paths, the fastest of ``repeats`` after an untimed (compiling) one. The rows written
    belong to no request and are masked or overwritten before anything reads them
    (``RolloutEngine.time_bucket_call``)."""
    c = engine.config
    w = engine.place(weights)
    rows = []
    for kind, limit in (("prefill", c.prompt_len), ("extend", c.response_len)):
        for t in length_buckets(limit):
            # The first call compiles; the engine's own call path, rows of no request.
            xs = [engine.time_bucket_call(kind, t, w) for _ in range(repeats + 1)][1:]
            rows.append(
                dict(
                    kind=kind,
                    tp=tp,
                    l=t,
                    seconds=float(min(xs)),
                    median=float(np.median(xs)),
                    n=len(xs),
                )
            )
    return rows


def bandwidths(weights, model_cfg, meshes: dict[int, Any]) -> tuple[float, float]:
    """(weight bytes/s, K/V bytes per source rank/s): the weights and a K/V-shaped array
    moved between the shardings of the smallest and largest TP the way a switch moves
    them (``dtarl.rollout.reshard.transfer``: device to device)."""
    lo, hi = min(meshes), max(meshes)
    w_lo = shard_params(weights, meshes[lo])
    w_hi = shard_params(weights, meshes[hi])
    jax.block_until_ready((w_lo, w_hi))
    nbytes = tree_bytes(w_lo)
    kv_shape = (8 * meshes[lo].shape["dp"], 256, model_cfg.num_kv_heads, model_cfg.head_dim)
    kv = np.zeros(kv_shape, np.dtype(model_cfg.compute_dtype))
    spec = P("dp", None, "tp", None)
    kv_lo = jax.device_put(kv, NamedSharding(meshes[lo], spec))
    kv_hi = jax.device_put(kv, NamedSharding(meshes[hi], spec))
    jax.block_until_ready((kv_lo, kv_hi))
    wt, kt = [], []
    # The first pass compiles the movers (one jitted identity per target sharding, as a
    # switch's first use does; the switch cost counts compiles apart): untimed.
    for timed in (False, True, True):
        for src, dst, tp_src in ((w_lo, meshes[hi], lo), (w_hi, meshes[lo], hi)):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.tree.map(transfer, src, param_shardings(src, dst)))
            w_s = time.perf_counter() - t0
            a, m = (kv_lo, meshes[hi]) if tp_src == lo else (kv_hi, meshes[lo])
            t0 = time.perf_counter()
            jax.block_until_ready(transfer(a, NamedSharding(m, spec)))
            if timed:
                wt.append(w_s)
                kt.append((kv.nbytes / tp_src, time.perf_counter() - t0))
    weights_bw = nbytes / max(float(np.median(wt)), 1e-9)
    kv_bw = float(np.median([b / max(s, 1e-9) for b, s in kt]))
    return weights_bw, kv_bw


def profile_engine(
    model: Decoder,
    weights,
    grid: ProfileGrid | None = None,
    *,
    engine: RolloutEngine | None = None,
    devices: Sequence[jax.Device] | None = None,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
) -> Profile:
    """Profiles the rollout engine's programs (module docstring) for every TP of
    ``grid.tps`` that divides the devices and the kv heads.

    ``engine``: profile on this engine (idle, on a mesh of the devices, its config
    ``grid.engine``); its compiled programs are then the grid's, so a generation on it
    compiles nothing more. Default: a new engine over ``devices`` (default all).

    Per point (tp, slots): one untimed generation (compiles; the compile seconds are
    recorded), then ``repeats`` rounds, each timing every point once (the order
    alternates between rounds, so a slow stretch of the machine is spread over all
    points). Decode: per response window, the fastest seconds per step of the calls
    that ran ``steps_per_call`` steps (background load only adds time, so the fastest
    is the program's own cost; ``median`` and ``cv``, their coefficient of variation,
    record the spread; ``decode_scale`` is the median of every timed step over its
    point's fastest); prefill: the median of the first scheduling round's seconds
    less its decode call's; kv_calls: one prefill / extend call per bucket, per TP
    (module docstring)."""
    grid = grid or ProfileGrid()
    c = grid.engine
    if engine is not None:
        if engine.mesh is None:
            raise PatError("profile: the engine has no mesh (RolloutEngine(..., mesh=...))")
        if engine.config != c:
            raise PatError(
                f"profile: the engine's config {engine.config} is not the grid's {c} "
                "(ProfileGrid(engine=engine.config))"
            )
        if engine.pending():
            raise PatError("profile: the engine has requests in flight (profile an idle one)")
        devs = list(engine.mesh.devices.flat)
    else:
        devs = list(jax.devices() if devices is None else devices)
    d, kv_heads = len(devs), model.cfg.num_kv_heads
    tps = [tp for tp in grid.tps if tp in TP_DEGREES and d % tp == 0 and kv_heads % tp == 0]
    if not tps:
        raise PatError(
            f"profile: no TP of {grid.tps} divides the {d} devices and the {kv_heads} kv heads"
        )
    grid = dataclasses.replace(grid, tps=tuple(tps))
    if engine is None:
        engine = RolloutEngine(model, c, mesh=make_mesh(d // tps[0], tps[0], devices=devs))
    first_mesh = tuple(int(x) for x in engine.mesh.devices.shape)
    prof = Profiler(engine, weights, seed)
    keys = grid.points(d)
    compiles: dict[tuple[int, int], float] = {}
    for tp, s in keys:  # compile every point first ...
        c0 = compile_seconds()
        prof.run(d // tp, tp, s, timed=False)
        compiles[tp, s] = compile_seconds() - c0
    for r in range(grid.repeats):  # ... then time them in rounds (the order alternates)
        for tp, s in keys if r % 2 == 0 else keys[::-1]:
            prof.run(d // tp, tp, s, timed=True)
    kv_calls = []  # the recompute's calls, at the full slot count of each TP
    for tp in tps:
        t0 = time.perf_counter()
        prof.move_to(d // tp, tp, c.slots)
        rows = _time_kv_calls(engine, weights, tp, max(5, grid.repeats))
        pool = np.asarray(prof.pool.get(tp, []))
        if pool.size:
            rows.append(
                dict(
                    kind="pool",
                    tp=tp,
                    l=c.slots,
                    seconds=float(pool.min()),
                    median=float(np.median(pool)),
                    n=int(pool.size),
                )
            )
        kv_calls += rows
        if say:
            per = ", ".join(f"{r['kind']} l{r['l']} {r['seconds'] * 1e3:.2f} ms" for r in rows)
            say(
                f"  tp={tp} recompute calls (one each, slots={c.slots}): {per} "
                f"(profiled in {time.perf_counter() - t0:.1f} s)"
            )
    prof.move_to(*first_mesh, c.slots)
    engine.reset()
    cells = c.prompt_slots * c.group_size * c.prompt_len
    dec, pre = [], []
    ratios = []  # every timed step over the fastest of its point (``decode_scale``)
    for tp, s in keys:
        dp, pt = d // tp, prof.data.get((tp, s))
        if not pt or not pt["steps"]:
            raise PatError(
                f"profile: no full decode call at tp={tp}, slots={s} (response_len "
                f"{c.response_len}, steps_per_call {c.steps_per_call})"
            )
        for window, xs in sorted(pt["steps"].items()):
            xs = np.asarray(xs)
            ratios += (xs / xs.min()).tolist()
            dec.append(
                dict(
                    tp=tp,
                    b=s // dp,
                    l=int(window),
                    t=(cells + s * window) / dp,
                    seconds=float(xs.min()),
                    median=float(np.median(xs)),
                    cv=float(xs.std() / xs.mean()) if xs.size > 1 else 0.0,
                    n=int(xs.size),
                )
            )
        if pt["prefill"]:
            pre.append(
                dict(
                    tp=tp,
                    b=s // dp,
                    l=c.prompt_len,
                    t=s * c.prompt_len / dp,
                    seconds=float(np.median(pt["prefill"])),
                )
            )
        if say:
            per = ", ".join(
                f"w{r['l']} {r['seconds'] * 1e3:.2f} ms (median {r['median'] * 1e3:.2f}, "
                f"cv {r['cv']:.0%})"
                for r in dec
                if r["tp"] == tp and r["b"] == s // dp
            )
            say(f"  tp={tp} slots={s} (B={s // dp}): {per}; compile {compiles[tp, s]:.1f} s")
    meshes = {tp: engine.mesh_for(d // tp, tp) for tp in tps}
    weights_bw, kv_bw = bandwidths(weights, model.cfg, meshes)
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
        token_cap=int(np.ceil(max(r["t"] for r in dec))),
        window=c.response_len,
        decode=tuple(dec),
        prefill=tuple(pre),
        weight_bytes=tree_bytes(weights),
        weights_bytes_per_s=weights_bw,
        kv_bytes_per_s=kv_bw,
        compile_s=float(np.median(list(compiles.values()))),
        steps_per_call=c.steps_per_call,
        engine={k: int(v) for k, v in dataclasses.asdict(c).items()},
        kv_calls=tuple(kv_calls),
        decode_scale=float(np.median(ratios)),
        notes=f"grid levels={grid.levels} repeats={grid.repeats} tps={list(tps)}",
    )


__all__ = ["Profiler", "ProfileGrid", "bandwidths", "profile_engine", "tree_bytes"]
