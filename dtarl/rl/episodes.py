"""Episodes: from problems to a training batch.

    rollout -> trajectories -> rewards (+ DAPO overlong shaping) -> dynamic sampling
            -> reference logprobs -> advantages (GRPO groups or PPO's GAE) -> RolloutBatch

``rl_batch`` runs that chain for one RL step; its pieces (``rollout``,
``shaped_rewards``, ``group_advantages``, ``reference_batch`` for SFT, ``Scorer``)
are plain functions usable on their own (see notebooks/).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl import advantages as adv_fns
from dtarl import aot
from dtarl.batch import RolloutBatch
from dtarl.engines.base import logprob_temperature
from dtarl.model.decoder import token_logprobs
from dtarl.parallel.sharded import allgather_objects
from dtarl.rl import darts
from dtarl.rl.config import Algorithm, ConfigError, TrainerConfig
from dtarl.rl.metrics import length_stats
from dtarl.rl.rewards import RewardFn, compute_rewards
from dtarl.rl.tasks import Problem, Role, Task
from dtarl.rl.value import ValueModel
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import Status
from dtarl.rollout.engine import complete as complete_responses
from dtarl.rollout.sampler import FinishReason, Sampler
from dtarl.rollout.stream import ScoreKind, Stream
from dtarl.tree.plan import bucket

# The reference policy's per-token logprobs of a list of sequences.
ReferenceFn = Callable[[Sequence[np.ndarray]], list[np.ndarray]]


# ------------------------------------------------------------ trajectories


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


def single_token(tokenizer, s: str, what: str) -> int:
    ids = tokenizer.encode(s)
    if len(ids) != 1:
        raise ConfigError(
            f"{what} {s!r} encodes to {len(ids)} tokens with this tokenizer; need exactly one"
        )
    return int(ids[0])


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


def rollout(
    sampler: Sampler | ContinuousSampler,
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
) -> tuple[list[Trajectory], dict[str, float]]:
    """Samples ``group_size`` trajectories per problem, running tool turns (multi-turn tasks).

    A turn that stopped on a tool-call marker (its tokens end with one of
    ``tool_stop_sequences``; ``sampler`` must stop on them) gets the task's tool
    output appended (masked out of the loss) and is continued in the next turn.

    DARTS (continuous engine only): ``counts[i]`` candidates of problem i instead,
    and problems with ``early_stop[i]`` cancel their other candidates once
    ``group_size`` of them completed.

    Turn 0 prefills each prompt once for its whole group. With the static sampler
    later turns re-prefill each distinct history once (samples that made the same
    calls share it); with the continuous engine (``ContinuousSampler``) a tool
    output is appended to the sample's own K/V and nothing is prefilled again.

    ``index_offset`` (continuous engine only): ``problems`` are the problems
    ``index_offset, index_offset + 1, ...`` of a larger batch (a process's share,
    ``process_rollout``): problem i's group is keyed by ``fold_in(key, index_offset + i)``
    as in the whole batch's rollout. ``problem_index`` stays local (0, 1, ...).

    ``on_call`` (continuous engine only): the engine's hook between decode calls
    (``RolloutEngine.run``), e.g. PAT's controller (``rollout.pat``); the engine is
    back on its construction mesh when the rollout returns.
    """
    if on_call is not None and not isinstance(sampler, ContinuousSampler):
        raise ConfigError("rollout.pat (an on_call hook) needs rollout.engine: continuous")
    if index_offset < 0:
        raise ValueError(f"index_offset={index_offset}: must be >= 0")
    if isinstance(sampler, ContinuousSampler):
        return _rollout_continuous(
            sampler,
            weights,
            tokenizer,
            task,
            problems,
            group_size=group_size,
            key=key,
            counts=counts,
            early_stop=early_stop,
            stream=stream,
            index_offset=index_offset,
            on_call=on_call,
        )
    if index_offset:
        raise ConfigError(
            f"rollout index_offset={index_offset} needs rollout.engine: continuous (the static "
            "sampler keys a whole turn's batch with one seed, so a share of it samples "
            "differently)"
        )
    if counts is not None or early_stop is not None:
        raise ConfigError("DARTS candidate counts need rollout.engine: continuous")
    if stream:
        raise ConfigError("rollout.streaming needs rollout.engine: continuous")
    tool_seqs = tool_stop_sequences(tokenizer, task)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    n = len(problems) * group_size
    owner = np.repeat(np.arange(len(problems)), group_size)
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    turn_text = [""] * n
    truncated = np.zeros(n, bool)
    turns = np.zeros(n, np.int64)
    active = list(range(n))
    gen_tokens, seconds = 0, 0.0
    for turn in range(task.max_turns):
        if not active:
            break
        histories = {}
        for row in active:
            h = np.concatenate([prompts[owner[row]]] + [p[0] for p in parts[row]])
            histories.setdefault(h.tobytes(), (h, []))[1].append(row)
        uniq = list(histories.values())
        rows = [r for _, rs in uniq for r in rs]
        res = sampler.generate(
            weights,
            [h for h, _ in uniq],
            num_samples=[len(rs) for _, rs in uniq],
            seed=jax.random.fold_in(key, turn),
        )
        gen_tokens += res.stats["generated_tokens"]
        seconds += res.stats["seconds"]
        nxt = []
        for j, row in enumerate(rows):
            tk = res.tokens[j].astype(np.int32)
            parts[row].append((tk, np.ones(tk.shape, np.float32), res.raw_logprobs[j]))
            turns[row] += 1
            text = tokenizer.decode(tk.tolist())
            finish = FinishReason(int(res.finish[j]))
            truncated[row] = finish is FinishReason.LENGTH
            if (
                finish is FinishReason.STOP
                and ends_with_any(tk, tool_seqs)
                and turn + 1 < task.max_turns
            ):
                out = task.tool(problems[owner[row]], turn_text[row] + text)
                if out is not None:
                    ids = np.asarray(tokenizer.encode(out), np.int32)
                    parts[row].append(
                        (ids, np.zeros(ids.shape, np.float32), np.zeros(ids.shape, np.float32))
                    )
                    turn_text[row] += text + out
                    nxt.append(row)
        active = nxt
    trajs = _trajectories(tokenizer, prompts, parts, truncated, turns, owner)
    stats = dict(
        rollout_seconds=seconds,
        rollout_tokens=gen_tokens,
        rollout_tokens_per_s=gen_tokens / max(seconds, 1e-9),
    )
    return trajs, stats


def _rollout_continuous(
    sampler: ContinuousSampler,
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
) -> tuple[list[Trajectory], dict[str, float]]:
    """``rollout`` on the continuous engine: one group per problem (its prompt prefilled
    once), tool turns continued in place with ``RolloutEngine.extend``.

    Each ``Stream`` of ``stream`` (the reference policy's logprobs, the critic's
    values) scores every ``stream_chunk`` generated tokens (and every tool output)
    between decode calls (one call of each scorer per decode call), so that when
    generation ends only the lag is left: ``stream_lag_tokens`` (tokens some streamed
    model had not scored when the last decode call returned), scored in
    ``stream_tail_seconds``; ``stream_seconds`` is the host's time in every scorer
    call of the rollout (interleaved and tail; on a scorer device of its own, the
    calls are not waited for, so it counts dispatching and the waits for results,
    not the device's time). The trajectories carry the results (``ref_logprobs``,
    ``values``; 0 on the prompt).
    """
    tool_seqs = tool_stop_sequences(tokenizer, task)
    multi = task.max_turns > 1
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    counts = [group_size] * len(problems) if counts is None else [int(c) for c in counts]
    early_stop = [False] * len(problems) if early_stop is None else list(early_stop)
    eng = sampler.ensure(prompt_len=max(p.size for p in prompts), group_size=max(counts))
    weights = eng.place(weights)
    owner = np.repeat(np.arange(len(problems)), counts)
    n = int(owner.size)
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    turn_text = [""] * n
    truncated = np.zeros(n, bool)
    turns = np.zeros(n, np.int64)
    base = np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                      else key)  # fmt: skip
    groups = [
        eng.submit(
            prompt,
            n=counts[i],
            max_new_tokens=sampler.max_new_tokens,
            seed=jax.random.fold_in(base, index_offset + i),
            hold=multi,
            until=complete_responses(group_size) if early_stop[i] else None,
            **sampler.sampling,
        )
        for i, prompt in enumerate(prompts)
    ]
    starts = np.concatenate([[0], np.cumsum(counts)])
    row_of = {id(r): int(starts[i]) + r.index for i, g in enumerate(groups) for r in g.requests}
    cancelled = np.zeros(n, bool)
    rank = np.full(n, -1, np.int64)
    finished = 0
    kinds = [s.kind for s in stream]
    if len(set(kinds)) != len(kinds):
        raise ConfigError(f"rollout streams {[k.value for k in kinds]}: one of each kind at most")
    scs = []  # (scorer, its weights placed on its device)
    for s in stream:
        sc = s.scorers.get(eng.config, s.weights)
        scs.append((sc, sc.place(s.weights)))
    scored: dict[ScoreKind, dict[int, np.ndarray]] = {k: {} for k in kinds}
    if scs:
        group_of = {id(r): i for i, g in enumerate(groups) for r in g.requests}

        def on_tokens(req, toks, lps):
            row = row_of[id(req)]
            for sc, _ in scs:
                if not sc.is_open(row):
                    sc.open(row, group_of[id(req)], prompts[group_of[id(req)]])
                sc.add(row, toks)

        for g in groups:
            g.on_tokens = on_tokens
    eng.stats(reset=True)
    hook = None
    if on_call is not None:  # a switch re-places the weights: later calls take the new ones

        def hook(engine, w):
            nonlocal weights
            new = on_call(engine, w)
            if new is not None:
                weights = new
            return new

    lag, tail = 0, 0.0  # the last decode call's close-time scoring: what streaming left over
    stream_s = 0.0  # every scorer call of the rollout (interleaved + close-time)
    while eng.pending():
        done = eng.run(weights, max_calls=1, on_call=hook)
        t0 = time.perf_counter()
        for sc, w in scs:
            sc.flush(w, max_calls=1)  # interleaved with decode
        stream_s += time.perf_counter() - t0
        lag, tail = 0, 0.0
        for r in done:
            row = row_of[id(r)]
            rank[row], finished = finished, finished + 1
            cancelled[row] = r.finish is FinishReason.ABORTED
            tk, lp = r.result()
            parts[row].append((tk, np.ones(tk.shape, np.float32), lp))
            turns[row] += 1
            text = tokenizer.decode(tk.tolist())
            truncated[row] = r.finish in (FinishReason.LENGTH, FinishReason.ABORTED)
            go_on = False
            if (
                multi
                and r.finish is FinishReason.STOP
                and tk.size
                and ends_with_any(tk, tool_seqs)
                and turns[row] < task.max_turns
            ):
                out = task.tool(problems[owner[row]], turn_text[row] + text)
                if out is not None:
                    ids = np.asarray(tokenizer.encode(out), np.int32)
                    room = eng.config.response_len - r.length - ids.size
                    parts[row].append(
                        (ids, np.zeros(ids.shape, np.float32), np.zeros(ids.shape, np.float32))
                    )
                    turn_text[row] += text + out
                    if ids.size and room >= 1:
                        eng.extend(r, ids, max_new_tokens=min(sampler.max_new_tokens, room))
                        go_on = True
                        for sc, _ in scs:
                            sc.add(row, ids)
                    else:  # no room left for another turn: the sample ends truncated
                        truncated[row] = True
            if multi and not go_on and r.status is not Status.RELEASED:
                eng.release(r)
            if scs and not go_on and scs[0][0].is_open(row):
                t0 = time.perf_counter()
                lag += max(sc.pending(row) for sc, _ in scs)
                for (sc, w), kind in zip(scs, kinds, strict=True):
                    scored[kind][row] = sc.close(row, w)  # scores its lag, frees its slot
                tail += time.perf_counter() - t0
                stream_s += time.perf_counter() - t0
    st = eng.stats()
    if on_call is not None:
        eng.reset()  # back to the construction mesh and slot count (nothing is live)
    trajs = _trajectories(tokenizer, prompts, parts, truncated, turns, owner)

    def streamed(kind: ScoreKind, i: int, t: Trajectory) -> np.ndarray | None:
        if kind not in scored:
            return None
        # A request cancelled before its first token was never opened: nothing to score.
        got = scored[kind].get(i, np.zeros(0, np.float32))
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

    trajs = [
        dataclasses.replace(
            t,
            cancelled=bool(cancelled[i]),
            finish_rank=int(rank[i]),
            ref_logprobs=streamed(ScoreKind.LOGPROBS, i, t),
            values=streamed(ScoreKind.VALUES, i, t),
        )
        for i, t in enumerate(trajs)
    ]
    stats = dict(
        rollout_seconds=st.seconds,
        rollout_tokens=st.generated_tokens,
        rollout_tokens_per_s=st.tokens_per_second,
        rollout_slot_utilisation=st.slot_utilisation,
        rollout_peak_kv_bytes=float(st.peak_kv_bytes),
        decode_calls=list(st.calls),
        decode_seconds_per_step=sum(c[0] for c in st.calls) / max(st.decode_steps, 1),
        decode_slots=eng.config.slots,  # the DARTS cost model's schedule
    )
    if scs:
        stats.update(
            stream_tokens=float(sum(s.size for s in scored[kinds[0]].values())),
            stream_lag_tokens=float(lag),
            stream_tail_seconds=tail,
            stream_seconds=stream_s,
        )
    return trajs, stats


def _trajectories(tokenizer, prompts, parts, truncated, turns, owner) -> list[Trajectory]:
    trajs = []
    for row in range(len(parts)):
        p = prompts[owner[row]]
        toks = np.concatenate([p] + [x[0] for x in parts[row]]).astype(np.int32)
        mask = np.concatenate([np.zeros(p.shape, np.float32)] + [x[1] for x in parts[row]])
        old = np.concatenate([np.zeros(p.shape, np.float32)] + [x[2] for x in parts[row]])
        trajs.append(
            Trajectory(
                tokens=toks,
                loss_mask=mask,
                old_logprobs=old.astype(np.float32),
                prompt_len=int(p.shape[0]),
                response_len=int(mask.sum()),
                completion=tokenizer.decode(toks[p.shape[0] :].tolist()),
                truncated=bool(truncated[row]),
                num_turns=int(turns[row]),
                problem_index=int(owner[row]),
            )
        )
    return trajs


def process_share(n: int, process: int, processes: int) -> tuple[int, int]:
    """``[start, stop)`` of process ``process``'s contiguous share of ``n`` problems
    (sizes differ by at most one; a process gets none when ``n < processes``)."""
    if processes < 1 or not 0 <= process < processes:
        raise ValueError(f"process={process}: need 0 <= process < processes={processes}")
    return n * process // processes, n * (process + 1) // processes


def _merge_rollout_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One rollout's stats from its processes' shares (those with problems): seconds and
    peak K/V the slowest / largest process's, tokens summed, slot utilisation
    averaged, decode calls concatenated in process order (every process's DARTS cost
    model then observes the same calls)."""
    out: dict[str, Any] = dict(
        rollout_seconds=max(p["rollout_seconds"] for p in parts),
        rollout_tokens=sum(p["rollout_tokens"] for p in parts),
    )
    out["rollout_tokens_per_s"] = out["rollout_tokens"] / max(out["rollout_seconds"], 1e-9)
    if "rollout_slot_utilisation" in parts[0]:  # the continuous engine's
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
    sampler: Sampler | ContinuousSampler,
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
    stats = _merge_rollout_stats([st for _, _, st in shares if st is not None])
    stats.update(rollout_processes=procs, rollout_local_prompts=stop - start)
    if "decode_calls" in stats:  # per process: its problems [lo, hi) and its decode calls
        stats["decode_calls_per_process"] = [
            (*process_share(n, j, procs), st["decode_calls"])
            for j, (_, _, st) in enumerate(shares)
            if st is not None
        ]
    return trajs, stats


