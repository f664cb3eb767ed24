"""``dtarl bench plan``: host planning seconds of the DFS engine, per 1k sequences.

Builds a seeded synthetic GRPO batch (``prompts`` x ``group`` sequences; prompt
lengths around ``prompt_len``, response lengths log-normal around
``response_len`` with a long tail, capped at ``max_response``) and times, side by
side in interleaved rounds (``dtarl.timing``), the three host stages of the DFS
engine's ``prepare``: the trie (``build_tree``), the greedy child order
(``child_order``) and the plan (``compile_plan``), with the engine's default
settings (``DFSConfig``) and a model preset's FLOPs per token. ``compile_plan``
includes its own child order, as in the engine. With ``reference`` the
pure-Python reference compiler (``compile_plan_reference``, the same plan bit
for bit) is timed in the same rounds.

Also reports the plan's host bytes: ``padded`` (every per-step array as the
device program takes it, padded to the widest op), ``filled`` (the entries a
step really uses) and ``compact`` (``SegmentPlan``'s ragged storage).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dtarl import timing
from dtarl.engines.config import DFSConfig
from dtarl.model import ModelConfig
from dtarl.tree import plan as plan_lib
from dtarl.tree.order import child_order
from dtarl.tree.plan_reference import compile_plan_reference
from dtarl.tree.trie import build_tree


def grpo_sequences(
    *,
    prompts: int,
    group: int,
    prompt_len: int,
    response_len: int,
    max_response: int,
    vocab: int = 151_936,
    seed: int = 0,
) -> list[np.ndarray]:
    """``prompts * group`` token arrays: each group's responses share one prompt.

    Prompt lengths ~ N(prompt_len, prompt_len / 8); response lengths log-normal
    with median ``response_len`` and sigma 0.8 (a long tail), in [1, max_response].
    """
    rs = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        p = int(np.clip(rs.normal(prompt_len, prompt_len / 8), 2, None))
        prompt = rs.integers(3, vocab, p, dtype=np.int32)
        for _ in range(group):
            n = int(np.clip(rs.lognormal(np.log(response_len), 0.8), 1, max_response))
            out.append(np.concatenate([prompt, rs.integers(3, vocab, n, dtype=np.int32)]))
    return out


def plan_bytes(plan: plan_lib.SegmentPlan) -> dict[str, int]:
    """Host bytes of a plan: padded (the device program's arrays), filled (entries in
    use, plus the per-step and slot arrays) and compact (the plan's own storage)."""
    per_step = sum(a.nbytes for a in (plan.op, plan.start, plan.pbucket))
    slot_bytes = plan.slots.nbytes + plan.slot_seg.nbytes
    entries = plan.num_entries
    return dict(
        padded=int(per_step + slot_bytes + 5 * plan.op.shape[0] * plan.width * 4),
        filled=int(per_step + slot_bytes + 5 * entries * 4),
        compact=int(plan.host_nbytes),
    )


def run(
    *,
    prompts: int = 64,
    group: int = 8,
    prompt_len: int = 512,
    response_len: int = 2048,
    max_response: int = 16384,
    chunk_len: int = 128,
    model: str = "qwen3_0p6b",
    rounds: int = 3,
    reference: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    seqs = grpo_sequences(
        prompts=prompts,
        group=group,
        prompt_len=prompt_len,
        response_len=response_len,
        max_response=max_response,
        seed=seed,
    )
    cfg = ModelConfig.preset(model)
    dfs = DFSConfig(chunk_len=chunk_len)
    tree = build_tree(seqs)
    kw = dict(
        chunk_len=dfs.chunk_len,
        order=dfs.order,
        pack_leaves=dfs.pack_leaves,
        rows=dfs.leaf_rows,
        wide=dfs.wide_chunks,
        token_flops=cfg.flops_per_token,
        wide_slack=dfs.wide_slack,
        prefix_levels=dfs.prefix_levels,
    )
    runs = {
        "trie": lambda: build_tree(seqs),
        "order": lambda: child_order(tree, dfs.order, chunk_len=dfs.chunk_len),
        "compile_plan": lambda: plan_lib.compile_plan(tree, **kw),
    }
    if reference:
        runs["compile_plan_reference"] = lambda: compile_plan_reference(tree, **kw)
    timed = timing.interleaved_rounds(
        runs, timing.Rounds(rounds=rounds, order=timing.alternating, warmup=False)
    )
    plan = plan_lib.compile_plan(tree, **kw)
    n = len(seqs)
    seconds = {k: v.median for k, v in timed.items()}
    return dict(
        sequences=n,
        tokens=int(tree.stats.num_tokens),
        tree_tokens=int(tree.stats.tree_tokens),
        chunk_len=chunk_len,
        steps=int(plan.num_steps),
        padded_steps=int(plan.op.shape[0]),
        width=int(plan.width),
        seconds=seconds,
        seconds_per_1k={k: v * 1000.0 / n for k, v in seconds.items()},
        bytes=plan_bytes(plan),
        machine=timing.machine_info(),
    )


def format_report(res: dict[str, Any]) -> str:
    b = res["bytes"]
    lines = [
        f"{res['sequences']} sequences, {res['tokens']:,} tokens ({res['tree_tokens']:,} in "
        f"the tree), chunk {res['chunk_len']}: {res['steps']} steps "
        f"(padded {res['padded_steps']}), entries per step {res['width']}",
        f"{'stage':<24}{'seconds':>10}{'s / 1k seqs':>14}",
    ]
    for k, s in res["seconds"].items():
        lines.append(f"{k:<24}{s:>10.3f}{res['seconds_per_1k'][k]:>14.3f}")
    lines.append(
        f"plan host bytes: padded {b['padded'] / 2**20:,.1f} MiB, filled "
        f"{b['filled'] / 2**20:,.1f} MiB ({b['filled'] / max(b['padded'], 1):.0%}), "
        f"compact {b['compact'] / 2**20:,.1f} MiB"
    )
    return "\n".join(lines)


__all__ = ["format_report", "grpo_sequences", "plan_bytes", "run"]
