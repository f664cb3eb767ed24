"""DARTS pieces (DARTS, arXiv 2605.30859): selection, allocation, budget, cost model, state."""

from __future__ import annotations

import itertools
import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.rl import darts
from dtarl.rl.config import ConfigError, TrainerConfig, from_dict
from dtarl.rl.episodes import Trajectory, rl_batch
from dtarl.rl.step import shape_darts
from dtarl.rl.trainer import Trainer


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
    # per_second with a free sample (k = 0): M* = inf, the 2 M N cap
    assert darts.optimal_budget(0.5, 1.0, 0.0, m, n, "per_second") == float("inf")
    assert darts.total_budget(rho=0.5, lam=1.0, k=0.0, m=m, n=n) == 2 * m * n
    # relative: M* = rho M N / lambda, whatever k is
    for k in (0.0, 1e-6, 3.0):
        assert darts.optimal_budget(0.9, 0.6, k, m, n, "relative") == pytest.approx(48.0)
        assert darts.total_budget(0.9, 0.6, k, m, n, "relative") == 48
    assert darts.total_budget(0.3, 0.6, 1.0, m, n, "relative") == m * n
    assert darts.total_budget(1.5, 0.6, 1.0, m, n, "relative") == 2 * m * n
    with pytest.raises(ValueError, match="units='seconds'"):
        darts.optimal_budget(0.5, 1.0, 0.1, m, n, "seconds")
    with pytest.raises(ValueError, match="lambda=0"):
        darts.optimal_budget(0.5, 0, 0.1, m, n, "relative")


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
    assert cm.e == 0
    # Eq. 4 for lengths [2, 5]: 2 steps at batch 2, then 3 at batch 1
    assert cm.predict([5, 2]) == pytest.approx(2 * (a + 2 * c) + 3 * (a + c))
    assert cm.per_sample_cost(100.0) == pytest.approx(100 * c)


def test_cost_model_window_fit_and_schedule():
    """Synthetic calls of an engine with windows 20/40/80 and 16 steps per call: the
    fit recovers PTL(b, w) = a + c b + e w, and Eq. 4 prices each step at the window
    the engine would read (calls starting at steps 0, 16, 32, 48: 20, 40, 80, 80)."""
    cm = darts.RolloutCostModel()
    a, c, e = 1e-3, 2e-5, 2.5e-5
    rng = np.random.default_rng(3)
    for _ in range(24):
        steps, w = int(rng.integers(1, 17)), int(rng.choice([20, 40, 80]))
        active = int(rng.integers(steps, 64 * steps))
        cm.observe(steps * (a + e * w) + c * active, steps, active, w)
    cm.observe(16 * (a + e * 80) + c * 16, 16, 16, 80)  # a full call: 16 steps per call
    assert cm.fit()
    assert (cm.a, cm.c, cm.e) == pytest.approx((a, c, e), rel=1e-6)
    lengths = [3, 50, 20]
    act, win = cm.schedule(lengths)
    assert act.tolist() == [3] * 3 + [2] * 17 + [1] * 30
    assert win.tolist() == [20] * 16 + [40] * 16 + [80] * 18
    want = sum(a + c * b + e * w for b, w in zip(act, win, strict=True))
    assert cm.predict(lengths) == pytest.approx(want)
    # the closed form of Eq. 4 when every response decodes at once
    flat = darts.RolloutCostModel(a=a, c=c, obs=[(1.0, 16.0, 1.0, 0.0)])
    assert flat.predict(lengths) == pytest.approx(3 * (a + 3 * c) + 17 * (a + 2 * c) + 30 * (a + c))
    assert cm.predict([]) == 0.0 and cm.predict([0, 0]) == 0.0
    # a checkpoint written before windows were recorded (3-value calls) still loads
    d = darts.DartsState().state_dict()
    d["cost"] = dict(a=a, c=c, obs=[[0.1, 16.0, 40.0]])
    back = darts.DartsState.from_state_dict(d)
    assert back.cost.obs == [(0.1, 16.0, 40.0, 0.0)] and back.cost.e == 0.0


