"""Simulator: features from the engines' own prepare, NNLS recovery, rollout features by
hand, cluster properties, profile JSON, validation reports and CLI errors.

Nothing here asserts a timing: the accuracy is a benchmark number, not a test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtarl.batch import RolloutBatch
from dtarl.bench.replay import (
    ReplayConfig,
    RolloutCall,
    WorkloadSpec,
    default_tool_sampler,
    model_config_to_dict,
    model_turns,
    rollout_calls,
    tool_phase,
)
from dtarl.bench.simulate import (
    AutoCost,
    ClusterSpec,
    CostProfile,
    EngineCost,
    RolloutCost,
    RolloutFeatures,
    WorkFeatures,
    calibrate_and_replay,
    calibration_batches,
    calibration_kinds,
    calibration_plan,
    calibration_rollouts,
    engine_features,
    fit_relative,
    inference_features,
    multi_turn_batch,
    nnls,
    predict_inference,
    predict_rollout,
    predict_step,
    predict_workload,
    profile_engines,
    rollout_call_features,
    rollout_features,
    validate,
)
from dtarl.bench.simulate.calibrate import _time_auto_choice
from dtarl.cli import main
from dtarl.engines import DFSConfig, make_engine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.testing import grpo_groups
from dtarl.timing import QuietGate
from dtarl.traces import generate_workload
from dtarl.tree.plan import Op
from dtarl.tree.trie import build_tree

CFG = ModelConfig.tiny()
SMALL_MODEL = ModelConfig.tiny(num_layers=1)
KINDS = ("dense", "dfs", "prefix_reuse")
F0 = CFG.flops_per_token(0)
FA = CFG.flops_per_token(1) - F0


def hand_profile(model: ModelConfig = CFG, *, rollout: bool = True) -> CostProfile:
    costs = {
        k: EngineCost(
            kind=k, lin_s_per_flop=1e-10, attn_s_per_flop=2e-10, step_s=1e-3, const_s=5e-3
        )
        for k in KINDS
    }
    roll = (
        RolloutCost(
            prefill_s_per_flop=1e-10,
            decode_lin_s_per_flop=2e-10,
            decode_attn_s_per_flop=3e-10,
            decode_step_s=1e-4,
            call_s=0.01,
            fit_mape=1.0,
            fit_max_ape=2.0,
        )
        if rollout
        else None
    )
    return CostProfile(
        engines=costs,
        model=model,
        auto=AutoCost(s_per_token=1e-7, const_s=1e-4, fit_mape=1.0),
        rollout=roll,
        machine={"note": "hand-made"},
    )


def _real_engine(kind: str, **kw):

    return make_engine(kind, init_model(CFG, 0), **kw)


def _loss():

    return ClippedSurrogateLoss.grpo()


# ----------------------------------------------------------------------------- features


def test_dense_features_follow_the_engines_buckets():
    b = RolloutBatch.create(tokens=[np.arange(1, 6), np.arange(1, 10), np.arange(1, 4)])
    f = engine_features("dense", b, CFG, microbatch=8)
    n_mb, mb, t = _real_engine("dense", microbatch=8).prepare(b, _loss()).static
    tok = n_mb * mb * t
    assert mb * n_mb >= 3 and t >= 9
    assert f.tokens == tok and f.steps == n_mb and f.program == "dense"
    assert f.lin_flops == pytest.approx(3 * tok * F0)
    assert f.attn_flops == pytest.approx(3 * tok * t * FA)
    remat = engine_features("dense_remat", b, CFG, microbatch=8)
    assert remat.lin_flops == pytest.approx(4 * tok * F0)


def test_prefix_reuse_features_by_hand():
    # One group: prefix [1, 2] (1 input), two leaves [3], [4]: rows of 1 token each.
    b = RolloutBatch.create(tokens=[np.array([1, 2, 3]), np.array([1, 2, 4])])
    f = engine_features("prefix_reuse", b, CFG)
    g, p, n_mb, mb, c = _real_engine("prefix_reuse").prepare(b, _loss()).static[:5]
    assert (g, p, n_mb, mb, c) == (1, 1, 1, 2, 1)
    assert f.tokens == 3 and f.steps == 2
    assert f.lin_flops == pytest.approx(F0 * (3 * 1 + 3 * 2))
    assert f.attn_flops == pytest.approx(FA * (3 * 1 * 1 + 3 * 2 * (1 + 1)))


@pytest.mark.parametrize("shape", ["grpo", "unshared"])
def test_dfs_features_follow_the_plan(shape):
    """Every step's entries, by op: PUSH/POP one chunk, POP_ROWS ``rows`` chunks,
    POP_WIDE ``rows`` rows of W chunks; each entry attends its prefix bucket and
    its whole row (W chunks for a wide step)."""

    if shape == "grpo":
        b = grpo_groups(num_groups=2, group_size=3, prompt_len=70, response_len=(5, 90), seed=1)
    else:  # unrelated sequences of 20-60 tokens: rows of wide leaves
        rs = np.random.RandomState(3)
        b = RolloutBatch.create(
            tokens=[[3 + i] + list(rs.randint(3, 256, rs.randint(20, 60))) for i in range(6)],
            advantages=rs.randn(6),
        )
    f = engine_features("dfs", b, CFG, chunk_len=16)
    prep = _real_engine("dfs", chunk_len=16).prepare(b, _loss())
    steps, st = prep.args[0], prep.static
    sizes, rows, wide = st.prefix_sizes, st.rows, st.wide
    op = np.asarray(steps.op)
    chunks = np.select(
        [op == Op.PUSH, op == Op.POP, op == Op.POP_ROWS, op == Op.POP_WIDE],
        [1, 1, rows, rows * wide],
        0,
    )
    row = np.where(op == Op.POP_WIDE, 16 * wide, 16)
    ctx = np.asarray(sizes)[np.asarray(steps.pbucket)] + row
    w = np.where(op == Op.PUSH, 1, 3) * chunks
    if shape == "unshared":
        assert (op == Op.POP_WIDE).any() and wide >= 2
    assert f.steps == np.count_nonzero(op != Op.NOOP) and f.tokens == 16 * chunks.sum()
    assert f.lin_flops == pytest.approx(16 * F0 * float(w.sum()))
    assert f.attn_flops == pytest.approx(16 * FA * float((w * ctx).sum()))


def test_auto_features_are_its_picks():
    """auto's features are those of the engine it picked for this prepare. The pick is
    not compared with a second, separate choice: auto adds each candidate's measured
    host prepare seconds to the cost model, so two choices may differ on a loaded
    machine when candidates are close."""
    b = grpo_groups(num_groups=2, group_size=4, prompt_len=30, response_len=(5, 40), seed=0)
    f = engine_features("auto", b, CFG)
    assert f.program in _real_engine("auto").candidates
    assert f == engine_features(f.program, b, CFG)  # auto's candidates: the default configs


def test_unknown_engine_is_rejected():
    b = grpo_groups(num_groups=1, group_size=2, prompt_len=3, response_len=3)
    with pytest.raises(ValueError, match="accepted"):
        engine_features("sparse", b, CFG)
    with pytest.raises(ValueError, match="accepted"):
        calibration_kinds(["dense", "nope"])


def test_calibration_kinds_auto_adds_its_candidates():
    kinds, auto = calibration_kinds(["dense", "auto"])
    assert auto and set(kinds) == {"dense", "prefix_reuse", "dfs"} and kinds[0] == "dense"
    assert calibration_kinds(["dfs"]) == (["dfs"], False)


def test_calibration_plan_covers_autos_dfs_chunk():

    batches = calibration_batches(size="tiny")
    # The plan's dfs chunk differs from the one auto runs (the DFSConfig default).
    plan = calibration_plan(["auto"], batches=batches, rollout=False, chunk_len=64)
    assert plan.with_auto and set(plan.train_kinds) == {"dense", "prefix_reuse", "dfs"}
    chunks = {j.engine_kwargs.get("chunk_len") for j in plan.jobs if j.kind == "dfs"}
    assert chunks == {64, DFSConfig().chunk_len}
    assert len(plan.jobs) == len(plan.features) == 3 * len(batches) + len(batches[::2])
    assert plan.rollouts == ()
    assert not calibration_plan(["dfs"], batches=batches, rollout=False).with_auto


def test_multi_turn_batch_is_a_chain_per_sample():

    b = multi_turn_batch(
        num_groups=2, group_size=3, turns=3, prompt_len=5, turn_len=(2, 4), tool_len=(1, 3)
    )
    assert b.num_sequences == 2 * 3 * 3
    tree = build_tree(b.tokens)
    # Each turn's sequence is a prefix of the next: 2 prompts + 3 x 3 samples x 3 turns
    # (the first turn node of a sample hangs off its prompt).
    assert len(tree.children[0]) == 2
    assert tree.stats.tree_tokens < b.num_tokens


# ----------------------------------------------------------------------------- rollout features


def test_rollout_features_by_hand():
    calls = [
        RolloutCall(prompts=(np.arange(5), np.arange(3)), counts=(2, 1), forced=(10, 4, 7)),
        RolloutCall(prompts=(np.arange(20),), counts=(1,), forced=(3,)),
    ]
    f = rollout_features(calls, CFG)
    # Buckets are the max over calls: Q = 2, rows = 4, P = bucket(20) = 32, R = 16.
    q, rows, p, r = 2, 4, 32, 16
    steps = (10 - 1) + (3 - 1)
    assert f.calls == 2 and f.decode_steps == steps and f.generated == 24
    assert f.prefill_flops == pytest.approx(2 * q * p * (F0 + FA * p))
    assert f.decode_lin_flops == pytest.approx(rows * steps * F0)
    assert f.decode_attn_flops == pytest.approx(rows * steps * FA * (p + r))
    half = rollout_features(calls, CFG, dp=2)  # 2 rows and 1 prompt per rank
    assert half.decode_lin_flops == pytest.approx(2 * steps * F0)
    assert half.prefill_flops == pytest.approx(2 * 1 * p * (F0 + FA * p))


def test_rollout_calls_of_calibration_are_consistent():
    for name, calls in calibration_rollouts():
        assert calls, name
        for c in calls:
            assert sum(c.counts) == len(c.forced) and len(c.prompts) == len(c.counts)
            assert min(c.forced) >= 1


# ----------------------------------------------------------------------------- fitting


def test_nnls_recovers_and_respects_bounds():
    rs = np.random.RandomState(0)
    x = rs.rand(12, 4) * np.array([1e9, 1e10, 100.0, 1.0])
    c = np.array([2e-10, 0.0, 3e-3, 1e-2])
    np.testing.assert_allclose(nnls(x, x @ c), c, rtol=1e-6, atol=1e-12)
    # Unconstrained least squares would need a negative weight on column 1.
    y = x @ np.array([1e-10, 0, 0, 0]) - 0.5 * x[:, 1] * 1e-10
    got = nnls(x, y)
    assert np.all(got >= 0)
    for j in range(4):  # no single non-negative column does better
        cj = max(float(x[:, j] @ y) / float(x[:, j] @ x[:, j]), 0.0)
        assert np.sum((x @ got - y) ** 2) <= np.sum((x[:, j] * cj - y) ** 2) * (1 + 1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_fit_recovers_known_coefficients_from_calibration_features(kind):
    """Synthetic timings from known coefficients on the real calibration features."""
    feats = [engine_features(kind, b, CFG) for _, b in calibration_batches()]
    true = EngineCost(
        kind=kind, lin_s_per_flop=3e-11, attn_s_per_flop=5e-11, step_s=4e-4, const_s=2e-3
    )
    secs = [true.predict(f) for f in feats]
    got = EngineCost.fit(kind, feats, secs)
    assert got.fit_mape < 1e-6
    for f in feats:  # the fitted model reproduces every point
        assert got.predict(f) == pytest.approx(true.predict(f), rel=1e-6)
    np.testing.assert_allclose(got.coef, true.coef, rtol=1e-3)


def test_rollout_fit_recovers_known_coefficients():
    feats = [rollout_features(calls, CFG) for _, calls in calibration_rollouts()]
    true = RolloutCost(
        prefill_s_per_flop=2e-11,
        decode_lin_s_per_flop=6e-11,
        decode_attn_s_per_flop=9e-11,
        decode_step_s=3e-4,
        call_s=4e-3,
    )
    got = RolloutCost.fit(feats, [true.predict(f) for f in feats])
    assert got.fit_mape < 1e-6
    for f in feats:
        assert got.predict(f) == pytest.approx(true.predict(f), rel=1e-6)
    np.testing.assert_allclose(got.coef, true.coef, rtol=1e-3)


def test_fit_rejects_bad_timings():
    x = np.ones((3, 2))
    with pytest.raises(ValueError, match="> 0"):
        fit_relative(x, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="feature rows"):
        fit_relative(x, [1.0, 1.0])


def test_engine_cost_rejects_negative():
    with pytest.raises(ValueError, match="step_s"):
        EngineCost(kind="dense", lin_s_per_flop=0, attn_s_per_flop=0, step_s=-1, const_s=0)
    with pytest.raises(ValueError, match="call_s"):
        RolloutCost(
            prefill_s_per_flop=0,
            decode_lin_s_per_flop=0,
            decode_attn_s_per_flop=0,
            decode_step_s=0,
            call_s=np.nan,
        )


# ----------------------------------------------------------------------------- prediction


@pytest.mark.parametrize("kind", KINDS)
def test_prediction_monotone_in_tokens(kind):
    prof = hand_profile()
    prev = -1.0
    for resp in (4, 16, 40, 100, 200, 400):
        b = grpo_groups(num_groups=2, group_size=4, prompt_len=20, response_len=resp, seed=0)
        t = predict_step(b, prof, engines=[kind]).engines[kind].train_s
        assert t >= prev
        prev = t


def test_auto_prediction_is_its_pick_plus_the_choice():
    prof = hand_profile()
    b = grpo_groups(num_groups=2, group_size=4, prompt_len=30, response_len=(20, 90), seed=0)
    p = predict_step(b, prof, engines=["auto"]).engines["auto"]
    f = p.features[0]
    assert p.program in KINDS and p.choose_s == pytest.approx(1e-7 * b.num_tokens + 1e-4)
    assert p.train_s == pytest.approx(prof.cost(p.program).predict(f) + p.choose_s)
    no_auto = CostProfile(engines=prof.engines, model=CFG)
    assert "auto" not in no_auto.kinds
    with pytest.raises(KeyError, match="auto"):
        predict_step(b, no_auto, engines=["auto"])


@pytest.mark.parametrize("kind", KINDS)
def test_dp_split_reduces_predicted_time(kind):
    prof = hand_profile()
    b = grpo_groups(num_groups=8, group_size=4, prompt_len=30, response_len=(20, 200), seed=2)
    one = predict_step(b, prof, ClusterSpec(), engines=[kind]).engines[kind]
    two = predict_step(b, prof, ClusterSpec(devices=2, dp=2), engines=[kind]).engines[kind]
    assert one.allreduce_s == 0 and two.allreduce_s > 0 and len(two.rank_s) == 2
    assert two.train_s < one.train_s


def test_tp_and_throughput_scale():
    prof = hand_profile()
    b = grpo_groups(num_groups=2, group_size=4, prompt_len=30, response_len=100, seed=0)
    base = predict_step(b, prof, engines=["dense"]).engines["dense"]
    fast = predict_step(b, prof, ClusterSpec(throughput_scale=2.0), engines=["dense"])
    tp2 = predict_step(b, prof, ClusterSpec(devices=2, tp=2), engines=["dense"]).engines["dense"]
    assert fast.engines["dense"].train_s < base.train_s
    assert tp2.tp_comm_s > 0 and base.tp_comm_s == 0
    f = base.features[0]
    c = prof.cost("dense")
    flop_part = c.lin_s_per_flop * f.lin_flops + c.attn_s_per_flop * f.attn_flops
    assert tp2.train_s == pytest.approx(base.train_s - flop_part / 2 + tp2.tp_comm_s)


def test_predict_rollout_of_a_workload(multi_run):

    w = generate_workload(multi_run, batch_size=2, step=0, seed=0)
    t, f = predict_rollout(w, hand_profile())
    assert f.calls == len(rollout_calls(w)) and t == pytest.approx(
        hand_profile().rollout.predict(f)
    )
    assert predict_rollout(w, hand_profile(rollout=False)) is None


def test_cluster_spec_validates():
    with pytest.raises(ValueError, match="devices=4"):
        ClusterSpec(devices=4, dp=2, tp=1)
    with pytest.raises(ValueError, match="throughput_scale"):
        ClusterSpec(throughput_scale=0)
    with pytest.raises(ValueError):
        ClusterSpec(partition="round_robin")
    with pytest.raises(ValueError, match="dp=4"):
        predict_step(
            grpo_groups(num_groups=1, group_size=2, prompt_len=3, response_len=3),
            hand_profile(),
            ClusterSpec(devices=4, dp=4),
        )


# ----------------------------------------------------------------------------- profile JSON


def test_profile_json_round_trip(tmp_path):
    prof = hand_profile(ModelConfig.tiny(num_layers=3))
    p = prof.save(tmp_path / "prof.json")
    back = CostProfile.load(p)
    assert back.model == prof.model and back.chunk_len == prof.chunk_len
    assert back.auto == prof.auto and back.rollout == prof.rollout
    for k in KINDS:
        np.testing.assert_array_equal(back.cost(k).coef, prof.cost(k).coef)
    with pytest.raises(KeyError, match="not in the cost profile"):
        back.cost("dense_remat")
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        CostProfile.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not a cost profile"):
        CostProfile.from_dict({"kind": "nope"})
    old = dict(prof.to_dict(), version=1)
    with pytest.raises(ValueError, match="version"):
        CostProfile.from_dict(old)
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": ')
    with pytest.raises(ValueError, match="bad.json:1"):
        CostProfile.load(bad)


# ----------------------------------------------------------------------------- validation


def _fake_replay(spec: WorkloadSpec, model: ModelConfig, engines: dict, rollout=None, tool=None):
    """A replay JSON with chosen measurements (no timing): validate only reads these."""

    return dict(
        kind="dtarl.trace.replay",
        config=dict(model=model_config_to_dict(model), tool_time_scale=1.0),
        workloads=[
            dict(
                spec=spec.to_dict(),
                stages=dict(
                    rollout=rollout or dict(status="skipped", seconds=None),
                    tool=tool or dict(status="no tool calls", seconds=0.0),
                ),
                engines=engines,
            )
        ],
    )


def test_validate_reports_relative_errors(single_run):
    prof = hand_profile()
    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    w = spec.build(vocab_size=CFG.vocab_size)
    pred = predict_step(w, prof, engines=["dense", "dfs"])
    roll_pred, _ = predict_rollout(w, prof)
    engines = {
        "dense": dict(
            step_s=pred.engines["dense"].train_s * 1.25,
            step_min_s=pred.engines["dense"].train_s / 1.1,
        ),
        "dfs": dict(
            step_s=pred.engines["dfs"].train_s * 1.5, step_min_s=pred.engines["dfs"].train_s * 2.0
        ),
        "dense_remat": dict(step_s=1.0, step_min_s=1.0),  # not in the profile: skipped
    }
    rollout = dict(status="ok", seconds=roll_pred * 1.2, min_seconds=roll_pred * 0.8)
    rep = validate(prof, _fake_replay(spec, CFG, engines, rollout=rollout))
    by = {(r.stage, r.engine): r for r in rep.rows}
    assert set(by) == {
        ("train", "dense"),
        ("train", "dfs"),
        ("rollout", ""),
        ("step", "dense"),
        ("step", "dfs"),
    }
    assert by["train", "dense"].rel_error == pytest.approx(0.1)
    assert by["train", "dense"].rel_error_median == pytest.approx(0.2)
    assert by["train", "dfs"].rel_error == pytest.approx(0.5)
    assert by["rollout", ""].rel_error == pytest.approx(0.25)
    step = by["step", "dense"]
    assert step.predicted_s == pytest.approx(roll_pred + pred.engines["dense"].train_s)
    s = rep.summary()
    assert s["train/dfs"]["mean_pct"] == pytest.approx(50.0)
    assert rep.per_engine()["dense"] == pytest.approx(10.0)
    assert not rep.within_target()  # dfs is 50% off
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["within_target"] is False and len(d["rows"]) == 5
    assert "dfs" in rep.table()
    only = validate(prof, _fake_replay(spec, CFG, engines, rollout=rollout), engines=["dense"])
    assert {r.engine for r in only.rows if r.stage == "train"} == {"dense"}
    # A rollout on the continuous engine is not what model (2) describes: no rollout row
    # (nor the step rows built on it).
    cont = dict(rollout, detail=dict(engine="continuous"))
    rows = validate(prof, _fake_replay(spec, CFG, engines, rollout=cont)).rows
    assert {r.stage for r in rows} == {"train"}


def test_inference_prediction_by_hand_and_validated(single_run):
    prof = hand_profile()
    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    w = spec.build(vocab_size=CFG.vocab_size)
    # 12 sequences -> 16 rows; the longest (8 + 9 = 17 tokens) -> 32 positions; one forward.
    f = inference_features(w.batch, CFG)
    assert (f.lin_flops, f.attn_flops, f.steps) == (16 * 32 * F0, 16 * 32 * 32 * FA, 1.0)
    one = 1e-10 * f.lin_flops + 2e-10 * f.attn_flops + 1e-3 + 5e-3
    assert predict_inference(w, prof, passes=2) == pytest.approx(2 * one)
    assert predict_inference(w, prof, passes=0) == 0.0
    # dp = 2: each rank scores its own half; the slowest rank sets the stage.
    assert predict_inference(w, prof, ClusterSpec(devices=2, dp=2, tp=1)) < one
    rep = validate(prof, _fake_replay(spec, CFG, {"dense": dict(step_s=1.0, step_min_s=1.0)}))
    assert not [r for r in rep.rows if r.stage == "inference"]
    js = _fake_replay(spec, CFG, {"dense": dict(step_s=1.0, step_min_s=1.0)})
    js["workloads"][0]["stages"]["inference"] = dict(
        status="ok", passes=2, seconds=2.2 * one, min_seconds=2.5 * one
    )
    (row,) = [r for r in validate(prof, js).rows if r.stage == "inference"]
    assert row.rel_error == pytest.approx(0.2)  # |2 - 2.5| / 2.5


def test_predicted_rollout_puts_tools_on_trajectory_timelines(multi_run):
    prof = hand_profile()
    spec = WorkloadSpec(name="mt", source=str(multi_run), batch_size=2, step=0, seed=1)
    w = spec.build(vocab_size=CFG.vocab_size)
    per_call = [prof.rollout.predict(f) for f in rollout_call_features(rollout_calls(w), CFG)]
    p = predict_workload(spec, prof, tool_time_scale=0.5)
    assert sum(per_call) == pytest.approx(p.rollout_s)  # per-call prices add up
    tool = tool_phase(w, default_tool_sampler(spec.source), time_scale=0.5, seed=spec.seed)
    turns = model_turns(w)
    want = max(
        sum(per_call[: len(turns[t][1])]) + 0.5 * x
        for t, x in zip(sorted(turns), tool.per_trajectory_s, strict=True)
    )
    assert p.rollout_step_s == pytest.approx(want)
    # Never above the serial bound (here equal: the slowest trajectory has the most turns).
    assert p.rollout_step_s <= p.rollout_s + p.tool_s + 1e-12
    total = want + p.reward_s + p.inference_s + p.engines["dense"].train_s
    assert p.step_s("dense") == pytest.approx(total)
    # Production tool seconds: no timeline, no step total.
    q = predict_workload(spec, prof)
    assert q.rollout_step_s is None and q.tool_s > 0 and q.step_s("dense") is None


def test_validate_rejects_mismatched_input(single_run):
    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    rj = _fake_replay(spec, CFG, {"dense": dict(step_s=0.1, step_min_s=0.1)})
    with pytest.raises(ValueError, match="different model"):
        validate(hand_profile(ModelConfig.tiny(num_layers=1)), rj)
    with pytest.raises(ValueError, match="no \\(workload, engine\\) pair"):
        validate(hand_profile(), _fake_replay(spec, CFG, {"dense_remat": dict(step_s=0.1)}))
    with pytest.raises(ValueError, match="missing field"):
        validate(hand_profile(), {"kind": "dtarl.trace.replay"})


def test_cli_validate_and_bad_input(single_run, tmp_path, capsys):

    prof = hand_profile().save(tmp_path / "p.json")
    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    rj = tmp_path / "replay.json"
    rj.write_text(json.dumps(_fake_replay(spec, CFG, {"dense": dict(step_s=0.2, step_min_s=0.1)})))
    out = tmp_path / "v"
    assert (
        main(
            ["trace", "simulate", "--profile", str(prof), "--validate", str(rj), "--out", str(out)]
        )
        == 0
    )
    d = json.loads((out / "validation.json").read_text())
    assert d["rows"][0]["engine"] == "dense" and d["rows"][0]["measured_s"] == 0.1
    assert "train/dense" in capsys.readouterr().out
    assert main(["trace", "simulate", "--profile", str(tmp_path / "none.json")]) == 2
    assert "--calibrate" in capsys.readouterr().err
    assert (
        main(["trace", "simulate", "--profile", str(prof), "--validate", str(tmp_path / "x.json")])
        == 2
    )
    assert "dtarl trace replay" in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end


def test_profile_engines_tiny_end_to_end(tmp_path):
    """A real (tiny) calibration: structure only, the numbers are machine dependent."""
    prof = profile_engines(
        ("dense",),
        model=SMALL_MODEL,
        batches=calibration_batches(size="tiny")[:2],
        rollouts=calibration_rollouts(size="tiny"),
        repeats=2,
        gate=QuietGate(cores=None),  # no waiting for other processes in tests
    )
    assert set(prof.engines) == {"dense"} and prof.auto is None and "auto" not in prof.kinds
    assert [p.kind for p in prof.points].count("dense") == 2
    for p in prof.points:
        assert 0 < p.measured_s <= p.median_s
    if prof.rollout is not None:  # dtarl.rollout has a forced-length sampler
        assert [p.kind for p in prof.points].count("rollout") == 1
    loaded = CostProfile.load(prof.save(tmp_path / "profile.json"))
    assert loaded.points == prof.points and loaded.rollout == prof.rollout


def test_auto_choice_overhead_is_host_time():

    got = _time_auto_choice(CFG, calibration_batches(size="tiny"), repeats=3, gate=None)
    assert len(got) == 3 and all(mn > 0 and med > 0 for mn, med in got)


def test_step_features_row():
    f = WorkFeatures(lin_flops=1.0, attn_flops=2.0, steps=3.0, tokens=4.0)
    np.testing.assert_array_equal(f.row(), [1.0, 2.0, 3.0, 1.0])
    r = RolloutFeatures(
        prefill_flops=1.0, decode_lin_flops=2.0, decode_attn_flops=3.0, decode_steps=4.0, calls=5.0
    )
    np.testing.assert_array_equal(r.row(), [1.0, 2.0, 3.0, 4.0, 5.0])


def test_calibrate_and_replay_share_the_rounds(single_run):
    """--joint: the calibration jobs ride along the replay's timing rounds."""

    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    cfg = ReplayConfig(model=SMALL_MODEL, repeats=2, rollout_repeats=2, quiet_cores=None)
    prof, res = calibrate_and_replay(
        [spec],
        ["dense"],
        cfg,
        batches=calibration_batches(size="tiny")[:2],
        rollouts=calibration_rollouts(size="tiny"),
    )
    assert [t.kind for t in res.extra_engines] == ["dense", "dense"]
    assert len(res.workloads) == 1 and set(res.workloads[0].engines) == {"dense"}
    assert [p.measured_s for p in prof.points if p.kind == "dense"] == [
        t.step_min_s for t in res.extra_engines
    ]
    assert prof.machine["joint_with_replay"] is True
    rep = validate(prof, json.loads(json.dumps(res.to_dict())))
    assert {(r.stage, r.engine) for r in rep.rows} >= {("train", "dense")}
    if prof.rollout is not None:  # a forced-length sampler exists
        assert len(res.extra_rollouts) == 1 and ("rollout", "") in {
            (r.stage, r.engine) for r in rep.rows
        }


def test_validate_warns_about_contended_measurements(single_run):
    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    loud = dict(step_s=0.2, step_min_s=0.1, runs_s=[0.2, 0.1], background_cores=[0.0, 1.0])
    quiet = dict(loud, background_cores=[1.0, 0.0])
    rep = validate(hand_profile(), _fake_replay(spec, CFG, {"dense": loud}))
    assert len(rep.contended_rows) == 1 and rep.rows[0].background_cores == 1.0
    assert "replay measurements" in rep.warnings()[0] and "WARNING" in rep.table()
    assert validate(hand_profile(), _fake_replay(spec, CFG, {"dense": quiet})).warnings() == []
