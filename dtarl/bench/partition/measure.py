"""Measured per-rank engine time (``--measure``): every rank's sub-batch through
the DFS engine on the tiny model, on this machine, next to its simulated makespan."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dtarl.batch import RolloutBatch
from dtarl.bench.partition.report import (
    REFERENCE,
    VARIANTS,
    format_wins,
    pct_lower,
    variant,
    win_counts,
)
from dtarl.bench.partition.steps import build_sequences, scale_step, select_steps
from dtarl.engines import DFSEngine
from dtarl.losses import MaskedNLLLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel.partition import dfs_order, partition
from dtarl.timing import Rounds, interleaved_rounds


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


class Measurer:
    """Times each rank's sub-batch through a DFS engine on the tiny model (CPU).

    Every rank is prepared with fresh (tight) shape buckets, as if it ran alone;
    compiled programs are shared between ranks whose buckets coincide.
    """

    def __init__(self, cfg: MeasureConfig):
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
        self.model = model
        self._programs: dict = {}  # static -> jitted device program, shared by ranks
        self._warm: set = set()

    def release(self) -> None:
        """Drops the compiled programs (and JAX's caches of them)."""
        self._programs.clear()
        self._warm.clear()
        jax.clear_caches()

    def rank_seconds(self, seqs: list[np.ndarray], ranks: Sequence[np.ndarray]) -> list[float]:
        """min over ``repeats`` (round-robin over ranks) of each rank's engine seconds."""
        runs = []
        for ix in ranks:
            if ix.shape[0] == 0:
                runs.append(None)
                continue
            # A fresh engine: tight buckets, as if this rank ran alone.
            engine = DFSEngine(self.model, chunk_len=self.cfg.chunk_len)
            prep = engine.prepare(
                RolloutBatch.create(tokens=[seqs[i] for i in ix.tolist()]), self.loss
            )
            if prep.static not in self._programs:
                self._programs[prep.static] = jax.jit(engine.device_fn(self.loss, prep.static))
            fn = self._programs[prep.static]
            args = jax.device_put(prep.args)
            key = (prep.static, tuple(np.shape(a) for a in jax.tree.leaves(prep.args)))
            if key not in self._warm:  # compile outside the timed runs
                jax.block_until_ready(fn(self.params, *args))
                self._warm.add(key)
            runs.append((fn, args))
        live = {j: (lambda r=r: r[0](self.params, *r[1])) for j, r in enumerate(runs) if r}
        protocol = Rounds(rounds=self.cfg.repeats)  # round-robin over the ranks
        timed = interleaved_rounds(live, protocol, block=jax.block_until_ready) if live else {}
        return [timed[j].min if j in timed else 0.0 for j in range(len(runs))]


def measure_rows(
    root: Path | None,
    ks: Sequence[int],
    workloads: Sequence[str],
    cfg: MeasureConfig,
    seed: int,
) -> list[dict]:
    """Measured rows: per workload, step, K and variant (method/units; tree-token partition)."""
    m = Measurer(cfg)
    rows = []
    for wl in workloads:
        for sb in select_steps(root, wl, cfg.steps, seed):
            small = scale_step(sb, cfg.scale)
            seqs, gids = build_sequences(small, seed, vocab=m.model_cfg.vocab_size)
            n_groups = len(small.prompt_lens)
            dfs = dfs_order(seqs)
            cache: dict[tuple, list[float]] = {}
            # Programs are shared within one batch only: every rank compiles its own
            # tight buckets, and a run keeping all of them crashed (LLVM ran out of
            # section memory after ~30 min of the default workloads).
            m.release()
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
                            "variant": variant(method, units),
                            "winner": p.winner,
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


def summarise_measured(rows: list[dict]) -> list[dict]:
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
                "wins": win_counts(rs),
            }
            for col, src in (("measured", "measured_max_s"), ("sim", "sim_makespan")):
                e[f"{col}_pct_lower"] = float(
                    np.mean([pct_lower(o[src], b[src]) for b, o in zip(ref, rs, strict=True)])
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
        f"{'measured %':>10} {'sim %':>7}  won",
    ]
    for s in summary:
        for v, e in s["variants"].items():
            lines.append(
                f"{s['workload']:<11} {s['k']:>2} {v:<24} {1e3 * e['measured_s']:>11.1f} "
                f"{e['sim_makespan']:>12.1f} {e['measured_pct_lower']:>9.1f}% "
                f"{e['sim_pct_lower']:>6.1f}%  {format_wins(e['wins'])}"
            )
    return "\n".join(lines)
