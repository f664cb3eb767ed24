"""engine="auto": FLOP counts, the cost model's choice and fit, delegation, and
the per-bucket autotuning (with a fake timer: no assertion depends on real time)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_math
from test_equivalence import _engine, _model, reference, rel_errors
from test_prefix_reuse import pr_engine

from dtarl.engines import AutoEngine, DFSConfig, EngineConfig, PrefixReuseConfig, RolloutBatch
from dtarl.engines import auto as auto_lib
from dtarl.engines.auto import time_program, time_programs
from dtarl.engines.base import WorkFeatures
from dtarl.engines.cost import (
    CostModel,
    EngineCoef,
    dense_flops,
    fit_cost_model,
    ideal_ratio,
    run_flops,
    token_flops,
    tree_flops,
)
from dtarl.losses import MaskedNLLLoss
from dtarl.model import ModelConfig, ModelFamily
from dtarl.testing import grpo_groups
from dtarl.tree import build_tree

CFG = ModelConfig.tiny()


def NO_HOST(kind, batch):
    """A fixed host cost: no choice checked here depends on this machine's speed."""
    return 0.0


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
    """Each engine's own count of its padded work orders the engines as expected."""
    model = _model(ModelFamily.QWEN3)[0]
    grpo = grpo_groups(num_groups=2, group_size=8, prompt_len=256, response_len=64, seed=1)
    assert build_tree(grpo.tokens).stats.depth == 2  # no two responses share a first token
    w, _ = AutoEngine(model).prepared_work(grpo)
    tf = tree_flops(CFG, grpo)
    # Every program computes at least the tree once; dense far more on shared prompts.
    assert tf < w["prefix_reuse"].flops < w["dense"].flops
    assert tf < w["dfs"].flops < w["dense"].flops
    assert w["prefix_reuse"].total_steps < w["dfs"].total_steps
    deep = multiturn(3, 3, 32, 32)
    # (dfs with chunks as long as a turn, so that padding does not decide)
    config = EngineConfig(
        dfs=DFSConfig(chunk_len=32), prefix_reuse=PrefixReuseConfig(deep_trees="rows")
    )
    rows = AutoEngine(model, engine_config=config)
    wd, _ = rows.prepared_work(deep)
    # Below the top fork the rows form recomputes shared turns; dfs does not.
    assert wd["dfs"].flops < wd["prefix_reuse"].flops < wd["dense"].flops


def test_default_choice():
    auto = AutoEngine(_model(ModelFamily.QWEN3)[0], host_seconds=NO_HOST)
    grpo = grpo_groups(num_groups=2, group_size=8, prompt_len=256, response_len=64)
    kind, reason, pred = auto.choose(grpo)
    assert kind == "prefix_reuse" and reason.startswith("prefix_reuse: predicted")
    assert set(pred) == {"dense", "prefix_reuse", "dfs"}
    no_share = RolloutBatch.create(tokens=[[i, 5, 6, 7] for i in range(3, 11)])
    # A fresh engine: buckets only grow, so after the GRPO batch dense would pad
    # these 4-token sequences to the GRPO length (and the prediction says so).
    assert AutoEngine(auto.model, host_seconds=NO_HOST).choose(no_share)[0] == "dense"
    # Candidates restrict the choice.
    only = AutoEngine(auto.model, candidates=("dense", "dfs"), host_seconds=NO_HOST)
    assert only.choose(grpo)[0] in ("dense", "dfs")
    with pytest.raises(ValueError, match="candidates"):
        AutoEngine(auto.model, candidates=("tree",))
    # The host cost is part of each estimate: a prefix_reuse prepare of 10 s loses.
    slow_host = AutoEngine(
        auto.model, host_seconds=lambda kind, batch: 10.0 if kind == "prefix_reuse" else 0.0
    )
    kind, reason, _ = slow_host.choose(grpo)
    assert kind != "prefix_reuse" and "prefix_reuse 1e+04 ms" in reason


