"""Simulator: features by hand, NNLS, structural properties, JSON round trip, end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtarl.engines.batch import RolloutBatch
from dtarl.model import ModelConfig
from dtarl.testing import grpo_groups
from dtarl.traces.replay import ReplayConfig, WorkloadSpec, load_replay_json, replay
from dtarl.traces.simulate import (
    ClusterSpec,
    CostProfile,
    EngineCost,
    StepFeatures,
    calibration_batches,
    engine_features,
    nnls,
    predict_step,
    profile_engines,
    validate,
)

CFG = ModelConfig.tiny()
SMALL_MODEL = ModelConfig.tiny(num_layers=1)
KINDS = ("dense", "dfs", "prefix_reuse")  # prefix_reuse exercises the generic tree features


def hand_profile(model: ModelConfig = CFG) -> CostProfile:
    costs = {
        k: EngineCost(
            kind=k, lin_s_per_flop=1e-10, attn_s_per_flop=2e-10, step_s=1e-3, const_s=5e-3
        )
        for k in KINDS
    }
    return CostProfile(engines=costs, model=model, machine={"note": "hand-made"})


def test_dense_features_by_hand():
    b = RolloutBatch.create(tokens=[np.arange(1, 6), np.arange(1, 10), np.arange(1, 4)])
    f = engine_features("dense", b, CFG, microbatch=8)
    # T = bucket(9, min 8) = 16, rows = bucket(3) = 4 in one microbatch of 4.
    f0 = CFG.flops_per_token(0)
    fa = CFG.flops_per_token(1) - f0
    assert f.tokens == 64 and f.steps == 1
    assert f.lin_flops == pytest.approx(3 * 64 * f0)
    assert f.attn_flops == pytest.approx(3 * 64 * 16 * fa)


def test_generic_tree_features_by_hand():
    b = RolloutBatch.create(tokens=[np.array([1, 2, 3]), np.array([1, 2, 4])])
    f = engine_features("prefix_reuse", b, CFG)
    f0 = CFG.flops_per_token(0)
    fa = CFG.flops_per_token(1) - f0
    # Tree: [1, 2] at depths 0, 1; leaves [3], [4] at depth 2: 4 tokens, depth sum 5, 3 nodes.
    assert f.tokens == 4 and f.steps == 3
    assert f.lin_flops == pytest.approx(3 * 4 * f0)
    assert f.attn_flops == pytest.approx(3 * 5 * fa)


def test_dfs_features_follow_the_plan():
    from dtarl.tree.plan import Op, compile_plan
    from dtarl.tree.trie import build_tree

    b = grpo_groups(num_groups=2, group_size=3, prompt_len=70, response_len=(5, 90), seed=1)
    plan = compile_plan(build_tree(b.tokens), chunk_len=16)  # packs leaves, like the engine
    f = engine_features("dfs", b, CFG, chunk_len=16)
    n_push, n_pop = int((plan.op == Op.PUSH).sum()), int((plan.op == Op.POP).sum())
    f0 = CFG.flops_per_token(0)
    assert f.steps == plan.op.shape[0]
    assert f.lin_flops == pytest.approx(16 * (n_push + 3 * n_pop) * f0)


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
def test_prediction_monotone_in_tokens(kind):
    prof = hand_profile()
    prev = -1.0
    for resp in (4, 16, 40, 100, 200, 400):
        b = grpo_groups(num_groups=2, group_size=4, prompt_len=20, response_len=resp, seed=0)
        t = predict_step(b, prof, engines=[kind]).engines[kind].train_s
        assert t >= prev
        prev = t


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


def test_profile_json_round_trip(tmp_path):
    prof = hand_profile(ModelConfig.tiny(num_layers=3))
    p = prof.save(tmp_path / "prof.json")
    back = CostProfile.load(p)
    assert back.model == prof.model and back.chunk_len == prof.chunk_len
    for k in KINDS:
        np.testing.assert_array_equal(back.cost(k).coef, prof.cost(k).coef)
    with pytest.raises(KeyError, match="not in the cost profile"):
        back.cost("dense_remat")
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        CostProfile.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not a cost profile"):
        CostProfile.from_dict({"kind": "nope"})


def test_engine_cost_rejects_negative():
    with pytest.raises(ValueError, match="step_s"):
        EngineCost(kind="dense", lin_s_per_flop=0, attn_s_per_flop=0, step_s=-1, const_s=0)


def test_simulator_end_to_end_tiny(single_run, tmp_path):
    """Profile -> JSON -> replay -> validate. Accuracy is a benchmark number, not asserted."""
    prof = profile_engines(
        ("dense",), model=SMALL_MODEL, batches=calibration_batches(size="tiny")[:2], repeats=1
    )
    assert len(prof.points) == 2 and prof.cost("dense").fit_mape >= 0
    loaded = CostProfile.load(prof.save(tmp_path / "profile.json"))
    for pt_a, pt_b in zip(prof.points, loaded.points, strict=True):
        assert pt_a == pt_b
    spec = WorkloadSpec(name="st", source=str(single_run), batch_size=3, step=0)
    cfg = ReplayConfig(engines=("dense",), repeats=1, model=SMALL_MODEL, rollout=False)
    res = replay([spec], cfg)
    rj = load_replay_json(res.save(tmp_path / "replay.json"))
    rep = validate(loaded, rj)
    (row,) = rep.rows
    assert row.workload == "st" and row.engine == "dense"
    assert row.measured_s == pytest.approx(res.workloads[0].engines["dense"].step_s)
    assert row.predicted_s > 0 and np.isfinite(rep.mean_abs_pct_error)
    d = json.loads(json.dumps(rep.to_dict()))
    assert set(d["per_engine_mean_abs_pct_error"]) == {"dense"}
    assert rep.plot(tmp_path / "v.png").stat().st_size > 0
    other = hand_profile(ModelConfig.tiny())  # a different model than the replay ran
    with pytest.raises(ValueError, match="different model"):
        validate(other, rj)


def test_step_features_row():
    f = StepFeatures(lin_flops=1.0, attn_flops=2.0, steps=3.0, tokens=4.0)
    np.testing.assert_array_equal(f.row(), [1.0, 2.0, 3.0, 1.0])
