"""Replay on the continuous engine: the engine plan by hand, tool latencies of the replayed
step, reward times of the workload's own run, and one replay whose trajectories each
continue after their own tool wait."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtarl.bench.replay import (
    ReplayConfig,
    WorkloadSpec,
    default_tool_sampler,
    engine_plan,
    replay,
    reward_phase,
    reward_sampler_for,
    tool_latencies,
    tool_phase,
)
from dtarl.model import ModelConfig
from dtarl.traces import generate_workload, load_trace

SMALL_MODEL = ModelConfig.tiny(num_layers=1)


def _two_steps(multi_run, tmp_path):
    """``multi_run`` with a step 1 whose tool latencies are 10x step 0's plus 5 s."""
    d = tmp_path / "mt2" / "profile" / "multiturn_workload_log" / "run"
    d.mkdir(parents=True)
    src = (multi_run / "multiturn_workload_step_0.jsonl").read_text()
    (d / "multiturn_workload_step_0.jsonl").write_text(src)
    rows = []
    for line in src.splitlines():
        row = json.loads(line)
        row["step"] = 1
        for c in row["tool_calls"]:
            c["latency_s"] = 10 * c["latency_s"] + 5.0
        rows.append(json.dumps(row))
    (d / "multiturn_workload_step_1.jsonl").write_text("\n".join(rows) + "\n")
    return d


def _latencies(run, step):
    return sorted(c.latency_s for t in load_trace(run).iter_step(step) for c in t.tool_calls)


def test_tool_latencies_come_from_the_replayed_step(multi_run, tmp_path):
    run = _two_steps(multi_run, tmp_path)
    for step in (0, 1):
        s = default_tool_sampler(str(run), step)
        np.testing.assert_allclose(s.latencies_s, _latencies(run, step))
    w = generate_workload(run, batch_size=2, step=1, seed=0)
    assert w.info.step == 1
    ph = tool_phase(w, default_tool_sampler(str(run), w.info.step), seed=3)
    drawn = np.concatenate(list(tool_latencies(w, default_tool_sampler(str(run), 1)).values()))
    assert set(np.round(drawn, 9)) <= set(np.round(_latencies(run, 1), 9))
    assert min(drawn) >= 5.0 and ph.total_call_s >= 5.0 * ph.calls  # none of step 0's


def test_reward_times_from_the_workload_own_run(single_run, multi_run):
    # conftest: reward_time_s = 1.5 + rank + step for ranks 0-2 in steps 0 and 1.
    s, where = reward_sampler_for(str(single_run), 1)
    np.testing.assert_allclose(s.times_s, [2.5, 3.5, 4.5])
    assert "step 1" in where
    none, why = reward_sampler_for(str(multi_run), 0)
    assert none is None and f"no reward timings in {multi_run}" in why
    none, why = reward_sampler_for("fitted:math", 0)
    assert none is None and "fitted:math is a fitted distribution" in why
    none, why = reward_sampler_for(str(single_run), 7)
    assert none is None and "no reward timings for step 7" in why and "[0, 1]" in why
    # Another run's times, when named: its step when it has it.
    s, _ = reward_sampler_for(str(multi_run), 0, reward_source=str(single_run))
    np.testing.assert_allclose(s.times_s, [1.5, 2.5, 3.5])
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0)
    ph = reward_phase(w, None, missing=why)
    assert ph.status == why and ph.seconds == 0.0


def test_engine_plan_by_hand(multi_run):
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0)
    waits = {t: 1.0 + np.arange(v.size) for t, v in tool_latencies(w, _const(0.5)).items()}
    plan = engine_plan(w, waits)
    trajs = plan.trajectories
    got = sorted((t.turns, tuple(x.size for x in t.tools), t.waits_s, t.tail_s) for t in trajs)
    # MULTI_STEP0 (conftest): model runs, tool outputs between them, a trailing tool
    # output of the truncated trajectory only delays its end.
    assert got == sorted(
        [
            ((4, 3), (7,), (1.0,), 0.0),
            ((2,), (), (), 0.0),
            ((5, 2, 6), (3, 4), (1.0, 2.0), 0.0),
            ((3, 4), (5,), (1.0,), 2.0),
            ((8,), (), (), 0.0),
            ((2, 2), (2,), (1.0,), 0.0),
        ]
    )
    assert [len(m) for m in plan.members] == [3, 3] and len(plan.prompts) == 2
    assert [p.size for p in plan.prompts] == [6, 9]
    for t in trajs:  # the tool tokens are the workload's own, between the turns
        i = int(np.flatnonzero(w.info.trajectory_ids == t.trajectory)[0])
        row, at = w.batch.tokens[i], plan.prompts[t.group].size
        for k, x in enumerate(t.tools):
            at += t.turns[k]
            np.testing.assert_array_equal(row[at : at + x.size], x)
            at += x.size
    with pytest.raises(ValueError, match=r"waits_s\[0\]: 0 tool latencies for 1 tool outputs"):
        engine_plan(w, {t: np.zeros(0) for t in waits})


def _const(x):
    from dtarl.traces import ToolLatencySampler

    return ToolLatencySampler(latencies_s=np.array([x]))


def test_replay_drives_the_continuous_engine_with_own_tool_waits(multi_run):
    # Tool latencies of this trace: 0.1 (k + 1) + 0.01 sample (production s). Scaled by
    # 1e4 the waits (1,000-3,000 s on the simulated clock) dwarf every engine second, so
    # a trajectory that waited for anyone else's tools would end late by >= 100 s.
    spec = WorkloadSpec(name="mt", source=str(multi_run), batch_size=2, step=0, seed=1)
    scale = 1e4
    cfg = ReplayConfig(
        engines=("dense",),
        repeats=1,
        rollout_repeats=1,
        model=SMALL_MODEL,
        tool_time_scale=scale,
        inference_passes=0,
        quiet_cores=None,
    )
    (w,) = replay([spec], cfg).workloads
    r = w.rollout
    assert r.status == "ok" and r.detail["engine"] == "continuous"
    assert r.detail["lengths_match"] and r.detail["traces_after_warmup"] == 0
    wl = spec.build(vocab_size=SMALL_MODEL.vocab_size)
    assert r.generated_tokens == sum(n for _, (_, runs) in _turns(wl).items() for _, n in runs)
    assert r.detail["extends"] == 5  # tool turns continued in place (MULTI_STEP0: 1+2+1+1)
    own = np.asarray(w.tool.per_trajectory_s) * scale  # each trajectory's own tool calls
    timeline = np.asarray(w.trajectory_timelines_s())
    engine_s = r.detail["engine_s"]
    assert np.all(timeline >= own) and np.all(timeline - own <= engine_s + 1e-9)
    assert r.detail["idle_s"] > 0 and w.rollout_step_s() == pytest.approx(timeline.max())
    assert r.min_seconds == pytest.approx(timeline.max())
    # No reward timings in this run: said, not borrowed from rllm.
    assert w.reward.status.startswith(f"no reward timings in {multi_run}")
    assert w.step_s("dense") == pytest.approx(timeline.max() + w.engines["dense"].step_s)


def _turns(w):
    from dtarl.bench.replay import model_turns

    return model_turns(w)
