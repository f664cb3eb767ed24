"""Benchmark of the DP partitioner on PolyTrace batches (simulated step time).

For every step file of each workload we build dummy token sequences with the
real prefix structure (one shared prompt per group, distinct random responses;
per-turn samples of one trajectory are prefixes of each other), partition them
over K ranks with every ``PartitionMethod``, and take the simulated step time =
makespan = max_j C(T_j) under a cost model: ``TreeTokenCost`` (the paper's C,
tree tokens) and ``FlopCost`` (tree tokens plus attention, a + b * depth).

Methods and units. The balanced method cuts a DFS order into K contiguous runs
of sequences (``BalancedOrder.BEST``); a GRPO group may span two ranks, which is
how ``ShardedEngine`` runs it (advantages and loss weights come from the whole
batch). Each baseline runs twice, with the unit AReaL / verl dispatch:

  sequences  every sequence is a unit: verl's ``balance_batch`` and AReaL's
             multi-turn dispatch (``redistribute(granularity=1)``, one unit per
             completion); the paper's ablation baseline (greedy to the least
             loaded rank by token count).
  groups     whole GRPO groups: AReaL's single-turn dispatch
             (``redistribute(granularity=group_size)``).

"AReaL dispatch" picks, per workload, the unit AReaL uses: groups for the
single-turn workloads, sequences (completions) for the multi-turn ones.
The real partitioners also equalise the number of units per rank (AReaL's
``ffd_allocate`` puts each unit, largest first, on the rank with the fewest;
verl's Karmarkar-Karp runs with ``equal_size=True``); the baselines here do
not. On the PolyTrace batches AReaL's rule gives equal or 0.6-4% higher
makespans than ``GREEDY_TOKENS`` at K=8, so these baselines are the stronger ones.

With ``--measure`` it also runs every rank's sub-batch through the DFS engine
on the tiny model on this machine's CPU, with the trace lengths scaled down by
``--measure-scale`` (tokens from the tiny model's 256-token vocabulary), and
reports the measured step time = max over ranks of the engine time next to the
simulated makespan (tree tokens) of the same scaled batch. Each rank is
prepared with fresh (tight) shape buckets, as if it ran alone, so the padding
of the power-of-two / quarter-octave buckets (up to 25% extra plan steps) is
part of what is measured; ranks with equal buckets share one compilation, and
compilation is never timed. Each rank is timed ``--measure-repeats`` times,
round-robin over the ranks (so load bursts hit all of them), and the min is kept.

Workloads (PolyTrace, see ``polytrace/README.md``):
  math         verl DAPO math, Qwen2.5-32B: 96 prompts x 8 responses per step.
  coding       rllm DeepCoder 16k: 16 prompts x 8 responses per step.
  search       Search-R1 multi-turn, per-turn samples (AReaL's per-completion
               view): one sample per model turn, the context up to the end of that
               turn; a trajectory's samples are prefixes of each other.
  search_traj  Search-R1 as whole trajectories (prompt + all turns, tool outputs
               included; the original verl run's view).
  video        verl-video (not in the default set; the prompt lengths are text-only).
Without a PolyTrace directory, synthetic batches with the same shapes stand in.

CLI: ``dtarl bench partition [--polytrace DIR] [--json OUT] [--max-steps N] [--measure]``
(or ``python -m dtarl.bench.partition ...``). Every step of the default
workloads takes about 20 s on one CPU core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from dtarl.parallel.partition import (
    FlopCost,
    PartitionMethod,
    TreeTokenCost,
    dfs_order,
    partition,
)

VOCAB = 32_000
TARGET_PCT = 10.0

_PACKED = {
    "math": "verl/profile/packed_length_log/20260610_092349",
    "coding": "rllm/profile/packed_length_log/20260616_024512",
    "video": "verl-video/profile/packed_length_log/20260609_033329",
}
_MULTITURN = {
    "search": "search_r1/profile/multiturn_workload_log/0617_0223",
    "search_traj": "search_r1/profile/multiturn_workload_log/0617_0223",
}
_PER_TURN = {"search"}
WORKLOADS = tuple(sorted(_PACKED | _MULTITURN))
DEFAULT_WORKLOADS = ("math", "coding", "search", "search_traj")
UNITS = ("sequences", "groups")
# The unit AReaL's dispatch uses (see the module docstring).
AREAL_UNITS = {
    "math": "groups",
    "coding": "groups",
    "video": "groups",
    "search": "sequences",
    "search_traj": "sequences",
}
# Workload sets the average line is taken over (the first complete one is the headline).
HEADLINE_SETS = {
    "math+coding+search": ("math", "coding", "search"),
    "math+coding+search_traj": ("math", "coding", "search_traj"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One training step: per group a prompt length and its sequences' response lengths.

    turn_ends: None for one sequence per response; otherwise per group, per
      trajectory, the response-relative end of each model turn: one per-turn sample
      (prompt + response[:end]) per entry.
    """

    workload: str
    step: int
    prompt_lens: tuple[int, ...]
    response_lens: tuple[tuple[int, ...], ...]
    turn_ends: tuple[tuple[tuple[int, ...], ...], ...] | None = None