def test_cost_model_schedule_with_fewer_slots_than_responses():
    """2 slots, 4 calls of up to 4 steps: [5, 2, 3, 0, 6] in submission order. The
    cancelled-before-start response (0) takes no slot; queued ones start at the next
    call after a slot frees; a call ends early when its last request finishes."""
    cm = darts.RolloutCostModel(a=1.0, c=0.1)
    cm.observe(1.0, 4, 8, 8)
    cm.observe(1.0, 4, 4, 16)
    act, win = cm.schedule([5, 2, 3, 0, 6], slots=2)
    # call 1: 5 and 2 (4 steps; 2 ends after 2); call 2: 5 (1 left) and 3 -> 3 steps;
    # call 3: 6 alone -> 4 steps; call 4: its last 2
    assert act.tolist() == [2, 2, 1, 1] + [2, 1, 1] + [1] * 4 + [1, 1]
    # windows 8 / 16 from the longest request's progress + 4 + 1: 0+5, 4+5, 0+5, 4+5
    assert win.tolist() == [8.0] * 4 + [16.0] * 3 + [8.0] * 4 + [16.0] * 2
    assert cm.predict([5, 2, 3, 0, 6], slots=2) == pytest.approx(13 + 0.1 * act.sum())
    # enough slots: every response from step 0, Eq. 4
    assert (
        cm.schedule([5, 2, 3, 0, 6], slots=8)[0].tolist()
        == (cm.schedule([5, 2, 3, 6])[0].tolist())
        == [4, 4, 3, 2, 2, 1]
    )
    with pytest.raises(ValueError, match="slots=0"):
        cm.schedule([1], slots=0)


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
    for units in darts.LAMBDA_UNITS:
        p0 = darts.plan(s, keys, m=4, up_factor=2.0, lam=1.0, units=units)
        assert p0.total == 24 and not p0.cost_fitted  # 1.5 M N before any measurement
        assert p0.m_star != p0.m_star  # NaN: the uniform budget
    s.update({"a": [1, 9, 3], "b": [2, 2, 2], "c": [1, 30, 2], "d": [4, 5, 6]})
    # relative units need no cost model
    p_rel = darts.plan(s, keys, m=4, up_factor=2.0, lam=1.0, units="relative")
    assert p_rel.m_star == pytest.approx(s.rho * 16) and not p_rel.cost_fitted
    for steps, active in ((8, 24), (16, 128)):
        s.cost.observe(1e-3 * steps + 1e-4 * active, steps, active)
    p1 = darts.plan(s, keys, m=4, up_factor=2.0, lam=1.0, units="per_second")
    assert p1.cost_fitted and 16 <= p1.total <= 32 and sum(p1.counts) == p1.total
    assert p1.k == pytest.approx(1e-4 * s.mean_len)
    assert p1.m_star == pytest.approx(s.rho / p1.k)
    assert p1.counts[2] == max(p1.counts)  # the most spread-out prompt gets the most
    assert p1.early_stop == tuple(c == 8 for c in p1.counts)


def test_fixed_shape_engine_calibration():
    """Decode calls whose time does not depend on the active slots (every slot decodes
    each step): the fit finds c = 0, so the per-second budget has k = 0 and sits at the
    2 M N cap (every prompt early-stopped), while the relative one stays inside."""
    s = darts.DartsState()
    rng = np.random.default_rng(1)
    for _ in range(30):
        steps = int(rng.integers(4, 17))
        s.cost.observe(3.4e-3 * steps, steps, int(rng.integers(steps, 256 * steps)))
    s.update({f"p{i}": [3 + i, 12, 30 - i, 5] for i in range(4)})
    s.update({"p0": [3, 3, 3, 40]})
    keys = [f"p{i}" for i in range(4)]
    ps = darts.plan(s, keys, m=4, up_factor=2.0, lam=0.6, units="per_second")
    assert s.cost.c == 0 and s.cost.a == pytest.approx(3.4e-3) and ps.k == 0
    assert ps.total == 32 and all(ps.early_stop)
    lam = s.rho / 1.5  # the relative lambda that puts M* at 1.5 M N
    pr = darts.plan(s, keys, m=4, up_factor=2.0, lam=lam, units="relative")
    assert pr.m_star == pytest.approx(24.0) and pr.total in (23, 24)
    assert any(pr.early_stop) and any(4 < c < 8 for c in pr.counts)


def test_lambda_for_budget_reproduces_the_paper_budget():
    # lambda' = rho / 1.5 puts Eq. 8's M* (relative units) at 1.5 M N for that rho.
    for rho in (0.3, 0.45, 0.9, 1.3):
        lam = darts.lambda_for_budget(rho)
        assert lam == pytest.approx(rho / 1.5)
        assert darts.optimal_budget(rho, lam, 0.0, 8, 8, "relative") == pytest.approx(96.0)
        assert darts.total_budget(rho, lam, 0.0, 8, 8, "relative") in (95, 96)  # floor
    assert darts.lambda_for_budget(0.6, budget=2.0) == pytest.approx(0.3)
    for rho, budget in ((0.0, 1.5), (float("nan"), 1.5), (0.5, 2.5), (0.5, 0.9)):
        with pytest.raises(ValueError, match="rho=|budget="):
            darts.lambda_for_budget(rho, budget)


