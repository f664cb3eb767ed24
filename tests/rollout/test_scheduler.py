"""The continuous engine's scheduler, driven without JAX: admission order, slot reuse,
group predicates, stop sequences, cancel and bad input (``dtarl.rollout.scheduler``).

A decode call is simulated by handing ``absorb`` host arrays, as the engine does with
the device program's outputs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dtarl.rollout.config import ContinuousConfig, EngineError
from dtarl.rollout.reasons import FinishReason
from dtarl.rollout.scheduler import Scheduler, Status, complete, stop_sequence_cut

CFG = ContinuousConfig(
    slots=4, groups=2, group_size=4, prompt_len=8, response_len=16, steps_per_call=4
)
VOCAB = 32


def keys(n):
    return np.arange(2 * n, dtype=np.uint32).reshape(n, 2)


def make(config=CFG) -> Scheduler:
    return Scheduler(config, vocab_size=VOCAB)


def submit(s, prompt=(1, 2, 3), **kw):
    return s.submit(list(prompt), member_keys=keys, **kw)


def decode(s, produced: dict, finish: dict | None = None):
    """One simulated decode call: ``produced[slot]`` tokens for each slot (logprob -1
    each), ``finish[slot]`` its reason (default RUNNING). Returns the turns."""
    n, steps = s.slots, CFG.steps_per_call
    count = np.zeros(n, np.int32)
    tokens = np.zeros((n, steps), np.int32)
    logprobs = np.full((n, steps), -1.0, np.float32)
    reasons = np.zeros(n, np.int32)
    length = s.mirror["length"].copy()
    token = s.mirror["token"].copy()
    budget = s.mirror["budget"].copy()
    for i, toks in produced.items():
        count[i] = len(toks)
        tokens[i, : len(toks)] = toks
        reasons[i] = int((finish or {}).get(i, FinishReason.RUNNING))
        length[i] += len(toks)
        token[i] = toks[-1]
        budget[i] -= len(toks)
    turns = s.absorb(count, tokens, logprobs, reasons, length, token, budget)
    s.retire(turns)
    return turns


def test_admission_is_fifo_and_fills_lowest_free_slots():
    s = make()
    a = submit(s, n=3)
    b = submit(s, prompt=(4, 5), n=3)
    s.admit()
    assert [r.slot for r in a.requests] == [0, 1, 2]
    assert [r.slot for r in b.requests] == [3, None, None]  # the rest waits, in order
    assert [r.status for r in b.requests] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    assert (a.pslot, b.pslot) == (0, 1) and s.to_prefill == [a, b]
    assert s.table[0, :3].tolist() == [0, 1, 2] and s.table[1, 0] == 3
    assert s.mirror["token"].tolist() == [3, 3, 3, 5]  # the prompt's last token is row 0
    assert s.mirror["cell"].tolist() == [0, 1, 2, 4]
    assert s.waiting() == 2 and s.pending()
    assert s.kv_rows() == 2 + 1  # prompts once, without their last token


def test_a_group_waits_for_a_prompt_row():
    s = make(ContinuousConfig(slots=4, groups=1, group_size=2, prompt_len=8, response_len=16))
    a = submit(s, n=1)
    b = submit(s, n=1)
    s.admit()
    assert a.requests[0].slot == 0 and b.requests[0].status is Status.WAITING
    assert b.pslot is None  # slots are free, but the only prompt row is a's
    s.take_prefill()
    decode(s, {0: [7]}, {0: FinishReason.STOP})
    assert a.pslot is None and a.done  # finished, not held: slot and row are free
    s.admit()
    assert (b.pslot, b.requests[0].slot) == (0, 0)


def test_slot_reuse_after_finish_and_retire_order():
    s = make()
    a = submit(s, n=4, max_new_tokens=[1, 8, 8, 8])
    b = submit(s, prompt=(9,), n=1)
    s.admit()
    s.take_prefill()
    turns = decode(s, {0: [5], 1: [6], 2: [7], 3: [8]}, {0: FinishReason.LENGTH})
    assert [(t.request.index, t.reason, t.tokens) for t in turns][0] == (
        0,
        FinishReason.LENGTH,
        1,
    )
    assert a.requests[0].status is Status.RELEASED and s.slot_req[0] is None
    assert s.take_finished() == [a.requests[0]]
    s.admit()
    assert b.requests[0].slot == 0 and s.mirror["length"][0] == 0  # reused, reset
    assert a.requests[1].tokens == [6] and a.requests[1].length == 1


def test_until_predicate_cancels_the_rest_of_its_group():
    s = make()
    g = submit(s, n=4, until=complete(2))
    other = submit(s, prompt=(4,), n=1)
    s.admit()
    s.take_prefill()
    decode(s, {0: [1], 1: [2], 2: [3], 3: [4]}, {0: FinishReason.STOP})
    assert not g.stopped  # one complete response is not enough
    decode(s, {1: [5], 2: [6], 3: [7]}, {1: FinishReason.STOP, 2: FinishReason.LENGTH})
    assert g.stopped and g.done
    assert [r.finish for r in g.requests] == [
        FinishReason.STOP,
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.ABORTED,
    ]
    assert other.requests[0].status is Status.WAITING  # another group is untouched
    s.admit()
    assert other.requests[0].slot == 0


def test_stop_sequence_cut():
    assert stop_sequence_cut([], [1, 2, 3], [(2, 3)]) == 3
    assert stop_sequence_cut([7, 2], [3, 4], [(2, 3)]) == 1  # spans the previous call
    assert stop_sequence_cut([1], [2, 5], [(9,), (1, 2)]) == 1
    assert stop_sequence_cut([1], [2, 5], [(3, 4)]) is None


def test_stop_sequence_rolls_back_the_tokens_after_it():
    s = make()
    g = submit(s, n=2, stop_sequences=[[4, 5]])
    s.admit()
    s.take_prefill()
    decode(s, {0: [1, 4], 1: [2, 2]})
    assert s.mirror["length"][:2].tolist() == [2, 2]
    turns = decode(s, {0: [5, 6, 7, 8], 1: [3, 3, 3, 3]})  # 0 matches [4, 5] at its 1st
    assert [(t.tokens, t.dropped) for t in turns] == [(1, 3), (4, 0)]
    a, b = g.requests
    assert a.finish is FinishReason.STOP and a.tokens == [1, 4, 5] and a.length == 3
    assert a.context == [1, 4, 5] and a.status is Status.RELEASED
    assert b.status is Status.RUNNING and b.length == 6
    assert s.mirror["length"][1] == 6 and s.mirror["token"][1] == 3


def test_forced_lengths_ignore_stop_sequences():
    s = make()
    g = submit(s, n=1, stop_sequences=[[4]], forced_lengths=[4])
    s.admit()
    turns = decode(s, {0: [4, 4, 4, 4]}, {0: FinishReason.LENGTH})
    assert turns[0].dropped == 0 and g.requests[0].tokens == [4, 4, 4, 4]


def test_cancel_waiting_and_running_requests():
    s = make()
    a = submit(s, n=4)
    b = submit(s, prompt=(4,), n=2)
    s.admit()
    s.cancel(b.requests[1])  # waiting: it never takes a slot
    assert b.requests[1].finish is FinishReason.ABORTED and b.requests[1].slot is None
    s.cancel(a.requests[2])  # running: its slot is given back
    assert s.slot_req[2] is None and not s.mirror["active"][2]
    assert a.requests[2].status is Status.RELEASED
    s.admit()
    assert b.requests[0].slot == 2 and s.waiting() == 0
    s.cancel(a)
    assert all(r.done for r in a.requests) and a.pslot is None
    other = make()
    with pytest.raises(EngineError, match="unknown request handle"):
        other.cancel(b.requests[0])
    with pytest.raises(EngineError, match="unknown group handle"):
        other.cancel(b)


def test_hold_extend_and_release():
    s = make()
    g = submit(s, n=1, hold=True, max_new_tokens=2)
    s.admit()
    s.take_prefill()
    decode(s, {0: [6, 7]}, {0: FinishReason.LENGTH})
    r = g.requests[0]
    assert r.status is Status.FINISHED and r.slot == 0 and g.pslot == 0  # held
    with pytest.raises(EngineError, match=r"max_new_tokens=20 must be in \[1, 12\]"):
        s.extend(r, [1, 2], max_new_tokens=20)  # 16 rows - 2 held - 2 appended
    s.extend(r, [1, 2], max_new_tokens=3)
    with pytest.raises(EngineError, match="still running"):
        s.release(r)
    ((req, feed),) = s.take_extend()
    assert req is r and feed.tolist() == [7, 1]  # the last sampled + all appended but last
    s.extended([(req, feed)])
    assert r.length == 4 and s.mirror["token"][0] == 2 and r.turns == 1
    assert r.context == [6, 7, 1, 2]
    decode(s, {0: [3]}, {0: FinishReason.STOP})
    s.release(r)
    assert s.slot_req[0] is None and g.pslot is None and s.idle()


def test_callback_error_cancels_only_its_request():
    s = make()

    def boom(request, tokens, logprobs):
        if request.index == 1:
            raise RuntimeError("no")

    g = submit(s, n=2, on_tokens=boom, max_new_tokens=1)
    s.admit()
    with pytest.warns(RuntimeWarning, match="no"):
        decode(s, {0: [1], 1: [2]}, {0: FinishReason.LENGTH, 1: FinishReason.LENGTH})
    a, b = g.requests
    assert a.finish is FinishReason.LENGTH and a.error is None
    assert b.error == "RuntimeError: no" and s.errors == [(b.id, b.error)]


def test_reshape_spreads_live_requests_over_dp():
    s = make()
    g = submit(s, n=3)
    s.admit()
    s.cancel(g.requests[1])
    src = s.reshape(2, dp=2)  # 2 live requests -> one per dp shard
    assert src.tolist() == [0, 2]
    assert [g.requests[0].slot, g.requests[2].slot] == [0, 1]
    assert s.table[0, [0, 2]].tolist() == [0, 1] and s.table[0, 1] == 2  # 2: no slot
    assert s.mirror["active"].tolist() == [True, True]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[VOCAB]), rf"prompt: token ids must be in \[0, {VOCAB}\)"),
        (dict(prompt=list(range(1, 10))), "prompt_len is 8"),
        (dict(n=5), r"n=5 must be an int in \[1, 4\]"),
        (dict(max_new_tokens=17), r"max_new_tokens: need an int or 1 ints in \[1, 16\]"),
        (dict(forced_lengths=[0]), r"forced_lengths: need 1 ints in \[1, 16\]"),
        (dict(stop_ids=[1, 2, 3, 4, 5]), "stop_ids: 5 ids"),
        (dict(stop_sequences=[[]]), r"stop_sequences\[0\] is empty"),
        (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k=-1 must be an int >= 0"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    s = make()
    kwargs = dict(prompt=[1, 2], **kwargs) if "prompt" not in kwargs else kwargs
    with pytest.raises(EngineError, match=match):
        s.submit(member_keys=keys, **kwargs)
    assert not s.queue and s.next_group == 0


def test_config_errors_name_the_field():
    with pytest.raises(EngineError, match=r"ContinuousConfig.slots=0 must be an int >= 1"):
        ContinuousConfig(slots=0)
    with pytest.raises(EngineError, match=r"ContinuousConfig.groups=-1 must be an int >= 0"):
        ContinuousConfig(groups=-1)


def test_scheduler_imports_no_jax():
    """The scheduler, its config and request modules load with jax and flax blocked
    (the package ``dtarl.rollout``'s own __init__, which loads the samplers, is skipped)."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys, types
        import dtarl

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Block())
        pkg = types.ModuleType("dtarl.rollout")
        pkg.__path__ = [dtarl.__path__[0] + "/rollout"]
        sys.modules["dtarl.rollout"] = pkg
        import dtarl.rollout.scheduler as s
        import dtarl.rollout.stats
        sched = s.Scheduler(s.ContinuousConfig(slots=2), vocab_size=8)
        sched.submit([1, 2], n=2, member_keys=lambda n: [[0, 0]] * n)
        sched.admit()
        assert [r.slot for r in sched.live()] == [0, 1]
        assert not any(m.split(".")[0] in ("jax", "flax") for m in sys.modules)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