def reference_batch(tokenizer, problems: Sequence[Problem]) -> RolloutBatch:
    """SFT batch: prompt + the reference trajectory + eos; loss on assistant tokens."""
    toks, masks = [], []
    for p in problems:
        seq = [encode_prompt(tokenizer, p.prompt)]
        mask = [np.zeros(seq[0].shape, np.float32)]
        for role, text in p.reference:
            ids = np.asarray(tokenizer.encode(text), np.int32)
            seq.append(ids)
            mask.append(np.full(ids.shape, 1.0 if role is Role.ASSISTANT else 0.0, np.float32))
        seq.append(np.asarray([tokenizer.eos_id], np.int32))
        mask.append(np.ones(1, np.float32))
        toks.append(np.concatenate(seq))
        masks.append(np.concatenate(mask))
    return RolloutBatch.create(tokens=toks, loss_mask=masks)


def success_rate(rewards: np.ndarray) -> float:
    """Fraction of samples with reward >= 1 (the built-in tasks score 0 or 1)."""
    r = np.asarray(rewards)
    return float(np.mean(r >= 1.0)) if r.size else 0.0


# ------------------------------------------------------ rewards, advantages


def shaped_rewards(cfg: TrainerConfig, rewards: np.ndarray, trajs: Sequence[Trajectory]):
    """Task rewards plus DAPO's overlong shaping (when ``algo.overlong_buffer > 0``)."""
    r = np.asarray(rewards, np.float32)
    if cfg.algo.overlong_buffer > 0:
        max_len = cfg.rollout.max_new_tokens * cfg.task.max_turns
        lens = [t.response_len for t in trajs]
        r = r + adv_fns.overlong_penalty(
            lens, max_len=max_len, buffer=min(cfg.algo.overlong_buffer, max_len)
        )
    return r


