"""``dtarl bench memory``: compiled peak memory of dense vs prefix_reuse, and the
capacity frontier (the most tokens trainable under a memory budget).

Both tables come from XLA's memory analysis of the compiled programs
(``compiled.memory_analysis()``: arguments + outputs + temporaries - aliased);
nothing runs, so the numbers do not depend on the machine's load.

1. Peak per GRPO group size G (one group, prompt ``--prompt``, responses of
   ``--response`` tokens): the whole dense program, the whole prefix_reuse
   program (prefix activations rematerialised) and prefix_reuse's suffix phase
   alone (the paper's "Phase-B peak"), with the same microbatch (dense sequences
   = suffix rows = ``--microbatch``, default the whole group).
2. The capacity frontier at each ``--budget-mib``: per engine the longest
   response R (prompt = ``--prompt-ratio`` x R, G sequences) whose program fits
   the budget, found by doubling then bisection (to ``--resolution`` tokens), and
   the total tokens it trains relative to dense.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flax import nnx

from dtarl.batch import RolloutBatch
from dtarl.bench import report
from dtarl.engines.dense import DenseEngine
from dtarl.engines.prefix_reuse import PrefixActivations, PrefixReuseEngine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.model.decoder import Decoder
from dtarl.testing import grpo_groups

MiB = 2**20


def peak_bytes(mem) -> int:
    """Peak device bytes of a compiled program: arguments + outputs + temporaries - aliased."""
    return int(
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )


def memory_report(
    model: Decoder, params, batch: RolloutBatch, loss, *, microbatch: int = 8, whole: bool = True
):
    """Compiled peak memory (XLA memory analysis, bytes) of dense vs prefix_reuse on
    one batch, with the same microbatch size (dense sequences = suffix rows).

    Keys: ``dense`` (whole dense program), ``prefix_reuse`` (whole program, REMAT
    prefix), ``suffix_phase`` (phase B alone), each with ``peak`` and ``temp``,
    and ``suffix_vs_dense`` = 1 - suffix peak / dense peak (the paper's
    "Phase-B peak HBM reduction"). ``whole=False`` skips compiling the whole
    prefix_reuse program.
    """
    dense = DenseEngine(model, microbatch=microbatch)
    pr = PrefixReuseEngine(model, microbatch=microbatch, prefix_activations=PrefixActivations.REMAT)
    programs = dict(
        dense=lambda: dense.compiled_memory(params, batch, loss),
        suffix_phase=lambda: pr.suffix_phase_memory(params, batch, loss),
    )
    if whole:
        programs["prefix_reuse"] = lambda: pr.compiled_memory(params, batch, loss)
    out = {}
    for key, compile_ in programs.items():
        mem = compile_()
        out[key] = dict(peak=peak_bytes(mem), temp=int(mem.temp_size_in_bytes))
    out["suffix_vs_dense"] = 1.0 - out["suffix_phase"]["peak"] / out["dense"]["peak"]
    if whole:
        out["whole_vs_dense"] = 1.0 - out["prefix_reuse"]["peak"] / out["dense"]["peak"]
    return out


def capacity_frontier(
    model: Decoder,
    params,
    loss,
    *,
    budget_bytes: int,
    group_size: int = 8,
    prompt_ratio: int = 4,
    microbatch: int | None = None,
    engines: tuple[str, ...] = ("dense", "prefix_reuse"),
    max_response: int = 4096,
    resolution: int = 8,
) -> list[dict]:
    """The largest trainable batch under a memory budget, per engine.

    One GRPO group of ``group_size`` sequences, prompt = ``prompt_ratio`` x response
    length; dense and prefix_reuse use the same ``microbatch`` (default: the whole
    group). For each engine, the response length R is grown (doubling, then
    bisection to ``resolution`` tokens) while the compiled program's peak
    (``peak_bytes``) stays within ``budget_bytes``. Only compiles, never runs.

    Returns one row per engine: engine, prompt_len, response_len, total_tokens
    (= group_size * (prompt + response)), peak_bytes, and ``gain`` (total tokens
    relative to the first engine's).
    """
    mb = microbatch or group_size

    def peak(kind: str, r: int) -> int:
        batch = grpo_groups(
            num_groups=1, group_size=group_size, prompt_len=prompt_ratio * r, response_len=r
        )
        if kind == "dense":
            engine = DenseEngine(model, microbatch=mb)
        elif kind == "prefix_reuse":
            engine = PrefixReuseEngine(
                model, microbatch=mb, prefix_activations=PrefixActivations.REMAT
            )
        else:
            raise ValueError(f"capacity_frontier: engine {kind!r}; accepted: dense, prefix_reuse")
        return peak_bytes(engine.compiled_memory(params, batch, loss))

    rows = []
    for kind in engines:
        lo, lo_peak, hi = 0, 0, None
        r = resolution
        while r <= max_response:  # doubling
            p = peak(kind, r)
            if p > budget_bytes:
                hi = r
                break
            lo, lo_peak = r, p
            r *= 2
        if hi is not None:
            while hi - lo > resolution:  # bisection
                mid = (lo + hi) // 2
                p = peak(kind, mid)
                if p > budget_bytes:
                    hi = mid
                else:
                    lo, lo_peak = mid, p
        rows.append(
            dict(
                engine=kind,
                prompt_len=prompt_ratio * lo,
                response_len=lo,
                total_tokens=group_size * (prompt_ratio + 1) * lo,
                peak_bytes=lo_peak,
            )
        )
    first = rows[0]["total_tokens"] if rows else 0
    for row in rows:
        row["gain"] = row["total_tokens"] / first if first else float("nan")
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table of a list of same-keyed dicts (for the bench command)."""
    if not rows:
        return ""
    keys = list(rows[0])

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    columns = [report.Column(title=k) for k in keys]
    return "\n".join(
        report.text_table(columns, [[fmt(r[k]) for k in keys] for r in rows], sep="  ")
    )


def run(
    *,
    model_cfg: ModelConfig | None = None,
    group_sizes: Sequence[int] = (4, 8, 16),
    prompt: int = 512,
    response: int = 96,
    microbatch: int | None = None,
    budgets_mib: Sequence[float] = (64.0,),
    frontier_group: int = 8,
    prompt_ratio: int = 4,
    max_response: int = 4096,
    resolution: int = 8,
    log: Callable[[str], None] = print,
) -> dict:
    """Both tables (module docstring); returns them as lists of rows."""
    checks = (
        ("prompt", prompt),
        ("response", response),
        ("resolution", resolution),
        ("frontier-group", frontier_group),
        ("prompt-ratio", prompt_ratio),
        ("max-response", max_response),
        ("microbatch", 1 if microbatch is None else microbatch),
    )
    for name, v in checks:
        if v < 1:
            raise ValueError(f"--{name}={v}: must be >= 1")
    if not group_sizes or min(group_sizes) < 1:
        raise ValueError(f"--group-sizes={list(group_sizes)}: each must be >= 1")
    if not budgets_mib or min(budgets_mib) <= 0:
        raise ValueError(f"--budget-mib={list(budgets_mib)}: each must be > 0")
    cfg = model_cfg or ModelConfig.tiny()
    model = init_model(cfg, seed=0)
    params = nnx.split(model, nnx.Param)[1]
    loss = ClippedSurrogateLoss.grpo()

    peaks = []
    for g in group_sizes:
        batch = grpo_groups(num_groups=1, group_size=g, prompt_len=prompt, response_len=response)
        rep = memory_report(model, params, batch, loss, microbatch=microbatch or g)
        peaks.append(
            dict(
                G=g,
                tokens=batch.num_tokens,
                dense_MiB=rep["dense"]["peak"] / MiB,
                prefix_reuse_MiB=rep["prefix_reuse"]["peak"] / MiB,
                suffix_phase_MiB=rep["suffix_phase"]["peak"] / MiB,
                suffix_vs_dense=rep["suffix_vs_dense"],
                whole_vs_dense=rep["whole_vs_dense"],
            )
        )
    log(
        f"Compiled peak memory, one GRPO group, prompt {prompt}, responses {response} "
        "(suffix_vs_dense = 1 - suffix-phase peak / dense peak):"
    )
    log(format_table(peaks))

    frontier = []
    for budget in budgets_mib:
        rows = capacity_frontier(
            model,
            params,
            loss,
            budget_bytes=int(budget * MiB),
            group_size=frontier_group,
            prompt_ratio=prompt_ratio,
            microbatch=microbatch,
            max_response=max_response,
            resolution=resolution,
        )
        for r in rows:
            frontier.append(
                dict(
                    budget_MiB=budget,
                    engine=r["engine"],
                    prompt_len=r["prompt_len"],
                    response_len=r["response_len"],
                    total_tokens=r["total_tokens"],
                    peak_MiB=r["peak_bytes"] / MiB,
                    gain=r["gain"],
                )
            )
    log(
        f"\nCapacity frontier: one GRPO group of {frontier_group}, prompt = {prompt_ratio} x "
        f"response, the longest response whose program fits the budget (to {resolution} "
        f"tokens; capped at {max_response}); gain = total tokens / dense's:"
    )
    log(format_table(frontier))
    return {"peaks": peaks, "frontier": frontier}


__all__ = ["capacity_frontier", "format_table", "memory_report", "peak_bytes", "run"]
