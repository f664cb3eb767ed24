"""The multi-turn rollout: problems -> ``Trajectory`` records, on any ``Rollout`` sampler.

    prompt -> turn 0 -> [tool output -> turn 1 -> ...]   (loss on the turns only)

A turn that stopped on a tool-call marker (``tool_stop_sequences``) gets the task's
tool output appended and continues. How a turn continues is the sampler's
``Feature.EXTEND``: with it, one ``generate`` call runs every turn (``on_turn``
appends the tool tokens to the sample's own K/V); without it, each turn is one
``generate`` call over the distinct histories (samples that made the same calls share
one prefill). ``process_rollout`` shards a rollout over the processes of a
multi-process run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dtarl.errors import ConfigError
from dtarl.parallel.sharded import allgather_objects
from dtarl.rl.tasks import Problem, Task
from dtarl.rollout.protocol import Feature, Rollout, features_of, require
from dtarl.rollout.sampler import FinishReason, SamplerError, SampleResult
from dtarl.rollout.stream import ScoreKind, Stream


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Trajectory:
    """One sample: prompt, then assistant turns and tool outputs, as tokens.

    ``loss_mask`` is 1 on assistant tokens only; ``old_logprobs`` holds the
    sampler's ``raw_logprobs`` there (log softmax(logits / T) at the sampling
    temperature T, untruncated; T = 1 when greedy), 0 elsewhere: the logprobs the
    training engine, built with the same temperature, recomputes.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    prompt_len: int
    response_len: int  # assistant tokens
    completion: str  # decoded text after the prompt (assistant + tool)
    truncated: bool  # the last turn hit its length limit (or it was cancelled)
    num_turns: int
    problem_index: int
    cancelled: bool = False  # stopped by a group's early stop (DARTS tail pruning)
    finish_rank: int = -1  # order in which the engine finished it (-1: not recorded)
    ref_logprobs: np.ndarray | None = None  # streamed reference logprobs (0 on the prompt)
    values: np.ndarray | None = None  # streamed critic values V[t] (0 on the prompt)


def encode_prompt(tokenizer, text: str) -> np.ndarray:
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(text)
    return np.asarray(ids, np.int32)


def problem_ids(tokenizer, problem: Problem) -> np.ndarray:
    """A problem's prompt tokens: its ``prompt_ids`` (a dataset row's, chat template
    applied) or ``encode_prompt`` of its text."""
    if problem.prompt_ids is not None:
        return np.asarray(problem.prompt_ids, np.int32)
    return encode_prompt(tokenizer, problem.prompt)


def tool_stop_sequences(tokenizer, task: Task) -> tuple[tuple[int, ...], ...]:
    """The task's tool-call markers (``task.stop_strings``) as token id sequences of the
    run's tokenizer, any length: the sampler stops a turn when its generated ids end
    with one (``SamplingParams.stop_sequences``), and ``rollout`` then calls the tool.
    A marker is matched as the tokenizer encodes it alone, so pick one that the model's
    text tokenises the same way (a special token, or text after a token boundary)."""
    out = []
    for i, s in enumerate(task.stop_strings):
        where = f"task stop string [{i}] {s!r}"
        if not isinstance(s, str) or not s:
            raise ConfigError(f"{where}: must be a non-empty string")
        try:
            ids = tuple(int(t) for t in tokenizer.encode(s))
        except ValueError as e:
            raise ConfigError(f"{where} cannot be encoded: {e}") from None
        if not ids:
            raise ConfigError(f"{where} encodes to no tokens with this tokenizer")
        out.append(ids)
    return tuple(out)


def ends_with_any(tokens: np.ndarray, sequences) -> bool:
    """True when ``tokens`` end with one of the id ``sequences``."""
    tk = [int(t) for t in tokens]
    return any(len(sq) <= len(tk) and tuple(tk[len(tk) - len(sq) :]) == sq for sq in sequences)


