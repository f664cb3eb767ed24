"""Replay benchmark: tool stage by hand, auto length scale, and a tiny end-to-end replay."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from dtarl.bench.replay import (
    ROLLOUT_UNAVAILABLE,
    EngineTiming,
    InferencePhase,
    ReplayConfig,
    ReplayResult,
    RolloutPhase,
    TimingJob,
    ToolClock,
    ToolPhase,
    WorkloadReplay,
    WorkloadSpec,
    auto_length_scale,
    find_forced_length_sampler,
    load_replay_json,
    model_config_from_dict,
    model_config_to_dict,
    model_turns,
    plot_stages,
    replay,
    replay_rounds,
    reward_phase,
    rollout_calls,
    rollout_phase,
    time_engines,
    tool_calls_per_trajectory,
    tool_phase,
)
from dtarl.commands.trace import register, sweep_specs
from dtarl.engines.base import split_model
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, ModelFamily, init_model
from dtarl.testing import grpo_groups
from dtarl.timing import QuietGate
from dtarl.traces import GroupSpec, RewardTimeSampler, ToolLatencySampler, generate_workload
from dtarl.traces.workload import truncate_spec

# One layer keeps the compiles of the end-to-end replay short.
SMALL_MODEL = ModelConfig.tiny(num_layers=1)


@pytest.mark.parametrize("mode", ["trajectory", "per_turn"])
def test_tool_calls_per_trajectory_by_hand(multi_run, mode):
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0, mode=mode)
    calls = tool_calls_per_trajectory(w)
    # Expected: the RLE's 0-runs of each trajectory (MULTI_STEP0 in conftest); per-turn
    # samples end at the last model run, so a trailing tool output is not in the batch.
    want = {(0, 0): 1, (0, 1): 0, (0, 2): 2, (1, 0): 2, (1, 1): 0, (1, 2): 1}
    if mode == "per_turn":
        want[(1, 0)] = 1
    got = {}
    for t, n in calls.items():
        row = int(np.flatnonzero(w.info.trajectory_ids == t)[0])
        key = (int(w.info.record_index[row]), int(w.info.sample_index[row]))
        got[key] = n
    assert got == want


def test_tool_phase_simulated_clock_is_critical_path(multi_run):
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0)
    const = ToolLatencySampler(latencies_s=np.array([0.5]))
    ph = tool_phase(w, const, clock=ToolClock.SIMULATED)
    # Concurrent trajectories, sequential calls: max calls per trajectory (2) x 0.5 s.
    assert ph.clock == "simulated" and ph.status == "ok"
    assert ph.calls == 6
    assert ph.critical_path_s == pytest.approx(1.0)
    assert ph.total_call_s == pytest.approx(3.0)
    assert ph.seconds == pytest.approx(1.0)
    assert ph.units == "production s" and ph.time_scale is None
    # Per trajectory (sorted ids): its calls x 0.5 s, production seconds.
    per = tool_calls_per_trajectory(w)
    assert ph.per_trajectory_s == pytest.approx([0.5 * per[t] for t in sorted(per)])
    scaled = tool_phase(w, const, clock=ToolClock.SIMULATED, time_scale=0.1)
    assert scaled.units == "replay s" and scaled.seconds == pytest.approx(0.1)


def _replay_of(turn_seconds, tool_s, turns, train_s=0.25, time_scale=0.5, **stages):
    t = EngineTiming(
        kind="dense",
        first_call_s=1.0,
        compile_s=0.75,
        step_s=train_s,
        step_min_s=train_s,
        device_s=train_s,
        host_s=0.0,
        runs_s=(train_s,),
        device_runs_s=(train_s,),
        host_runs_s=(0.0,),
        background_cores=(None,),
        num_tokens=10,
        tree_tokens=None,
        computed_tokens=None,
        trace_count=1,
        stats={},
    )
    tool = ToolPhase(
        clock="simulated",
        calls=3,
        critical_path_s=max(tool_s),
        total_call_s=sum(tool_s),
        seconds=max(tool_s) * (1.0 if time_scale is None else time_scale),
        time_scale=time_scale,
        per_trajectory_s=tuple(tool_s),
    )
    roll = RolloutPhase(status="ok", seconds=sum(turn_seconds), turn_seconds=turn_seconds)
    spec = WorkloadSpec(name="x", source="fitted:tool", batch_size=1)
    return WorkloadReplay(
        spec=spec,
        num_sequences=3,
        dense_tokens=10,
        tree_tokens=8,
        max_len=5,
        rollout=roll,
        tool=tool,
        engines={"dense": t},
        turns_per_trajectory=tuple(turns),
        **stages,
    )


def test_end_to_end_puts_tools_on_each_trajectory_timeline():
    # Turns take 1, 2, 4 s (replay); production tool seconds 10, 4, 0 scaled by 0.5.
    # Timelines: 1 + 2 + 5 = 8; 1 + 2 + 4 + 2 = 9; 1 + 0 = 1 -> the rollout stage is 9 s
    # (the serial sum rollout + tool critical path would be 7 + 5 = 12 s).
    w = _replay_of((1.0, 2.0, 4.0), (10.0, 4.0, 0.0), (2, 3, 1))
    assert w.trajectory_timelines_s() == pytest.approx((8.0, 9.0, 1.0))
    assert w.rollout_step_s() == pytest.approx(9.0)
    assert w.step_s("dense") == pytest.approx(9.25)
    d = w.to_dict()
    assert d["engines"]["dense"]["end_to_end_step_s"] == pytest.approx(9.25)
    assert d["stages"]["tool"]["units"] == "replay s"
    # Production tool seconds are never added to replay seconds: no total.
    w = _replay_of((1.0, 2.0, 4.0), (10.0, 4.0, 0.0), (2, 3, 1), time_scale=None)
    assert w.rollout_step_s() is None and w.step_s("dense") is None
    assert w.to_dict()["engines"]["dense"]["end_to_end_step_s"] is None


def test_reward_and_inference_stages_join_the_step(multi_run, tmp_path):
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0)  # 6 trajectories
    sampler = RewardTimeSampler(times_s=np.array([5.0]), batch_size=4)
    ph = reward_phase(w, sampler)  # ceil(6 / 4) = 2 ranks in parallel, 5 s each
    assert ph.status == "ok" and ph.ranks == 2 and ph.seconds == 5.0
    assert ph.units == "production s"
    scaled = reward_phase(w, sampler, time_scale=0.1)
    assert scaled.seconds == pytest.approx(0.5) and scaled.units == "replay s"
    assert "no reward timings" in reward_phase(w, None).status
    inf = InferencePhase(status="ok", passes=2, seconds=0.75, min_seconds=0.5)
    r = _replay_of((1.0, 2.0, 4.0), (10.0, 4.0, 0.0), (2, 3, 1), inference=inf, reward=scaled)
    # rollout timeline 9 + reward 0.5 + inference 0.75 + train 0.25
    assert r.step_s("dense") == pytest.approx(10.5)
    st = r.stage_seconds("dense")
    assert set(st) == {"rollout+tool", "reward", "inference", "train"}
    assert sum(v for v, _ in st.values()) == pytest.approx(r.step_s("dense"))
    # Reward in production seconds: reported apart, no total.
    r2 = _replay_of((1.0,), (0.0, 0.0, 0.0), (1, 1, 1), inference=inf, reward=ph)
    assert r2.step_s("dense") is None
    assert r2.stage_seconds("dense")["reward"] == (5.0, "production s")
    assert set(r2.stage_seconds("dense")) == {"rollout+tool", "reward", "inference", "train"}
    res = ReplayResult(config=ReplayConfig(), machine={}, workloads=(r, r2))
    assert plot_stages(res, tmp_path / "stages.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no replayed workload has engine 'dfs'"):
        plot_stages(res, tmp_path / "x.png", kind="dfs")


def test_reward_sampler_from_trace(single_run):
    # conftest: reward_time_s = 1.5 + rank + step for ranks 0-2, steps 0-1; batch_size 4.
    s = RewardTimeSampler.from_trace(str(single_run))
    np.testing.assert_allclose(s.times_s, [1.5, 2.5, 2.5, 3.5, 3.5, 4.5])
    assert s.batch_size == 4
    with pytest.raises(ValueError, match="> 0"):
        RewardTimeSampler(times_s=np.array([0.0]), batch_size=1)


def test_sweep_specs_and_response_budget(multi_run):
    base = WorkloadSpec(name="mt", source=str(multi_run), batch_size=2, step=0, seed=1)
    specs = sweep_specs([base], [1, 2], [6, 100])
    assert [s.name for s in specs] == ["mt/b1/L6", "mt/b1/L100", "mt/b2/L6", "mt/b2/L100"]
    assert [(s.batch_size, s.max_response_len) for s in specs] == [
        (1, 6),
        (1, 100),
        (2, 6),
        (2, 100),
    ]
    assert sweep_specs([base]) == [base]
    by_step = sweep_specs([base], steps=[0, 1])
    want = [("mt/s0/b2", 0, 2), ("mt/s1/b2", 1, 2)]
    assert [(s.name, s.step, s.batch_size) for s in by_step] == want
    # A 6-token budget cuts every response (runs of MULTI_STEP0 reach 60 tokens).
    w = specs[2].build()
    assert int(w.info.response_lens.max()) <= 6
    assert WorkloadSpec.from_dict(specs[2].to_dict()) == specs[2]
    with pytest.raises(ValueError, match="max_response_len"):
        WorkloadSpec(name="x", source="fitted:tool", batch_size=1, max_response_len=0)


def test_truncate_spec_by_hand():
    spec = GroupSpec(
        prompt_len=3,
        responses=(((1, 4), (0, 7), (1, 3)), ((1, 2),)),
        truncated=(False, False),
    )
    cut = truncate_spec(spec, 6)
    assert cut.responses == (((1, 4), (0, 2)), ((1, 2),))
    assert cut.truncated == (True, False)
    assert truncate_spec(spec, 14).responses == spec.responses
    assert truncate_spec(spec, 14).truncated == (False, False)


def test_tool_phase_sleep_clock_sleeps(multi_run):
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0)
    const = ToolLatencySampler(latencies_s=np.array([0.5]))
    ph = tool_phase(w, const, clock="sleep", time_scale=0.01)
    assert ph.clock == "sleep"
    assert ph.critical_path_s == pytest.approx(1.0)
    assert ph.seconds >= 0.01  # measured wall time of the (scaled) sleep


def test_tool_phase_single_turn_and_missing_latencies(single_run, multi_run):
    ph = tool_phase(generate_workload(single_run, batch_size=2, step=0), None)
    assert ph.calls == 0 and ph.status == "no tool calls" and ph.seconds == 0
    ph = tool_phase(generate_workload(multi_run, batch_size=2, step=0), None)
    assert ph.calls == 6 and ph.seconds == 0 and "no tool-latency data" in ph.status


def test_auto_length_scale_by_hand(single_run):
    # Step 0 groups (prompt, outputs): (5, .., 9), (8, 9, ..), (3, .., 9): longest 8 + 9 = 17.
    s = auto_length_scale(single_run, batch_size=3, step=0, max_len=10)
    assert s == pytest.approx(10 / 17)
    assert auto_length_scale(single_run, batch_size=3, step=0, max_len=1000) == 1.0
    w = generate_workload(single_run, batch_size=3, step=0, length_scale=s)
    assert w.batch.lengths.max() <= 10


def test_workload_spec_validates_and_round_trips(single_run):
    with pytest.raises(ValueError, match="batch_size"):
        WorkloadSpec(name="x", source=str(single_run), batch_size=0)
    with pytest.raises(ValueError, match="length_scale"):
        WorkloadSpec(name="x", source=str(single_run), batch_size=1, length_scale=0)
    with pytest.raises(ValueError, match="per_turn"):
        WorkloadSpec(name="x", source=str(single_run), batch_size=1, mode="bogus")
    spec = WorkloadSpec(name="x", source=str(single_run), batch_size=2, step=1, seed=3)
    assert WorkloadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_replay_config_validates():
    with pytest.raises(ValueError, match="engines"):
        ReplayConfig(engines=())
    with pytest.raises(ValueError, match="repeats"):
        ReplayConfig(repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        ReplayConfig(warmup=0)
    assert ReplayConfig(tool_clock="sleep").tool_clock is ToolClock.SLEEP
    with pytest.raises(ValueError, match="tool_time_scale"):
        ReplayConfig(tool_time_scale=-1.0)


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), ModelConfig.tiny(ModelFamily.LLAMA3)])
def test_model_config_json_round_trip(cfg):
    assert model_config_from_dict(json.loads(json.dumps(model_config_to_dict(cfg)))) == cfg


def test_rollout_phase_forced_lengths(single_run):

    w = generate_workload(single_run, batch_size=2, step=1, seed=0)
    model = init_model(SMALL_MODEL, 0)
    _, params = split_model(model)
    ph = rollout_phase(w, model, params, repeats=1, gate=QuietGate(cores=None))
    if find_forced_length_sampler() is None:
        assert ph.status == ROLLOUT_UNAVAILABLE and ph.seconds is None
        return
    # Every response generated with exactly its trace length (EOS ignored).
    assert ph.status == "ok" and ph.detail["lengths_match"] and ph.detail["turns"] == 1
    assert ph.generated_tokens == int(w.info.response_lens.sum())
    assert ph.seconds > 0 and ph.compile_s >= 0 and 0 < ph.min_seconds <= ph.seconds
    assert sum(ph.turn_seconds) == pytest.approx(ph.min_seconds)  # the fastest run's turns
    # The calls are the turns of the workload (one per turn, forced lengths per row).
    calls = rollout_calls(w)
    assert len(calls) == ph.detail["turns"]
    assert sum(sum(c.forced) for c in calls) == ph.generated_tokens


@pytest.mark.parametrize("mode", ["trajectory", "per_turn"])
def test_model_turns_by_hand(multi_run, mode):
    w = generate_workload(multi_run, batch_size=2, step=0, seed=0, mode=mode)
    turns = model_turns(w)
    lens = sorted(tuple(n for _, n in runs) for _, runs in turns.values())
    # The RLE's model runs of MULTI_STEP0 (conftest).
    assert lens == sorted([(4, 3), (2,), (5, 2, 6), (3, 4), (8,), (2, 2)])


def test_replay_end_to_end_tiny(multi_run, tmp_path):
    spec = WorkloadSpec(name="mt", source=str(multi_run), batch_size=2, step=0, seed=1)
    cfg = ReplayConfig(
        engines=("dense", "dfs"),
        repeats=2,
        model=SMALL_MODEL,
        tool_latency_source=str(multi_run),
        rollout=False,  # the rollout stage has its own test below
        quiet_cores=None,  # no waiting for other processes in tests
    )
    res = replay([spec], cfg)
    (w,) = res.workloads
    assert w.num_sequences == 6
    assert w.rollout.seconds is None and w.rollout.status.startswith("skipped")
    # Latencies of this synthetic trace: 0.1 (k + 1) + 0.01 sample; tool stage is simulated.
    assert w.tool.clock == "simulated" and w.tool.calls == 6 and w.tool.seconds > 0
    for kind in ("dense", "dfs"):
        t = w.engines[kind]
        assert t.step_s > 0 and t.compile_s >= 0 and len(t.runs_s) == 2
        assert t.step_min_s == min(t.runs_s) <= t.step_s
        assert t.runs_s == pytest.approx(
            [d + h for d, h in zip(t.device_runs_s, t.host_runs_s, strict=True)]
        )
        assert t.trace_count == 1  # warm-up compiled once; timed repeats never retrace
        assert t.num_tokens == w.dense_tokens
        # Tool seconds are production seconds (no tool_time_scale): no end-to-end total.
        assert w.step_s(kind) is None
    # Forward-only inference: one pass of the trainer's dense scorer over every sequence.
    assert w.inference.status == "ok" and w.inference.passes == 1
    assert 0 < w.inference.min_seconds <= w.inference.seconds
    assert w.inference.tokens == w.dense_tokens
    # This run records no reward times: the stage says so (nothing borrowed from rllm).
    assert w.reward.status.startswith(f"no reward timings in {multi_run}")
    assert w.speedup("dense") == 1.0
    assert w.speedup("dfs") == pytest.approx(w.engines["dense"].step_s / w.engines["dfs"].step_s)
    js = res.save(tmp_path / "r" / "replay.json")
    png = res.plot(tmp_path / "r" / "replay.png")
    assert png.stat().st_size > 0
    d = load_replay_json(js)
    e = d["workloads"][0]["engines"]["dfs"]
    assert e["speedup_vs_dense"] == pytest.approx(w.speedup("dfs"))
    assert d["workloads"][0]["stages"]["tool"]["clock"] == "simulated"
    assert WorkloadSpec.from_dict(d["workloads"][0]["spec"]) == spec
    assert "dfs" in res.table()


def test_load_replay_json_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"kind": "something"}))
    with pytest.raises(ValueError, match="not a dtarl replay"):
        load_replay_json(p)
    p.write_text("[1, 2")
    with pytest.raises(ValueError, match="x.json:1"):
        load_replay_json(p)
    with pytest.raises(FileNotFoundError, match="dtarl trace replay"):
        load_replay_json(tmp_path / "missing.json")


def test_time_engines_interleaves_rounds():

    model = init_model(SMALL_MODEL, 0)
    _, params = split_model(model)
    b1 = grpo_groups(num_groups=1, group_size=2, prompt_len=3, response_len=4, seed=0)
    b2 = grpo_groups(num_groups=2, group_size=2, prompt_len=5, response_len=(3, 9), seed=1)
    jobs = [TimingJob(kind="dense", batch=b1, label="a"), TimingJob(kind="dense", batch=b2)]
    lines = []
    loss, off = ClippedSurrogateLoss.grpo(), QuietGate(cores=None)
    ts = time_engines(jobs, model, params, loss, repeats=3, gate=off, log=lines.append)
    assert len(ts) == 2 and len(lines) == 2 and lines[0].startswith("compiled a dense")
    for t, b in zip(ts, (b1, b2), strict=True):
        assert len(t.runs_s) == 3 and t.step_min_s <= t.step_s and t.trace_count == 1
        assert t.num_tokens == b.num_tokens
    with pytest.raises(ValueError, match="repeats"):
        time_engines(jobs, model, params, ClippedSurrogateLoss.grpo(), repeats=0)
    with pytest.raises(ValueError, match="empty"):
        time_engines([], model, params, ClippedSurrogateLoss.grpo())


def test_cli_registers_replay_and_simulate():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    a = parser.parse_args(["trace", "replay", "fitted:math", "--engines", "dense", "dfs"])
    assert a.sources == ["fitted:math"] and a.engines == ["dense", "dfs"]
    assert a.tool_clock == "simulated"
    assert a.rollout_engine == "continuous" and a.reward_times is None
    a = parser.parse_args(
        ["trace", "replay", "--rollout-engine", "static", "--reward-times", "run"]
    )
    assert a.rollout_engine == "static" and a.reward_times == "run"
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "replay", "--rollout-engine", "lockstep"])
    with pytest.raises(ValueError, match=r"rollout_engine='lockstep'; accepted: \['continuous'"):
        ReplayConfig(rollout_engine="lockstep")
    a = parser.parse_args(["trace", "simulate", "--profile", "p.json", "--dp", "2", "--tp", "2"])
    assert a.profile == "p.json" and a.dp == 2 and a.tp == 2 and a.calibrate is False
    assert a.engines is None and a.target == 0.10 and a.no_rollout is False


class _ScriptedGate:
    """A QuietGate double: background readings come from a script, no waiting."""

    def __init__(self, readings, cores=0.5, budget_s=10.0):
        self.readings, self.cores, self.budget_s, self.waited_s = (
            list(readings),
            cores,
            budget_s,
            0.0,
        )

    def wait(self):
        self.waited_s += 0.1
        return 0.0

    def snapshot(self):
        return None

    def between(self, a, b):
        return self.readings.pop(0)


def test_replay_rounds_reruns_contended_minima():
    t = iter([1.0, 2.0, 0.5, 2.5, 0.4, 0.7])  # job 0's fastest (0.5) is contended
    calls = [lambda: next(t), lambda: next(t)]
    # Round 1: job0 1.0 (quiet), job1 2.0 (loud); round 2: job0 0.5 (loud), job1 2.5 (quiet).
    # Extra round: both minima are loud -> both re-run: 0.4 (quiet), 0.7 (quiet); then
    # both minima are quiet and the rounds stop.
    gate = _ScriptedGate([0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    a, b = replay_rounds(calls, repeats=2, gate=gate)
    assert a.seconds == (1.0, 0.5, 0.4) and a.background == (0.0, 1.0, 0.0)
    assert b.seconds == (2.0, 2.5, 0.7) and b.best == 2
    plain = replay_rounds([lambda: 1.0], repeats=3)
    assert plain[0].seconds == (1.0, 1.0, 1.0) and plain[0].background == (None,) * 3
    with pytest.raises(ValueError, match="repeats"):
        replay_rounds([lambda: 1.0], repeats=0)