def test_fit_cost_model_recovers_coefficients():
    true = {
        "dense": EngineCoef(seconds_per_flop=1e-10, seconds_per_step=1e-3),
        "prefix_reuse": EngineCoef(seconds_per_flop=2e-10, seconds_per_step=5e-4),
        "dfs": EngineCoef(seconds_per_flop=1e-10, seconds_per_step=4e-3),
    }
    samples = []
    for f, s in ((1e8, 4), (5e8, 10), (2e9, 7)):
        for e, c in true.items():
            w = WorkFeatures(lin_flops=f, attn_flops=0.0, steps=s, tokens=0.0, program=e)
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
    turn_chunks = EngineConfig(dfs=DFSConfig(chunk_len=16))  # dfs chunks as long as a turn
    work, _ = AutoEngine(_model(ModelFamily.QWEN3)[0], engine_config=turn_chunks).prepared_work(
        deep
    )
    assert cheap_dfs.choose(work)[0] == "dfs"
    with pytest.raises(ValueError, match="missing engines"):
        CostModel(coefs={"dense": true["dense"]})


def _engines():
    """Pre-sized engines shared with the equivalence tests (compiled once per loss)."""
    return {
        "dense": _engine("dense", ModelFamily.QWEN3),
        "dfs": _engine("dfs", ModelFamily.QWEN3),
        "prefix_reuse": pr_engine(),
    }


def _batch():
    return grpo_groups(num_groups=2, group_size=4, prompt_len=30, response_len=(3, 8), seed=2)