def _step_of(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def _model_turn_ends(rle) -> tuple[int, ...]:
    """Response-relative end of every model run (mask 1) of a loss-mask RLE."""
    out, pos = [], 0
    for mask, n in rle:
        pos += int(n)
        if int(mask) == 1:
            out.append(pos)
    return tuple(out)


def load_steps(trace_root: Path, workload: str) -> list[StepBatch]:
    """Reads every step file of a PolyTrace workload into ``StepBatch``es."""
    if workload in _PACKED:
        folder = trace_root / _PACKED[workload]
        files = sorted(folder.glob("packed_lengths_step_*.jsonl"), key=_step_of)
        out = []
        for f in files:
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if not r.get("validate", False)]
            out.append(
                StepBatch(
                    workload=workload,
                    step=_step_of(f),
                    prompt_lens=tuple(int(r["input"]) for r in rows),
                    response_lens=tuple(tuple(int(x) for x in r["output"]) for r in rows),
                )
            )
    elif workload in _MULTITURN:
        folder = trace_root / _MULTITURN[workload]
        files = sorted(folder.glob("multiturn_workload_step_*.jsonl"), key=_step_of)
        out = []
        for f in files:
            groups: dict[int, list[dict]] = {}
            for line in f.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    if not r.get("validate", False):
                        groups.setdefault(int(r["prompt_group_id"]), []).append(r)
            keys = sorted(groups)
            # The trained response is final_response_len tokens (the RLE's total;
            # final_total_len can run past a truncated response).
            out.append(
                StepBatch(
                    workload=workload,
                    step=_step_of(f),
                    prompt_lens=tuple(int(groups[g][0]["prompt_len"]) for g in keys),
                    response_lens=tuple(
                        tuple(int(r["final_response_len"]) for r in groups[g]) for g in keys
                    ),
                    turn_ends=tuple(
                        tuple(_model_turn_ends(r["response_loss_mask_rle"]) for r in groups[g])
                        for g in keys
                    )
                    if workload in _PER_TURN
                    else None,
                )
            )
    else:
        raise ValueError(f"workload={workload!r}: expected one of {list(WORKLOADS)}")
    if not out:
        raise FileNotFoundError(f"{workload}: no step files under {folder}")
    return out


