"""Benchmark of the DP partitioner on PolyTrace batches (simulated step time).

For every step file of each workload we build dummy token sequences with the
real prefix structure (one shared prompt per group, distinct random responses),
partition them over K ranks with every ``PartitionMethod``, and take the
simulated step time = makespan = max_j C(T_j) under a cost model
(``TreeTokenCost`` and ``FlopCost``).

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
  math    verl DAPO math, Qwen2.5-32B: 96 prompts x 8 responses per step.
  coding  rllm DeepCoder 16k: 16 prompts x 8 responses per step.
  search  Search-R1 multi-turn: 256 prompts x 8 trajectories per step; a
          trajectory = prompt + all turns (tool outputs included).
  video   verl-video (not in the default set; the prompt lengths are text-only).
Without a PolyTrace directory, synthetic GRPO-like batches stand in.

CLI: ``dtarl bench partition [--polytrace DIR] [--json OUT] [--measure]``
(or ``python -m dtarl.parallel.bench_partition ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from dtarl.parallel.partition import FlopCost, PartitionMethod, TreeTokenCost, partition

VOCAB = 32_000
TARGET_PCT = 10.0

_PACKED = {
    "math": "verl/profile/packed_length_log/20260610_092349",
    "coding": "rllm/profile/packed_length_log/20260616_024512",
    "video": "verl-video/profile/packed_length_log/20260609_033329",
}
_MULTITURN = {"search": "search_r1/profile/multiturn_workload_log/0617_0223"}
DEFAULT_WORKLOADS = ("math", "coding", "search")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One training step: per group a prompt length and its sequences' response lengths."""

    workload: str
    step: int
    prompt_lens: tuple[int, ...]
    response_lens: tuple[tuple[int, ...], ...]


