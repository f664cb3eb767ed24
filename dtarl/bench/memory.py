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

import json
from collections.abc import Callable, Sequence

from flax import nnx

from dtarl.engines.prefix_reuse import capacity_frontier, format_table, memory_report
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.testing import grpo_groups

MiB = 2**20


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


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "memory",
        help="compiled peak memory of dense vs prefix_reuse; the capacity frontier",
        description=__doc__,
    )
    p.add_argument("--model", default="tiny", help=f"preset, one of {ModelConfig.PRESETS}")
    p.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (peak table)")
    p.add_argument("--response", type=int, default=96, help="response tokens (peak table)")
    p.add_argument("--microbatch", type=int, help="dense / suffix microbatch (default: G)")
    p.add_argument("--budget-mib", type=float, nargs="+", default=[64.0])
    p.add_argument("--frontier-group", type=int, default=8, help="G of the frontier's group")
    p.add_argument("--prompt-ratio", type=int, default=4, help="frontier prompt / response")
    p.add_argument("--max-response", type=int, default=4096)
    p.add_argument("--resolution", type=int, default=8)
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=_main)


def _main(args) -> int:
    res = run(
        model_cfg=ModelConfig.preset(args.model),
        group_sizes=args.group_sizes,
        prompt=args.prompt,
        response=args.response,
        microbatch=args.microbatch,
        budgets_mib=args.budget_mib,
        frontier_group=args.frontier_group,
        prompt_ratio=args.prompt_ratio,
        max_response=args.max_response,
        resolution=args.resolution,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(res, model=args.model), f, indent=1)
        print(f"\nwrote {args.json}")
    return 0