def group_advantages(cfg: TrainerConfig, rewards: np.ndarray, group_ids: np.ndarray):
    """``grpo_advantages`` with the algorithm's options (Dr.GRPO: no std scaling;
    ``algo.std_ddof``)."""
    scale = cfg.algo.algorithm is not Algorithm.DR_GRPO
    return adv_fns.grpo_advantages(rewards, group_ids, scale_std=scale, ddof=cfg.algo.std_ddof)


class Scorer:
    """Jitted dense per-token logprobs of a batch under given weights (reference policy),
    of logits / ``temperature`` like the training engine's (``logprob_temperature``)."""

    def __init__(self, model, *, temperature: float = 1.0):
        self.graphdef, _ = nnx.split(model, nnx.Param)
        self.cfg = model.cfg
        self.temperature = logprob_temperature(temperature)
        self._fn = aot.jit(self._score, name="_score", static=(repr(self.cfg), self.temperature))
        self._min = dict(n=1, t=8)
        self._compiled: dict[tuple[int, int], Any] = {}  # (rows, length) -> executable
        self._reserved: tuple[int, int] | None = None  # (rows, longest length) to warm

    def _score(self, weights, tokens_NxT):
        model = nnx.merge(self.graphdef, weights)
        n, t = tokens_NxT.shape
        pos = jnp.broadcast_to(jnp.arange(t), (n, t))
        hidden, _ = model(tokens_NxT, pos, return_hidden=True)
        lp, _ = token_logprobs(
            model.lm_head_weight(),
            hidden[:, :-1],
            tokens_NxT[:, 1:],
            chunk=self.cfg.logits_chunk,
            temperature=self.temperature,
            dtype=self.cfg.compute_dtype,
        )
        return jnp.concatenate([jnp.zeros((n, 1), jnp.float32), lp], axis=1)

    def reserve(self, *, sequences: int, length: int) -> Scorer:
        """Sizes the row bucket for ``sequences`` up front and, at the first call,
        compiles the program of every length bucket from that call's up to ``length``:
        a longer batch later in the run then compiles nothing, while each batch still
        runs at its own (power-of-two) length bucket, never below an earlier one's (so
        the buckets below the first call's are never compiled)."""
        self._min["n"] = bucket(sequences, self._min["n"])
        self._reserved = (self._min["n"], bucket(length, self._min["t"]))
        return self

    def _program(self, weights, n: int, t: int):
        fn = self._compiled.get((n, t))
        if fn is None:
            arr = jax.ShapeDtypeStruct((n, t), jnp.int32)
            fn = self._compiled[(n, t)] = self._fn.lower(weights, arr).compile()
        return fn

    def __call__(self, weights, tokens: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self._reserved is not None:
            n, top = self._reserved
            t = bucket(max(len(x) for x in tokens), self._min["t"])
            while t <= top:
                self._program(weights, n, t)
                t *= 2
            self._reserved = None
        self._min["n"] = n = bucket(len(tokens), self._min["n"])
        self._min["t"] = t = bucket(max(len(x) for x in tokens), self._min["t"])
        arr = np.zeros((n, t), np.int32)
        for i, x in enumerate(tokens):
            arr[i, : len(x)] = x
        out = np.asarray(self._program(weights, n, t)(weights, arr))
        return [out[i, : len(x)].copy() for i, x in enumerate(tokens)]


def advantage_abs_mean(batch: RolloutBatch) -> float:
    """Mean |A| of the advantages the loss uses: per trained token where the batch has
    per-token advantages (PPO/GAE; its sequence advantages are then 0), else per sequence."""
    if batch.token_advantages is None:
        return float(np.abs(batch.advantages).mean())
    pairs = zip(batch.token_advantages, batch.loss_mask, strict=True)
    num = sum(float(np.sum(m * np.abs(a))) for a, m in pairs)
    return num / max(sum(float(m.sum()) for m in batch.loss_mask), 1e-30)


# ---------------------------------------------------------------- rl_batch


# Rollout keys of refill batches: fold_in(key, _REFILL_KEY + k) for generation batch k >= 1.
_REFILL_KEY = 1 << 20

# DARTS metrics summed over a step's generation batches (the others: the last batch's).
_DARTS_SUMS = (
    "darts_m_total",
    "darts_cancelled_tokens",
    "darts_early_stop_groups",
    "darts_dual_end_groups",
)


def _darts_shape(
    cfg: TrainerConfig,
    state: darts.DartsState,
    plan: darts.Plan,
    keys: Sequence[str],
    trajs: Sequence[Trajectory],
    rewards: np.ndarray,
    stats: dict[str, Any],
) -> tuple[np.ndarray, dict[str, Any]]:
    """DARTS selection of each problem's training group from its candidates (Alg. 2),
    then the state's updates: length EMAs and the cost model's decode calls.

    Returns (indices into ``trajs`` of the training groups, metrics). The cost
    model's prediction of this step's decode time (Eq. 4 on the lengths generated)
    uses only earlier steps' calls, so ``darts_cost_error`` is a held-out error.
    """
    m = cfg.rollout.group_size
    short_k = cfg.algo.darts.short_k or m - 1
    by_problem: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        by_problem.setdefault(t.problem_index, []).append(i)
    chosen: list[int] = []
    lengths = np.asarray([t.response_len for t in trajs], np.int64)
    complete = np.asarray([not t.truncated for t in trajs], bool)
    for p, rows in sorted(by_problem.items()):
        lens, ok = lengths[rows].tolist(), complete[rows].tolist()
        if plan.early_stop[p]:
            order = sorted(range(len(rows)), key=lambda j: trajs[rows[j]].finish_rank)
            pick = darts.early_stop_select(lens, ok, order, m)
        else:
            pick = darts.dual_end_select(lens, ok, m, min(short_k, m))
        chosen += [rows[j] for j in pick]
    idx = np.asarray(chosen, np.int64)
    cancelled = np.asarray([t.cancelled for t in trajs], bool)
    finished = ~cancelled
    # The processes of a sharded rollout decode concurrently: the step's decode time is
    # the slowest process's, each priced by Eq. 4 on its own share's lengths.
    parts = stats.get("decode_calls_per_process") or [
        (0, len(plan.counts), stats.get("decode_calls", []))
    ]
    share_lens = [
        [int(lengths[i]) for i, t in enumerate(trajs) if lo <= t.problem_index < hi]
        for lo, hi, _ in parts
    ]
    pred, actual = darts.step_cost(
        state.cost, share_lens, [c for _, _, c in parts], stats.get("decode_slots")
    )
    if not plan.cost_fitted:
        pred = float("nan")
    # The schedule's decode steps against the engine's (a check free of machine load).
    slots = stats.get("decode_slots")
    steps_pred = max(len(state.cost.schedule(ls, slots)[0]) for ls in share_lens)
    steps_actual = max(int(sum(c[1] for c in cs)) for _, _, cs in parts)
    alloc_max = max(plan.counts)
    metrics = dict(
        darts_m_total=float(plan.total),
        darts_m_star=plan.m_star,
        darts_k_s=plan.k,
        darts_alloc_min=float(min(plan.counts)),
        darts_alloc_mean=float(np.mean(plan.counts)),
        darts_alloc_max=float(alloc_max),
        darts_alloc_hist=np.bincount(plan.counts).tolist(),
        darts_early_stop_groups=float(sum(plan.early_stop)),
        # groups with redundant candidates that dual-end selection shapes (Alg. 2)
        darts_dual_end_groups=float(
            sum(c > m and not e for c, e in zip(plan.counts, plan.early_stop, strict=True))
        ),
        darts_generated_len_mean=float(lengths[finished].mean()) if finished.any() else 0.0,
        darts_kept_len_mean=float(lengths[idx].mean()),
        darts_cancelled_tokens=float(lengths[cancelled].sum()),
        darts_reward_shift=float(rewards[idx].mean() - rewards[finished].mean())
        if finished.any()
        else 0.0,
        darts_cost_predicted_s=pred,
        darts_cost_actual_s=actual,
        darts_decode_steps_predicted=float(steps_pred),
        darts_decode_steps=float(steps_actual),
        darts_cost_error=abs(pred - actual) / actual
        if plan.cost_fitted and actual
        else float("nan"),
        darts_rho=state.rho,
    )
    state.update(
        {keys[p]: [int(lengths[i]) for i in rows if finished[i]] for p, rows in by_problem.items()}
    )
    for call in stats.get("decode_calls", []):  # every process's calls
        state.cost.observe(*call)
    return idx, metrics


def rl_batch(
    cfg: TrainerConfig,
    problems: Sequence[Problem],
    *,
    sampler: Sampler,
    params,
    tokenizer,
    task: Task,
    reward_fn: RewardFn,
    key: jax.Array,
    reference: ReferenceFn | None = None,
    value: ValueModel | None = None,
    more_problems: Callable[[int], Sequence[Problem]] | None = None,
    darts_state: darts.DartsState | None = None,
    stream: Sequence[Stream] = (),
    shard_processes: bool = False,
    on_call: Callable[[Any, Any], Any] | None = None,
) -> tuple[RolloutBatch | None, dict[str, Any]]:
    """One RL step's batch: ``cfg.rollout.group_size`` samples of each problem under
    ``params``, scored by ``reward_fn`` and shaped, filtered by dynamic sampling
    (DAPO), with reference logprobs (``reference``, for a KL term) and advantages:
    GRPO's group-normalised ones, or per-token GAE from ``value`` (PPO).

    Dynamic sampling keeps the groups whose *task* rewards (the verifier's scores,
    before overlong shaping) are not all equal, as DAPO filters on accuracy. While
    fewer than ``len(problems)`` groups are kept it samples another batch of
    ``more_problems(k)`` (k = 1, 2, ...), up to ``algo.max_generation_batches`` in
    all, and trains on the first ``len(problems)`` kept groups. Metrics:
    ``generation_batches``, ``kept_fraction`` (kept / generated groups) and
    ``groups_short`` (groups missing from the target; 0 when it was filled).

    With ``darts_state`` (``algo.darts.enabled``) each problem gets the DARTS
    allocation's number of candidates and its training group is shaped from them
    (``_darts_shape``); the state's statistics are updated in place.

    With ``shard_processes`` (a multi-process run) each generation batch is
    ``process_rollout``: every process samples its share of the problems and all of
    them get the whole batch (metrics ``rollout_processes``, ``rollout_local_prompts``:
    this process's share of the step's problems, summed over generation batches).

    Returns ``(batch, metrics)``; ``batch`` is None when dynamic sampling kept no
    group (``metrics`` then say ``skipped=1`` and why).

    ``on_call``: the continuous engine's hook between decode calls (PAT's controller).
    """
    target = len(problems)
    dynamic = cfg.algo.use_dynamic_sampling
    trajs: list[Trajectory] = []
    task_r, rewards, gids, keep = [], [], [], []
    n_errors, reward_s, gen_batches, kept_groups = 0, 0.0, 0, 0
    roll: dict[str, float] = dict(rollout_seconds=0.0, rollout_tokens=0)
    batch_problems = list(problems)
    darts_m: dict[str, Any] = {}
    while True:
        k = gen_batches
        t_key = key if k == 0 else jax.random.fold_in(key, _REFILL_KEY + k)
        plan = None
        if darts_state is not None:
            dc = cfg.algo.darts
            keys = [darts.prompt_key(p.prompt) for p in batch_problems]
            plan = darts.plan(
                darts_state,
                keys,
                m=cfg.rollout.group_size,
                up_factor=dc.up_factor,
                lam=dc.lambda_,
                units=dc.lambda_units.value,
            )
        common = dict(
            group_size=cfg.rollout.group_size,
            key=t_key,
            counts=None if plan is None else plan.counts,
            early_stop=None if plan is None else plan.early_stop,
        )
        if shard_processes:
            if stream:
                raise ConfigError(
                    "rollout.streaming is not supported with a process-sharded rollout "
                    "(the streaming scorers are single-process)"
                )
            b_trajs, stats = process_rollout(
                sampler, params, tokenizer, task, batch_problems, **common
            )
            roll["rollout_processes"] = stats["rollout_processes"]
            roll["rollout_local_prompts"] = (
                roll.get("rollout_local_prompts", 0) + stats["rollout_local_prompts"]
            )
        else:
            b_trajs, stats = rollout(
                sampler,
                params,
                tokenizer,
                task,
                batch_problems,
                stream=stream,
                on_call=on_call,
                **common,
            )
        for name in ("stream_tokens", "stream_lag_tokens", "stream_tail_seconds", "stream_seconds"):
            if name in stats:
                roll[name] = roll.get(name, 0.0) + stats[name]
        if "decode_seconds_per_step" in stats:  # the step's last generation batch's
            roll["decode_seconds_per_step"] = stats["decode_seconds_per_step"]
        gen_batches += 1
        roll["rollout_seconds"] += stats["rollout_seconds"]
        roll["rollout_tokens"] += stats["rollout_tokens"]
        t_reward = time.perf_counter()
        scored = compute_rewards(
            reward_fn,
            [batch_problems[t.problem_index] for t in b_trajs],
            [t.completion for t in b_trajs],
            on_error=cfg.reward_on_error,
        )
        reward_s += time.perf_counter() - t_reward
        n_errors += len(scored.errors)
        b_rewards = np.asarray(scored.rewards, np.float32)
        if plan is not None:
            idx, d_m = _darts_shape(cfg, darts_state, plan, keys, b_trajs, b_rewards, stats)
            b_trajs, b_rewards = [b_trajs[i] for i in idx], b_rewards[idx]
            for name, v in d_m.items():  # summed over generation batches
                darts_m[name] = darts_m.get(name, 0.0) + v if name in _DARTS_SUMS else v
        offset = k * target
        b_gids = np.array([offset + t.problem_index for t in b_trajs], np.int32)
        b_keep = np.ones(len(b_trajs), bool)
        if dynamic:
            b_keep = adv_fns.dynamic_sampling_mask(b_rewards, b_gids)
        trajs += b_trajs
        task_r.append(b_rewards)
        rewards.append(shaped_rewards(cfg, b_rewards, b_trajs))
        gids.append(b_gids)
        keep.append(b_keep)
        kept_groups += len(np.unique(b_gids[b_keep]))
        if (
            not dynamic
            or kept_groups >= target
            or more_problems is None
            or gen_batches >= cfg.algo.max_generation_batches
        ):
            break
        batch_problems = list(more_problems(gen_batches))
        if len(batch_problems) != target:
            raise ValueError(
                f"more_problems({gen_batches}) gave {len(batch_problems)} problems; "
                f"expected {target} (one generation batch)"
            )
    task_rewards = np.concatenate(task_r)
    rewards, gids, keep = np.concatenate(rewards), np.concatenate(gids), np.concatenate(keep)
    generated_groups = gen_batches * target
    m: dict[str, Any] = dict(
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        success_rate=success_rate(task_rewards),
        truncated_fraction=float(np.mean([t.truncated for t in trajs])),
        turns_mean=float(np.mean([t.num_turns for t in trajs])),
        reward_errors=n_errors,
        reward_seconds=reward_s,
        rollout_tokens_per_s=roll["rollout_tokens"] / max(roll["rollout_seconds"], 1e-9),
        **roll,
        **length_stats([t.response_len for t in trajs]),
        generation_batches=gen_batches,
        kept_fraction=kept_groups / generated_groups,
        groups_short=max(0, target - kept_groups),
        **darts_m,
    )
    if not keep.any():
        m.update(skipped=1, skip_reason="every group has equal task rewards (no signal)")
        return None, m
    # The first ``target`` kept groups, in generation order.
    first = list(dict.fromkeys(gids[keep].tolist()))[:target]
    idx = np.flatnonzero(keep & np.isin(gids, first))
    trajs = [trajs[i] for i in idx]
    rewards, gids = rewards[idx], gids[idx]
    toks = [t.tokens for t in trajs]
    masks = [t.loss_mask for t in trajs]
    olds = [t.old_logprobs for t in trajs]

    # The forward-only passes left after generation: the streamed models' tail (scored
    # in the rollout) plus the forward over the finished batch of any model not streamed.
    forward_s, has_forward = roll.get("stream_tail_seconds", 0.0), False
    t0 = time.perf_counter()
    if all(t.ref_logprobs is not None for t in trajs):  # streamed during the rollout
        ref, has_forward = [t.ref_logprobs for t in trajs], True
    else:
        ref = reference(toks) if reference is not None else None
        if ref is not None:
            forward_s, has_forward = forward_s + time.perf_counter() - t0, True
    if value is not None:
        t0 = time.perf_counter()
        if all(t.values is not None for t in trajs):  # streamed during the rollout
            values = [t.values for t in trajs]
        else:
            values = value.values(toks)
            forward_s += time.perf_counter() - t0
        has_forward = True
    if has_forward:
        m["post_rollout_forward_seconds"] = forward_s
    if value is not None:
        advs = np.zeros(len(trajs), np.float32)
        token_adv, value_stats = value.advantages(
            toks,
            masks,
            olds,
            rewards,
            ref,
            kl_coef=cfg.algo.kl_coef,
            gamma=cfg.algo.gamma,
            lam=cfg.algo.lam,
            values=values,
        )
        m.update(value_stats)
    else:
        advs = group_advantages(cfg, rewards, gids)
        token_adv = None
    batch = RolloutBatch.create(
        tokens=toks,
        loss_mask=masks,
        advantages=advs,
        old_logprobs=olds,
        ref_logprobs=ref,
        token_advantages=token_adv,
        group_ids=gids,
        rewards=rewards,
    )
    tree = batch.prefix_tree()  # built once: the engine reuses it
    m.update(
        advantage_abs_mean=advantage_abs_mean(batch),
        tree_token_ratio=tree.stats.ideal_token_ratio,
        num_tokens=batch.num_tokens,
        tree_tokens=tree.stats.tree_tokens,
    )
    return batch, m


__all__ = [
    "ReferenceFn",
    "Scorer",
    "advantage_abs_mean",
    "Trajectory",
    "encode_prompt",
    "process_rollout",
    "process_share",
    "group_advantages",
    "reference_batch",
    "rl_batch",
    "rollout",
    "shaped_rewards",
    "ends_with_any",
    "single_token",
    "success_rate",
    "tool_stop_sequences",
]
