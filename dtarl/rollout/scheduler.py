"""The continuous engine's scheduler: slots, groups, admission, retirement, stop
sequences and the host mirror of the slot state. Pure Python and numpy (no JAX): the
engine (``dtarl.rollout.engine``) runs the device programs and hands their outputs
here as host arrays.

*Slots and prompt rows.* ``slots`` decode slots (``slot_req[i]``: the request in slot
i) and ``config.prompt_slots`` prompt rows (``pslot_group[q]``: the group whose
prompt row q holds). A group takes a prompt row when its first member is admitted and
gives it back when no member holds a slot any more. ``table[q, j]`` is the slot of
member j of the group in row q (``slots`` when it has none).

*Admission* is FIFO over groups: the oldest group with waiting members takes the free
slots (lowest first) for its members in order; a group that finds no free prompt row
waits (and the groups behind it too). A group admitted for the first time is queued
for prefill (``to_prefill``).

*Retirement.* After a decode call ``absorb`` takes the call's tokens, matches stop
sequences (the tokens past a match are dropped and the slot's length rolled back),
and ``retire`` finishes the requests whose turn ended, frees their slots (unless held)
and evaluates each touched group's ``until`` predicate.

*The host mirror* (``mirror``): one numpy array per ``kernels.Slots`` field, the
per-slot state uploaded with every decode call.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from dtarl.batch import token_ids
from dtarl.rollout.config import ContinuousConfig, EngineError, len_bucket
from dtarl.rollout.reasons import FinishReason
from dtarl.rollout.requests import Group, Request, Status, complete


def empty_slots(n: int, max_stop_ids: int) -> dict[str, np.ndarray]:
    """The host mirror of ``n`` idle slots: one array per ``kernels.Slots`` field."""
    return dict(
        group=np.zeros(n, np.int32),
        cell=np.zeros(n, np.int32),
        length=np.zeros(n, np.int32),
        token=np.zeros(n, np.int32),
        active=np.zeros(n, bool),
        budget=np.zeros(n, np.int32),
        forced=np.zeros(n, bool),
        key=np.zeros((n, 2), np.uint32),
        temperature=np.ones(n, np.float32),
        top_p=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32),
        stop_ids=np.full((n, max_stop_ids), -1, np.int32),
    )


def stop_sequence_cut(
    old: Sequence[int], new: Sequence[int], sequences: Sequence[tuple[int, ...]]
) -> int | None:
    """Index (exclusive) in ``new`` where the first match of a stop sequence over
    ``old + new`` ends, if one ends inside ``new``."""
    old, new = list(old), list(new)
    for j in range(len(new)):
        end = len(old) + j + 1
        for sq in sequences:
            n = len(sq)
            if end >= n and tuple((old + new[: j + 1])[end - n : end]) == sq:
                return j + 1
    return None


class DecodeStatics(NamedTuple):
    """The statics of the next decode program (``ProgramKey`` fields)."""

    steps: int
    filtered: bool  # some active slot samples with top-k or top-p
    window: int  # response rows read


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one decode call produced for one request (``Scheduler.absorb``)."""

    request: Request
    reason: FinishReason
    tokens: int  # kept (after a stop-sequence cut)
    dropped: int  # generated past a stop sequence and rolled back