class Turns:
    """The turns of ``len(owner)`` samples (sample i of problem ``owner[i]``), as they
    end: ``turn`` records one and returns the tool output to continue with (or None),
    ``trajectories`` assembles them."""

    def __init__(self, tokenizer, task: Task, problems: Sequence[Problem], owner: np.ndarray):
        self.tokenizer, self.task, self.problems, self.owner = tokenizer, task, problems, owner
        self.tool_seqs = tool_stop_sequences(tokenizer, task)
        self.prompts = [problem_ids(tokenizer, p) for p in problems]
        n = int(owner.size)
        self.parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.turns = np.zeros(n, np.int64)

    def history(self, row: int) -> np.ndarray:
        return np.concatenate([self.prompts[self.owner[row]]] + [p[0] for p in self.parts[row]])

    def turn(self, row: int, tokens, raw_logprobs, finish: FinishReason) -> np.ndarray | None:
        """A ``TurnFn``: records sample ``row``'s turn; a turn that stopped on a tool-call
        marker before the task's last turn gets the tool's output (masked out of the
        loss) appended, and its ids are returned to continue with."""
        tk = np.asarray(tokens, np.int32)
        self.parts[row].append((tk, np.ones(tk.shape, np.float32), np.asarray(raw_logprobs)))
        self.turns[row] += 1
        if not (
            finish is FinishReason.STOP
            and ends_with_any(tk, self.tool_seqs)
            and self.turns[row] < self.task.max_turns
        ):
            return None
        text = self.tokenizer.decode(tk.tolist())
        out = self.task.tool(self.problems[self.owner[row]], self.text[row] + text)
        if out is None:
            return None
        ids = np.asarray(self.tokenizer.encode(out), np.int32)
        zeros = np.zeros(ids.shape, np.float32)
        self.parts[row].append((ids, zeros, zeros))
        self.text[row] += text + out
        return ids

    def trajectories(self, finish: np.ndarray) -> list[Trajectory]:
        """One ``Trajectory`` per sample; ``finish``: each sample's last turn's reason."""
        out = []
        for row, parts in enumerate(self.parts):
            p = self.prompts[self.owner[row]]
            toks = np.concatenate([p] + [x[0] for x in parts]).astype(np.int32)
            mask = np.concatenate([np.zeros(p.shape, np.float32)] + [x[1] for x in parts])
            old = np.concatenate([np.zeros(p.shape, np.float32)] + [x[2] for x in parts])
            reason = FinishReason(int(finish[row]))
            out.append(
                Trajectory(
                    tokens=toks,
                    loss_mask=mask,
                    old_logprobs=old.astype(np.float32),
                    prompt_len=int(p.shape[0]),
                    response_len=int(mask.sum()),
                    completion=self.tokenizer.decode(toks[p.shape[0] :].tolist()),
                    truncated=reason in (FinishReason.LENGTH, FinishReason.CANCELLED),
                    num_turns=int(self.turns[row]),
                    problem_index=int(self.owner[row]),
                    cancelled=reason is FinishReason.CANCELLED,
                )
            )
        return out


def rollout(
    sampler: Rollout,
    weights,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    group_size: int,
    key: jax.Array,
    counts: Sequence[int] | None = None,
    early_stop: Sequence[bool] | None = None,
    stream: Sequence[Stream] = (),
    index_offset: int = 0,
    on_call: Callable[[Any, Any], Any] | None = None,
) -> tuple[list[Trajectory], dict[str, Any]]:
    """Samples ``group_size`` trajectories per problem, running tool turns (multi-turn
    tasks; ``sampler`` must stop on ``tool_stop_sequences``).

    DARTS: ``counts[i]`` candidates of problem i instead, and problems with
    ``early_stop[i]`` cancel their other candidates once ``group_size`` of them
    completed (``Feature.CANDIDATES``). ``stream``: forward-only models scored while
    generation goes on (``Feature.STREAM``); the trajectories carry the results
    (``ref_logprobs``, ``values``; 0 on the prompt). ``index_offset``: ``problems``
    are the problems ``index_offset, index_offset + 1, ...`` of a larger batch (a
    process's share, ``process_rollout``), keyed as there (``Feature.SHARE``;
    ``problem_index`` stays local). ``on_call``: the sampler's hook between decode
    calls, e.g. PAT's controller (``Feature.SWITCH``). A sampler without the feature
    an argument needs raises ``SamplerError`` naming it.
    """
    if index_offset < 0:
        raise SamplerError(f"index_offset={index_offset}: must be >= 0")
    asked = {
        "on_call": (on_call is not None, Feature.SWITCH),
        "index_offset": (index_offset != 0, Feature.SHARE),
        "counts (DARTS candidate counts)": (counts is not None, Feature.CANDIDATES),
        "early_stop": (early_stop is not None, Feature.CANDIDATES),
        "stream (rollout.streaming)": (bool(stream), Feature.STREAM),
    }
    for argument, (used, feature) in asked.items():
        if used:
            require(sampler, feature, argument)
            require(sampler, Feature.EXTEND, argument)  # every feature rides one call
    counts = [group_size] * len(problems) if counts is None else [int(c) for c in counts]
    turns = Turns(tokenizer, task, problems, np.repeat(np.arange(len(problems)), counts))
    if Feature.EXTEND not in features_of(sampler):
        return _rollout_reprefill(sampler, weights, turns, key)
    res = sampler.generate(
        weights,
        turns.prompts,
        num_samples=counts,
        seed=key,
        **({"index_offset": index_offset} if index_offset else {}),
        **({"on_call": on_call} if on_call is not None else {}),
        **({"early_stop": [group_size * bool(e) for e in early_stop]} if early_stop else {}),
        **({"stream": stream} if stream else {}),
        **({"on_turn": turns.turn} if task.max_turns > 1 else {}),
    )
    if task.max_turns == 1:  # one turn each: recorded from the result
        for row, tk in enumerate(res.tokens):
            turns.turn(row, tk, res.raw_logprobs[row], FinishReason(int(res.finish[row])))
    trajs = turns.trajectories(res.finish)
    if res.finish_rank is not None:
        trajs = [
            dataclasses.replace(t, finish_rank=int(r))
            for t, r in zip(trajs, res.finish_rank, strict=True)
        ]
    if res.streamed:
        trajs = _with_streamed(trajs, res.streamed)
    return trajs, _rollout_stats(res.stats)