def test_plan_has_early_stopped_and_dual_end_prompts():
    """A deterministic step of both kinds: a high-spread prompt reaches M_up (early
    stop), a mid one gets redundant candidates below M_up (dual-end), a flat one M."""
    s = _two_path_state(["x", "y", "z"])
    p = darts.plan(s, ["x", "y", "z"], m=4, up_factor=2.0, lam=0.5, units="relative")
    assert p.m_star == pytest.approx(18.0) and p.total == 18
    assert p.counts == (8, 6, 4) and p.early_stop == (True, False, False)


def _two_path_state(keys) -> darts.DartsState:
    s = darts.DartsState()
    s.prompt_std = {keys[0]: 4.0, keys[1]: 1.0, keys[2]: 0.0}  # weights 1, 0.25, 0
    s.mean_len, s.std_len = 4.0, 3.0  # rho = 0.75: M* = 0.75 x 12 / 0.5 = 18
    return s


def _traj(problem: int, length: int, *, truncated=False, cancelled=False, rank=-1):
    toks = np.zeros(2 + length, np.int32)
    mask = np.concatenate([np.zeros(2, np.float32), np.ones(length, np.float32)])
    return Trajectory(
        tokens=toks,
        loss_mask=mask,
        old_logprobs=np.zeros(toks.shape, np.float32),
        prompt_len=2,
        response_len=length,
        completion="",
        truncated=truncated or cancelled,
        num_turns=1,
        problem_index=problem,
        cancelled=cancelled,
        finish_rank=rank,
    )


def _cfg(**darts_kw) -> TrainerConfig:
    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="arithmetic", max_operand=9, ops="+-"),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=4, group_size=2, max_new_tokens=8),
        algo=dict(engine="dense", darts=dict(enabled=True, **darts_kw)),
        eval=dict(num_problems=0),
        console=False,
        mesh=dict(dp=1),
    )
    return from_dict(TrainerConfig, raw)


def test_shape_multi_process_cost_is_the_slowest_process():
    """A 2-process rollout of 4 problems (process 0: problems 0-1, process 1: 2-3): the
    step's actual decode time is the slower process's calls (not their sum), the
    prediction the larger of the two shares' Eq. 4, and every call is an observation."""
    cfg = _cfg()
    s = darts.DartsState()
    a, c = 1e-3, 1e-4
    for steps in (8, 16, 12):
        s.cost.observe(a * steps + c * 3 * steps, steps, 3 * steps)
    keys = ["p0", "p1", "p2", "p3"]
    plan = darts.Plan(counts=(2, 3, 2, 4), early_stop=(False,) * 4, total=11, cost_fitted=True)
    assert s.cost.fit()
    lens = {0: [3, 5], 1: [2, 4, 9], 2: [1, 1], 3: [6, 2, 2, 20]}
    trajs = [_traj(p, n) for p, ls in lens.items() for n in ls]
    calls0 = [(0.05, 9, 20)]
    calls1 = [(0.04, 16, 30), (0.03, 4, 4)]
    stats = dict(
        decode_calls=calls0 + calls1,
        decode_calls_per_process=[(0, 2, calls0), (2, 4, calls1)],
    )
    rewards = np.zeros(len(trajs), np.float32)
    idx, m = shape_darts(cfg, s, plan, keys, trajs, rewards, stats)
    assert m["darts_cost_actual_s"] == pytest.approx(0.07)  # max(0.05, 0.04 + 0.03)
    share0 = darts.RolloutCostModel(a=s.cost.a, c=s.cost.c).predict([3, 5, 2, 4, 9])
    share1 = darts.RolloutCostModel(a=s.cost.a, c=s.cost.c).predict([1, 1, 6, 2, 2, 20])
    assert share1 > share0
    assert m["darts_cost_predicted_s"] == pytest.approx(share1)
    assert m["darts_cost_error"] == pytest.approx(abs(share1 - 0.07) / 0.07)
    assert len(s.cost.obs) == 3 + 3  # all processes' calls observed
    assert m["darts_decode_steps"] == 20 and m["darts_decode_steps_predicted"] == 20
    assert len(idx) == 4 * 2 and m["darts_dual_end_groups"] == 2
    # one process: the same step from the concatenated calls is their sum
    s1 = darts.DartsState()
    s1.cost = darts.RolloutCostModel(a=s.cost.a, c=s.cost.c, obs=list(s.cost.obs[:3]))
    _, m1 = shape_darts(cfg, s1, plan, keys, trajs, rewards, dict(decode_calls=calls0 + calls1))
    assert m1["darts_cost_actual_s"] == pytest.approx(0.12)
    with pytest.raises(ValueError, match="lengths: 1 processes, calls: 2"):
        darts.step_cost(s.cost, [[1]], [calls0, calls1])


class _RecordingEngine:
    """The trainer's engine, recording every batch it trains on."""

    def __init__(self, inner):
        self.inner = inner
        self.batches = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def value_and_grad(self, params, batch, loss, **kw):
        self.batches.append(batch)
        return self.inner.value_and_grad(params, batch, loss, **kw)


