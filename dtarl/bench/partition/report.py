"""Partition variants (method x units), the per-step summaries, the headline
averages and the plain-text table of the simulated makespans."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtarl.bench.report import Column, text_table
from dtarl.parallel.partition import PartitionMethod

TARGET_PCT = 10.0


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


def variant(method: PartitionMethod, units: str) -> str:
    return f"{method.value}/{units}"


# Every method with both units; the balanced method's rows with sequence units are the reference.
VARIANTS = tuple((m, u) for m in PartitionMethod for u in UNITS)


REFERENCE = variant(PartitionMethod.BALANCED, "sequences")


BASELINE = PartitionMethod.GREEDY_TOKENS


def pct_lower(base: float, ours: float) -> float:
    """% by which ``ours`` is lower than ``base``."""
    return 100.0 * (base - ours) / base


SHORT_WINNER = {
    "balanced/lexicographic": "lex",
    "balanced/blocks": "blocks",
    "greedy_tokens": "g_tok",
    "greedy_tree": "g_tree",
    "karmarkar_karp": "kk",
}


def win_counts(rows: list[dict]) -> dict[str, int]:
    """How often each candidate won (``Partition.winner``), most frequent first."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["winner"]] = counts.get(r["winner"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def format_wins(wins: dict[str, int]) -> str:
    """``{"balanced/blocks": 3, "greedy_tree": 1}`` -> ``"blocks 3, g_tree 1"``."""
    return ", ".join(f"{SHORT_WINNER.get(w, w)} {c}" for w, c in wins.items())


def summarise(rows: list[dict]) -> list[dict]:
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
                        [pct_lower(r["makespan"], ref[s]["makespan"]) for s, r in by_step.items()]
                    )
                ),
                # What a partition with no duplication and perfect balance (C(T)/K) would get.
                "ideal_pct_lower": float(
                    np.mean([pct_lower(r["makespan"], r["ideal_makespan"]) for r in rs])
                ),
                "seconds": float(np.mean([r["seconds"] for r in rs])),
                "wins": win_counts(rs),
            }
        out.append(entry)
    return out


def baseline_variant(workload: str, units: str) -> str:
    return variant(BASELINE, AREAL_UNITS.get(workload, "sequences") if units == "areal" else units)


def headline(summary: list[dict], workloads: Sequence[str]) -> dict:
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
                    v = s["variants"].get(baseline_variant(s["workload"], units))
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


UNITS_NOTE = {
    "sequences": "sequence units (the paper's baseline; verl, AReaL multi-turn)",
    "groups": "group units (AReaL single-turn)",
    "areal": "AReaL dispatch (groups single-turn, completions multi-turn)",
}


_COLUMNS = [
    Column(title=t, width=w, align=a)
    for t, w, a in (
        ("workload", 11, "<"), ("K", 2, ">"), ("variant", 24, "<"), ("max load", 12, ">"),
        ("mean load", 12, ">"), ("max/mean", 8, ">"), ("dup tokens", 10, ">"),
        ("dup/bound", 9, ">"), ("bal%", 6, ">"), ("ideal%", 6, ">"), ("won (steps)", 0, "<"),
    )
]  # fmt: skip


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
        ]
        cells = [
            [
                s["workload"],
                str(s["k"]),
                v,
                f"{e['makespan']:.1f}",
                f"{e['mean_load']:.1f}",
                f"{e['imbalance']:.3f}",
                f"{e['duplicated_tokens']:.0f}",
                f"{e['dup_over_bound_max']:.3f}",
                f"{e['pct_lower']:.1f}%",
                f"{e['ideal_pct_lower']:.1f}%",
                format_wins(e["wins"]),
            ]
            for s in sel
            for v, e in s["variants"].items()
        ]
        lines += text_table(_COLUMNS, cells, sep=[" "] * 9 + ["  "])
        for set_name, by_units in result["headline"].get(cname, {}).items():
            lines.append(f"average over {set_name}, {REFERENCE} lower than greedy_tokens with:")
            for units, h in by_units.items():
                per_k = "  ".join(f"K={k}: {x:5.1f}%" for k, x in h["per_k"].items())
                lines.append(
                    f"  {UNITS_NOTE[units]:<60} {per_k}  | all: {h['mean']:5.1f}% "
                    f"(target >= {TARGET_PCT:.0f}%: {'met' if h['meets_target'] else 'MISSED'})"
                )
    lines.append(
        "dup tokens = sum_j |T_j| - |T| (mean over steps); dup/bound = max over steps of "
        "dup tokens / ((K-1) max_len); won = the assignment returned, per step (balanced: "
        "lex / blocks = contiguous cut of that order, g_tok / g_tree / kk = a baseline had "
        "the lower makespan)"
    )
    return "\n".join(lines)
