"""``dtarl bench train``: training engines side by side on one set of workloads.

For every workload the same batch goes through each engine (same parameters,
same loss); each engine is warmed up (compiled) once, then all are timed side by
side: ``repeats`` rounds, each of which gives every engine one turn (an untimed
step, then one timed step, or the mean of as many as fit in 0.4 s for a short
one), in a random order per round (a machine that drifts by 10-30% over a
minute would otherwise hand its drift to whichever engine ran in the slow
stretch). Printed per engine: the median step time, tokens/s, the speedup vs
dense and vs dense+remat (the median over rounds of the two steps' ratio in the
same round), the ideal ratio (dense FLOPs / tree FLOPs with attention's
quadratic part), measured / ideal, and XLA's compiled peak memory.

auto: its cost model is first calibrated on other batches (``calibration_batches``);
a fresh auto engine per workload then autotunes in its warm-up call (it times the
programs of the candidates within its margin, compiling them), so its step time
excludes the tuning, which is reported separately (``autotune_seconds``). Per
workload the bench reports ``auto_vs_best``: auto's step time over that of the
fastest other engine (1.05 = 5% slower), measured pairwise against every engine
within 1.25x of the fastest median (at least 15 rounds of short alternating
turns of the two, more for short steps; the median of the per-round ratios),
the largest of those, and at the end on how many workloads auto was within 5%.
auto's step includes its host work: the chosen engine's prepare, and every
candidate's on a batch whose choice is not reused (about 1 ms per step on the
tiny workloads).

``mesh=(dp, tp)`` (``--mesh dp=4,tp=2``): every engine runs through ``ShardedEngine``
on a ('dp', 'tp') mesh of the first dp x tp devices (params split over tp by the rule
table), each batch cut over dp by the balanced partition priced by the engine's own
work counts (``partition_cost``; ``FlopCost`` only as the fallback), as ``dtarl train``
does on a mesh. Workloads with fewer sequences than dp ranks are skipped (said so). Per
engine the bench adds the partition's makespan balance twice: ``cost_balance``,
max / mean rank load under the cost model, and ``measured_balance``, max / mean
of each rank's program timed ALONE on one device (min of a few calls, with the
ranks' common padded shapes, tp collapsed to one device): simulated CPU
devices share the host's cores, so the ranks' concurrent times would not say
which rank the step waits for. The ranks run one program at one padded shape, so
for an engine whose work does not depend on the data (dense) the measured spread
is timing noise; a DFS plan's push/pop steps do depend on it.

Every engine is reserved as ``dtarl train`` reserves its engines (``dtarl.rl.capacity``)
for a run whose largest batch is the workload (``workload_capacity``: its sequences,
longest sequence, groups, largest group, longest prompt and response; on a mesh a
dp rank's share), so each column is the program a run would time: dense pads rows to
the reserved length rounded up to 8 (prompt 512 + 64 new tokens: 576) instead of
its quarter-octave bucket (640), and prefix_reuse pads its groups to the reserved
shapes. Per workload the bench prints dense's padded tokens unreserved (the bucket)
and reserved.

The ideal ratio counts forward+backward FLOPs of every token at its context
length: dense = sum over sequences and positions, tree = sum over distinct
prefixes (tree tokens). A tree engine can approach it but not beat it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from dtarl.engines import (
    Capacity,
    DenseConfig,
    DFSConfig,
    EngineConfig,
    EngineKind,
    PrefixReuseConfig,
    RolloutBatch,
    make_engine,
)
from dtarl.engines.cost import ideal_ratio
from dtarl.engines.dense import DenseEngine
from dtarl.engines.prefix_reuse import deep_sequences
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.partition import FlopCost
from dtarl.parallel.sharded import ShardedEngine
from dtarl.rl import capacity as capacity_lib
from dtarl.testing import grpo_groups
from dtarl.timing import Rounds, Settle, alternating, interleaved_rounds, shuffled
from dtarl.traces import default_polytrace_root, sample_workload
from dtarl.tree import DFSOrder


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    make: Callable[[], RolloutBatch]
    note: str = ""


def synthetic_workloads(quick: bool = False) -> list[Workload]:
    s = 0.25 if quick else 1.0

    def grpo(g, p, r, seed):
        return lambda: grpo_groups(
            num_groups=2,
            group_size=g,
            prompt_len=max(2, int(p * s)),
            response_len=(max(1, int(r * s * 0.75)), max(1, int(r * s))),
            seed=seed,
        )

    def unshared():
        rs = np.random.RandomState(11)
        toks = [rs.randint(3, 256, int(384 * s)) for _ in range(8)]
        return RolloutBatch.create(tokens=toks, prompt_lens=[1] * 8, advantages=rs.randn(8))

    out = [
        Workload(
            name=f"grpo_G{g}_prompt>>resp", make=grpo(g, 512, 96, g), note="prompt 512, resp <=96"
        )
        for g in ((4, 8) if quick else (4, 8, 16))
    ]
    out.append(Workload(name="grpo_G8_resp>>prompt", make=grpo(8, 64, 384, 3), note="prompt 64"))
    out.append(Workload(name="no_shared_prefix", make=unshared, note="8 unrelated sequences"))
    return out


def polytrace_workloads(
    root: str | None, length_scale: float, quick: bool = False
) -> list[Workload]:
    """Real prefix structure and length distributions from PolyTrace (if present)."""
    root = root or str(default_polytrace_root())
    if not os.path.isdir(root):
        return []
    found = []
    specs = [
        ("verl_math", "verl", "trajectory", 2, 8),
        ("search_r1_traj", "search_r1", "trajectory", 2, 8),
        ("search_r1_per_turn", "search_r1", "per_turn", 2, 8),
    ]
    for name, sub, mode, groups, n in specs[:2] if quick else specs:
        path = _first_run(os.path.join(root, sub))
        if path is None:
            continue
        scale = length_scale * (10.0 if sub == "search_r1" else 1.0)

        def make(path=path, mode=mode, groups=groups, n=n, scale=scale):
            return sample_workload(
                path,
                batch_size=groups,
                n_sampling=n,
                step=None,
                seed=0,
                length_scale=scale,
                mode=mode,
                vocab_size=256,
            )

        found.append(Workload(name=name, make=make, note=f"{sub} x{scale:g} {mode}"))
    return found


def calibration_batches(quick: bool = False) -> list[RolloutBatch]:
    """The short timed run that fits auto's cost model: synthetic batches of other
    shapes than the workloads (GRPO groups of several sizes and prompt/response
    ratios, unrelated sequences, a branching multi-turn tree, and a tiny batch).

    The tiny batch (16 sequences of 16-28 tokens, a few ms a step) pins down the
    per-step term: fitted on large batches alone, dense's came out anywhere from
    0 to 64 ms a step, and auto's tuning margin then left dense untimed on small
    batches where it is the fastest engine."""
    s = 0.25 if quick else 1.0

    def n(x):
        return max(2, int(x * s))

    rs = np.random.RandomState(101)
    out = [
        grpo_groups(
            num_groups=2, group_size=4, prompt_len=n(256), response_len=(n(48), n(64)), seed=101
        ),
        grpo_groups(
            num_groups=2, group_size=12, prompt_len=n(384), response_len=(n(24), n(48)), seed=102
        ),
        grpo_groups(
            num_groups=1, group_size=8, prompt_len=n(32), response_len=(n(192), n(256)), seed=103
        ),
        RolloutBatch.create(
            tokens=[rs.randint(3, 256, n(256)) for _ in range(6)],
            prompt_lens=[1] * 6,
            advantages=rs.randn(6),
        ),
    ]
    out.append(
        grpo_groups(num_groups=4, group_size=4, prompt_len=12, response_len=(4, 16), seed=104)
    )
    if not quick:
        seqs = [list(rs.randint(3, 256, 64))]
        for _ in range(3):
            seqs = [q + list(rs.randint(3, 256, 32)) for q in seqs for _ in range(3)]
        out.append(RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs))))
    return out


def workload_capacity(batch: RolloutBatch, dp: int = 1) -> Capacity:
    """The ``Capacity`` a run whose largest batch is ``batch`` reserves
    (``dtarl.rl.capacity.capacity``, as ``dtarl train`` from its config's maxima): the
    sequences, the longest sequence, the groups and the largest group (each over ``dp``
    ranks, rounded up), the longest prompt and the longest response; ``turns`` 2 when some group
    branches deep below its prompt (a run with tool turns reserves prefix_reuse's
    two-program form and buckets auto's depth from it), else 1."""
    lengths = batch.lengths
    prompts = np.array(
        [int(np.argmax(m)) if m.any() else len(m) for m in batch.loss_mask], np.int64
    )
    _, sizes = np.unique(batch.group_ids, return_counts=True)
    deep = bool(deep_sequences(batch.prefix_tree()).any())
    return capacity_lib.capacity(
        sequences=batch.num_sequences,
        groups=len(sizes),
        length=int(lengths.max()),
        group_size=int(sizes.max()),
        prompt_len=max(1, int(prompts.max())),
        response_len=max(1, int((lengths - prompts).max())),
        turns=2 if deep else 1,
        dp=dp,
    )


def dense_padding(model, batch: RolloutBatch, capacity: Capacity, microbatch: int, loss) -> dict:
    """dense's rows for ``batch`` (host preparation only): unreserved (its length
    bucket) and reserved to ``capacity`` (a run's program): padded length, computed
    tokens (rows x length) and their excess over the batch's tokens."""
    out = {"num_tokens": batch.num_tokens}
    for name, cap in (("unreserved", None), ("reserved", capacity)):
        engine = DenseEngine(model, DenseConfig(microbatch=microbatch))
        if cap is not None:
            engine.reserve(cap)
        st = engine.prepare(batch, loss).stats
        out[name] = {
            "padded_length": st["padded_length"],
            "computed_tokens": st["computed_tokens"],
            "excess": st["computed_tokens"] / batch.num_tokens - 1.0,
        }
    return out


def _first_run(folder: str) -> str | None:
    """The first directory below ``folder`` that holds *.jsonl step files."""
    for dirpath, _, files in sorted(os.walk(folder)):
        if any(f.endswith(".jsonl") and "step" in f for f in files):
            return dirpath
    return None


ENGINE_SPECS = {
    "dense": (EngineKind.DENSE, {}),
    "dense_remat": (EngineKind.DENSE_REMAT, {}),
    "dfs_lex": (EngineKind.DFS, {"order": DFSOrder.LEXICOGRAPHIC}),
    "dfs": (EngineKind.DFS, {"order": DFSOrder.GREEDY}),
}


def engine_names() -> list[str]:
    """Every engine name ``run(engines=...)`` accepts."""
    return sorted(_engine_specs(None))


def _engine_specs(names: Sequence[str] | None) -> dict[str, tuple]:
    specs = dict(ENGINE_SPECS)
    for kind in EngineKind:  # engines added later (prefix_reuse, auto) join automatically
        if kind.value not in specs and kind.value not in ("dense_remat",):
            specs[kind.value] = (kind, {})
    if names:
        unknown = [n for n in names if n not in specs]
        if unknown:
            raise ValueError(f"--engines: unknown {unknown}; accepted: {sorted(specs)}")
        specs = {n: specs[n] for n in names}
    return specs


def _engine_config(chunk_len: int, microbatch: int) -> EngineConfig:
    """The bench's engine settings: one dfs chunk length and one microbatch for all."""
    return EngineConfig(
        dense=DenseConfig(microbatch=microbatch),
        dfs=DFSConfig(chunk_len=chunk_len),
        prefix_reuse=PrefixReuseConfig(microbatch=microbatch),
    )


def _peak_bytes(engine, params, batch, loss) -> int | None:
    fn = getattr(engine, "compiled_memory", None)
    if fn is None:
        return None
    try:
        mem = fn(params, batch, loss)
    except Exception:  # noqa: BLE001 - memory analysis is optional per backend
        return None
    if mem is None:
        return None
    return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)


def run(
    *,
    model_cfg: ModelConfig | None = None,
    engines: Sequence[str] | None = None,
    workloads: Sequence[str] | None = None,
    polytrace: str | None = None,
    length_scale: float = 0.02,
    repeats: int = 3,
    chunk_len: int = 128,
    microbatch: int = 8,
    quick: bool = False,
    autotune: bool = True,
    tune_margin: float | None = None,
    mesh: tuple[int, int] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Runs the benchmark and returns the results (also what the CLI writes as JSON).

    ``autotune`` and ``tune_margin`` (default: ``AutoEngine``'s) go to auto.
    ``mesh=(dp, tp)``: every engine sharded on that mesh (see the module docstring)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    cfg = model_cfg or ModelConfig.tiny()
    model = init_model(cfg, seed=0)
    params = nnx.split(model, nnx.Param)[1]
    host_params, dev_mesh, cost = params, None, None
    if mesh is not None:
        dp, tp = mesh
        n = len(jax.devices())
        if dp < 1 or tp < 1 or dp * tp > n:
            raise ValueError(
                f"--mesh dp={dp},tp={tp}: needs dp, tp >= 1 and dp x tp <= {n} devices"
                + (
                    " (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "simulates 8 devices)"
                    if jax.default_backend() == "cpu"
                    else ""
                )
            )
        dev_mesh = mesh_lib.make_mesh(dp, tp, devices=jax.devices()[: dp * tp])
        cost = FlopCost.from_transformer(
            num_params=cfg.num_params(), num_layers=cfg.num_layers, hidden=cfg.hidden_size
        )
        params = mesh_lib.shard_params(params, dev_mesh)
    loss = ClippedSurrogateLoss.grpo()
    specs = _engine_specs(engines)
    all_w = synthetic_workloads(quick) + polytrace_workloads(polytrace, length_scale, quick)
    if workloads:
        known = {w.name for w in all_w}
        unknown = [w for w in workloads if w not in known]
        if unknown:
            raise ValueError(f"--workloads: unknown {unknown}; accepted: {sorted(known)}")
        all_w = [w for w in all_w if w.name in workloads]
    results = {"model": dataclasses.asdict(cfg) | {"family": cfg.family.value}, "workloads": []}
    if mesh is not None:
        results["mesh"] = {"dp": mesh[0], "tp": mesh[1]}
    results["model"]["attention_backend"] = cfg.attention_backend.value
    cost_model = None
    if any(kind is EngineKind.AUTO for kind, _ in specs.values()):
        # auto's cost model is fitted once, on other batches than the workloads.
        t0 = time.perf_counter()
        calib = make_engine(EngineKind.AUTO, model, _engine_config(chunk_len, microbatch))
        batches = calibration_batches(quick)
        cost_model = calib.calibrate(params, batches, loss, repeats=max(repeats, 2))
        coefs = {
            e: {
                "seconds_per_gflop": c.seconds_per_flop * 1e9,
                "seconds_per_step": c.seconds_per_step,
            }
            for e, c in cost_model.coefs.items()
        }
        results["auto_calibration"] = {
            "batches": len(batches),
            "seconds": time.perf_counter() - t0,
            "coefficients": coefs,
        }
        log(
            f"auto: cost model calibrated on {len(batches)} batches in "
            f"{time.perf_counter() - t0:.0f} s: "
            + "; ".join(
                f"{e} {c['seconds_per_gflop'] * 1e3:.2f} ms/GFLOP"
                f" + {c['seconds_per_step'] * 1e3:.2f} ms/step"
                for e, c in coefs.items()
            )
        )
    for wl in all_w:
        batch = wl.make()
        if dev_mesh is not None and batch.num_sequences < mesh[0]:
            log(f"\n== {wl.name}: skipped, {batch.num_sequences} sequences < dp={mesh[0]} ranks")
            continue
        tree = batch.prefix_tree()
        ideal = ideal_ratio(cfg, tree)
        cap = workload_capacity(batch, 1 if mesh is None else mesh[0])
        row = {
            "workload": wl.name,
            "note": wl.note,
            "sequences": batch.num_sequences,
            "num_tokens": batch.num_tokens,
            "tree_tokens": tree.stats.tree_tokens,
            "longest_path": tree.stats.longest_path,
            "ideal_ratio": ideal,
            "capacity": dataclasses.asdict(cap),
            "dense_padding": dense_padding(model, batch, cap, microbatch, loss),
            "engines": {},
        }
        log(
            f"\n== {wl.name} ({wl.note}): {batch.num_sequences} seqs, {batch.num_tokens} tokens, "
            f"{tree.stats.tree_tokens} tree tokens, ideal x{ideal:.2f}"
        )
        log(_format_padding(row["dense_padding"]))
        live, first = {}, {}  # this workload's engines; auto's first (full) choice
        for name, (kind, extra) in specs.items():
            kw = dict(extra)
            if kind is EngineKind.AUTO:
                kw["cost_model"] = cost_model
                kw["autotune"] = autotune
                if tune_margin is not None:
                    kw["tune_margin"] = tune_margin
            engine = make_engine(kind, model, _engine_config(chunk_len, microbatch), **kw)
            engine.reserve(cap)  # as a run reserves its engines
            if dev_mesh is not None:
                engine = ShardedEngine(engine, dev_mesh, fallback_cost=cost)
            live[name] = engine
            t0 = time.perf_counter()
            _, _, aux = engine.value_and_grad(params, batch, loss)  # compile (+ tune), warm up
            first[name] = aux.stats
            row["engines"][name] = {
                "compile_seconds": time.perf_counter() - t0,
                "peak_bytes": _peak_bytes(engine, params, batch, loss),
            }
        # Side by side: every round times each engine once, in an order that rotates.
        times, stats = _rounds(live, params, batch, loss, repeats)
        for name, e in row["engines"].items():
            step = statistics.median(times[name])
            e.update(
                step_seconds=step,
                device_seconds=stats[name].get("seconds"),
                host_seconds=stats[name].get("host_seconds"),
                tokens_per_second=batch.num_tokens / step,
                stats={k: v for k, v in stats[name].items() if isinstance(v, (int, float, str))},
            )
            if "chosen_engine" in stats[name]:
                f = first[name]
                e["auto"] = {
                    "picked": stats[name]["chosen_engine"],
                    "basis": stats[name].get("choice_basis"),
                    "first_pick": f.get("chosen_engine"),
                    "reason": f.get("choice_reason"),
                    "autotune_seconds": f.get("autotune_seconds", 0.0),
                    "predicted_seconds": f.get("predicted_seconds"),
                    "measured_seconds": f.get("measured_seconds"),
                }
        for name, e in row["engines"].items():
            e["speedup_vs_dense"] = _paired(times, "dense", name)
            e["speedup_vs_dense_remat"] = _paired(times, "dense_remat", name)
            e["measured_over_ideal"] = (
                e["speedup_vs_dense"] / ideal if e["speedup_vs_dense"] else None
            )
        _auto_vs_best(row, live, params, batch, loss)
        if dev_mesh is not None:
            for name, e in row["engines"].items():
                e["partition"] = rank_balance(live[name], host_params, batch, loss)
        del live
        log(_format_rows(row))
        results["workloads"].append(row)
    _auto_summary(results, log)
    return results


def rank_balance(sharded: ShardedEngine, params, batch: RolloutBatch, loss, calls: int = 3):
    """The dp partition's makespan balance for ``batch``: ``cost_balance`` (max / mean
    rank load under the partition's cost model) and ``measured_balance`` (max / mean
    of each rank's program run alone on one device with unsharded ``params``, min of
    ``calls`` timed calls after one untimed; the ranks share one padded shape)."""
    prepared = sharded.prepare(batch, loss)
    loads = np.asarray(prepared.partition.loads, np.float64)
    inner = sharded.engine
    dev = jax.devices()[0]
    params = jax.device_put(params, dev)
    seconds = []
    for r in prepared.ranks:
        args = jax.device_put(r.args, dev)
        jax.block_until_ready(inner.jit(loss, r.static, params, args))
        best = float("inf")
        for _ in range(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(inner.jit(loss, r.static, params, args))
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
    sec = np.asarray(seconds)
    return {
        "method": prepared.partition.method.value,
        "rank_loads": loads.tolist(),
        "cost_balance": float(loads.max() / loads.mean()),
        "rank_seconds_alone": sec.tolist(),
        "measured_balance": float(sec.max() / sec.mean()),
        "rank_sequences": [int(ix.shape[0]) for ix in prepared.partition.indices],
    }


ROUND_SECONDS = 0.4  # an engine's turn in a round times steps for at least this long ...
ROUND_CALLS = 40  # ... or this many steps


def _rounds(live: dict, params, batch, loss, repeats: int) -> tuple[dict, dict]:
    """``repeats`` rounds, each giving every engine one turn, in a random order
    (seeded per round) so that no engine always follows the same one. A turn is
    one untimed step (the engine's first step after another engine's, whose
    caches and allocations that one left behind) and then timed steps: one, or
    as many as fit in ``ROUND_SECONDS`` (at most ``ROUND_CALLS``) for a short
    step, whose mean counts. Training runs one engine step after step, so that
    steady state is what is timed. Returns (seconds per step, per engine per
    round; each engine's last stats)."""
    stats: dict[str, dict] = {}

    def step(n: str):
        def run():
            _, _, aux = live[n].value_and_grad(params, batch, loss)
            stats[n] = aux.stats
            return aux

        return run

    protocol = Rounds(
        rounds=repeats,
        order=shuffled,
        settle=Settle.ALWAYS,
        turn_seconds=ROUND_SECONDS,
        turn_calls=ROUND_CALLS,
    )
    # The batch's buckets were tuned in the warm-up; never count tuning.
    timed = interleaved_rounds(
        {n: step(n) for n in live},
        protocol,
        measure=lambda aux, dt: dt - aux.stats.get("autotune_seconds", 0.0),
    )
    return {n: list(t.seconds) for n, t in timed.items()}, stats


def _paired(times: dict, base: str, name: str) -> float | None:
    """The median over rounds of ``base``'s step / ``name``'s in the same round
    (a speedup of ``name`` over ``base``; a drift between rounds cancels)."""
    if base not in times:
        return None
    return statistics.median(b / t for b, t in zip(times[base], times[name], strict=True))


PAIR_ROUNDS = 15  # auto against each contender: at least this many rounds of one turn each ...
PAIR_SECONDS = 0.15  # ... whose timed steps last at least this long ...
PAIR_CALLS = 20  # ... (at most this many steps) ...
PAIR_BUDGET = 20.0  # ... and more rounds until the pair has run this long ...
PAIR_MAX_ROUNDS = 61  # ... up to this many (short steps get more rounds)
CONTENDER_MARGIN = 1.25  # contenders: engines within this factor of the fastest median


def _pairwise(a, b, params, batch, loss) -> float:
    """The median over rounds of a's step / b's in the same round.
    Each round gives a and b one turn (the order alternates): one untimed step,
    then timed steps for ``PAIR_SECONDS`` (at least one), whose mean counts.
    Short turns of two engines keep the pair's samples close in time, which is
    what makes a few percent measurable on a machine whose speed moves by 10-30%
    over seconds. There are ``PAIR_ROUNDS`` rounds, and more (up to
    ``PAIR_MAX_ROUNDS``) until the pair has run ``PAIR_BUDGET`` seconds. On verl
    math's 10 ms step, auto running dense measured 1.050 against dense in 15
    rounds and 1.009 and 1.001 in 61 (two dense engines: 1.003 and 0.980)."""
    protocol = Rounds(
        rounds=PAIR_ROUNDS,
        order=alternating,
        settle=Settle.ALWAYS,
        turn_seconds=PAIR_SECONDS,
        turn_calls=PAIR_CALLS,
        budget_s=PAIR_BUDGET,
        max_rounds=PAIR_MAX_ROUNDS,
    )
    runs = {
        "a": lambda: a.value_and_grad(params, batch, loss),
        "b": lambda: b.value_and_grad(params, batch, loss),
    }
    t = interleaved_rounds(runs, protocol)
    return statistics.median(x / y for x, y in zip(t["a"].seconds, t["b"].seconds, strict=True))


def _auto_vs_best(row: dict, live: dict, params, batch, loss) -> None:
    """Adds to every auto entry of ``row``: ``vs_contenders`` (auto's step over each
    contender's, measured pairwise by ``_pairwise``; the contenders are the other
    engines whose median step is within ``CONTENDER_MARGIN`` of the fastest),
    ``auto_vs_best`` (the largest: auto against the contender that is fastest
    side by side, ``best_engine``) and ``auto_vs_best_table`` (auto's median step
    over the fastest other median, from the rounds)."""
    others = {n: e["step_seconds"] for n, e in row["engines"].items() if "auto" not in e}
    fastest = min(others.values()) if others else None
    for n, e in row["engines"].items():
        if "auto" not in e:
            continue
        a = e["auto"]
        a["best_engine"] = a["auto_vs_best"] = a["auto_vs_best_table"] = None
        a["vs_contenders"] = {}
        if not others:
            continue
        a["auto_vs_best_table"] = e["step_seconds"] / fastest
        for c, t in others.items():
            if t <= CONTENDER_MARGIN * fastest:
                a["vs_contenders"][c] = _pairwise(live[n], live[c], params, batch, loss)
        a["best_engine"] = max(a["vs_contenders"], key=a["vs_contenders"].get)
        a["auto_vs_best"] = a["vs_contenders"][a["best_engine"]]


def _auto_summary(results: dict, log: Callable[[str], None]) -> None:
    ratios = [
        e["auto"]["auto_vs_best"]
        for row in results["workloads"]
        for e in row["engines"].values()
        if "auto" in e and e["auto"]["auto_vs_best"] is not None
    ]
    if not ratios:
        return
    within = sum(r <= 1.05 for r in ratios)
    results["auto_summary"] = {
        "workloads": len(ratios),
        "within_5_percent": within,
        "worst_auto_vs_best": max(ratios),
        "autotune_seconds": sum(
            e["auto"]["autotune_seconds"]
            for row in results["workloads"]
            for e in row["engines"].values()
            if "auto" in e
        ),
    }
    log(
        f"\nauto: within 5% of the best engine on {within} of {len(ratios)} workloads "
        f"(worst auto/best {max(ratios):.3f})"
    )


def _format_rows(row: dict) -> str:
    head = (
        f"{'engine':<14}{'step s':>9}{'tok/s':>10}{'x dense':>9}{'x remat':>9}"
        f"{'ideal':>7}{'meas/ideal':>11}{'peak MiB':>10}{'compile s':>10}  steps(packed, rows)"
    )
    lines = [head]
    for name, e in row["engines"].items():

        def f(x, fmt):
            return format(x, fmt) if x is not None else "-"

        peak = e["peak_bytes"] / 2**20 if e["peak_bytes"] else None
        lines.append(
            f"{name:<14}{e['step_seconds']:>9.3f}{e['tokens_per_second']:>10.0f}"
            f"{f(e['speedup_vs_dense'], '>9.2f')}{f(e['speedup_vs_dense_remat'], '>9.2f')}"
            f"{row['ideal_ratio']:>7.2f}{f(e['measured_over_ideal'], '>11.2f')}"
            f"{f(peak, '>10.1f')}{e['compile_seconds']:>10.1f}  {_steps(e['stats'])}"
        )
    for name, e in row["engines"].items():
        if "auto" not in e:
            continue
        a = e["auto"]
        vs = (
            f"auto/best {a['auto_vs_best']:.3f} side by side (best: {a['best_engine']}; "
            + ", ".join(f"vs {c} {r:.3f}" for c, r in a["vs_contenders"].items())
            + f"), {a['auto_vs_best_table']:.3f} as a ratio of medians"
            if a.get("auto_vs_best") is not None
            else "no other engine to compare"
        )
        lines.append(
            f"{name}: picked {a['picked']} ({a['basis']}), {vs}; "
            f"tuning {a['autotune_seconds']:.1f} s (in its compile s, not its step)"
        )
    for name, e in row["engines"].items():
        if "partition" not in e:
            continue
        p = e["partition"]
        ms = " ".join(f"{x * 1e3:.1f}" for x in p["rank_seconds_alone"])
        lines.append(
            f"{name}: partition {p['method']} over {len(p['rank_loads'])} ranks "
            f"(sequences {p['rank_sequences']}): makespan balance max/mean "
            f"{p['cost_balance']:.3f} (cost model), {p['measured_balance']:.3f} measured "
            f"(each rank alone on one device, ms: {ms})"
        )
    return "\n".join(lines)


def _format_padding(p: dict) -> str:
    u, r = p["unreserved"], p["reserved"]
    return (
        f"dense rows padded to {u['padded_length']} tokens unreserved (length bucket: "
        f"{u['computed_tokens']} tokens, +{100 * u['excess']:.0f}% over the batch's "
        f"{p['num_tokens']}) -> {r['padded_length']} reserved as a run reserves "
        f"({r['computed_tokens']} tokens, +{100 * r['excess']:.0f}%)"
    )


def _steps(stats: dict) -> str:
    chosen = f"-> {stats['chosen_engine']} " if "chosen_engine" in stats else ""
    if "num_steps" not in stats:
        return chosen + "-"
    packed, rows = stats.get("packed_steps", 0), stats.get("row_steps", 0)
    wide = f", wide {stats['wide_steps']}" if "wide_steps" in stats else ""
    return f"{chosen}{stats['num_steps']}({packed}, rows {rows}{wide})"
