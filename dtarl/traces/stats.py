"""Per-step workload statistics of a trace (pure functions over records).

Tree statistics use the structure only (no trie): a GRPO group costs
``prompt + sum(responses)`` tree tokens versus ``G * prompt + sum(responses)``
dense; in the per-turn view each turn's sample is a prefix of the next, so a
trajectory costs its longest per-turn sample once in the tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from dtarl.traces.records import PromptGroup, Trajectory
from dtarl.traces.workload import group_trajectories


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthStats:
    n: int
    mean: float
    std: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values) -> LengthStats:
        a = np.asarray(values, np.float64).reshape(-1)
        if a.size == 0:
            nan = float("nan")
            return cls(n=0, mean=nan, std=nan, p50=nan, p90=nan, p99=nan, max=nan)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(
            n=int(a.size),
            mean=float(a.mean()),
            std=float(a.std()),
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
            max=float(a.max()),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeStats:
    """dense = tokens of the sequences laid out one by one; tree = prefix-tree tokens."""

    dense_tokens: int
    tree_tokens: int

    @property
    def ideal_speedup(self) -> float:
        return self.dense_tokens / max(self.tree_tokens, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepStats:
    """Everything the report shows for one step of one run.

    inputs: per group prompt lengths; outputs: per response lengths (all samples);
    sample_inputs: the prompt length of each entry of ``outputs``.
    intra_std / intra_max_over_mean: per group std and max/mean of its response lengths.
    Multi-turn extras (empty for single-turn): turns, tool_calls per trajectory,
    tool latencies, per-turn completion tokens, per-turn request inputs.
    """

    step: int
    num_groups: int
    inputs: np.ndarray
    outputs: np.ndarray
    sample_inputs: np.ndarray
    intra_std: np.ndarray
    intra_max_over_mean: np.ndarray
    truncation_rate: float
    tree: TreeStats
    per_turn_tree: TreeStats | None = None
    turns: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    tool_calls: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    tool_latency_s: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    turn_completion: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    # ``generated_text_token_len`` of the turns that record it (the paper's search output)
    turn_generated_text: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    turn_request_input: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


def _intra(groups_out: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    std = np.array([g.std() for g in groups_out])
    ratio = np.array([g.max() / g.mean() if g.mean() > 0 else 1.0 for g in groups_out])
    return std, ratio


def single_turn_step_stats(step: int, recs: Iterable[PromptGroup], run_max: int) -> StepStats:
    """Stats of one packed-length step; responses equal to ``run_max`` count as truncated."""
    recs = list(recs)
    outs = [np.asarray(r.output, np.float64) for r in recs]
    flat = np.concatenate(outs) if outs else np.zeros(0)
    std, ratio = _intra(outs)
    return StepStats(
        step=step,
        num_groups=len(recs),
        inputs=np.array([r.input for r in recs], np.float64),
        outputs=flat,
        sample_inputs=np.array([r.input for r in recs for _ in r.output], np.float64),
        intra_std=std,
        intra_max_over_mean=ratio,
        truncation_rate=float((flat >= run_max).mean()) if flat.size else 0.0,
        tree=TreeStats(
            dense_tokens=sum(r.dense_tokens for r in recs),
            tree_tokens=sum(r.tree_tokens for r in recs),
        ),
    )


def multi_turn_step_stats(step: int, recs: Iterable[Trajectory]) -> StepStats:
    """Stats of one multi-turn step (trajectory and per-turn tree views)."""
    recs = list(recs)
    groups = group_trajectories(recs)
    outs = [np.array([t.final_response_len for t in g], np.float64) for g in groups]
    std, ratio = _intra(outs)
    dense = sum(t.sequence_len for t in recs)
    tree = sum(g[0].prompt_len + sum(t.final_response_len for t in g) for g in groups)
    pt_dense = sum(sum(t.per_turn_lens) for t in recs)
    pt_tree = sum(
        g[0].prompt_len + sum((t.per_turn_lens or (t.prompt_len,))[-1] - t.prompt_len for t in g)
        for g in groups
    )
    return StepStats(
        step=step,
        num_groups=len(groups),
        inputs=np.array([g[0].prompt_len for g in groups], np.float64),
        outputs=np.array([t.final_response_len for t in recs], np.float64),
        sample_inputs=np.array([t.prompt_len for t in recs], np.float64),
        intra_std=std,
        intra_max_over_mean=ratio,
        truncation_rate=float(np.mean([t.truncated for t in recs])) if recs else 0.0,
        tree=TreeStats(dense_tokens=dense, tree_tokens=tree),
        per_turn_tree=TreeStats(dense_tokens=pt_dense, tree_tokens=pt_tree),
        turns=np.array([t.turn_count for t in recs], np.float64),
        tool_calls=np.array([len(t.tool_calls) for t in recs], np.float64),
        tool_latency_s=np.array([c.latency_s for t in recs for c in t.tool_calls], np.float64),
        turn_completion=np.array([u.completion_tokens for t in recs for u in t.turns], np.float64),
        turn_generated_text=np.array(
            [
                u.generated_text_token_len
                for t in recs
                for u in t.turns
                if u.generated_text_token_len is not None
            ],
            np.float64,
        ),
        turn_request_input=np.array(
            [u.generation_prompt_len for t in recs for u in t.turns], np.float64
        ),
    )
