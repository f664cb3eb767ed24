"""engine="auto": FLOP counts, the cost model's choice and fit, and delegation."""

import numpy as np
import pytest
from test_equivalence import _engine, _model, reference, rel_errors
from test_prefix_reuse import pr_engine

from dtarl.engines import AutoEngine, RolloutBatch
from dtarl.engines.cost import (
    CostModel,
    EngineCoef,
    EngineWork,
    dense_flops,
    engine_work,
    fit_cost_model,
    ideal_ratio,
    run_flops,
    tree_flops,
)
from dtarl.model import ModelConfig, ModelFamily
from dtarl.rl.losses import MaskedNLLLoss
from dtarl.testing import grpo_groups
from dtarl.tree import build_tree

CFG = ModelConfig.tiny()


def multiturn(turns, branch, prompt, turn_len, seed=0):
    rs = np.random.RandomState(seed)
    seqs = [list(rs.randint(3, 256, prompt))]
    for _ in range(turns):
        seqs = [s + list(rs.randint(3, 256, turn_len)) for s in seqs for _ in range(branch)]
    return RolloutBatch.create(tokens=seqs, advantages=rs.randn(len(seqs)))


def test_flops_hand_computed():
    # run_flops sums flops_per_token(t + 1) over the run's positions (linear in context).
    want = sum(CFG.flops_per_token(t + 1) for t in range(3, 10))
    assert run_flops(CFG, 3, 7) == pytest.approx(want, rel=1e-12)
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [9, 9]]
    dense = 3 * sum(sum(CFG.flops_per_token(t + 1) for t in range(len(s))) for s in seqs)
    assert dense_flops(CFG, seqs) == pytest.approx(dense, rel=1e-12)
    # Tree nodes: [1,2,3] [4] [5,6] [9,9].
    tree = 3 * sum(CFG.flops_per_token(t + 1) for t in (0, 1, 2, 3, 3, 4, 0, 1))
    assert tree_flops(CFG, seqs) == pytest.approx(tree, rel=1e-12)
    assert ideal_ratio(CFG, seqs) == pytest.approx(dense / tree)


def test_engine_work_orders():
    grpo = grpo_groups(num_groups=2, group_size=8, prompt_len=256, response_len=64, seed=1)
    assert build_tree(grpo.tokens).stats.depth == 2  # no two responses share a first token
    w = engine_work(CFG, grpo)
    tf = tree_flops(CFG, grpo)
    # Depth 2: prefix_reuse (prefix kept) computes exactly the tree; dfs adds a prefix forward.
    assert w["prefix_reuse"].flops == pytest.approx(tf, rel=1e-9)
    assert tf < w["dfs"].flops < w["dense"].flops
    assert w["prefix_reuse"].steps < w["dfs"].steps
    deep = multiturn(3, 3, 32, 32)
    wd = engine_work(CFG, deep)
    # Below the top fork prefix_reuse recomputes shared turns; dfs does not.
    assert wd["dfs"].flops < wd["prefix_reuse"].flops < wd["dense"].flops


def test_default_choice():
    auto = AutoEngine(_model(ModelFamily.QWEN3)[0])
    grpo = grpo_groups(num_groups=2, group_size=8, prompt_len=256, response_len=64)
    kind, reason, pred = auto.choose(grpo)
    assert kind == "prefix_reuse" and reason.startswith("prefix_reuse: predicted")
    assert set(pred) == {"dense", "prefix_reuse", "dfs"}
    no_share = RolloutBatch.create(tokens=[[i, 5, 6, 7] for i in range(3, 11)])
    # A fresh engine: buckets only grow, so after the GRPO batch dense would pad
    # these 4-token sequences to the GRPO length (and the prediction says so).
    assert AutoEngine(auto.model).choose(no_share)[0] == "dense"
    # Candidates restrict the choice.
    only = AutoEngine(auto.model, candidates=("dense", "dfs"))
    assert only.choose(grpo)[0] in ("dense", "dfs")
    with pytest.raises(ValueError, match="candidates"):
        AutoEngine(auto.model, candidates=("tree",))


