"""Production-timing validation (dtarl.bench.simulate.production): hand-computed processor
sharing, exact recovery on synthetic steps, disjoint fit/test steps, the real search_r1 / rllm
timings (skipped without the shared traces) and ``dtarl trace validate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtarl.bench.simulate.production import (
    EngineLatencyModel,
    RewardTimeModel,
    TurnTable,
    accuracy,
    complete_steps,
    split_steps,
    validate_production,
)
from dtarl.bench.simulate.skill import skill, skill_table
from dtarl.cli import main
from dtarl.traces.loaders import default_polytrace_root, load_trace
from dtarl.traces.records import RewardTiming

SEARCH_R1 = default_polytrace_root() / "search_r1/profile/multiturn_workload_log/0617_0223"
RLLM = default_polytrace_root() / "rllm/profile/packed_length_log/20260616_024512"


def _table(traj, completion, tool_after, prefill=None, latency=None, step=0) -> TurnTable:
    n = len(traj)
    return TurnTable(
        step=step,
        traj=np.asarray(traj),
        completion=np.asarray(completion, float),
        prefill=np.zeros(n) if prefill is None else np.asarray(prefill, float),
        tool_after=np.asarray(tool_after, float),
        latency=np.ones(n) if latency is None else np.asarray(latency, float),
    )


def test_processor_sharing_hand_computed():
    # Trajectory 0: a 1-token turn, a 2 s tool call, then a 1-token turn; trajectory 1: 3 tokens.
    # tau(n) = n s/token, 0.5 s admission. t in [0.5, 2.5]: n = 2, tau = 2: turn A done at 2.5,
    # B has 2 tokens left. [2.5, 4.5]: n = 1, B done at 4.5. C submitted at 4.5 (2.5 + 2 s tool),
    # admitted at 5.0 alone: done at 6.0.
    tab = _table(traj=[0, 0, 1], completion=[1, 1, 3], tool_after=[2.0, 0.0, 0.0])
    m = EngineLatencyModel(floor_s=0.0, per_request_s=1.0, prefill_s=0.0, overhead_s=0.5)
    start, end = m.simulate(tab)
    np.testing.assert_allclose(start, [0.0, 4.5, 0.0])
    np.testing.assert_allclose(end, [2.5, 6.0, 4.5])
    # A floor of 3 s/token: both at 3 s/token; A at 3.5, B at 9.5; C from 5.5 + 0.5 to 9.0.
    m3 = EngineLatencyModel(floor_s=3.0, per_request_s=1.0, prefill_s=0.0, overhead_s=0.5)
    np.testing.assert_allclose(m3.simulate(tab)[1], [3.5, 9.0, 9.5])
    # The step's makespan is the slowest trajectory's timeline, tool calls included.
    lat = end - start
    np.testing.assert_allclose(tab.trajectory_totals(lat), [2.5 + 2.0 + 1.5, 4.5])
    assert tab.makespan(lat) == pytest.approx(6.0)
    # The real timeline puts each turn after the trajectory's earlier turns and tools.
    s2, e2 = tab.timeline(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(s2, [0.0, 3.0, 0.0])
    np.testing.assert_allclose(e2, [1.0, 5.0, 3.0])


def test_model_and_accuracy_reject_bad_input():
    with pytest.raises(ValueError, match="per_request_s"):
        EngineLatencyModel(floor_s=0.0, per_request_s=-1.0, prefill_s=0.0, overhead_s=0.0)
    with pytest.raises(ValueError, match="both 0"):
        EngineLatencyModel(floor_s=0.0, per_request_s=0.0, prefill_s=0.0, overhead_s=0.0)
    with pytest.raises(ValueError, match="> 0"):
        accuracy([1.0], [0.0])
    assert accuracy([0.9, 2.2], [1.0, 2.0]) == pytest.approx(0.9)


def _synthetic_step(rng, model, step, n_traj=48):
    traj, comp, tool, pref = [], [], [], []
    for i in range(n_traj):
        k = int(rng.integers(1, 4))
        for j in range(k):
            traj.append(i)
            comp.append(int(rng.integers(5, 200)))
            pref.append(int(rng.integers(50, 400)))
            tool.append(float(rng.uniform(0.1, 2.0)) if j < k - 1 else 0.0)
    tab = _table(traj, comp, tool, prefill=pref, step=step)
    start, end = model.simulate(tab)
    return TurnTable(**{**tab.__dict__, "latency": end - start})


def test_fit_recovers_a_throughput_bound_engine_on_held_out_steps():
    # Without a floor or admission delay the fit's linearization is exact: the fit steps'
    # latencies identify per_request_s and the held-out step is predicted to fp precision.
    true = EngineLatencyModel(floor_s=0.0, per_request_s=0.01, prefill_s=0.0, overhead_s=0.0)
    rng = np.random.default_rng(0)
    fit = [_synthetic_step(rng, true, s) for s in (0, 1)]
    held = _synthetic_step(rng, true, 2)
    m = EngineLatencyModel.fit(fit)
    assert m.per_request_s == pytest.approx(0.01, rel=1e-6)
    pred = m.predict(held)
    np.testing.assert_allclose(pred, held.latency, rtol=1e-4)
    assert held.makespan(pred) == pytest.approx(held.makespan(held.latency), rel=1e-4)


def test_reward_model_is_exact_on_a_linear_law():
    def rec(step, rank, s, mx):
        return RewardTiming(
            step=step,
            rank=rank,
            dp_rank=rank,
            tp_rank=0,
            batch_size=4,
            reward_time_s=2e-4 * s + 1e-3 * mx + 3.0,
            response_sum=s,
            response_mean=s / 4,
            response_max=mx,
        )

    recs = [rec(0, r, 1000 * (r + 1), 300 + 500 * r * r) for r in range(4)]
    m = RewardTimeModel.fit(recs)
    held = [rec(1, 0, 7000, 900), rec(1, 1, 2500, 2500)]
    np.testing.assert_allclose(m.predict(held), [r.reward_time_s for r in held], rtol=1e-6)


def test_fit_and_test_steps_never_share_a_step():
    assert split_steps([0, 1, 2, 3, 4], None, None, what="x") == ((0, 1, 2), (3, 4))
    assert split_steps([0, 1, 2], [2], None, what="x") == ((2,), (0, 1))
    with pytest.raises(ValueError, match=r"steps \[2\] are in both"):
        split_steps([0, 1, 2, 3], [0, 2], [2, 3], what="rollout")
    with pytest.raises(ValueError, match=r"test_steps \[9\] not among the usable steps"):
        split_steps([0, 1, 2], [0], [9], what="rollout")
    with pytest.raises(ValueError, match="test_steps is empty"):
        split_steps([0, 1], [0, 1], None, what="rollout")
    with pytest.raises(ValueError, match="need >= 2"):
        split_steps([0], None, None, what="rollout")


def _write_multiturn_run(root: Path, model: EngineLatencyModel) -> Path:
    """Two complete steps and a partial one of synthetic search_r1 records (latencies from
    ``model``)."""
    d = root / "mt" / "profile" / "multiturn_workload_log" / "run"
    d.mkdir(parents=True)
    rng = np.random.default_rng(3)
    for step, n_traj in ((0, 16), (1, 16), (2, 5)):
        tab = _synthetic_step(rng, model, step, n_traj=n_traj)
        lines = []
        for i in range(tab.num_trajectories):
            rows = np.nonzero(tab.traj == i)[0]
            turns, calls, rle = [], [], []
            for k, r in enumerate(rows):
                c = int(tab.completion[r])
                last = k == len(rows) - 1
                turns.append(
                    dict(
                        turn=k,
                        generation_prompt_len=int(tab.prefill[r]),
                        cached_tokens=0,
                        completion_tokens=c,
                        assistant_append_len=c,
                        assistant_loss_len=c,
                        finish_reason="stop" if last else "tool_calls",
                        tool_call_count=0 if last else 1,
                        engine_latency_s=float(tab.latency[r]),
                    )
                )
                rle.append([1, c])
                if not last:
                    calls.append(
                        dict(
                            turn=k,
                            tool_name="search",
                            latency_s=float(tab.tool_after[r]),
                            response_token_len=5,
                            append_len=5,
                            status="success",
                        )
                    )
                    rle.append([0, 5])
            resp = sum(n for _, n in rle)
            lines.append(
                dict(
                    step=step,
                    prompt_len=10,
                    max_response_len=10_000,
                    turns=turns,
                    tool_calls=calls,
                    final_total_len=10 + resp,
                    final_response_len=resp,
                    response_loss_mask_rle=rle,
                    prompt_group_id=i // 4,
                    sample_id=i % 4,
                )
            )
        (d / f"multiturn_workload_step_{step}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines)
        )
    return d


def test_trace_validate_command_on_synthetic_runs(tmp_path, single_run, capsys):
    true = EngineLatencyModel(floor_s=0.0, per_request_s=0.02, prefill_s=0.0, overhead_s=0.0)
    run = _write_multiturn_run(tmp_path, true)
    assert complete_steps(load_trace(run)) == (0, 1)  # step 2 is partial
    with pytest.raises(ValueError, match=r"test_steps \[2\] not among the usable steps"):
        validate_production(run, fit_steps=[0], test_steps=[2], reward=False)
    out = tmp_path / "out"
    rc = main(
        ["trace", "validate", "--rollout", str(run), "--reward", str(single_run)]
        + ["--out", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "fit steps [0], held-out steps [1]" in text
    assert "overall: per-turn 100.0%" in text  # exact model, exact recovery
    rep = json.loads((out / "production.json").read_text())
    assert rep["fit_steps"] == [0] and rep["test_steps"] == [1]
    assert rep["reward_fit_steps"] == [0] and rep["reward_test_steps"] == [1]
    assert 0.0 < rep["reward_rank_accuracy"] <= 1.0
    assert (out / "production.png").stat().st_size > 0
    # Every accuracy stands beside the fit-mean baseline; the exact model beats it per turn.
    sk = {r["figure"]: r for r in rep["skill"]}
    assert set(sk) == {
        "engine latency per turn",
        "trajectory total",
        "step makespan",
        "reward per rank",
        "reward stage",
    }
    turn = sk["engine latency per turn"]
    assert turn["model"] == pytest.approx(1.0) and turn["carries_skill"]
    assert turn["baseline"] < 1.0 and "figures with skill: engine latency per turn" in text


def test_skill_baseline_predicts_the_fit_mean_by_hand():
    # fit mean 3; held-out real [3, 6]: relative errors 0 and 0.5 -> baseline 75%.
    s = skill("x", 0.8, [2.0, 4.0], [3.0, 6.0])
    assert s.baseline_value == 3.0 and s.baseline == pytest.approx(0.75)
    assert s.carries_skill
    worse = skill("x", 0.7, [2.0, 4.0], [3.0, 6.0])
    assert not worse.carries_skill
    assert "  figures with skill: none" in skill_table([worse])
    with pytest.raises(ValueError, match="x: no fit-step values"):
        skill("x", 0.7, [], [3.0])


@pytest.mark.skipif(not SEARCH_R1.exists() or not RLLM.exists(), reason="no shared PolyTrace")
def test_search_r1_production_latencies_held_out(tmp_path):
    # Fit on step 0 only, predict step 3; the partial last step (5) is never usable.
    run = load_trace(SEARCH_R1)
    assert 5 in run.steps and 5 not in complete_steps(run)
    rep = validate_production(
        SEARCH_R1, fit_steps=[0], test_steps=[3], reward_trace=RLLM, reward_fit_steps=[0, 1]
    )
    assert rep.fit_steps == (0,) and rep.test_steps == (3,)
    assert rep.reward_test_steps == (2, 3, 4)
    (row,) = rep.rollout_rows
    assert row.trajectories == 2048 and row.turns == len(rep.turn_pairs[0])
    # Measured 91.1% / 94.7% / 93.5% (per turn / trajectory / makespan); floors leave margin.
    assert rep.turn_accuracy > 0.85 and rep.trajectory_accuracy > 0.88
    assert rep.makespan_accuracy > 0.7
    assert rep.plot(tmp_path / "p.png").stat().st_size > 0
