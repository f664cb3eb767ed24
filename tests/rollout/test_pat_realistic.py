"""PAT's controller knows L_max, not a forced request's exact length (issue 39: the
benchmark's controller decided with oracle knowledge)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from dtarl.rollout import pat
from dtarl.rollout.engine import ContinuousConfig
from dtarl.rollout.pat_controller import engine_state
from dtarl.rollout.stats import EngineView


def _engine(forced):
    view = EngineView(
        dp=8, tp=1, slots=4, active=3, live=3, waiting=0,
        prompt_tokens=np.array([5, 5, 5]),
        response_tokens=np.array([10, 20, 90]),
        remaining=np.array([3, 60, 4]),  # forced: exact; unforced: max_new_tokens left
        forced=np.asarray(forced),
        decode_calls=(),
    )  # fmt: skip
    cfg = ContinuousConfig(slots=4, groups=1, group_size=4, prompt_len=8, response_len=100)
    return types.SimpleNamespace(view=lambda: view, config=cfg)


def test_forced_lengths_are_not_read_unless_oracle():
    eng = _engine([True, False, True])
    real = engine_state(eng, lambda *a: True)
    # forced rows: L_max (the engine's 100 rows) minus the rows held, at least 1
    assert real.remaining.tolist() == [90, 60, 10]
    assert engine_state(eng, lambda *a: True, l_max=50).remaining.tolist() == [40, 60, 1]
    assert engine_state(eng, lambda *a: True, oracle=True).remaining.tolist() == [3, 60, 4]
    # nothing forced: the budgets are what any controller knows
    assert engine_state(_engine([False] * 3), lambda *a: True).remaining.tolist() == [3, 60, 4]


def test_controller_checks_l_max():
    from tests.rollout.test_pat import make_profile

    pred = pat.Predictor(make_profile(lambda tp, b, t: 1e-3 * b / tp))
    with pytest.raises(pat.PatError, match="l_max=0"):
        pat.PatController(pred, l_max=0)
    assert pat.PatController(pred).oracle is False
