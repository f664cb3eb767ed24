"""The timing harness (``dtarl.timing``) on a fake clock: which calls run, in which
order, which are timed, and what each sample is. Nothing here depends on speed."""

from __future__ import annotations

import numpy as np
import pytest

from dtarl.timing import (
    QuietGate,
    Rounds,
    Settle,
    alternating,
    fixed,
    interleaved_rounds,
    self_timed,
    shuffled,
)


class FakeClock:
    """A clock that only moves when a fake program runs (``program`` advances it)."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def program(self, name: str, seconds):
        """A run that takes ``seconds`` (a number, or an iterator of numbers) per call."""
        it = iter(seconds) if not isinstance(seconds, int | float) else None

        def run():
            self.calls.append(name)
            self.now += next(it) if it is not None else seconds
            return name

        return run


def test_tuner_protocol_warms_up_settles_after_a_switch_and_extends_short_runs():
    """auto's protocol: a warm-up each, alternating rounds, an untimed call when the
    previous call was the other run's, and a short run stays until min_seconds."""
    clock = FakeClock()
    runs = {"a": clock.program("a", 1.0), "b": clock.program("b", 0.03)}
    protocol = Rounds(
        rounds=3, order=alternating, warmup=True, settle=Settle.ON_SWITCH, min_seconds=0.1
    )
    got = interleaved_rounds(runs, protocol, clock=clock)
    # Warm-ups; round 0 (a b): both follow the other's call -> settle; round 1 (b a):
    # b follows itself; round 2 (a b); then b alone (0.09 s < 0.1 s) for one more sample.
    assert "".join(clock.calls) == "ab" + "aabb" + "baa" + "abb" + "b"
    assert got["a"].seconds == pytest.approx((1.0,) * 3)
    assert got["b"].seconds == pytest.approx((0.03,) * 4)
    assert got["a"].median == pytest.approx(1.0) and got["b"].background == (None,) * 4


def test_min_seconds_stops_at_max_samples():
    clock = FakeClock()
    got = interleaved_rounds(
        {"x": clock.program("x", 0.001)},
        Rounds(rounds=2, min_seconds=60.0, max_samples=7),
        clock=clock,
    )
    assert len(got["x"].seconds) == 7 and len(clock.calls) == 7


def test_turns_settle_always_and_average_timed_calls_for_turn_seconds():
    """bench train's protocol: every turn starts untimed, then timed calls until
    turn_seconds (at most turn_calls); the turn's sample is their mean."""
    clock = FakeClock()
    # a: untimed 9 s, then timed 0.1, 0.3 (sum 0.4 >= 0.35): mean 0.2; round 2 the same.
    # b: untimed 9 s, then timed 1.0 (>= 0.35 at once).
    runs = {
        "a": clock.program("a", [9.0, 0.1, 0.3, 9.0, 0.2, 0.2]),
        "b": clock.program("b", [9.0, 1.0, 9.0, 1.0]),
    }
    protocol = Rounds(rounds=2, settle=Settle.ALWAYS, turn_seconds=0.35, turn_calls=40)
    got = interleaved_rounds(runs, protocol, clock=clock)
    assert "".join(clock.calls) == "aaabb" + "aaabb"
    assert got["a"].seconds == pytest.approx((0.2, 0.2))
    assert got["b"].seconds == pytest.approx((1.0, 1.0))
    # turn_calls caps a turn of very short calls.
    clock = FakeClock()
    got = interleaved_rounds(
        {"s": clock.program("s", 0.001)},
        Rounds(rounds=1, turn_seconds=10.0, turn_calls=5),
        clock=clock,
    )
    assert len(clock.calls) == 5 and got["s"].seconds == pytest.approx((0.001,))


def test_orders():
    names = ["a", "b", "c"]
    assert fixed(3, names) == names
    assert alternating(0, names) == names and alternating(1, names) == ["c", "b", "a"]
    for r in range(4):
        want = [names[i] for i in np.random.RandomState(r).permutation(3)]
        assert shuffled(r, names) == want
    clock = FakeClock()
    runs = {n: clock.program(n, 1.0) for n in names}
    interleaved_rounds(runs, Rounds(rounds=3, order=shuffled), clock=clock)
    assert clock.calls == [n for r in range(3) for n in shuffled(r, names)]