def _check_reference(model, params, batch, loss, got_loss, got_grads, aux):
    want_loss, want_grads, want_logp = reference(model, params, batch, loss)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert max(rel_errors(got_grads, want_grads)) <= 1e-5
    for a, b in zip(aux.logprobs, want_logp, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    reference_math.check(
        model.cfg, params, batch, loss, got_loss, got_grads, aux.logprobs, name="auto"
    )


class FakeTimer:
    """Fixed seconds per engine; records what it timed. Runs each program once
    (compiling it, as the real timer's warm-up does)."""

    def __init__(self, seconds):
        self.seconds = dict(seconds)
        self.calls = []  # every program timed, in order
        self.rounds = []  # the programs timed together, per call

    def __call__(self, runs):
        self.rounds.append(sorted(runs))
        for kind, run in runs.items():
            self.calls.append(kind)
            jax.block_until_ready(run())
        return {kind: self.seconds[kind] for kind in runs}


def _model_predicting(auto, batch, loss, target):
    """A cost model whose prediction for ``batch`` is exactly ``target[e]`` seconds."""
    work, _ = auto.prepared_work(batch, loss)
    return CostModel(
        coefs={
            e: EngineCoef(seconds_per_flop=target[e] / work[e].flops, seconds_per_step=0.0)
            for e in work
        }
    )


def test_auto_delegates_and_reports():
    """autotune=False: auto runs the cost model's pick with the chosen engine's
    compiled program (shared with that engine), matches the reference, never times;
    stats say which engine and why."""
    model, params = _model(ModelFamily.QWEN3)
    engines = _engines()
    timer = FakeTimer({})
    auto = AutoEngine(model, engines=engines, autotune=False, timer=timer, host_seconds=NO_HOST)
    loss = MaskedNLLLoss()
    batch = _batch()
    kind = auto.choose(batch)[0]
    got_loss, got_grads, aux = auto.value_and_grad(params, batch, loss)
    assert aux.stats["engine"] == "auto" and aux.stats["chosen_engine"] == kind
    assert aux.stats["choice_reason"].startswith(kind)
    assert aux.stats["choice_basis"] == "predicted" and aux.stats["autotune_seconds"] == 0.0
    assert timer.calls == [] and auto.timings == {} and aux.stats["measured_seconds"] == {}
    _check_reference(model, params, batch, loss, got_loss, got_grads, aux)
    # The program is the inner engine's own: running it directly does not retrace.
    before = auto.trace_count
    engines[kind].value_and_grad(params, batch, loss)
    assert auto.trace_count == before


def test_autotune_overrides_a_wrong_cost_model():
    """Measurements beat a cost model that ranks the engines backwards; the run
    still equals the dense reference; the next batch in the same buckets is neither
    timed nor recompiled; prepare() (the sharded path) follows the measurements."""
    model, params = _model(ModelFamily.QWEN3)
    loss = MaskedNLLLoss()
    batch = _batch()
    fake = {"dense": 0.3, "prefix_reuse": 0.2, "dfs": 0.1}
    timer = FakeTimer(fake)
    auto = AutoEngine(model, engines=_engines(), tune_margin=4.0, timer=timer, host_seconds=NO_HOST)
    auto.cost_model = _model_predicting(
        auto, batch, loss, {"dense": 0.1, "prefix_reuse": 0.2, "dfs": 0.3}
    )
    assert auto.choose(batch, loss)[0] == "dense"  # what the model alone would run
    got_loss, got_grads, aux = auto.value_and_grad(params, batch, loss)
    st = aux.stats
    assert st["chosen_engine"] == "dfs" and st["choice_basis"] == "measured"
    assert st["choice_reason"].startswith("dfs: measured 100 ms (vs dense measured 300 ms")
    assert sorted(timer.calls) == sorted(fake) and sorted(st["autotuned"]) == sorted(fake)
    assert st["measured_seconds"] == fake and st["autotune_seconds"] > 0
    assert st["predicted_seconds"]["dense"] == pytest.approx(0.1)
    _check_reference(model, params, batch, loss, got_loss, got_grads, aux)

    # Same buckets (same tokens, other advantages): no timing, no retrace.
    again = RolloutBatch.create(tokens=batch.tokens, advantages=-batch.advantages)
    traces = auto.trace_count
    _, _, aux2 = auto.value_and_grad(params, again, loss)
    assert len(timer.calls) == 3 and auto.trace_count == traces
    assert aux2.stats["chosen_engine"] == "dfs" and aux2.stats["autotune_seconds"] == 0.0
    # The same signature: the measured choice is reused, and only dfs prepared.
    assert aux2.stats["autotuned"] == [] and aux2.stats["choice_basis"] == "reused"
    assert aux2.stats["choice_reason"].startswith("dfs: measured 100 ms on a batch with the same")
    assert aux2.stats["predicted_seconds"] == {}
    _check_reference(model, params, again, loss, *aux2_run(auto, params, again, loss))
    # Without reuse every candidate prepares, and the bucket's measurement decides.
    auto.config = dataclasses.replace(auto.config, reuse_choices=False)
    _, _, aux3 = auto.value_and_grad(params, again, loss)
    assert len(timer.calls) == 3 and auto.trace_count == traces
    assert aux3.stats["chosen_engine"] == "dfs" and aux3.stats["choice_basis"] == "measured"
    assert aux3.stats["choice_reason"].startswith("dfs: bucket-measured x")
    # With reuse, every recheck_every-th batch of a signature is chosen in full.
    auto.config = dataclasses.replace(auto.config, reuse_choices=True, recheck_every=2)
    auto._reused.clear()
    bases = [auto.value_and_grad(params, again, loss)[2].stats["choice_basis"] for _ in range(4)]
    assert bases == ["reused", "measured", "reused", "measured"] and len(timer.calls) == 3
    auto.config = dataclasses.replace(auto.config, reuse_choices=False)
    # The same sizes without the shared prompts: another signature, no reuse.
    unshared = RolloutBatch.create(tokens=[[3 + i, *t[1:]] for i, t in enumerate(batch.tokens)])
    assert auto.signature(unshared, loss) != auto.signature(batch, loss)
    assert auto._reuse(unshared, loss, None) is None

    # prepare() never times, but uses the corrected estimates.
    prepared = auto.prepare(batch, loss)
    assert prepared.static[0] == "dfs" and len(timer.calls) == 3
    for e, s in fake.items():
        assert prepared.stats["estimated_seconds"][e] == pytest.approx(s)
    # The correction is measured / predicted against the current model: a refit
    # that doubles every prediction leaves the timed buckets' estimates alone.
    auto.cost_model = CostModel(
        coefs={
            e: EngineCoef(seconds_per_flop=2 * c.seconds_per_flop, seconds_per_step=0.0)
            for e, c in auto.cost_model.coefs.items()
        }
    )
    kind, _, est = auto.choose(batch, loss)
    assert kind == "dfs" and est == pytest.approx(fake)


def test_a_tree_engine_within_the_noise_of_dense_is_not_picked():
    """A tree engine measured at most ``prefer_dense_within`` faster than dense loses to
    dense (its bigger program is not worth a gain within the timing noise); a larger
    gain wins; 0 picks the measured fastest. The choice is what later batches of the
    signature reuse, and prepare() (never timed) agrees."""
    model, params = _model(ModelFamily.QWEN3)
    loss = MaskedNLLLoss()
    batch = _batch()
    picks = {}
    engines = _engines()  # shared: each program compiles once
    for fake, within in (
        ({"dense": 0.102, "dfs": 0.1}, 0.03),  # 1.96% faster
        ({"dense": 0.110, "dfs": 0.1}, 0.03),  # 9.1% faster
        ({"dense": 0.102, "dfs": 0.1}, 0.0),
    ):
        auto = AutoEngine(
            model,
            engines=engines,
            candidates=("dense", "dfs"),
            tune_all_below=1.0,
            prefer_dense_within=within,
            timer=FakeTimer(fake),
            host_seconds=NO_HOST,
        )
        _, _, aux = auto.value_and_grad(params, batch, loss)
        st = aux.stats
        picks[fake["dense"], within] = st["chosen_engine"]
        assert st["choice_basis"] == "measured" and st["measured_seconds"] == fake
        assert auto.prepare(batch, loss).stats["chosen_engine"] == st["chosen_engine"]
        again = auto.value_and_grad(params, batch, loss)[2].stats
        assert again["choice_basis"] == "reused"
        assert again["chosen_engine"] == st["chosen_engine"]
        if st["chosen_engine"] == "dense":
            note = "dfs measured 2.0% faster, within prefer_dense_within=0.03: dense"
            assert note in st["choice_reason"]
    assert picks == {(0.102, 0.03): "dense", (0.110, 0.03): "dfs", (0.102, 0.0): "dfs"}
    with pytest.raises(ValueError, match="prefer_dense_within"):
        AutoEngine(model, prefer_dense_within=-0.1)


def aux2_run(auto, params, batch, loss):
    got_loss, got_grads, aux = auto.value_and_grad(params, batch, loss)
    assert aux.stats["choice_basis"] == "reused"
    return got_loss, got_grads, aux


def test_autotune_margin():
    """Only candidates within tune_margin of the best estimate are timed; the margin
    is checked again after each timing round (a predicted best that measures slow
    brings the next candidate in), and a candidate far outside is never timed."""
    model, params = _model(ModelFamily.QWEN3)
    loss = MaskedNLLLoss()
    batch = _batch()
    timer = FakeTimer({"dense": 1.0, "prefix_reuse": 0.4, "dfs": 0.1})
    auto = AutoEngine(model, engines=_engines(), tune_margin=2.0, timer=timer, host_seconds=NO_HOST)
    auto.cost_model = _model_predicting(
        auto, batch, loss, {"dense": 0.1, "prefix_reuse": 0.3, "dfs": 10.0}
    )
    _, _, aux = auto.value_and_grad(params, batch, loss)
    st = aux.stats
    # Round 1 times dense (0.1 s; prefix_reuse 0.3 s > 2 x 0.1 s); dense measures
    # 1 s, so round 2 times prefix_reuse (0.3 s <= 2 x 0.3 s); dfs (10 s) never
    # comes in. (Fake times are large against the host prepare time, which the
    # choice adds.)
    assert timer.calls == ["dense", "prefix_reuse"]
    assert st["chosen_engine"] == "prefix_reuse" and set(st["measured_seconds"]) == {
        "dense",
        "prefix_reuse",
    }
    assert st["estimated_seconds"]["dfs"] == pytest.approx(10.0)
    assert "dfs predicted 1e+04 ms" in st["choice_reason"]
    assert timer.rounds == [["dense"], ["prefix_reuse"]]
    # A program timed in an earlier round that is still in margin is timed again,
    # side by side with the new one: dense measures 0.5 s, inside 2 x 0.3 s.
    timer = FakeTimer({"dense": 0.5, "prefix_reuse": 0.4, "dfs": 0.1})
    auto = AutoEngine(
        model, engines=auto.engines, tune_margin=2.0, timer=timer, host_seconds=NO_HOST
    )
    auto.cost_model = _model_predicting(
        auto, batch, loss, {"dense": 0.1, "prefix_reuse": 0.3, "dfs": 10.0}
    )
    _, _, aux = auto.value_and_grad(params, batch, loss)
    assert timer.rounds == [["dense"], ["dense", "prefix_reuse"]]
    assert aux.stats["chosen_engine"] == "prefix_reuse"
    assert aux.stats["autotuned"] == ["dense", "prefix_reuse"]
    # A batch whose best estimate is under tune_all_below times every candidate.
    timer = FakeTimer({"dense": 0.01, "prefix_reuse": 0.02, "dfs": 0.03})
    auto = AutoEngine(
        model, engines=auto.engines, tune_all_below=0.05, timer=timer, host_seconds=NO_HOST
    )
    auto.cost_model = _model_predicting(
        auto, batch, loss, {"dense": 0.1, "prefix_reuse": 0.004, "dfs": 0.04}
    )
    _, _, aux = auto.value_and_grad(params, batch, loss)
    assert timer.rounds == [["dense", "dfs", "prefix_reuse"]]
    assert aux.stats["chosen_engine"] == "dense"
    with pytest.raises(ValueError, match="tune_margin"):
        AutoEngine(model, tune_margin=0.5)
    with pytest.raises(ValueError, match="tune_all_below"):
        AutoEngine(model, tune_all_below=-1)


def test_time_program_warms_up_then_takes_the_median(monkeypatch):
    """A fake clock: the warm-up call takes 100 s (compilation: not timed), the timed
    calls 1, 9 and 2 s in two orders. The time is their median, 2 s: not the mean (4),
    the minimum (1), the warm-up (100) nor the last call (9 in the second order)."""
    now = [0.0]
    calls = []

    def program(durations):
        def run():
            now[0] += durations[len(calls)]
            calls.append(1)
            return jnp.zeros(())

        return run

    monkeypatch.setattr(auto_lib.time, "perf_counter", lambda: now[0])
    seconds = time_program("dense", program([100.0, 1.0, 9.0, 2.0]), repeats=3, min_seconds=0.0)
    assert len(calls) == 4 and seconds == 2.0
    calls.clear()
    seconds = time_program("dense", program([100.0, 2.0, 1.0, 9.0]), repeats=3, min_seconds=0.0)
    assert len(calls) == 4 and seconds == 2.0
    monkeypatch.undo()

    def run():
        calls.append(1)
        return jnp.zeros(())

    # A program far shorter than min_seconds is repeated, at most 50 timed calls.
    calls.clear()
    time_program("dense", run, repeats=3, min_seconds=60.0)
    assert len(calls) == 1 + 50


def test_time_programs_interleaves(monkeypatch):
    """Programs are timed in alternating rounds; each stays in the rounds until it
    has ``repeats`` timed calls and ``min_seconds`` timed (a fake clock: program a
    takes 1 s a call, b 0.03 s; untimed calls advance it too)."""
    now = [0.0]
    order = []

    def program(name, seconds):
        def run():
            order.append(name)
            now[0] += seconds
            return jnp.zeros(())

        return run

    monkeypatch.setattr(auto_lib.time, "perf_counter", lambda: now[0])
    got = time_programs(
        {"a": program("a", 1.0), "b": program("b", 0.03)}, repeats=3, min_seconds=0.1
    )
    # Warm-ups, three alternating rounds (an untimed call first in a turn that
    # follows the other program's), then b alone until 0.12 s >= 0.1 s.
    assert "".join(order) == "ab" + "aabb" + "baa" + "abb" + "b"
    assert got == pytest.approx({"a": 1.0, "b": 0.03})
    with pytest.raises(ValueError, match="runs is empty"):
        time_programs({})


def test_prepared_work_counts_padding():
    """auto predicts from what each program computes, padding included."""
    auto = AutoEngine(
        _model(ModelFamily.QWEN3)[0],
        engine_config=EngineConfig(dfs=DFSConfig(chunk_len=32)),
        host_seconds=NO_HOST,
    )
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=40, response_len=(5, 20), seed=9)
    work, prepared = auto.prepared_work(batch)
    for kind in ("dense", "prefix_reuse", "dfs"):
        assert work[kind] == auto.engines[kind].features(prepared[kind])
        assert work[kind].flops >= tree_flops(CFG, batch) * (1 - 1e-9), kind
    assert work["dense"].flops >= dense_flops(CFG, batch)
    op = prepared["dfs"].args[0].op  # padding steps (NOOP) are not counted
    assert work["dfs"].steps == prepared["dfs"].stats["num_steps"] == (op != 0).sum()
    st = prepared["dense"].stats
    rows, t = st["computed_tokens"] // st["padded_length"], st["padded_length"]
    f0, fa = token_flops(CFG)  # every padded row computes its full t x t attention
    assert work["dense"].flops == pytest.approx(3 * rows * t * (f0 + t * fa))
    # The chosen engine's prepared batch is the one that runs (no second prepare).
    kind, _, pred = auto.choose(batch)
    assert min(pred, key=pred.get) == kind