class Scheduler:
    """The engine's host state (module docstring). ``slots``: the slot count now
    (``reshape`` changes it; at most config.slots)."""

    def __init__(self, config: ContinuousConfig, *, vocab_size: int):
        self.config = config
        self.vocab_size = int(vocab_size)
        q = config.prompt_slots
        self.slots = n = config.slots
        self.mirror = empty_slots(n, config.max_stop_ids)
        self.table = np.full((q, config.group_size), n, np.int32)
        self.slot_req: list[Request | None] = [None] * n
        self.pslot_group: list[Group | None] = [None] * q
        self.queue: deque[Group] = deque()  # groups with waiting members, FIFO
        self.to_prefill: list[Group] = []
        self.to_extend: list[Request] = []
        self.finished: list[Request] = []
        self.errors: list[tuple[tuple[int, int], str]] = []
        self.next_group = 0

    # ------------------------------------------------------------ requests

    def submit(
        self,
        prompt: Sequence[int],
        *,
        n: int = 1,
        max_new_tokens: int | Sequence[int] | None = None,
        stop_ids: Sequence[int] = (),
        stop_sequences: Sequence[Sequence[int]] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        member_keys: Callable[[int], np.ndarray],
        forced_lengths: Sequence[int] | None = None,
        hold: bool = False,
        until: Callable[[Group], bool] | None = None,
        on_tokens: Callable | None = None,
        on_finish: Callable | None = None,
    ) -> Group:
        """Checks a request group and queues it; ``member_keys(n)`` gives the members'
        [n, 2] uint32 keys (called once every argument is checked)."""
        c = self.config
        ids = token_ids("prompt", prompt, error=EngineError).reshape(-1)
        if ids.size == 0:
            raise EngineError("prompt is empty (need at least one token, e.g. bos)")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise EngineError(
                f"prompt: token ids must be in [0, {self.vocab_size}), "
                f"got [{ids.min()}, {ids.max()}]"
            )
        if ids.size > c.prompt_len:
            raise EngineError(
                f"prompt has {ids.size} tokens; the engine's prompt_len is {c.prompt_len} "
                "(ContinuousConfig.prompt_len)"
            )
        if not isinstance(n, int | np.integer) or not 1 <= n <= c.group_size:
            raise EngineError(f"n={n!r} must be an int in [1, {c.group_size}] (group_size)")
        limit = c.response_len
        if max_new_tokens is None:  # as many as the response rows hold
            max_new_tokens = limit
        mx = (
            np.broadcast_to(np.asarray(max_new_tokens, np.int64), (n,))
            if np.ndim(max_new_tokens) == 0
            else np.asarray(max_new_tokens, np.int64).reshape(-1)
        )
        forced = forced_lengths is not None
        if not forced and (mx.shape != (n,) or mx.min() < 1 or mx.max() > limit):
            raise EngineError(
                f"max_new_tokens: need an int or {n} ints in [1, {limit}] (response_len), "
                f"got {np.asarray(max_new_tokens).tolist()}"
            )
        if forced:  # exact lengths (trace replay); max_new_tokens is not used
            f = np.asarray(forced_lengths, np.int64).reshape(-1)
            if f.shape != (n,) or f.min() < 1 or f.max() > limit:
                raise EngineError(
                    f"forced_lengths: need {n} ints in [1, {limit}], got {f.tolist()}"
                )
            mx = f
        stops = tuple(
            int(t) for t in token_ids("stop_ids", list(stop_ids), error=EngineError).reshape(-1)
        )
        if len(stops) > c.max_stop_ids:
            raise EngineError(
                f"stop_ids: {len(stops)} ids, the engine takes at most {c.max_stop_ids} "
                "(ContinuousConfig.max_stop_ids); use stop_sequences for the rest"
            )
        if any(not 0 <= t < self.vocab_size for t in stops):
            raise EngineError(f"stop_ids: ids must be in [0, {self.vocab_size}), got {stops}")
        seqs = []
        for i, sq in enumerate(stop_sequences):
            a = token_ids(f"stop_sequences[{i}]", list(sq), error=EngineError).reshape(-1)
            if a.size == 0:
                raise EngineError(f"stop_sequences[{i}] is empty (need at least one id)")
            seqs.append(tuple(int(t) for t in a))
        if not temperature >= 0:
            raise EngineError(f"temperature={temperature} must be >= 0 (0 = greedy)")
        if not 0 < top_p <= 1:
            raise EngineError(f"top_p={top_p} must be in (0, 1]")
        if not isinstance(top_k, int | np.integer) or top_k < 0:
            raise EngineError(f"top_k={top_k!r} must be an int >= 0 (0 = off)")
        keys = np.asarray(member_keys(int(n)), np.uint32)
        group = Group(
            id=self.next_group,
            prompt=ids.astype(np.int32),
            requests=[],
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            stop_ids=stops,
            stop_sequences=tuple(seqs),
            on_tokens=on_tokens,
            on_finish=on_finish,
            until=until,
            owner=self,
        )
        self.next_group += 1
        group.requests = [
            Request(
                group=group,
                index=j,
                key=keys[j],
                max_new_tokens=int(mx[j]),
                forced=forced,
                hold=hold,
            )
            for j in range(n)
        ]
        self.queue.append(group)
        return group

    def check(self, r: Request) -> None:
        """Raises unless ``r`` is a request this scheduler accepted."""
        if not isinstance(r, Request) or r.group.owner is not self:
            raise EngineError(f"unknown request handle {r!r}")

    def cancel(self, target: Request | Group) -> None:
        """Stops a request (or every request of a group) with reason CANCELLED: a waiting
        one never takes a slot, a running one gives its slot back."""
        reqs = target.requests if isinstance(target, Group) else [target]
        if isinstance(target, Group) and target.owner is not self:
            raise EngineError(f"unknown group handle {target.id} (submitted to another engine)")
        for r in reqs:
            self.check(r)
            if r.status in (Status.WAITING, Status.RUNNING):
                self.finish(r, FinishReason.ABORTED)

    def extend(self, request: Request, tokens: Sequence[int], *, max_new_tokens: int) -> Request:
        """Queues ``tokens`` to be appended to a held, finished request, which then
        decodes up to ``max_new_tokens`` more."""
        self.check(request)
        if not request.hold or request.status is not Status.FINISHED or request.slot is None:
            raise EngineError(
                f"extend: request {request.id} must be a finished request submitted with "
                f"hold=True and not released (status {request.status.value})"
            )
        ids = token_ids("tokens", tokens, error=EngineError).reshape(-1)
        if ids.size == 0:
            raise EngineError("extend: tokens is empty (need at least one token)")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise EngineError(f"extend: token ids must be in [0, {self.vocab_size})")
        # Rows: the last sampled token + all appended but the last (the next input).
        room = self.config.response_len - request.length - ids.size
        if max_new_tokens < 1 or max_new_tokens > room:
            raise EngineError(
                f"extend: max_new_tokens={max_new_tokens} must be in [1, {room}] (the request "
                f"holds {request.length} of response_len={self.config.response_len} rows and "
                f"appends {ids.size})"
            )
        request.pending = ids.astype(np.int32)
        request.max_new_tokens = int(max_new_tokens)
        request.tokens, request.logprobs = [], []
        request.streamed = 0
        request.finish = FinishReason.RUNNING
        request.status = Status.RUNNING
        self.to_extend.append(request)
        return request

    def release(self, request: Request) -> None:
        """Frees a held request's slot (and its group's prompt row when the group is done)."""
        self.check(request)
        if request.status is Status.RUNNING:
            raise EngineError(f"release: request {request.id} is still running; cancel it first")
        self.free(request)
        if request.finish is not FinishReason.ABORTED:  # a held stop is final now
            self.check_until(request.group)

    # ------------------------------------------------------------ queries

    def pending(self) -> bool:
        return bool(self.queue or self.to_extend or self.mirror["active"].any())

    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return sum(r.status is Status.WAITING for g in self.queue for r in g.requests)

    def live(self) -> list[Request]:
        """Requests holding a slot (running, and held after their turn), in slot order."""
        return [r for r in self.slot_req if r is not None]

    def running(self) -> list[Request]:
        """Requests decoding now, in slot order."""
        return [r for r in self.live() if self.mirror["active"][r.slot]]

    def resident(self) -> list[Group]:
        """Groups whose prompt row is filled (resident and already prefilled), row order."""
        return [g for g in self.pslot_group if g is not None and g not in self.to_prefill]

    def kv_rows(self) -> int:
        """Live K/V rows: each resident prompt once (its last token is a response row)
        and each slot's response rows."""
        rows = sum(g.prompt.size - 1 for g in self.pslot_group if g is not None)
        return rows + sum(r.length for r in self.live())

    def idle(self) -> bool:
        """No slot, prompt row, prefill or extend in use."""
        return not (
            self.live()
            or any(g is not None for g in self.pslot_group)
            or self.to_prefill
            or self.to_extend
        )

    # ------------------------------------------------------------ admission

    def admit(self) -> None:
        """Gives free slots to waiting requests (module docstring)."""
        s, c = self.mirror, self.config
        free = [i for i, r in enumerate(self.slot_req) if r is None]
        while self.queue and free:
            g = self.queue[0]
            waiting = [r for r in g.requests if r.status is Status.WAITING]
            if not waiting:
                self.queue.popleft()
                continue
            if g.pslot is None:
                try:
                    g.pslot = self.pslot_group.index(None)
                except ValueError:
                    break  # every prompt row is in use: wait for a group to finish
                self.pslot_group[g.pslot] = g
                self.to_prefill.append(g)
            for r in waiting:
                if not free:
                    break
                i = free.pop(0)
                r.slot, r.status, r.length = i, Status.RUNNING, 0
                r.context = []
                self.slot_req[i] = r
                self.table[g.pslot, r.index] = i
                s["group"][i] = g.pslot
                s["cell"][i] = g.pslot * c.group_size + r.index
                s["length"][i] = 0
                s["token"][i] = g.prompt[-1]
                s["active"][i] = True
                s["budget"][i] = r.max_new_tokens
                s["forced"][i] = r.forced
                s["key"][i] = r.key
                s["temperature"][i] = g.temperature
                s["top_p"][i] = g.top_p
                s["top_k"][i] = g.top_k
                s["stop_ids"][i] = -1
                s["stop_ids"][i, : len(g.stop_ids)] = g.stop_ids
            if all(r.status is not Status.WAITING for r in g.requests):
                self.queue.popleft()

    def take_prefill(self) -> list[Group]:
        """The next prefill call's groups (at most prefill_batch), off the queue."""
        b = self.config.prefill_batch
        batch, self.to_prefill = self.to_prefill[:b], self.to_prefill[b:]
        return batch

    def take_extend(self) -> list[tuple[Request, np.ndarray]]:
        """The next extend call's requests (at most extend_batch), off the queue, each
        with the tokens it feeds: the last sampled token and every appended one but the
        last."""
        b = self.config.extend_batch
        batch, self.to_extend = self.to_extend[:b], self.to_extend[b:]
        s = self.mirror
        return [(r, np.concatenate([[s["token"][r.slot]], r.pending[:-1]])) for r in batch]

    def extended(self, batch: list[tuple[Request, np.ndarray]]) -> None:
        """Marks an extend call's requests running again with their rows written."""
        s = self.mirror
        for r, f in batch:
            i = r.slot
            r.length += f.size
            s["length"][i] = r.length
            s["token"][i] = r.pending[-1]
            s["active"][i] = True
            s["budget"][i] = r.max_new_tokens
            r.context.extend(r.pending.tolist())
            r.pending = None
            r.turns += 1

    def prefill_inputs(
        self, batch: list[Group], t: int | None, pad_id: int
    ) -> tuple[np.ndarray, ...]:
        """(prompt rows [B], tokens [B, t], lengths [B]) of a prefill call over these
        groups' prompts but their last token (B = prefill_batch; unused entries point at
        row Q, which the program drops); ``t`` None: the bucket of the longest."""
        c = self.config
        if t is None:
            t = len_bucket(max(g.prompt.size - 1 for g in batch), c.prompt_len)
        qs = np.full(c.prefill_batch, c.prompt_slots, np.int32)
        toks = np.full((c.prefill_batch, t), pad_id, np.int32)
        lens = np.zeros(c.prefill_batch, np.int32)
        for j, g in enumerate(batch):
            qs[j] = g.pslot
            toks[j, : g.prompt.size - 1] = g.prompt[:-1]
            lens[j] = g.prompt.size - 1
        return qs, toks, lens

    def extend_inputs(
        self, items: list[tuple[int, int, int, np.ndarray]], t: int | None, pad_id: int
    ) -> tuple[np.ndarray, ...]:
        """(slot, prompt row, first row [E], tokens [E, t], count [E]) of an extend call
        over (slot, prompt row, first row, tokens) items (E = extend_batch; unused
        entries point at slot N, which the program drops); ``t`` None: the bucket of the
        most tokens."""
        c = self.config
        if t is None:
            t = len_bucket(max(f.size for *_, f in items), c.response_len)
        e = c.extend_batch
        slot = np.full(e, self.slots, np.int32)
        grp = np.zeros(e, np.int32)
        length = np.zeros(e, np.int32)
        toks = np.full((e, t), pad_id, np.int32)
        count = np.zeros(e, np.int32)
        for j, (sl, g, first, f) in enumerate(items):
            slot[j], grp[j], length[j] = sl, g, first
            toks[j, : f.size] = f
            count[j] = f.size
        return slot, grp, length, toks, count

    def placeholder_prefill(self, length: int) -> list[Group]:
        """prefill_batch groups of ``length + 1``-token prompts on prompt rows 0, 1, ...
        (owned by no scheduler; a timing call's input, ``RolloutEngine.time_bucket_call``)."""
        c = self.config
        return [
            Group(
                id=-1 - j,
                prompt=np.ones(length + 1, np.int32),
                requests=[],
                temperature=0.0,
                top_p=1.0,
                top_k=0,
                stop_ids=(),
                stop_sequences=(),
                on_tokens=None,
                on_finish=None,
                until=None,
                pslot=j % c.prompt_slots,
            )
            for j in range(c.prefill_batch)
        ]

    def placeholder_extend(self, length: int) -> list[tuple[int, int, int, np.ndarray]]:
        """extend_batch items of ``length`` tokens from row 0 of slots 0, 1, ..."""
        c = self.config
        return [
            (j % self.slots, j % c.prompt_slots, 0, np.ones(length, np.int32))
            for j in range(c.extend_batch)
        ]

    def decode_statics(self, windows: Sequence[int]) -> DecodeStatics:
        """(steps, filtered, window) of the next decode call (some slot must be active):
        the smallest of ``windows`` holding the longest active slot after the call."""
        c, s = self.config, self.mirror
        filtered = bool(
            np.any(s["active"] & ((s["top_k"] > 0) | (s["top_p"] < 1)) & (s["temperature"] > 0))
        )
        need = int(s["length"][s["active"]].max()) + c.steps_per_call + 1
        window = next(w for w in windows if w >= need or w == c.response_len)
        return DecodeStatics(c.steps_per_call, filtered, window)

    # ------------------------------------------------------------ retirement

    def absorb(self, count, tokens, logprobs, finish, length, token, budget) -> list[Turn]:
        """Takes one decode call's outputs (host arrays: per slot the tokens produced
        ``count``, ``tokens``/``logprobs`` [slots, steps], the ``finish`` reason, and the
        slot state after the call ``length``, ``token``, ``budget``). A stop sequence
        ending inside the call drops the tokens after it and rolls the slot's length
        back. Returns what each request produced (``retire`` finishes them)."""
        s, out = self.mirror, []
        for i in np.flatnonzero(count):
            r = self.slot_req[i]
            cnt = int(count[i])
            toks = [int(x) for x in tokens[i, :cnt]]
            lps = [float(x) for x in logprobs[i, :cnt]]
            reason = FinishReason(int(finish[i]))
            new_len, new_tok = int(length[i]), int(token[i])
            seqs = r.group.stop_sequences
            cut = None if r.forced or not seqs else stop_sequence_cut(r.tokens, toks, seqs)
            if cut is not None and (cut < cnt or reason is not FinishReason.STOP):
                # A stop sequence ends inside this call: drop what follows, roll back.
                toks, lps, reason = toks[:cut], lps[:cut], FinishReason.STOP
                new_len -= cnt - cut
                new_tok = toks[-1]
            r.tokens.extend(toks)
            r.logprobs.extend(lps)
            r.context.extend(toks)
            r.length = new_len
            s["length"][i] = new_len
            s["token"][i] = new_tok
            s["budget"][i] = budget[i]
            out.append(Turn(r, reason, len(toks), cnt - len(toks)))
        return out

    def retire(self, turns: list[Turn]) -> None:
        """Streams each request's tokens, finishes those whose turn ended, then checks
        the ``until`` predicate of every touched group (seeing all its members that
        finished in this call)."""
        for t in turns:
            self.stream(t.request)
            if t.reason is not FinishReason.RUNNING and t.request.status is Status.RUNNING:
                self.finish(t.request, t.reason, check=False)
        for g in {id(t.request.group): t.request.group for t in turns}.values():
            self.check_until(g)

    def stream(self, r: Request, *, flush: bool = False) -> None:
        """Fires ``on_tokens`` for every full ``stream_chunk`` (``flush``: and the rest)."""
        g, chunk = r.group, self.config.stream_chunk
        if g.on_tokens is None or r.error is not None:
            return
        while len(r.tokens) - r.streamed >= max(chunk, 1) and (chunk or flush):
            end = r.streamed + (chunk or len(r.tokens) - r.streamed)
            if not self.callback(
                r,
                g.on_tokens,
                r,
                np.asarray(r.tokens[r.streamed : end], np.int32),
                np.asarray(r.logprobs[r.streamed : end], np.float32),
            ):
                return
            r.streamed = end
        if flush and len(r.tokens) > r.streamed:
            end = len(r.tokens)
            if self.callback(
                r,
                g.on_tokens,
                r,
                np.asarray(r.tokens[r.streamed :], np.int32),
                np.asarray(r.logprobs[r.streamed :], np.float32),
            ):
                r.streamed = end

    def callback(self, r: Request, fn, *args) -> bool:
        """Calls a user callback of ``r``; one that raises cancels only ``r`` (the error
        kept in ``r.error`` and ``errors``). Returns whether it succeeded."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - a user callback; it must not wedge the engine
            r.error = f"{type(exc).__name__}: {exc}"
            self.errors.append((r.id, r.error))
            warnings.warn(
                f"rollout engine: callback {getattr(fn, '__name__', fn)!r} of request {r.id} "
                f"raised {r.error}; the request is cancelled",
                RuntimeWarning,
                stacklevel=2,
            )
            if r.status in (Status.WAITING, Status.RUNNING):
                self.finish(r, FinishReason.ABORTED)
            return False

    def finish(self, r: Request, reason: FinishReason, *, check: bool = True) -> None:
        """Ends ``r``'s turn: flushes its stream, calls ``on_finish``, frees its slot
        unless it is held (a cancelled one always), then (``check``) its group's
        ``until``."""
        if r.slot is not None:
            self.mirror["active"][r.slot] = False
        if r.pending is not None:  # cancelled before its queued extend ran: drop it
            self.to_extend = [q for q in self.to_extend if q is not r]
            r.pending = None
        r.finish = reason
        r.status = Status.FINISHED
        self.finished.append(r)
        self.stream(r, flush=True)
        if r.group.on_finish is not None:
            self.callback(r, r.group.on_finish, r, reason)
        if not r.hold or reason is FinishReason.ABORTED:
            self.free(r)
        if check and reason is not FinishReason.ABORTED:
            self.check_until(r.group)

    def check_until(self, g: Group) -> None:
        """Cancels the group's unfinished members once its ``until`` predicate holds."""
        if g.until is None or g.stopped or not g.until(g):
            return
        g.stopped = True
        for other in g.requests:
            if other.status in (Status.WAITING, Status.RUNNING):
                self.finish(other, FinishReason.ABORTED, check=False)

    def free(self, r: Request) -> None:
        """Gives ``r``'s slot back, and its group's prompt row once no member holds one."""
        g = r.group
        if r.slot is not None:
            self.slot_req[r.slot] = None
            self.mirror["active"][r.slot] = False
            if g.pslot is not None:
                self.table[g.pslot, r.index] = self.slots
            r.slot = None
        r.status = Status.RELEASED
        if g.pslot is not None and all(
            q.status is Status.RELEASED or (q.status is Status.FINISHED and q.slot is None)
            for q in g.requests
        ):
            self.pslot_group[g.pslot] = None
            g.pslot = None

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call, in completion order."""
        out, self.finished = self.finished, []
        return out

    # ------------------------------------------------------------ reshaping

    def reshape(self, n: int, dp: int) -> np.ndarray:
        """Moves the live requests into ``n`` slots spread evenly over ``dp`` shards
        (live request k -> shard k % dp, when dp divides n) and remaps the mirror, the
        table and ``request.slot``. Returns ``src``: new slot j takes old row
        ``src[j]`` (a free slot: row 0)."""
        live = self.live()
        per = n // dp if n % dp == 0 else n
        ways = dp if n % dp == 0 else 1
        src = np.zeros(n, np.int32)
        remap = np.full(self.slots + 1, n, np.int32)  # old slot -> new (old N -> new N)
        for k, r in enumerate(live):
            j = (k % ways) * per + k // ways
            src[j], remap[r.slot] = r.slot, j
        old = self.mirror
        self.slots, self.mirror = n, empty_slots(n, self.config.max_stop_ids)
        self.slot_req = [None] * n
        for r in live:
            j = int(remap[r.slot])
            for k, v in old.items():
                self.mirror[k][j] = v[r.slot]
            self.slot_req[j] = r
            r.slot = j
        self.table = remap[self.table]
        return src

    def clear_slots(self, n: int) -> None:
        """``n`` empty slots (nothing may hold one: see ``idle``)."""
        if self.live():
            raise EngineError(f"clear_slots: {len(self.live())} slots are in use")
        self.slots, self.mirror = n, empty_slots(n, self.config.max_stop_ids)
        self.slot_req = [None] * n
        self.table = np.full(self.table.shape, n, np.int32)


__all__ = [
    "DecodeStatics",
    "Group",
    "Request",
    "Scheduler",
    "Status",
    "Turn",
    "complete",
    "empty_slots",
    "stop_sequence_cut",
]