def synthetic_steps(workload: str, n_steps: int = 3, seed: int = 0) -> list[StepBatch]:
    """Built-in stand-ins (lognormal lengths, sizes as in PolyTrace) when no traces are given.

    The search workloads get 1-5 model turns per trajectory, ending at random
    points of the response (the last one at its end).
    """
    shapes = {  # groups, group size, prompt (median, sigma), response (median, sigma, cap)
        "math": (96, 8, (150, 0.4), (450, 1.0, 16000)),
        "coding": (16, 8, (450, 0.3), (8000, 0.9, 16000)),
        "search": (256, 8, (310, 0.15), (900, 0.8, 3000)),
        "search_traj": (256, 8, (310, 0.15), (900, 0.8, 3000)),
        "video": (64, 8, (300, 0.3), (150, 0.6, 2000)),
    }
    if workload not in shapes:
        raise ValueError(f"workload={workload!r}: expected one of {sorted(shapes)}")
    g, m, (pm, ps), (rm, rs, cap) = shapes[workload]
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n_steps):
        p = np.maximum(1, rng.lognormal(np.log(pm), ps, g)).astype(int)
        r = np.clip(rng.lognormal(np.log(rm), rs, (g, m)), 1, cap).astype(int)
        ends = None
        if workload in _PER_TURN:
            ends = tuple(
                tuple(
                    tuple(sorted(set(rng.integers(1, x + 1, rng.integers(0, 5)).tolist()) | {x}))
                    for x in row
                )
                for row in r.tolist()
            )
        out.append(
            StepBatch(
                workload=workload,
                step=step,
                prompt_lens=tuple(p.tolist()),
                response_lens=tuple(tuple(row) for row in r.tolist()),
                turn_ends=ends,
            )
        )
    return out


def build_sequences(
    batch: StepBatch, seed: int = 0, *, vocab: int = VOCAB
) -> tuple[list[np.ndarray], np.ndarray]:
    """Dummy tokens with the batch's prefix structure.

    Each group gets one random prompt shared by its sequences; each response is
    random tokens whose first token differs from its siblings', so siblings share
    exactly the prompt. With ``turn_ends`` every trajectory yields one sample per
    model turn, prompt + response[:end], so its samples are prefixes of each other
    (a trajectory without model turns yields none). Returns (sequences,
    group_ids). ``vocab`` must be at least the largest group size.
    """
    rng = np.random.default_rng([seed, batch.step])
    seqs, gids = [], []
    for g, (p, resp) in enumerate(zip(batch.prompt_lens, batch.response_lens, strict=True)):
        prompt = rng.integers(0, vocab, max(int(p), 1), dtype=np.int32)
        firsts = rng.choice(vocab, size=len(resp), replace=False).astype(np.int32)
        for s, (first, r) in enumerate(zip(firsts, resp, strict=True)):
            body = rng.integers(0, vocab, max(int(r) - 1, 0), dtype=np.int32)
            full = np.concatenate([prompt, [first] if r > 0 else [], body]).astype(np.int32)
            if batch.turn_ends is None:
                seqs.append(full)
                gids.append(g)
                continue
            for end in batch.turn_ends[g][s]:
                seqs.append(full[: prompt.shape[0] + min(int(end), int(r))])
                gids.append(g)
    return seqs, np.array(gids, np.int32)


def _cost_models(flop: FlopCost) -> dict[str, object]:
    return {"tree_tokens": TreeTokenCost(), "flops": flop}


def _steps(trace_root: Path | None, workload: str, max_steps: int | None, seed: int):
    steps = load_steps(trace_root, workload) if trace_root else synthetic_steps(workload, 3, seed)
    return steps[:max_steps] if max_steps else steps