def test_trainer_runs_darts_and_resumes(tmp_path):
    """A short GRPO run with DARTS: groups of M, metrics, state saved and restored."""
    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="arithmetic", max_operand=9, ops="+-"),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=3, group_size=4, max_new_tokens=6),
        algo=dict(engine="dense", darts=dict(enabled=True, short_k=3, up_factor=2.0)),
        steps=4,
        eval=dict(num_problems=0),
        checkpoint_every=4,
        out_dir=str(tmp_path),
        console=False,
        mesh=dict(dp=1),
    )
    cfg = from_dict(TrainerConfig, raw)
    assert cfg.algo.darts.lambda_ == 0.6 and cfg.algo.darts.lambda_units.value == "relative"
    tr = Trainer(cfg)
    assert tr.sampler.engine.config.group_size == 8  # room for M_up = 2 M candidates
    tr.engine = trained = _RecordingEngine(tr.engine)
    tr.run()
    rl = [h for h in tr.history if h.get("phase") == "rl"]
    assert len(rl) == 4 and len(trained.batches) == 4  # one update per step
    for h, batch in zip(rl, trained.batches, strict=True):
        assert 12 <= h["darts_m_total"] <= 24
        assert sum(h["darts_alloc_hist"]) == 3
        # Whatever was generated (up to 2 M per prompt), the engine trains M = 4
        # sequences per prompt: 3 groups of 4.
        assert batch.num_sequences == 12
        assert np.bincount(batch.group_ids).tolist() == [4, 4, 4]
        # ... and the logged kept length is the trained responses' mean length.
        kept = np.mean([m.sum() for m in batch.loss_mask])
        assert h["darts_kept_len_mean"] == pytest.approx(kept, rel=1e-6)
    # Some step had more candidates than it kept, so the selection was not the identity.
    assert max(h["darts_m_total"] for h in rl) > 12
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
    with pytest.raises(ConfigError, match="lambda_units"):
        from_dict(TrainerConfig, {**raw, "algo": dict(darts=dict(lambda_units="seconds"))})


def test_darts_batch_is_deterministic_and_shapes_both_ways(tmp_path):
    """Same seed and state: the same allocation, candidates and training groups; the
    step has an early-stopped prompt (at M_up) and a dual-end-selected one."""
    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="arithmetic", max_operand=9, ops="+-"),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=3, group_size=4, max_new_tokens=6),
        algo=dict(engine="dense", darts={"enabled": True, "lambda": 0.5}),
        steps=1,
        eval=dict(num_problems=0),
        out_dir=str(tmp_path),
        console=False,
        mesh=dict(dp=1),
    )
    tr = Trainer(from_dict(TrainerConfig, raw))
    probs = tr._problems(2, 0, 3)
    state = _two_path_state([darts.prompt_key(p.prompt) for p in probs])

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
        return [t.tolist() for t in batch.tokens], m, s.state_dict()

    a, b = one(), one()
    assert a[0] == b[0] and a[1]["darts_alloc_hist"] == b[1]["darts_alloc_hist"]
    assert a[2]["prompt_std"] == b[2]["prompt_std"]
    assert len(a[0]) == 12  # 3 groups of M = 4
    m = a[1]
    assert m["darts_m_total"] == 18 and m["darts_alloc_hist"] == [0, 0, 0, 0, 1, 0, 1, 0, 1]
    assert m["darts_early_stop_groups"] == 1 and m["darts_dual_end_groups"] == 1


def test_darts_with_the_calculator_task(tmp_path):
    """Multi-turn DARTS runs end to end (issue 39): every prompt early-stopped
    on the calculator task (turns held and extended on the continuous engine), M
    trained per prompt. That a tool-call stop is not a complete response is checked
    on the engine (tests/rollout/test_until_final.py)."""
    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="calculator", max_turns=2),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=2, group_size=2, max_new_tokens=8),
        algo=dict(engine="dense", darts={"enabled": True, "up_factor": 2.0, "lambda": 0.01}),
        steps=1,
        eval=dict(num_problems=0),
        out_dir=str(tmp_path),
        console=False,
        mesh=dict(dp=1),
    )
    tr = Trainer(from_dict(TrainerConfig, raw))
    tr.darts.mean_len = tr.darts.std_len = 4.0  # rho = 1: M* >> 2 M N, the cap
    tr.engine = trained = _RecordingEngine(tr.engine)
    tr.run()
    (h,) = [h for h in tr.history if h.get("phase") == "rl"]
    assert h["darts_m_total"] == 8 and h["darts_early_stop_groups"] == 2  # (4, 4)
    (batch,) = trained.batches
    assert np.bincount(batch.group_ids).tolist() == [2, 2]