def _step_of(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


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
            out.append(
                StepBatch(
                    workload=workload,
                    step=_step_of(f),
                    prompt_lens=tuple(int(groups[g][0]["prompt_len"]) for g in keys),
                    response_lens=tuple(
                        tuple(int(r["final_total_len"]) - int(r["prompt_len"]) for r in groups[g])
                        for g in keys
                    ),
                )
            )
    else:
        raise ValueError(f"workload={workload!r}: expected one of {sorted(_PACKED | _MULTITURN)}")
    if not out:
        raise FileNotFoundError(f"{workload}: no step files under {folder}")
    return out


def synthetic_steps(workload: str, n_steps: int = 3, seed: int = 0) -> list[StepBatch]:
    """Built-in stand-ins (lognormal lengths, sizes as in PolyTrace) when no traces are given."""
    shapes = {  # groups, group size, prompt (median, sigma), response (median, sigma, cap)
        "math": (96, 8, (150, 0.4), (450, 1.0, 16000)),
        "coding": (16, 8, (450, 0.3), (8000, 0.9, 16000)),
        "search": (256, 8, (310, 0.15), (900, 0.8, 7000)),
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
        out.append(
            StepBatch(
                workload=workload,
                step=step,
                prompt_lens=tuple(p.tolist()),
                response_lens=tuple(tuple(row) for row in r.tolist()),
            )
        )
    return out


def build_sequences(
    batch: StepBatch, seed: int = 0, *, vocab: int = VOCAB
) -> tuple[list[np.ndarray], np.ndarray]:
    """Dummy tokens with the batch's prefix structure.

    Each group gets one random prompt shared by its sequences; each response is
    random tokens whose first token differs from its siblings', so siblings share
    exactly the prompt. Returns (sequences, group_ids). ``vocab`` must be at
    least the largest group size.
    """
    rng = np.random.default_rng([seed, batch.step])
    seqs, gids = [], []
    for g, (p, resp) in enumerate(zip(batch.prompt_lens, batch.response_lens, strict=True)):
        prompt = rng.integers(0, vocab, max(int(p), 1), dtype=np.int32)
        firsts = rng.choice(vocab, size=len(resp), replace=False).astype(np.int32)
        for first, r in zip(firsts, resp, strict=True):
            body = rng.integers(0, vocab, max(int(r) - 1, 0), dtype=np.int32)
            seqs.append(np.concatenate([prompt, [first] if r > 0 else [], body]).astype(np.int32))
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
    """The step with every prompt and response length scaled (at least 1 token each)."""

    def f(x: int) -> int:
        return max(1, int(round(x * scale)))

    return dataclasses.replace(
        sb,
        prompt_lens=tuple(f(p) for p in sb.prompt_lens),
        response_lens=tuple(tuple(f(r) for r in rs) for rs in sb.response_lens),
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
        from dtarl.model import ModelConfig, init_model
        from dtarl.rl.losses import MaskedNLLLoss

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

        from dtarl.engines.batch import RolloutBatch

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
    keep_groups_modes: Sequence[bool],
    cfg: MeasureConfig,
    seed: int,
) -> list[dict]:
    """Measured rows: per workload, step, K, units mode and method (tree-token partition)."""
    m = _Measurer(cfg)
    rows = []
    for wl in workloads:
        for sb in _steps(root, wl, cfg.steps, seed):
            small = scale_step(sb, cfg.scale)
            seqs, gids = build_sequences(small, seed, vocab=m.model_cfg.vocab_size)
            n_groups = len(small.prompt_lens)
            cache: dict[tuple, list[float]] = {}
            for k in ks:
                for kg in keep_groups_modes:
                    if k > (n_groups if kg else len(seqs)):
                        continue
                    for method in PartitionMethod:
                        p = partition(seqs, k, method=method, group_ids=gids, keep_groups=kg)
                        key = tuple(tuple(ix.tolist()) for ix in p.indices)
                        if key not in cache:
                            cache[key] = m.rank_seconds(seqs, p.indices)
                        times = cache[key]
                        rows.append(
                            {
                                "workload": wl,
                                "step": sb.step,
                                "k": k,
                                "keep_groups": kg,
                                "method": method.value,
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
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["k"], r["keep_groups"]), {}).setdefault(
            r["method"], []
        ).append(r)
    out = []
    for (wl, k, kg), methods in by.items():
        bal = methods[PartitionMethod.BALANCED.value]
        entry = {"workload": wl, "k": k, "keep_groups": kg, "steps": len(bal)}
        for meth, rs in methods.items():
            entry[f"measured_s_{meth}"] = float(np.mean([r["measured_max_s"] for r in rs]))
            entry[f"sim_{meth}"] = float(np.mean([r["sim_makespan"] for r in rs]))
            if meth != PartitionMethod.BALANCED.value:
                for col, src in (("measured", "measured_max_s"), ("sim", "sim_makespan")):
                    entry[f"{col}_pct_lower_vs_{meth}"] = float(
                        np.mean([_pct_lower(b[src], o[src]) for o, b in zip(bal, rs, strict=True)])
                    )
        out.append(entry)
    return out


def format_measured(result: dict) -> str:
    """Plain-text table of the measured per-rank engine times (max over ranks)."""
    summary = result.get("measured_summary")
    if not summary:
        return ""
    cfg = result["config"]["measure"]
    methods = [m.value for m in PartitionMethod]
    base = [m for m in methods if m != PartitionMethod.BALANCED.value]
    lines = [
        "",
        f"measured: DFS engine, tiny model, CPU, lengths x{cfg['scale']:.4g}; step time = max "
        "over ranks (ms); % = balanced lower than baseline, measured (simulated tree tokens)",
    ]
    hdr = f"{'workload':<8} {'K':>2} {'units':<9} " + " ".join(f"{m[:13]:>13}" for m in methods)
    hdr += " " + " ".join(f"{'vs ' + m[:13]:>19}" for m in base)
    lines.append(hdr)
    for s in summary:
        row = f"{s['workload']:<8} {s['k']:>2} {'groups' if s['keep_groups'] else 'sequences':<9} "
        row += " ".join(f"{1e3 * s['measured_s_' + m]:>13.1f}" for m in methods)
        row += " " + " ".join(
            f"{s['measured_pct_lower_vs_' + m]:>8.1f}% ({s['sim_pct_lower_vs_' + m]:>6.1f}%)"
            for m in base
        )
        lines.append(row)
    return "\n".join(lines)


def run(
    trace_root: str | Path | None,
    ks: Sequence[int] = (2, 4, 8),
    *,
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    keep_groups_modes: Sequence[bool] = (False, True),
    flop: FlopCost | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    measure: MeasureConfig | None = None,
) -> dict:
    """Partitions every step of every workload for each K, cost model and method.

    Returns a JSON-able dict: ``rows`` (one per step x K x cost x mode x method),
    ``summary`` (per workload, K, cost, mode: mean % lower makespan of balanced
    vs each baseline, and the balanced duplication vs its bound) and
    ``headline`` (the % vs greedy-by-tokens averaged over workloads). With
    ``measure``, also ``measured`` rows (per-rank DFS engine seconds on CPU, scaled
    lengths; see ``MeasureConfig``) and their ``measured_summary``.
    """
    flop = FlopCost() if flop is None else flop
    root = Path(trace_root) if trace_root else None
    costs = _cost_models(flop)
    rows = []
    for wl in workloads:
        for sb in _steps(root, wl, max_steps, seed):
            seqs, gids = build_sequences(sb, seed)
            n_groups = len(sb.prompt_lens)
            for k in ks:
                for kg in keep_groups_modes:
                    if k > (n_groups if kg else len(seqs)):
                        continue
                    for cname, cost in costs.items():
                        for method in PartitionMethod:
                            t0 = time.perf_counter()
                            p = partition(
                                seqs, k, method=method, cost=cost, group_ids=gids, keep_groups=kg
                            )
                            rows.append(
                                {
                                    "workload": wl,
                                    "step": sb.step,
                                    "k": k,
                                    "cost": cname,
                                    "keep_groups": kg,
                                    "method": method.value,
                                    "makespan": p.makespan,
                                    "mean_load": p.mean_load,
                                    "imbalance": p.imbalance,
                                    "duplicated_tokens": p.duplicated_tokens,
                                    "duplication_bound": p.duplication_bound,
                                    "global_tree_tokens": p.global_tree_tokens,
                                    "total_tokens": p.total_tokens,
                                    "n_sequences": len(seqs),
                                    "n_groups": n_groups,
                                    "seconds": time.perf_counter() - t0,
                                }
                            )
    summary = _summarise(rows)
    headline = _headline(summary)
    measured = _measure(root, ks, workloads, keep_groups_modes, measure, seed) if measure else []
    return {
        "measured": measured,
        "measured_summary": _summarise_measured(measured),
        "config": {
            "trace_root": str(root) if root else None,
            "synthetic": root is None,
            "ks": list(ks),
            "workloads": list(workloads),
            "keep_groups_modes": list(keep_groups_modes),
            "flop_cost": {"a": flop.a, "b": flop.b},
            "seed": seed,
            "max_steps": max_steps,
            "measure": dataclasses.asdict(measure) if measure else None,
        },
        "rows": rows,
        "summary": summary,
        "headline": headline,
        "target_pct": TARGET_PCT,
    }


def _pct_lower(base: float, ours: float) -> float:
    return 100.0 * (base - ours) / base


def _summarise(rows: list[dict]) -> list[dict]:
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        key = (r["workload"], r["k"], r["cost"], r["keep_groups"])
        by.setdefault(key, {}).setdefault(r["method"], []).append(r)
    out = []
    for (wl, k, cname, kg), methods in by.items():
        bal = methods[PartitionMethod.BALANCED.value]
        entry = {"workload": wl, "k": k, "cost": cname, "keep_groups": kg, "steps": len(bal)}
        for m, rs in methods.items():
            entry[f"makespan_{m}"] = float(np.mean([r["makespan"] for r in rs]))
            entry[f"imbalance_{m}"] = float(np.mean([r["imbalance"] for r in rs]))
            entry[f"dup_pct_{m}"] = float(
                np.mean([100.0 * r["duplicated_tokens"] / r["global_tree_tokens"] for r in rs])
            )
            if m != PartitionMethod.BALANCED.value:
                entry[f"pct_lower_vs_{m}"] = float(
                    np.mean(
                        [
                            _pct_lower(b["makespan"], o["makespan"])
                            for o, b in zip(bal, rs, strict=True)
                        ]
                    )
                )
        entry["balanced_dup_tokens_max"] = int(max(r["duplicated_tokens"] for r in bal))
        entry["balanced_dup_over_bound_max"] = float(
            max(r["duplicated_tokens"] / r["duplication_bound"] for r in bal)
        )
        out.append(entry)
    return out


def _headline(summary: list[dict]) -> dict:
    """Mean over workloads of % lower makespan (balanced vs greedy_tokens), per cost/mode/K."""
    key = f"pct_lower_vs_{PartitionMethod.GREEDY_TOKENS.value}"
    out: dict = {}
    for cname in sorted({s["cost"] for s in summary}):
        for kg in sorted({s["keep_groups"] for s in summary}):
            sel = [s for s in summary if s["cost"] == cname and s["keep_groups"] == kg]
            if not sel:
                continue
            per_k = {
                str(k): float(np.mean([s[key] for s in sel if s["k"] == k]))
                for k in sorted({s["k"] for s in sel})
            }
            mean = float(np.mean([s[key] for s in sel]))
            out[f"{cname}/{'groups' if kg else 'sequences'}"] = {
                "per_k": per_k,
                "mean": mean,
                "meets_target": mean >= TARGET_PCT,
            }
    return out


def format_table(result: dict) -> str:
    """Plain-text tables: per workload and K, balanced vs each baseline."""
    methods = [m.value for m in PartitionMethod]
    base = [m for m in methods if m != PartitionMethod.BALANCED.value]
    lines = []
    for cname in sorted({s["cost"] for s in result["summary"]}):
        for kg in sorted({s["keep_groups"] for s in result["summary"]}):
            sel = [s for s in result["summary"] if s["cost"] == cname and s["keep_groups"] == kg]
            if not sel:
                continue
            lines.append("")
            lines.append(
                f"cost={cname}  units={'groups' if kg else 'sequences'}  "
                "(makespan mean over steps; % = balanced lower than baseline)"
            )
            hdr = f"{'workload':<8} {'K':>2} " + " ".join(f"{m:>14}" for m in methods)
            hdr += " " + " ".join(f"{'vs ' + m[:11]:>14}" for m in base)
            hdr += f" {'dup% bal':>8} {'dup% tok':>8} {'dup/bnd':>7}"
            lines.append(hdr)
            for s in sel:
                row = f"{s['workload']:<8} {s['k']:>2} "
                row += " ".join(f"{s['makespan_' + m]:>14.1f}" for m in methods)
                row += " " + " ".join(f"{s['pct_lower_vs_' + m]:>13.1f}%" for m in base)
                row += f" {s['dup_pct_balanced']:>7.2f}% {s['dup_pct_greedy_tokens']:>7.2f}%"
                row += f" {s['balanced_dup_over_bound_max']:>7.3f}"
                lines.append(row)
            h = result["headline"][f"{cname}/{'groups' if kg else 'sequences'}"]
            per_k = "  ".join(f"K={k}: {v:.1f}%" for k, v in h["per_k"].items())
            lines.append(
                f"-> balanced vs greedy_tokens, mean over workloads: {per_k}  | all: "
                f"{h['mean']:.1f}% (target >= {TARGET_PCT:.0f}%: "
                f"{'met' if h['meets_target'] else 'MISSED'})"
            )
    lines.append(
        "dup% = duplicated tokens / global tree tokens; dup/bnd = max over steps of "
        "balanced duplicated / ((K-1) max_len)"
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
        "--workloads",
        nargs="+",
        default=list(DEFAULT_WORKLOADS),
        choices=sorted(_PACKED | _MULTITURN),
    )
    p.add_argument("--max-steps", type=int, default=None, help="steps per workload (all)")
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
    root = None if args.synthetic else (args.polytrace or _default_root())
    result = run(
        root,
        tuple(args.ks),
        workloads=tuple(args.workloads),
        flop=FlopCost(a=1.0, b=args.flop_b),
        max_steps=args.max_steps,
        seed=args.seed,
        measure=MeasureConfig(
            scale=args.measure_scale, steps=args.measure_steps, repeats=args.measure_repeats
        )
        if args.measure
        else None,
    )
    print(f"traces: {root if root else 'synthetic (no PolyTrace directory)'}")
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
    p = argparse.ArgumentParser(prog="python -m dtarl.parallel.bench_partition")
    _add_arguments(p)
    _main(p.parse_args(argv))


def iter_batches(trace_root: str | Path | None, workload: str) -> Iterator[tuple[list, np.ndarray]]:
    """(sequences, group_ids) per step of a workload, for notebooks and other benches."""
    for sb in _steps(Path(trace_root) if trace_root else None, workload, None, 0):
        yield build_sequences(sb)


if __name__ == "__main__":
    main()