def test_budget_adds_rounds_until_spent_or_max_rounds():
    """The pairwise protocol: at least ``rounds`` rounds, then more while the rounds
    have run less than ``budget_s`` (up to ``max_rounds``)."""
    clock = FakeClock()
    runs = {"a": clock.program("a", 1.0), "b": clock.program("b", 1.0)}
    got = interleaved_rounds(
        runs, Rounds(rounds=2, order=alternating, budget_s=7.0, max_rounds=10), clock=clock
    )
    # 2 s per round: after rounds 0..3 the clock reads 8 s >= 7 s.
    assert len(got["a"].seconds) == 4 and clock.calls == list("abbaabba")
    clock = FakeClock()
    runs = {"a": clock.program("a", 1.0)}
    got = interleaved_rounds(runs, Rounds(rounds=1, budget_s=1e9, max_rounds=5), clock=clock)
    assert len(got["a"].seconds) == 5


def test_measure_and_block_hooks():
    clock = FakeClock()
    blocked = []
    got = interleaved_rounds(
        {"a": lambda: 0.25},
        Rounds(rounds=2),
        clock=clock,
        block=lambda out: blocked.append(out) or out,
        measure=self_timed,
    )
    assert got["a"].seconds == (0.25, 0.25) and blocked == [0.25, 0.25]


class ScriptedGate:
    """A QuietGate double: background readings come from a script, no waiting."""

    def __init__(self, readings, cores=0.5, budget_s=10.0):
        self.readings, self.cores, self.budget_s, self.waited_s = list(readings), cores, budget_s, 0
        self.waits = 0

    def wait(self):
        self.waits += 1
        self.waited_s += 0.1
        return 0.0

    def snapshot(self):
        return None

    def between(self, a, b):
        return self.readings.pop(0)


def test_gate_records_background_and_reruns_contended_minima():
    clock = FakeClock()
    runs = {
        "a": clock.program("a", [1.0, 0.5, 0.4]),  # its fastest (0.5) is contended
        "b": clock.program("b", [2.0, 2.5, 0.7]),
    }
    gate = ScriptedGate([0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    got = interleaved_rounds(runs, Rounds(rounds=2), gate=gate, clock=clock)
    assert clock.calls == list("abab" + "ab")  # one extra round for both loud minima
    assert got["a"].seconds == pytest.approx((1.0, 0.5, 0.4))
    assert got["a"].background == (0.0, 1.0, 0.0)
    assert got["b"].best == 2 and gate.waits == 6
    # A spent budget stops the reruns.
    clock = FakeClock()
    gate = ScriptedGate([1.0, 1.0], budget_s=0.0)
    got = interleaved_rounds({"a": clock.program("a", 1.0)}, Rounds(rounds=2), gate=gate)
    assert len(got["a"].seconds) == 2


class LoudGate(QuietGate):
    """Other processes always use 5 cores."""

    @staticmethod
    def between(a, b):
        return 5.0


def test_quiet_gate_wait_is_bounded():
    gate = LoudGate(cores=0.5, budget_s=0.2, window_s=0.05)
    bg = gate.wait()  # never quiet: gives up once the budget is spent
    if bg is None:  # no /proc/stat on this machine: the gate is off
        return
    assert bg == 5.0 and 0.2 <= gate.waited_s < 0.2 + 0.05 + 1e-9
    gate.wait()  # the budget is spent: one window, no more waiting
    assert gate.waited_s < 0.2 + 0.05 + 1e-9
    assert QuietGate(cores=None).wait() is None


def test_bad_input():
    with pytest.raises(ValueError, match="runs is empty"):
        interleaved_rounds({})
    with pytest.raises(ValueError, match="Rounds.rounds=0"):
        Rounds(rounds=0)
    with pytest.raises(ValueError, match="Rounds.budget_s"):
        Rounds(budget_s=-1.0)
