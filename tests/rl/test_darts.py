"""DARTS pieces (papers/002): selection, allocation, budget, cost model, state."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.rl import darts


def test_dual_end_shortest_then_longest_complete():
    lengths = [5, 9, 3, 12, 7, 3, 12]
    complete = [True, True, True, False, True, True, True]
    got = darts.dual_end_select(lengths, complete, m=4, k=3)
    # K=3 shortest (ties by index: 2 before 5), then the longest complete (6; 3 is truncated)
    assert got == [2, 5, 0, 6]


def test_dual_end_fills_when_too_few_complete():
    lengths = [4, 20, 20, 2]
    complete = [True, False, False, True]
    assert darts.dual_end_select(lengths, complete, m=3, k=2) == [3, 0, 1]
    assert darts.dual_end_select(lengths, complete, m=8, k=7) == [3, 0, 1, 2]
    with pytest.raises(ValueError, match="short_k"):
        darts.dual_end_select(lengths, complete, m=3, k=4)


def test_early_stop_selection_prefers_complete_in_finish_order():
    lengths = [6, 2, 9, 4, 5]
    complete = [True, True, False, True, False]
    got = darts.early_stop_select(lengths, complete, finish_order=[1, 3, 0, 4, 2], m=3)
    assert got == [1, 3, 0] and all(complete[i] for i in got)
    # fewer complete than M: complete first, then the shortest incomplete
    assert darts.early_stop_select(lengths, complete, [1, 3, 0], m=4) == [1, 3, 0, 4]


def _brute(w, total, lo, hi):
    best = None
    for alloc in itertools.product(range(lo, hi + 1), repeat=len(w)):
        if sum(alloc) != total:
            continue
        obj = sum(wi / a for wi, a in zip(w, alloc, strict=True))
        if best is None or obj < best[0] - 1e-12:
            best = (obj, alloc)
    return best


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=4),
    st.integers(1, 3),
    st.data(),
)
def test_allocation_matches_brute_force(sigmas, m, data):
    n = len(sigmas)
    m_up = 2 * m
    total = data.draw(st.integers(n * m, n * m_up))
    w = darts.normalise(sigmas)
    got = darts.allocate(w, total, m, m_up)
    assert got.sum() == total and got.min() >= m and got.max() <= m_up
    obj = float(np.sum(w / got))
    assert obj <= _brute(w, total, m, m_up)[0] + 1e-9


def test_allocation_prefers_high_variance():
    got = darts.allocate(darts.normalise([1.0, 9.0, 5.0]), total=18, m_low=4, m_up=8)
    assert got[1] >= got[2] >= got[0] and got.sum() == 18


def test_budget_formula_and_clipping():
    m, n = 8, 4
    assert darts.total_budget(rho=0.5, lam=1.0, k=0.01, m=m, n=n) == 50  # floor(50)
    assert darts.total_budget(rho=0.5, lam=1.0, k=1.0, m=m, n=n) == m * n  # clipped low
    assert darts.total_budget(rho=5.0, lam=1e-3, k=0.01, m=m, n=n) == 2 * m * n  # high


def test_cost_model_recovers_ptl_and_eq4():
    cm = darts.RolloutCostModel()
    a, c = 2e-3, 5e-4
    rng = np.random.default_rng(0)
    for _ in range(20):
        steps = int(rng.integers(4, 17))
        active = int(rng.integers(steps, 16 * steps))
        cm.observe(a * steps + c * active, steps, active)
    assert cm.fit()
    assert cm.a == pytest.approx(a, rel=1e-6) and cm.c == pytest.approx(c, rel=1e-6)
    # Eq. 4 for lengths [2, 5]: 2 steps at batch 2, then 3 at batch 1
    assert cm.predict([5, 2]) == pytest.approx(2 * (a + 2 * c) + 3 * (a + c))
    assert cm.per_sample_cost(100.0) == pytest.approx(100 * c)


def test_state_ema_and_round_trip():
    s = darts.DartsState(ema=0.5)
    s.update({"p": [2, 4, 6], "q": [5, 5]})
    s.update({"p": [4, 4, 4]})
    assert s.prompt_std["p"] == pytest.approx(0.5 * 2.0 + 0.5 * 0.0)
    assert s.prompt_std["q"] == 0.0
    assert s.sigma("unseen") == s.std_len
    s.cost.observe(0.1, 4, 10)
    back = darts.DartsState.from_state_dict(json.loads(json.dumps(s.state_dict())))
    assert back.state_dict() == s.state_dict()


def test_plan_uniform_then_cost_model_budget():
    s = darts.DartsState()
    keys = ["a", "b", "c", "d"]
    p0 = darts.plan(s, keys, m=4, up_factor=2.0, lam=1.0)
    assert p0.total == 24 and not p0.cost_fitted  # 1.5 M N before any measurement
    s.update({"a": [1, 9, 3], "b": [2, 2, 2], "c": [1, 30, 2], "d": [4, 5, 6]})
    for steps in (8, 16):
        s.cost.observe(1e-3 * steps + 1e-4 * steps * 8, steps, steps * 8)
    p1 = darts.plan(s, keys, m=4, up_factor=2.0, lam=1.0)
    assert p1.cost_fitted and 16 <= p1.total <= 32 and sum(p1.counts) == p1.total
    assert p1.counts[2] == max(p1.counts)  # the most spread-out prompt gets the most
    assert p1.early_stop == tuple(c == 8 for c in p1.counts)


def test_trainer_runs_darts_and_resumes(tmp_path):
    """A short GRPO run with DARTS: groups of M, metrics, state saved and restored."""
    from dtarl.rl.config import ConfigError, TrainerConfig, from_dict
    from dtarl.rl.trainer import Trainer

    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="arithmetic", max_operand=9, ops="+-"),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=3, group_size=4, max_new_tokens=6),
        algo=dict(engine="dense", darts=dict(enabled=True, short_k=3, up_factor=2.0)),
        steps=4,
        eval_problems=0,
        checkpoint_every=4,
        out_dir=str(tmp_path),
        console=False,
        tensorboard=False,
        mesh=dict(dp=1),
    )
    cfg = from_dict(TrainerConfig, raw)
    assert cfg.algo.darts.lambda_ == 1.0
    tr = Trainer(cfg)
    assert tr.sampler.engine.config.group_size == 8  # room for M_up = 2 M candidates
    tr.run()
    rl = [h for h in tr.history if h.get("phase") == "rl"]
    assert len(rl) == 4
    for h in rl:
        assert 12 <= h["darts_m_total"] <= 24
        assert sum(h["darts_alloc_hist"]) == 3
        assert h["darts_kept_len_mean"] <= h["darts_generated_len_mean"] + 6
        assert h["num_sequences"] == 12 if "num_sequences" in h else True
    # Decode calls that compiled are not cost observations; once two calls that
    # did not are recorded, the held-out prediction error is finite.
    fitted = [h for h in rl if h["darts_cost_error"] == h["darts_cost_error"]]
    assert fitted and fitted[-1] is rl[-1] and 0 <= rl[-1]["darts_cost_error"]
    saved = tr.darts.state_dict()
    assert saved["mean_len"] is not None and saved["cost"]["obs"]
    back = Trainer(cfg)
    assert back.try_resume() and back.darts.state_dict() == saved
    with pytest.raises(ConfigError, match="rollout.engine=continuous"):
        from_dict(TrainerConfig, {**raw, "rollout": {**raw["rollout"], "engine": "static"}})
    with pytest.raises(ConfigError, match="algo.darts.up_factor"):
        from_dict(TrainerConfig, {**raw, "algo": dict(darts=dict(up_factor=0.5))})


def test_darts_batch_is_deterministic_under_a_fixed_seed(tmp_path):
    """Same seed and state: the same allocation, candidates and training groups."""
    import jax

    from dtarl.rl.config import TrainerConfig, from_dict
    from dtarl.rl.episodes import rl_batch
    from dtarl.rl.trainer import Trainer

    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="arithmetic", max_operand=9, ops="+-"),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=3, group_size=4, max_new_tokens=6),
        algo=dict(engine="dense", darts=dict(enabled=True)),
        steps=1,
        eval_problems=0,
        out_dir=str(tmp_path),
        console=False,
        tensorboard=False,
        mesh=dict(dp=1),
    )
    tr = Trainer(from_dict(TrainerConfig, raw))
    probs = tr._problems(2, 0, 3)
    state = darts.DartsState()
    state.update({darts.prompt_key(p.prompt): [1, 6, 2, 2] for p in probs[:2]})

    def one():
        s = darts.DartsState.from_state_dict(state.state_dict())
        batch, m = rl_batch(
            tr.cfg,
            probs,
            sampler=tr.sampler,
            params=tr.params,
            tokenizer=tr.tokenizer,
            task=tr.task,
            reward_fn=tr.reward_fn,
            key=jax.random.PRNGKey(7),
            darts_state=s,
        )
        return [t.tolist() for t in batch.tokens], m["darts_alloc_hist"], s.state_dict()

    a, b = one(), one()
    assert a[0] == b[0] and a[1] == b[1]
    assert a[2]["prompt_std"] == b[2]["prompt_std"]
    assert len(a[0]) == 12  # 3 groups of M = 4