def _rollout_stats(st: dict[str, Any]) -> dict[str, Any]:
    """A one-call rollout's stats from its ``SampleResult.stats`` (``engine_stats``)."""
    out = dict(
        rollout_seconds=st["engine_seconds"],
        rollout_tokens=st["generated_tokens"],
        rollout_tokens_per_s=st["tokens_per_second"],
        rollout_slot_utilisation=st["slot_utilisation"],
        rollout_peak_kv_bytes=float(st["peak_kv_bytes"]),
        decode_calls=st["decode_calls"],
        decode_seconds_per_step=sum(c[0] for c in st["decode_calls"]) / max(st["decode_steps"], 1),
        decode_slots=st["rows"],  # the DARTS cost model's schedule
    )
    for name in ("stream_tokens", "stream_lag_tokens", "stream_tail_seconds", "stream_seconds"):
        if name in st:
            out[name] = st[name]
    return out


def _rollout_reprefill(
    sampler: Rollout, weights, turns: Turns, key: jax.Array
) -> tuple[list[Trajectory], dict[str, Any]]:
    """``rollout`` without ``Feature.EXTEND``: turn t is one ``generate`` call (seed
    ``fold_in(key, t)``) over the distinct histories of the samples still going."""
    n = int(turns.owner.size)
    finish = np.full(n, int(FinishReason.RUNNING), np.int64)
    active = list(range(n))
    gen_tokens, seconds = 0, 0.0
    for t in range(turns.task.max_turns):
        if not active:
            break
        histories: dict[bytes, tuple[np.ndarray, list[int]]] = {}
        for row in active:
            h = turns.history(row)
            histories.setdefault(h.tobytes(), (h, []))[1].append(row)
        uniq = list(histories.values())
        res: SampleResult = sampler.generate(
            weights,
            [h for h, _ in uniq],
            num_samples=[len(rs) for _, rs in uniq],
            seed=jax.random.fold_in(key, t),
        )
        gen_tokens += res.stats["generated_tokens"]
        seconds += res.stats["seconds"]
        rows = [r for _, rs in uniq for r in rs]
        active = []
        for j, row in enumerate(rows):
            finish[row] = int(res.finish[j])
            reason = FinishReason(int(res.finish[j]))
            if turns.turn(row, res.tokens[j], res.raw_logprobs[j], reason) is not None:
                active.append(row)
    stats = dict(
        rollout_seconds=seconds,
        rollout_tokens=gen_tokens,
        rollout_tokens_per_s=gen_tokens / max(seconds, 1e-9),
    )
    return turns.trajectories(finish), stats


def _with_streamed(trajs: list[Trajectory], streamed) -> list[Trajectory]:
    """The streamed scores on each trajectory's tokens (0 on the prompt)."""

    def scores(kind: ScoreKind, i: int, t: Trajectory) -> np.ndarray | None:
        if kind not in streamed:
            return None
        got = streamed[kind][i]
        end = t.prompt_len + got.size
        # A last tool output with no room for another turn is not streamed: it is
        # never an action (loss mask 0), so its scores are never read; they are 0.
        if end > t.tokens.size or t.loss_mask[end:].any():
            raise RuntimeError(
                f"streamed {kind.value} of trajectory {i}: {got.size} tokens scored of the "
                f"{t.tokens.size - t.prompt_len} after the prompt"
            )
        out = np.zeros(t.tokens.size, np.float32)
        out[t.prompt_len : end] = got
        return out

    return [
        dataclasses.replace(
            t,
            ref_logprobs=scores(ScoreKind.LOGPROBS, i, t),
            values=scores(ScoreKind.VALUES, i, t),
        )
        for i, t in enumerate(trajs)
    ]