# ----------------------------------------------------------------------------- measured


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """Measured per-rank engine time: DFS engine, tiny model, CPU, scaled lengths.

    scale: every prompt / response length is multiplied by this (>= 1 token kept).
    steps: trace steps per workload to measure (the first ones).
    repeats: timed runs per rank after one warm-up (min is kept).
    chunk_len: the DFS engine's chunk length.
    """

    scale: float = 1 / 64
    steps: int = 1
    repeats: int = 3
    chunk_len: int = 32

    def __post_init__(self):
        if not 0 < self.scale <= 1:
            raise ValueError(f"MeasureConfig.scale={self.scale}: must be in (0, 1]")
        for name in ("steps", "repeats", "chunk_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"MeasureConfig.{name}={getattr(self, name)}: must be >= 1")


def scale_step(sb: StepBatch, scale: float) -> StepBatch:
    """The step with every prompt, response and turn-end length scaled (at least 1 token each).

    Turn ends that collapse onto one scaled length are kept once.
    """

    def f(x: int) -> int:
        return max(1, int(round(x * scale)))

    ends = None
    if sb.turn_ends is not None:
        ends = tuple(
            tuple(
                tuple(sorted({min(f(e), f(r)) for e in es}))
                for es, r in zip(group, rs, strict=True)
            )
            for group, rs in zip(sb.turn_ends, sb.response_lens, strict=True)
        )
    return dataclasses.replace(
        sb,
        prompt_lens=tuple(f(p) for p in sb.prompt_lens),
        response_lens=tuple(tuple(f(r) for r in rs) for rs in sb.response_lens),
        turn_ends=ends,
    )


class _Measurer:
    """Times each rank's sub-batch through a DFS engine on the tiny model (CPU).

    Every rank is prepared with fresh (tight) shape buckets, as if it ran alone;
    compiled programs are shared between ranks whose buckets coincide.
    """

    def __init__(self, cfg: MeasureConfig):
        import jax
        from flax import nnx

        from dtarl.engines import DFSEngine
        from dtarl.losses import MaskedNLLLoss
        from dtarl.model import ModelConfig, init_model

        self.cfg = cfg
        self.model_cfg = ModelConfig.tiny()
        # Abstract init + host values: no per-op compilation for the weights.
        model = nnx.eval_shape(lambda: init_model(self.model_cfg, seed=0))
        _, abstract = nnx.split(model, nnx.Param)
        rs = np.random.RandomState(0)
        self.params = jax.device_put(
            jax.tree.map(lambda a: (0.05 * rs.standard_normal(a.shape)).astype(a.dtype), abstract)
        )
        self.loss = MaskedNLLLoss()
        self.engine = DFSEngine(model, chunk_len=cfg.chunk_len)
        self._fresh = dict(self.engine._min)
        self._warm: set = set()

    def rank_seconds(self, seqs: list[np.ndarray], ranks: Sequence[np.ndarray]) -> list[float]:
        """min over ``repeats`` (round-robin over ranks) of each rank's engine seconds."""
        import jax

        from dtarl.batch import RolloutBatch

        runs = []
        for ix in ranks:
            if ix.shape[0] == 0:
                runs.append(None)
                continue
            self.engine._min = dict(self._fresh)  # tight buckets: this rank alone
            prep = self.engine.prepare(
                RolloutBatch.create(tokens=[seqs[i] for i in ix.tolist()]), self.loss
            )
            fn = self.engine.jit.get(self.loss, prep.static)
            args = jax.device_put(prep.args)
            key = (prep.static, tuple(np.shape(a) for a in jax.tree.leaves(prep.args)))
            if key not in self._warm:  # compile outside the timed runs
                jax.block_until_ready(fn(self.params, *args))
                self._warm.add(key)
            runs.append((fn, args))
        best = [float("inf") if r is not None else 0.0 for r in runs]
        for _ in range(self.cfg.repeats):
            for j, r in enumerate(runs):
                if r is None:
                    continue
                t0 = time.perf_counter()
                jax.block_until_ready(r[0](self.params, *r[1]))
                best[j] = min(best[j], time.perf_counter() - t0)
        return best


def _measure(
    root: Path | None,
    ks: Sequence[int],
    workloads: Sequence[str],
    cfg: MeasureConfig,
    seed: int,
) -> list[dict]:
    """Measured rows: per workload, step, K and variant (method/units; tree-token partition)."""
    m = _Measurer(cfg)
    rows = []
    for wl in workloads:
        for sb in _steps(root, wl, cfg.steps, seed):
            small = scale_step(sb, cfg.scale)
            seqs, gids = build_sequences(small, seed, vocab=m.model_cfg.vocab_size)
            n_groups = len(small.prompt_lens)
            dfs = dfs_order(seqs)
            cache: dict[tuple, list[float]] = {}
            for k in ks:
                for method, units in VARIANTS:
                    kg = units == "groups"
                    if k > (n_groups if kg else len(seqs)):
                        continue
                    p = partition(seqs, k, method=method, group_ids=gids, keep_groups=kg, dfs=dfs)
                    key = tuple(tuple(ix.tolist()) for ix in p.indices)
                    if key not in cache:
                        cache[key] = m.rank_seconds(seqs, p.indices)
                    times = cache[key]
                    rows.append(
                        {
                            "workload": wl,
                            "step": sb.step,
                            "k": k,
                            "variant": _variant(method, units),
                            "scale": cfg.scale,
                            "rank_seconds": times,
                            "measured_max_s": max(times),
                            "measured_mean_s": float(np.mean(times)),
                            "sim_makespan": p.makespan,
                            "rank_tree_tokens": p.tree_tokens.tolist(),
                            "n_sequences": len(seqs),
                            "scaled_tree_tokens": p.global_tree_tokens,
                        }
                    )
    return rows


def _summarise_measured(rows: list[dict]) -> list[dict]:
    """Per workload and K: mean over steps of each variant's measured / simulated step time,
    and the mean % by which ``balanced/sequences`` is lower than each other variant."""
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["k"]), {}).setdefault(r["variant"], []).append(r)
    out = []
    for (wl, k), variants in by.items():
        ref = variants[REFERENCE]
        entry = {"workload": wl, "k": k, "steps": len(ref), "variants": {}}
        for v, rs in variants.items():
            e = {
                "measured_s": float(np.mean([r["measured_max_s"] for r in rs])),
                "sim_makespan": float(np.mean([r["sim_makespan"] for r in rs])),
            }
            for col, src in (("measured", "measured_max_s"), ("sim", "sim_makespan")):
                e[f"{col}_pct_lower"] = float(
                    np.mean([_pct_lower(o[src], b[src]) for b, o in zip(ref, rs, strict=True)])
                )
            entry["variants"][v] = e
        out.append(entry)
    return out


