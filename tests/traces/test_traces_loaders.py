"""Loaders: format detection, streaming, validation errors naming file:line and field."""

from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtarl.traces import (
    DapoFilterBatch,
    FileKind,
    FittedWorkload,
    PromptGroup,
    RewardTiming,
    RunKind,
    RunTrace,
    TraceFormatError,
    Trajectory,
    detect_file,
    find_traces,
    iter_jsonl,
    load_fitted,
    load_trace,
)
from dtarl.traces.loaders import parse_prompt_group

# ----------------------------------------------------------------------------- synthetic


def test_detect_file_names():
    assert detect_file("a/packed_lengths_step_12.jsonl") == (FileKind.PACKED_LENGTHS, 12)
    assert detect_file("multiturn_workload_step_3.jsonl") == (FileKind.MULTITURN, 3)
    assert detect_file("reward_timings_step_0.jsonl") == (FileKind.REWARD_TIMINGS, 0)
    assert detect_file("x/dapo_filter_indices.jsonl") == (FileKind.DAPO_FILTER, None)
    assert detect_file("enhanced_task_distribution_parameters.json") == (FileKind.FITTED, None)
    with pytest.raises(TraceFormatError, match="unknown trace file name"):
        detect_file("notes.txt")


def test_single_turn_run_directory(single_run, synth):
    run = load_trace(single_run)
    assert isinstance(run, RunTrace)
    assert run.kind is RunKind.SINGLE_TURN
    assert run.task == "synth" and run.name == "synth/run1"
    assert run.steps == (0, 1)
    recs = list(run.iter_step(0))
    assert all(isinstance(r, PromptGroup) for r in recs)
    assert [(r.input, list(r.output)) for r in recs] == [(i, o) for i, o in synth.SINGLE_STEPS[0]]
    assert recs[0].dense_tokens == 4 * 5 + 21 and recs[0].tree_tokens == 5 + 21
    assert len(list(run.iter_records())) == 5
    rt = list(run.iter_reward_timings())
    assert len(rt) == 6 and all(isinstance(r, RewardTiming) for r in rt)
    (d,) = run.iter_dapo_filter()
    assert isinstance(d, DapoFilterBatch)
    assert d.kept_prompt_indices == (0, 2) and d.used_prompt_indices == (2,)
    assert d.kept_fraction == pytest.approx(2 / 3)
    with pytest.raises(TraceFormatError, match="no step 7"):
        run.iter_step(7)


def test_single_files_load(single_run):
    one = load_trace(single_run / "packed_lengths_step_1.jsonl")
    assert one.steps == (1,) and len(list(one.iter_records())) == 2
    rt = load_trace(single_run / "reward_timings_step_0.jsonl")
    assert rt.steps == () and len(list(rt.iter_reward_timings())) == 3
    dapo = load_trace(single_run / "dapo_filter_indices.jsonl")
    assert len(list(dapo.iter_dapo_filter())) == 1


def test_multi_turn_run(multi_run, synth):
    run = load_trace(multi_run)
    assert run.kind is RunKind.MULTI_TURN and run.steps == (0,)
    trajs = list(run.iter_step(0))
    assert all(isinstance(t, Trajectory) for t in trajs)
    t = trajs[2]
    assert t.turn_count == 3 and len(t.tool_calls) == 2
    assert t.model_runs == (5, 2, 6)
    # per-turn samples end where each model run ends: 6+5, 6+5+3+2, 6+20
    assert t.per_turn_lens == (11, 16, 26)
    assert t.sequence_len == 26 and not t.truncated
    assert trajs[3].truncated  # response reached max_response_len = 60
    assert trajs[3].per_turn_lens == (12, 21)


def test_streaming_is_lazy(single_run, synth):
    """A bad line after the first is only reported when reached: records stream."""
    p = single_run / "packed_lengths_step_0.jsonl"
    with open(p, "a") as f:
        f.write("{broken\n")
    it = load_trace(p).iter_records()
    assert isinstance(it, types.GeneratorType)
    first = next(it)
    assert first.input == 5
    with pytest.raises(TraceFormatError, match=r"packed_lengths_step_0.jsonl:4: malformed JSON"):
        list(it)


def test_find_traces_and_directory_errors(single_run, multi_run, fitted_file, tmp_path):
    found = find_traces(tmp_path)
    names = sorted(t.name for t in found)
    assert names == ["fitted/production", "synth/run1", "synth_mt/run2"]
    with pytest.raises(TraceFormatError, match="find_traces"):
        load_trace(tmp_path)
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "missing")