def process_share(n: int, process: int, processes: int) -> tuple[int, int]:
    """``[start, stop)`` of process ``process``'s contiguous share of ``n`` problems
    (sizes differ by at most one; a process gets none when ``n < processes``)."""
    if processes < 1 or not 0 <= process < processes:
        raise ValueError(f"process={process}: need 0 <= process < processes={processes}")
    return n * process // processes, n * (process + 1) // processes


def merge_rollout_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One rollout's stats from its processes' shares (those with problems): seconds and
    peak K/V the slowest / largest process's, tokens summed, slot utilisation
    averaged, decode calls concatenated in process order (every process's DARTS cost
    model then observes the same calls)."""
    out: dict[str, Any] = dict(
        rollout_seconds=max(p["rollout_seconds"] for p in parts),
        rollout_tokens=sum(p["rollout_tokens"] for p in parts),
    )
    out["rollout_tokens_per_s"] = out["rollout_tokens"] / max(out["rollout_seconds"], 1e-9)
    if "rollout_slot_utilisation" in parts[0]:  # a one-call (engine) rollout's
        out.update(
            rollout_slot_utilisation=float(np.mean([p["rollout_slot_utilisation"] for p in parts])),
            rollout_peak_kv_bytes=max(p["rollout_peak_kv_bytes"] for p in parts),
            decode_calls=[c for p in parts for c in p["decode_calls"]],
            decode_slots=parts[0].get("decode_slots"),
            decode_seconds_per_step=max(p["decode_seconds_per_step"] for p in parts),
        )
    for name in ("stream_tokens", "stream_lag_tokens", "stream_tail_seconds", "stream_seconds"):
        if name in parts[0]:
            out[name] = sum(p[name] for p in parts)
    return out


def process_rollout(
    sampler: Rollout,
    weights,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    group_size: int,
    key: jax.Array,
    counts: Sequence[int] | None = None,
    early_stop: Sequence[bool] | None = None,
) -> tuple[list[Trajectory], dict[str, Any]]:
    """``rollout`` sharded over the processes of a multi-process run: each process
    samples the groups of its contiguous share of ``problems`` (``process_share``; whole
    groups, tool turns included) with their global keys (``index_offset``), then the
    trajectories are all-gathered, so that every process returns the whole batch in
    the order (and with the ``problem_index`` values) of ``rollout`` on all of it.
    One process: ``rollout`` itself. Every process must call it with the same
    arguments. Adds ``rollout_processes`` and ``rollout_local_prompts`` (this
    process's share) to the stats.
    """
    procs, me = jax.process_count(), jax.process_index()
    n = len(problems)
    if n == 0:
        raise ValueError("problems: empty (need at least one problem)")
    for name, vals in (("counts", counts), ("early_stop", early_stop)):
        if vals is not None and len(vals) != n:
            raise ValueError(f"{name}: {len(vals)} values for {n} problems (need one each)")
    start, stop = process_share(n, me, procs)
    local: tuple[list[Trajectory], dict[str, Any] | None] = ([], None)
    if stop > start:
        local = rollout(
            sampler,
            weights,
            tokenizer,
            task,
            problems[start:stop],
            group_size=group_size,
            key=key,
            counts=None if counts is None else counts[start:stop],
            early_stop=None if early_stop is None else early_stop[start:stop],
            index_offset=start,
        )
    shares = allgather_objects(
        (start, *local), what=f"gathering the rollout's trajectories ({n} problems)"
    )
    trajs = [
        dataclasses.replace(t, problem_index=t.problem_index + offset)
        for offset, ts, _ in shares
        for t in ts
    ]
    stats = merge_rollout_stats([st for _, _, st in shares if st is not None])
    stats.update(rollout_processes=procs, rollout_local_prompts=stop - start)
    if "decode_calls" in stats:  # per process: its problems [lo, hi) and its decode calls
        stats["decode_calls_per_process"] = [
            (*process_share(n, j, procs), st["decode_calls"])
            for j, (_, _, st) in enumerate(shares)
            if st is not None
        ]
    return trajs, stats


__all__ = [
    "Trajectory",
    "Turns",
    "encode_prompt",
    "problem_ids",
    "ends_with_any",
    "merge_rollout_stats",
    "process_rollout",
    "process_share",
    "rollout",
    "tool_stop_sequences",
]