def test_fit_cost_model_recovers_coefficients():
    true = {
        "dense": EngineCoef(seconds_per_flop=1e-10, seconds_per_step=1e-3),
        "prefix_reuse": EngineCoef(seconds_per_flop=2e-10, seconds_per_step=5e-4),
        "dfs": EngineCoef(seconds_per_flop=1e-10, seconds_per_step=4e-3),
    }
    samples = []
    for f, s in ((1e8, 4), (5e8, 10), (2e9, 7)):
        for e, c in true.items():
            w = EngineWork(engine=e, flops=f, steps=s)
            samples.append((e, w, c.predict(w)))
    fitted = fit_cost_model(samples)
    for e, c in true.items():
        assert fitted.coefs[e].seconds_per_flop == pytest.approx(c.seconds_per_flop, rel=1e-6)
        assert fitted.coefs[e].seconds_per_step == pytest.approx(c.seconds_per_step, rel=1e-6)
    # A deep tree under these coefficients: dfs's per-step overhead is high, but a
    # calibrated model with cheap dfs steps picks dfs.
    deep = multiturn(3, 4, 16, 16)
    cheap_dfs = CostModel(
        coefs=dict(true, dfs=EngineCoef(seconds_per_flop=1e-10, seconds_per_step=0))
    )
    assert cheap_dfs.choose(engine_work(CFG, deep))[0] == "dfs"
    with pytest.raises(ValueError, match="missing engines"):
        CostModel(coefs={"dense": true["dense"]})


def test_auto_delegates_and_reports():
    """Auto runs the chosen engine's compiled program (shared with that engine) and
    matches the reference; stats say which engine and why."""
    model, params = _model(ModelFamily.QWEN3)
    engines = {
        "dense": _engine("dense", ModelFamily.QWEN3),
        "dfs": _engine("dfs", ModelFamily.QWEN3),
        "prefix_reuse": pr_engine(),
    }
    auto = AutoEngine(model, engines=engines)
    loss = MaskedNLLLoss()
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=30, response_len=(3, 8), seed=2)
    kind = auto.choose(batch)[0]
    want_loss, want_grads, want_logp = reference(model, params, batch, loss)
    got_loss, got_grads, aux = auto.value_and_grad(params, batch, loss)
    assert aux.stats["engine"] == "auto" and aux.stats["chosen_engine"] == kind
    assert aux.stats["choice_reason"].startswith(kind)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert max(rel_errors(got_grads, want_grads)) <= 1e-5
    for a, b in zip(aux.logprobs, want_logp, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # The program is the inner engine's own: running it directly does not retrace.
    before = auto.trace_count
    engines[kind].value_and_grad(params, batch, loss)
    assert auto.trace_count == before


def test_prepared_work_counts_padding():
    """auto predicts from what each program computes, padding included."""
    auto = AutoEngine(_model(ModelFamily.QWEN3)[0], chunk_len=32)
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=40, response_len=(5, 20), seed=9)
    work, prepared = auto.prepared_work(batch)
    ideal = engine_work(CFG, batch, chunk_len=32)
    for kind in ("dense", "prefix_reuse", "dfs"):
        assert work[kind].flops >= ideal[kind].flops * (1 - 1e-9), kind
        assert work[kind].steps == prepared[kind].stats["work_steps"]
    assert work["dfs"].steps == prepared["dfs"].stats["num_steps"]
    st = prepared["dense"].stats
    rows = st["computed_tokens"] // st["padded_length"]
    assert work["dense"].flops == pytest.approx(3 * rows * run_flops(CFG, 0, st["padded_length"]))
    # The chosen engine's prepared batch is the one that runs (no second prepare).
    kind, _, pred = auto.choose(batch)
    assert min(pred, key=pred.get) == kind
