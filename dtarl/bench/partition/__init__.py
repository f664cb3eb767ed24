"""Benchmark of the DP partitioner on PolyTrace batches (simulated step time).

For every step file of each workload we build dummy token sequences with the
real prefix structure (one shared prompt per group, distinct random responses;
per-turn samples of one trajectory are prefixes of each other), partition them
over K ranks with every ``PartitionMethod``, and take the simulated step time =
makespan = max_j C(T_j) under a cost model: ``TreeTokenCost`` (the paper's C,
tree tokens) and ``FlopCost`` (tree tokens plus attention, a + b * depth).

Methods and units. The balanced method cuts a DFS order into K contiguous runs
of sequences and, with ``BalancedOrder.BEST`` (the default, what the bench runs),
also computes the three baselines on the same units and keeps the lowest makespan
under the cost model; every row records the ``winner`` (and all ``candidates``),
and the tables count the winners over the steps. A GRPO group may span two ranks,
which is how ``ShardedEngine`` runs it (advantages and loss weights come from the
whole batch). Each baseline runs twice, with the unit AReaL / verl dispatch:

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

CLI: ``dtarl bench partition [--polytrace DIR] [--json OUT] [--max-steps N] [--measure]``.
Every step of the default workloads with ``--costs tree_tokens`` took 87 s in all
(16 s of CPU) on a busy 2-core machine; ``--measure`` took 20-22 min per workload
(one step, 3 K, 8 variants; run one workload per process on such a machine).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dtarl.bench.partition.measure import (
    MeasureConfig,
    format_measured,
    measure_rows,
    summarise_measured,
)
from dtarl.bench.partition.report import (
    AREAL_UNITS,
    HEADLINE_SETS,
    REFERENCE,
    TARGET_PCT,
    UNITS,
    VARIANTS,
    format_table,
    format_wins,
    headline,
    summarise,
    variant,
    win_counts,
)
from dtarl.bench.partition.steps import (
    DEFAULT_WORKLOADS,
    MULTITURN_RUNS,
    PACKED_RUNS,
    WORKLOADS,
    StepBatch,
    build_sequences,
    default_root,
    iter_batches,
    load_steps,
    scale_step,
    select_steps,
    synthetic_steps,
)
from dtarl.parallel.partition import FlopCost, TreeTokenCost, dfs_order, partition


def cost_models(flop: FlopCost) -> dict[str, object]:
    return {"tree_tokens": TreeTokenCost(), "flops": flop}


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
    all_costs = cost_models(flop)
    unknown = [c for c in costs if c not in all_costs]
    if unknown or not costs:
        raise ValueError(f"costs={list(costs)}: expected a non-empty subset of {list(all_costs)}")
    rows = []
    for wl in workloads:
        for sb in select_steps(root, wl, max_steps, seed):
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
                                "variant": variant(method, units),
                                "winner": p.winner,
                                "candidates": p.candidates,
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
    summary = summarise(rows)
    measured = measure_rows(root, ks, workloads, measure, seed) if measure else []
    return {
        "measured": measured,
        "measured_summary": summarise_measured(measured),
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
        "headline": headline(summary, workloads),
        "target_pct": TARGET_PCT,
    }


__all__ = [
    "AREAL_UNITS",
    "DEFAULT_WORKLOADS",
    "HEADLINE_SETS",
    "MULTITURN_RUNS",
    "PACKED_RUNS",
    "REFERENCE",
    "TARGET_PCT",
    "UNITS",
    "VARIANTS",
    "WORKLOADS",
    "MeasureConfig",
    "StepBatch",
    "build_sequences",
    "cost_models",
    "default_root",
    "format_measured",
    "format_table",
    "format_wins",
    "headline",
    "iter_batches",
    "load_steps",
    "measure_rows",
    "run",
    "scale_step",
    "select_steps",
    "summarise",
    "summarise_measured",
    "synthetic_steps",
    "variant",
    "win_counts",
]