def format_measured(result: dict) -> str:
    """Plain-text table of the measured per-rank engine times (max over ranks)."""
    summary = result.get("measured_summary")
    if not summary:
        return ""
    cfg = result["config"]["measure"]
    lines = [
        "",
        f"measured: DFS engine, tiny model, CPU, lengths x{cfg['scale']:.4g}; step time = max "
        f"over ranks; % = {REFERENCE} lower than the row, measured (simulated tree tokens)",
        f"{'workload':<11} {'K':>2} {'variant':<24} {'measured ms':>11} {'sim makespan':>12} "
        f"{'measured %':>10} {'sim %':>7}",
    ]
    for s in summary:
        for v, e in s["variants"].items():
            lines.append(
                f"{s['workload']:<11} {s['k']:>2} {v:<24} {1e3 * e['measured_s']:>11.1f} "
                f"{e['sim_makespan']:>12.1f} {e['measured_pct_lower']:>9.1f}% "
                f"{e['sim_pct_lower']:>6.1f}%"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- simulated


def _variant(method: PartitionMethod, units: str) -> str:
    return f"{method.value}/{units}"


# Every method with both units; the balanced method's rows with sequence units are the reference.
VARIANTS = tuple((m, u) for m in PartitionMethod for u in UNITS)
REFERENCE = _variant(PartitionMethod.BALANCED, "sequences")
_BASELINE = PartitionMethod.GREEDY_TOKENS


def run(
    trace_root: str | Path | None,
    ks: Sequence[int] = (2, 4, 8),
    *,
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    costs: Sequence[str] = ("tree_tokens", "flops"),
    flop: FlopCost | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    measure: MeasureConfig | None = None,
) -> dict:
    """Partitions the first ``max_steps`` steps (None: all) of every workload for each K,
    cost model and variant (method x units).

    Returns a JSON-able dict: ``rows`` (one per step x K x cost x variant),
    ``summary`` (per workload, K and cost: per variant the mean makespan, mean load,
    max/mean, duplicated tokens vs the (K-1) max_len bound, and the mean % by which
    ``balanced/sequences`` is lower) and ``headline`` (that %, vs greedy by tokens,
    averaged over the workloads of each complete ``HEADLINE_SETS`` entry). With
    ``measure``, also ``measured`` rows (per-rank DFS engine seconds on CPU, scaled
    lengths; see ``MeasureConfig``) and their ``measured_summary``.
    """
    flop = FlopCost() if flop is None else flop
    root = Path(trace_root) if trace_root else None
    all_costs = _cost_models(flop)
    unknown = [c for c in costs if c not in all_costs]
    if unknown or not costs:
        raise ValueError(f"costs={list(costs)}: expected a non-empty subset of {list(all_costs)}")
    rows = []
    for wl in workloads:
        for sb in _steps(root, wl, max_steps, seed):
            seqs, gids = build_sequences(sb, seed)
            dfs = dfs_order(seqs)
            order, lcps, lengths = dfs
            n_groups = int(np.unique(gids).shape[0])
            for k in ks:
                for cname in costs:
                    cost = all_costs[cname]
                    global_cost = float(cost.append_cost(lengths[order], lcps).sum())
                    for method, units in VARIANTS:
                        kg = units == "groups"
                        if k > (n_groups if kg else len(seqs)):
                            continue
                        t0 = time.perf_counter()
                        p = partition(
                            seqs,
                            k,
                            method=method,
                            cost=cost,
                            group_ids=gids,
                            keep_groups=kg,
                            dfs=dfs,
                        )
                        rows.append(
                            {
                                "workload": wl,
                                "step": sb.step,
                                "k": k,
                                "cost": cname,
                                "variant": _variant(method, units),
                                "makespan": p.makespan,
                                "mean_load": p.mean_load,
                                "imbalance": p.imbalance,
                                "duplicated_tokens": p.duplicated_tokens,
                                "duplication_bound": p.duplication_bound,
                                "global_tree_tokens": p.global_tree_tokens,
                                "ideal_makespan": global_cost / k,
                                "total_tokens": p.total_tokens,
                                "n_sequences": len(seqs),
                                "n_groups": n_groups,
                                "seconds": time.perf_counter() - t0,
                            }
                        )
    summary = _summarise(rows)
    measured = _measure(root, ks, workloads, measure, seed) if measure else []
    return {
        "measured": measured,
        "measured_summary": _summarise_measured(measured),
        "config": {
            "trace_root": str(root) if root else None,
            "synthetic": root is None,
            "ks": list(ks),
            "workloads": list(workloads),
            "costs": list(costs),
            "flop_cost": {"a": flop.a, "b": flop.b},
            "seed": seed,
            "max_steps": max_steps,
            "measure": dataclasses.asdict(measure) if measure else None,
        },
        "rows": rows,
        "summary": summary,
        "headline": _headline(summary, workloads),
        "target_pct": TARGET_PCT,
    }


def _pct_lower(base: float, ours: float) -> float:
    """% by which ``ours`` is lower than ``base``."""
    return 100.0 * (base - ours) / base


def _summarise(rows: list[dict]) -> list[dict]:
    by: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in rows:
        key = (r["workload"], r["k"], r["cost"])
        by.setdefault(key, {}).setdefault(r["variant"], {})[r["step"]] = r
    out = []
    for (wl, k, cname), variants in by.items():
        ref = variants[REFERENCE]
        entry = {"workload": wl, "k": k, "cost": cname, "steps": len(ref), "variants": {}}
        for v, by_step in variants.items():
            rs = list(by_step.values())
            entry["variants"][v] = {
                "steps": len(rs),
                "makespan": float(np.mean([r["makespan"] for r in rs])),
                "mean_load": float(np.mean([r["mean_load"] for r in rs])),
                "imbalance": float(np.mean([r["imbalance"] for r in rs])),
                "duplicated_tokens": float(np.mean([r["duplicated_tokens"] for r in rs])),
                "dup_pct": float(
                    np.mean([100.0 * r["duplicated_tokens"] / r["global_tree_tokens"] for r in rs])
                ),
                "dup_over_bound_max": float(
                    max(r["duplicated_tokens"] / max(r["duplication_bound"], 1) for r in rs)
                ),
                # balanced/sequences vs this variant, paired by step.
                "pct_lower": float(
                    np.mean(
                        [_pct_lower(r["makespan"], ref[s]["makespan"]) for s, r in by_step.items()]
                    )
                ),
                # What a partition with no duplication and perfect balance (C(T)/K) would get.
                "ideal_pct_lower": float(
                    np.mean([_pct_lower(r["makespan"], r["ideal_makespan"]) for r in rs])
                ),
                "seconds": float(np.mean([r["seconds"] for r in rs])),
            }
        out.append(entry)
    return out


def _baseline_variant(workload: str, units: str) -> str:
    return _variant(
        _BASELINE, AREAL_UNITS.get(workload, "sequences") if units == "areal" else units
    )


def _headline(summary: list[dict], workloads: Sequence[str]) -> dict:
    """Mean over a workload set of % lower makespan (balanced/sequences vs greedy by tokens).

    Per cost and complete ``HEADLINE_SETS`` entry (or all workloads run, if none is
    complete), per baseline units: "sequences", "groups" and "areal" (the unit
    AReaL's dispatch uses for the workload).
    """
    sets = {n: ws for n, ws in HEADLINE_SETS.items() if set(ws) <= set(workloads)}
    if not sets:
        sets = {"+".join(workloads): tuple(workloads)}
    out: dict = {}
    for cname in sorted({s["cost"] for s in summary}):
        for set_name, ws in sets.items():
            for units in (*UNITS, "areal"):
                vals = {}  # k -> [% per workload]
                for s in summary:
                    if s["cost"] != cname or s["workload"] not in ws:
                        continue
                    v = s["variants"].get(_baseline_variant(s["workload"], units))
                    if v is not None:
                        vals.setdefault(s["k"], []).append(v["pct_lower"])
                if not vals:
                    continue
                allv = [x for xs in vals.values() for x in xs]
                mean = float(np.mean(allv))
                out.setdefault(cname, {}).setdefault(set_name, {})[units] = {
                    "per_k": {str(k): float(np.mean(xs)) for k, xs in sorted(vals.items())},
                    "mean": mean,
                    "meets_target": mean >= TARGET_PCT,
                }
    return out


_UNITS_NOTE = {
    "sequences": "sequence units (the paper's baseline; verl, AReaL multi-turn)",
    "groups": "group units (AReaL single-turn)",
    "areal": "AReaL dispatch (groups single-turn, completions multi-turn)",
}


def format_table(result: dict) -> str:
    """Plain-text tables: per cost, workload, K and variant; then the average lines."""
    lines = []
    for cname in result["config"]["costs"]:
        sel = [s for s in result["summary"] if s["cost"] == cname]
        if not sel:
            continue
        lines += [
            "",
            f"cost={cname}: makespan = max load over ranks, mean over steps; "
            f"bal% = {REFERENCE} lower than the row; ideal% = C(T)/K lower than the row",
            f"{'workload':<11} {'K':>2} {'variant':<24} {'max load':>12} {'mean load':>12} "
            f"{'max/mean':>8} {'dup tokens':>10} {'dup/bound':>9} {'bal%':>6} {'ideal%':>6}",
        ]
        for s in sel:
            for v, e in s["variants"].items():
                lines.append(
                    f"{s['workload']:<11} {s['k']:>2} {v:<24} {e['makespan']:>12.1f} "
                    f"{e['mean_load']:>12.1f} {e['imbalance']:>8.3f} "
                    f"{e['duplicated_tokens']:>10.0f} {e['dup_over_bound_max']:>9.3f} "
                    f"{e['pct_lower']:>5.1f}% {e['ideal_pct_lower']:>5.1f}%"
                )
        for set_name, by_units in result["headline"].get(cname, {}).items():
            lines.append(f"average over {set_name}, {REFERENCE} lower than greedy_tokens with:")
            for units, h in by_units.items():
                per_k = "  ".join(f"K={k}: {x:5.1f}%" for k, x in h["per_k"].items())
                lines.append(
                    f"  {_UNITS_NOTE[units]:<60} {per_k}  | all: {h['mean']:5.1f}% "
                    f"(target >= {TARGET_PCT:.0f}%: {'met' if h['meets_target'] else 'MISSED'})"
                )
    lines.append(
        "dup tokens = sum_j |T_j| - |T| (mean over steps); dup/bound = max over steps of "
        "dup tokens / ((K-1) max_len)"
    )
    return "\n".join(lines)


def _default_root() -> Path | None:
    for cand in (Path("../shared/polytrace"), Path("/work/shared/polytrace")):
        if cand.is_dir():
            return cand
    return None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--polytrace",
        type=Path,
        default=None,
        metavar="DIR",
        help="PolyTrace directory (default: ../shared/polytrace if present, else synthetic)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results here")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="DP ranks to try")
    p.add_argument(
        "--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=list(WORKLOADS)
    )
    p.add_argument(
        "--costs",
        nargs="+",
        default=["tree_tokens", "flops"],
        choices=["tree_tokens", "flops"],
        help="cost models C(T_j) (tree_tokens is the paper's)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="first steps per workload (default 0 = every step)",
    )
    p.add_argument("--flop-b", type=float, default=FlopCost().b, help="FlopCost b (a = 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic", action="store_true", help="ignore traces; synthetic batches")
    m = MeasureConfig()
    p.add_argument(
        "--measure",
        action="store_true",
        help="also time each rank's sub-batch through the DFS engine (tiny model, CPU)",
    )
    p.add_argument(
        "--measure-scale", type=float, default=m.scale, help="length scale for --measure"
    )
    p.add_argument(
        "--measure-steps", type=int, default=m.steps, help="steps per workload to measure"
    )
    p.add_argument(
        "--measure-repeats", type=int, default=m.repeats, help="timed runs per rank (min)"
    )


