"""PolyTrace step batches for the partition bench: read through ``dtarl.traces``
(``load_trace``: validated ``PromptGroup`` / ``Trajectory`` records), synthetic
stand-ins, and the dummy token sequences with their real prefix structure."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dtarl.traces import PromptGroup, RunTrace, Trajectory, load_trace

VOCAB = 32_000


PACKED_RUNS = {
    "math": "verl/profile/packed_length_log/20260610_092349",
    "coding": "rllm/profile/packed_length_log/20260616_024512",
    "video": "verl-video/profile/packed_length_log/20260609_033329",
}


MULTITURN_RUNS = {
    "search": "search_r1/profile/multiturn_workload_log/0617_0223",
    "search_traj": "search_r1/profile/multiturn_workload_log/0617_0223",
}


PER_TURN = {"search"}


WORKLOADS = tuple(sorted(PACKED_RUNS | MULTITURN_RUNS))


DEFAULT_WORKLOADS = ("math", "coding", "search", "search_traj")


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


def _run(trace_root: Path, rel: str) -> RunTrace:
    folder = trace_root / rel
    run = load_trace(folder) if folder.is_dir() else None
    if not isinstance(run, RunTrace) or not run.steps:
        raise FileNotFoundError(f"no step files under {folder}")
    return run


def _model_turn_ends(t: Trajectory) -> tuple[int, ...]:
    """Response-relative end of every model run (mask 1) of a trajectory's loss mask."""
    return tuple(end - t.prompt_len for end in t.per_turn_lens)


def load_steps(trace_root: Path, workload: str) -> list[StepBatch]:
    """Every step of a PolyTrace workload as ``StepBatch``es, read through ``dtarl.traces``
    (validated records; validation samples are left out)."""
    out = []
    if workload in PACKED_RUNS:
        run = _run(trace_root, PACKED_RUNS[workload])
        for step in run.steps:
            rows: list[PromptGroup] = [r for r in run.iter_step(step) if not r.validate]
            out.append(
                StepBatch(
                    workload=workload,
                    step=step,
                    prompt_lens=tuple(r.input for r in rows),
                    response_lens=tuple(tuple(r.output) for r in rows),
                )
            )
    elif workload in MULTITURN_RUNS:
        run = _run(trace_root, MULTITURN_RUNS[workload])
        for step in run.steps:
            groups: dict[int, list[Trajectory]] = {}
            for t in run.iter_step(step):
                if not t.validate:
                    groups.setdefault(t.prompt_group_id, []).append(t)
            keys = sorted(groups)
            # The trained response is final_response_len tokens (the RLE's total;
            # final_total_len can run past a truncated response).
            out.append(
                StepBatch(
                    workload=workload,
                    step=step,
                    prompt_lens=tuple(groups[g][0].prompt_len for g in keys),
                    response_lens=tuple(
                        tuple(t.final_response_len for t in groups[g]) for g in keys
                    ),
                    turn_ends=tuple(tuple(_model_turn_ends(t) for t in groups[g]) for g in keys)
                    if workload in PER_TURN
                    else None,
                )
            )
    else:
        raise ValueError(f"workload={workload!r}: expected one of {list(WORKLOADS)}")
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
        if workload in PER_TURN:
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


def select_steps(trace_root: Path | None, workload: str, max_steps: int | None, seed: int):
    steps = load_steps(trace_root, workload) if trace_root else synthetic_steps(workload, 3, seed)
    return steps[:max_steps] if max_steps else steps


def default_root() -> Path | None:
    for cand in (Path("../shared/polytrace"), Path("/work/shared/polytrace")):
        if cand.is_dir():
            return cand
    return None


def iter_batches(trace_root: str | Path | None, workload: str) -> Iterator[tuple[list, np.ndarray]]:
    """(sequences, group_ids) per step of a workload, for notebooks and other benches."""
    for sb in select_steps(Path(trace_root) if trace_root else None, workload, None, 0):
        yield build_sequences(sb)