def test_blank_lines_are_skipped(tmp_path, synth):
    p = tmp_path / "packed_lengths_step_0.jsonl"
    synth.write_jsonl(p, [synth.packed_row(0, 0, 3, [1, 2]), "", synth.packed_row(0, 1, 2, [4, 5])])
    assert len(list(iter_jsonl(p))) == 2


# ----------------------------------------------------------------------------- malformed


def _packed_cases(synth):
    good = synth.packed_row(0, 0, 5, [1, 2, 3])

    def edit(**kw):
        r = copy.deepcopy(good)
        for k, v in kw.items():
            if v is None:
                del r[k]
            else:
                r[k] = v
        return r

    return [
        ("{not json", "malformed JSON"),
        (edit(input=-3), "'input' = -3: negative length"),
        (edit(output=[1, -2, 3]), "'output[1]' = -2: negative length"),
        (edit(n_sampling=4), "'output' has 3 responses but n_sampling = 4"),
        (edit(input=None), "missing field 'input'"),
        (edit(output=None), "missing field 'output'"),
        (edit(input="12"), "'input' = '12': expected an integer"),
        (edit(input=True), "'input' = True: expected an integer"),
        (edit(step=1), "'step' = 1 but the file name says step 0"),
        ("[1, 2]", "expected a JSON object"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_packed_malformed(case, tmp_path, synth):
    bad, message = _packed_cases(synth)[case]
    p = tmp_path / "packed_lengths_step_0.jsonl"
    synth.write_jsonl(p, [synth.packed_row(0, 0, 4, [1, 2, 3]), bad])
    with pytest.raises(TraceFormatError) as e:
        list(load_trace(p).iter_records())
    assert f"{p}:2:" in str(e.value)
    assert message in str(e.value)


def _traj_cases(synth):
    good = synth.trajectory_row(0, 0, 0, 6, [[1, 4], [0, 7], [1, 3]])

    def edit(fn):
        r = copy.deepcopy(good)
        fn(r)
        return r

    return [
        (
            edit(lambda r: r.update(final_response_len=15)),
            "'response_loss_mask_rle' runs sum to 14 tokens but final_response_len = 15",
        ),
        (
            edit(lambda r: r["response_loss_mask_rle"].__setitem__(1, [2, 7])),
            "'response_loss_mask_rle[1]' mask = 2",
        ),
        (
            edit(lambda r: r["response_loss_mask_rle"].__setitem__(1, [0, -7])),
            "'response_loss_mask_rle[1]' length = -7: negative length",
        ),
        (
            edit(lambda r: r["response_loss_mask_rle"].__setitem__(0, [1])),
            "'response_loss_mask_rle[0]' = [1]: expected a [mask, length] integer pair",
        ),
        (edit(lambda r: r["turns"][1].pop("completion_tokens")), "'turns[1].completion_tokens'"),
        (
            edit(lambda r: r["tool_calls"][0].update(latency_s=-1.0)),
            "'tool_calls[0].latency_s' = -1.0: must be >= 0",
        ),
        (edit(lambda r: r.update(prompt_len=-6)), "'prompt_len' = -6: negative length"),
        (edit(lambda r: r.update(turn_count=5)), "'turn_count' = 5 but the record lists 2"),
        (edit(lambda r: r.pop("prompt_group_id")), "missing field 'prompt_group_id'"),
        (edit(lambda r: r.update(final_total_len=3)), "'final_total_len' = 3 < prompt_len"),
        (edit(lambda r: r.update(turns={})), "'turns': expected a list"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_trajectory_malformed(case, tmp_path, synth):
    bad, message = _traj_cases(synth)[case]
    p = tmp_path / "multiturn_workload_step_0.jsonl"
    synth.write_jsonl(p, ["", bad])
    with pytest.raises(TraceFormatError) as e:
        list(load_trace(p).iter_records())
    assert f"{p}:2:" in str(e.value)
    assert message in str(e.value)


def test_reward_and_dapo_malformed(single_run, synth):
    p = single_run / "reward_timings_step_0.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    rows[2]["reward_time_s"] = -0.5
    synth.write_jsonl(p, rows)
    with pytest.raises(TraceFormatError, match=rf"{p}:3: field 'reward_time_s' = -0.5"):
        list(load_trace(single_run).iter_reward_timings())

    d = single_run / "dapo_filter_indices.jsonl"
    row = json.loads(d.read_text())
    for edit, msg in (
        ({"used_prompt_indices": [1]}, "not in 'kept_prompt_indices'"),
        ({"kept_prompt_indices": [0, 5]}, "index 5 >= prompt_count 3"),
        ({"kept_prompt_count": 3}, "'kept_prompt_count' = 3 but 'kept_prompt_indices' has 2"),
    ):
        synth.write_jsonl(d, [dict(row, **edit)])
        with pytest.raises(TraceFormatError) as e:
            list(load_trace(d).iter_dapo_filter())
        assert f"{d}:1:" in str(e.value) and msg in str(e.value)


def test_fitted_file(fitted_file):
    fw = load_trace(fitted_file)
    assert isinstance(fw, FittedWorkload)
    assert fw.math.joint.weights.shape == (2,)
    assert list(fw.tool.call_counts) == [1, 2]
    np.testing.assert_allclose(fw.tool.call_probs, [0.25, 0.75])
    assert fw.math.output_lognorm.mean == pytest.approx(1000 * np.exp(0.125))


def test_fitted_malformed(tmp_path, synth):
    p = tmp_path / "enhanced_task_distribution_parameters.json"
    p.write_text('{\n "math_task": {\n  "x": 1,\n }\n}')
    with pytest.raises(TraceFormatError, match=rf"{p}:4: malformed JSON"):
        load_fitted(p)
    d = synth.fitted_dict()
    del d["math_task"]["gmm_parameters"]["weights"]
    p.write_text(json.dumps(d))
    with pytest.raises(TraceFormatError, match=r"missing field 'math_task.gmm_parameters.weights'"):
        load_fitted(p)
    d = synth.fitted_dict()
    d["tool_calling_task"]["sequence_models"]["2"]["feature_names"].remove("output_2")
    p.write_text(json.dumps(d))
    with pytest.raises(TraceFormatError, match=r"sequence_models.2.*missing \['output_2'\]"):
        load_fitted(p)


@settings(max_examples=40, deadline=None)
@given(
    inp=st.integers(0, 10**6),
    outs=st.lists(st.integers(0, 10**6), min_size=1, max_size=16),
    step=st.integers(0, 1000),
)
def test_prompt_group_roundtrip(inp, outs, step):
    row = {"step": step, "input": inp, "output": outs, "n_sampling": len(outs)}
    rec = parse_prompt_group(json.loads(json.dumps(row)), "x.jsonl:1")
    assert (rec.input, rec.output, rec.n_sampling, rec.step) == (inp, tuple(outs), len(outs), step)
    assert rec.dense_tokens - rec.tree_tokens == (len(outs) - 1) * inp


# ----------------------------------------------------------------------------- shared traces


EXPECTED_RUNS = {
    # name: (kind, steps, groups per full step, n_sampling)
    "verl/20260610_092349": (RunKind.SINGLE_TURN, tuple(range(6)), 96, 8),
    "verl/20260614_023133": (RunKind.SINGLE_TURN, tuple(range(6)), 96, 8),
    "rllm/20260616_024512": (RunKind.SINGLE_TURN, tuple(range(5)), 16, 8),
    "verl-video/20260609_033329": (RunKind.SINGLE_TURN, tuple(range(1, 22)), 64, 8),
    "search_r1/0617_0223": (RunKind.MULTI_TURN, tuple(range(6)), 2048, None),
}


def test_shared_traces_all_load(polytrace_root):
    found = {t.name: t for t in find_traces(polytrace_root)}
    assert set(EXPECTED_RUNS) | {"fitted/production"} == set(found)
    for name, (kind, steps, rows, g) in EXPECTED_RUNS.items():
        run = found[name]
        assert run.kind is kind and run.steps == steps, name
        if kind is RunKind.SINGLE_TURN:
            for s in steps:
                recs = list(run.iter_step(s))
                assert len(recs) == rows and all(r.n_sampling == g for r in recs), (name, s)
    rllm = found["rllm/20260616_024512"]
    rt = list(rllm.iter_reward_timings())
    assert len(rt) > 0 and all(r.reward_time_s > 0 and r.response_max <= 16000 for r in rt)
    dapo = list(found["verl/20260614_023133"].iter_dapo_filter())
    assert len(dapo) == 6 and all(b.prompt_count == 96 for b in dapo)
    fw = found["fitted/production"]
    assert fw.math.n_samples == 385_024 and fw.tool.n_samples == 241_546
    assert list(fw.tool.call_counts) == list(range(1, 11))


def test_shared_search_r1(polytrace_root):
    run = load_trace(polytrace_root / "search_r1/profile/multiturn_workload_log/0617_0223")
    counts = {}
    for s in run.steps:
        trajs = list(run.iter_step(s))
        counts[s] = len(trajs)
        for t in trajs:
            assert sum(n for _, n in t.loss_mask_rle) == t.final_response_len
            assert len(t.per_turn_lens) <= t.turn_count
    assert counts == {0: 2048, 1: 2048, 2: 2048, 3: 2048, 4: 2048, 5: 47}