def _main(args: argparse.Namespace) -> dict:
    if args.max_steps < 0:
        raise ValueError(f"--max-steps={args.max_steps}: must be >= 0 (0 = every step)")
    root = None if args.synthetic else (args.polytrace or _default_root())
    t0 = time.perf_counter()
    result = run(
        root,
        tuple(args.ks),
        workloads=tuple(args.workloads),
        costs=tuple(args.costs),
        flop=FlopCost(a=1.0, b=args.flop_b),
        max_steps=args.max_steps or None,
        seed=args.seed,
        measure=MeasureConfig(
            scale=args.measure_scale, steps=args.measure_steps, repeats=args.measure_repeats
        )
        if args.measure
        else None,
    )
    steps = "all steps" if not args.max_steps else f"first {args.max_steps} steps"
    print(
        f"traces: {root if root else 'synthetic (no PolyTrace directory)'} ({steps} per "
        f"workload; {time.perf_counter() - t0:.1f} s)"
    )
    print(format_table(result))
    if args.measure:
        print(format_measured(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``partition`` to the ``bench`` command's subparsers (``dtarl bench partition``).

    The handler is stored as ``func`` (call ``args.func(args)``).
    """
    p = subparsers.add_parser(
        "partition", help="DP partition: simulated makespan, balanced vs baselines"
    )
    _add_arguments(p)
    p.set_defaults(func=_cli)
    return p


def _cli(args: argparse.Namespace) -> int:
    _main(args)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtarl.bench.partition")
    _add_arguments(p)
    _main(p.parse_args(argv))


def iter_batches(trace_root: str | Path | None, workload: str) -> Iterator[tuple[list, np.ndarray]]:
    """(sequences, group_ids) per step of a workload, for notebooks and other benches."""
    for sb in _steps(Path(trace_root) if trace_root else None, workload, None, 0):
        yield build_sequences(sb)


if __name__ == "__main__":
    main()
