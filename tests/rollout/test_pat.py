"""PAT's profile, predictor, switch cost and controller (dtarl.rollout.pat)."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.bench import pat_profile
from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.model.tokenizer import ByteTokenizer
from dtarl.parallel.mesh import make_mesh
from dtarl.rl.config import ConfigError, TrainerConfig, from_dict
from dtarl.rl.episodes import rollout
from dtarl.rl.tasks import TaskKind, make_task
from dtarl.rl.trainer import Trainer
from dtarl.rollout import pat
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import (
    ContinuousConfig,
    RolloutEngine,
    recompute_calls,
)

MODEL = dict(num_layers=2, num_kv_heads=8, head_dim=4, compute_dtype="float32")


def make_profile(
    step, prefill=lambda tp, b, l: 1e-3 * b * l / tp, *, bs=(1, 4, 16), ls=(8, 64, 512), **kw
):
    """A synthetic profile: decode seconds per step ``step(tp, b, t)`` on the grid."""
    dec, pre = [], []
    for tp in pat.TP_DEGREES:
        for b in bs:
            for l in ls:
                t = b * (l + 16)
                dec.append(dict(tp=tp, b=b, l=l, t=t, seconds=float(step(tp, b, t))))
                pre.append(dict(tp=tp, b=b, l=l, t=b * l, seconds=float(prefill(tp, b, l))))
    base = dict(
        model=dict(MODEL),
        device_kind="synthetic",
        platform="cpu",
        jax_version="0",
        devices=8,
        mesh_axes=("dp", "tp"),
        token_cap=8192,
        window=16,
        decode=tuple(dec),
        prefill=tuple(pre),
        weight_bytes=1000,
        weights_bytes_per_s=1e6,
        kv_bytes_per_s=1e6,
        compile_s=0.5,
    )
    base.update(kw)
    return pat.Profile(**base)


def linear(tp, b, t):
    return 1e-3 * (1 + 0.5 * tp) + 2e-4 * b + 1e-6 * t


def test_predictor_exact_on_grid_and_linear_between():
    # Nonlinear in t and b: exact on grid points, linear between them.
    step = lambda tp, b, t: 1e-3 * tp + 1e-4 * b**1.5 + 1e-7 * t**1.3  # noqa: E731
    p = pat.Predictor(make_profile(step))
    for r in p.profile.decode:
        assert float(p.step_seconds(r["tp"], r["b"], r["t"])) == pytest.approx(r["seconds"], 1e-12)
    # Midway in T on one B curve: the mean of the two neighbours.
    t0, t1 = 4 * (8 + 16), 4 * (64 + 16)
    mid = float(p.step_seconds(2, 4, (t0 + t1) / 2))
    assert mid == pytest.approx((step(2, 4, t0) + step(2, 4, t1)) / 2, 1e-12)
    # Between B = 4 and 16: linear in B of the two curves, each read at the same
    # context per request (T x B' / B), not at the same T.
    t = 1000.0
    y4, y16 = float(p.step_seconds(1, 4, t * 4 / 7)), float(p.step_seconds(1, 16, t * 16 / 7))
    assert float(p.step_seconds(1, 7, t)) == pytest.approx(y4 + (y16 - y4) * 3 / 12, 1e-12)
    # Below the smallest B: the smallest B's curve; above the largest: linear extension.
    assert float(p.step_seconds(1, 0.5, t)) == pytest.approx(float(p.step_seconds(1, 1, t)))
    y4, y16 = float(p.step_seconds(1, 4, t / 8)), float(p.step_seconds(1, 16, t / 2))
    y32 = float(p.step_seconds(1, 32, t))
    assert y32 == pytest.approx(y16 + (y16 - y4) * 16 / 12, 1e-12)
    # A curve that falls past its last point is not extended downwards (nor is a B
    # trend): flat instead.
    falling = pat.Predictor(make_profile(lambda tp, b, t: 1.0 / (1 + t) + 1.0 / b))
    last = falling.profile.decode[2]  # tp 1, B 1, the largest T
    assert float(falling.step_seconds(1, 1, 10 * last["t"])) == pytest.approx(last["seconds"])
    y16 = float(falling.step_seconds(1, 16, 5000.0 * 16 / 64))
    assert float(falling.step_seconds(1, 64, 5000.0)) == pytest.approx(y16)
    with pytest.raises(pat.PatError, match="tp=3 is not in the profile"):
        p.step_seconds(3, 1, 10)


def test_predictor_linear_profile_is_exact_everywhere_and_loo_zero():
    p = pat.Predictor(make_profile(linear))
    for tp, b, t in [(1, 2.5, 100.0), (4, 9, 3000.0), (8, 40, 20000.0), (2, 1, 30.0)]:
        assert float(p.step_seconds(tp, b, t)) == pytest.approx(linear(tp, b, t), 1e-9)
    # Below the smallest profiled T (B = 1: 1 x (8 + 16) = 24): that point's value.
    assert float(p.step_seconds(2, 1, 1.0)) == pytest.approx(linear(2, 1, 24), 1e-12)
    errs = pat.leave_one_out(p.profile)
    # Held out: only points inside the grid. Between windows (kind t): the middle T of
    # each (tp, B) curve, on the line through its neighbours. Between B levels (kind b):
    # every point of the middle level, from B = 1 and 16 at the same context per
    # request, both inside their curves: exact on a linear profile too.
    assert sorted((e["kind"], e["tp"], e["b"], e["l"]) for e in errs) == sorted(
        [("t", tp, b, 64) for tp in pat.TP_DEGREES for b in (1, 4, 16)]
        + [("b", tp, 4, ln) for tp in pat.TP_DEGREES for ln in (8, 64, 512)]
    )
    for e in errs:
        assert e["predicted"] == pytest.approx(e["seconds"], 1e-9)
    # At the same T instead, B = 1's curve would be read at 4x its requests' context
    # and B = 16's at a quarter (below its first point, held at that point's value):
    e = next(x for x in errs if (x["kind"], x["tp"], x["l"]) == ("b", 1, 64))
    y1, y16 = linear(1, 1, 320), linear(1, 16, 384)
    assert e["t"] == 320 and abs(y1 + (y16 - y1) * 3 / 15 - e["seconds"]) > 1e-5


def test_decode_scale_turns_the_fastest_steps_into_typical_ones(tmp_path):
    """Decode predictions are the profile's (fastest) seconds times ``decode_scale``;
    the held-out error compares on the rows' own scale, so the factor cancels there; a
    profile without the field (made before it) predicts the fastest steps; a bad value
    names the field."""
    step = lambda tp, b, t: 1e-3 * tp + 1e-4 * b**1.5 + 1e-7 * t**1.3  # noqa: E731
    plain = pat.Predictor(make_profile(step))
    scaled = pat.Predictor(make_profile(step, decode_scale=1.25))
    for tp, b, t in [(1, 1, 24), (2, 7, 1000.0), (8, 40, 20000.0)]:
        want = 1.25 * float(plain.step_seconds(tp, b, t))
        assert float(scaled.step_seconds(tp, b, t)) == pytest.approx(want, 1e-12)
    assert scaled.est_rem_time(4, 3, 60, 10) == pytest.approx(
        1.25 * plain.est_rem_time(4, 3, 60, 10), 1e-12
    )
    loo = [x for e in pat.leave_one_out(scaled.profile) for x in (e["rel_error"], e["predicted"])]
    want = [x for e in pat.leave_one_out(plain.profile) for x in (e["rel_error"], e["predicted"])]
    assert len(loo) > 0 and loo == pytest.approx(want, 1e-12)
    path = scaled.profile.save(tmp_path / "p.json")
    assert pat.Profile.load(path).decode_scale == 1.25
    d = json.loads(path.read_text())
    del d["decode_scale"]
    path.write_text(json.dumps(d))
    assert pat.Profile.load(path).decode_scale == 1.0
    for bad in (0, -1.0, "1.1", True, float("inf")):
        d["decode_scale"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(pat.PatError, match="decode_scale must be a finite number > 0"):
            pat.Profile.load(path)


def test_est_rem_time_by_hand():
    p = pat.Predictor(make_profile(linear))
    # b = 2, steps l_gen = 60..62, T_k = 2 x 60 + 2k = 120, 122, 124.
    want = sum(linear(4, 2, t) for t in (120, 122, 124))
    assert p.est_rem_time(4, 2, 63, 60) == pytest.approx(want, 1e-12)
    want = sum(linear(4, 2, t) for t in (100, 102))
    assert p.est_rem_time(4, 2, 4, 2, context=100) == pytest.approx(want, 1e-12)
    assert p.est_rem_time(4, 2, 3, 3) == 0.0


def test_switch_cost_by_hand():
    prof = make_profile(linear)
    p = pat.Predictor(prof)
    contexts = [10, 20, 30]
    # Eq. 1: 2 x layers x L x (kv heads x head dim / tp_src) x 4 bytes.
    per_rank = 2 * 2 * 60 * (8 * 4 / 2) * 4
    assert pat.kv_rank_bytes(MODEL, contexts, 2) == per_rank
    c = pat.switch_cost(p, tp_src=2, tp_dst=8, contexts=contexts, cached=False)
    assert c.weights_s == pytest.approx(1000 / 1e6)
    assert c.move_s == pytest.approx(per_rank / 1e6)
    # Eq. 3-4: prefill of 3 requests (dp = 1 at tp 8) at the RMS length.
    l_rms = math.sqrt((100 + 400 + 900) / 3)
    assert c.recompute_s == pytest.approx(1e-3 * 3 * l_rms / 8, 1e-9)
    assert c.compile_s == 0.5
    assert c.mode == ("migrate" if c.move_s <= c.recompute_s else "recompute")
    assert c.total == pytest.approx(c.weights_s + min(c.move_s, c.recompute_s) + 0.5)
    cached = pat.switch_cost(p, tp_src=2, tp_dst=8, contexts=contexts, cached=True)
    assert cached.compile_s == 0 and cached.total == pytest.approx(c.total - 0.5)
    # Compaction at the same TP moves no weights.
    same = pat.switch_cost(p, tp_src=2, tp_dst=2, contexts=contexts, cached=True)
    assert same.weights_s == 0 and same.move_s == pytest.approx(per_rank / 1e6)
    # An engine profile times the prefill at one prompt length (8 here): above it the
    # seconds grow in proportion to the tokens, below it they stay.
    one = pat.Predictor(
        dataclasses.replace(prof, prefill=tuple(r for r in prof.prefill if r["l"] == 8))
    )
    y = 1e-3 * 4 * 8 / 2  # tp 2, B 4, l 8
    assert float(one.prefill_seconds(2, 4, 32)) == pytest.approx(y * 4, 1e-12)
    assert float(one.prefill_seconds(2, 4, 2)) == pytest.approx(y, 1e-12)


# An engine config for the recompute's calls, and one call's seconds per (kind, tp, bucket).
POOL_S = 2e-3  # a recompute's fixed part (pool freed and re-created), x tp
CALL_ENGINE = dict(prefill_batch=2, extend_batch=3, prompt_len=32, response_len=64)


def call_s(kind, tp, l):
    return (1e-3 if kind == "prefill" else 3e-4) * l / tp + 1e-4 * tp


def with_kv_calls(prof):
    rows = [
        dict(kind=kind, tp=tp, l=l, seconds=call_s(kind, tp, l))
        for tp in pat.TP_DEGREES
        for kind, ls in (("prefill", (16, 32)), ("extend", (16, 32, 64)))
        for l in ls
    ]
    rows += [dict(kind="pool", tp=tp, l=8, seconds=POOL_S * tp) for tp in (1, 4, 8)]
    return dataclasses.replace(prof, engine=dict(CALL_ENGINE), kv_calls=tuple(rows))


def test_recompute_seconds_follow_the_engines_calls():
    p = pat.Predictor(with_kv_calls(make_profile(linear)))
    prompts = [5, 20, 32, 9, 17]  # prefill rows 4, 19, 31, 8, 16
    lengths = [3, 0, 9, 12, 17, 0, 40, 64]  # slot order; two slots hold no rows yet
    calls = [
        ("prefill", 32, 0, 2),
        ("prefill", 32, 2, 4),
        ("prefill", 16, 4, 5),
        ("extend", 16, 0, 3),  # rows 3, 9, 12
        ("extend", 64, 3, 6),  # rows 17, 40, 64
    ]
    assert recompute_calls(prompts, lengths, **CALL_ENGINE) == calls
    with pytest.raises(ValueError, match="extend_batch=0 must be an int >= 1"):
        recompute_calls(prompts, lengths, **dict(CALL_ENGINE, extend_batch=0))
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        recompute_calls([0], lengths, **CALL_ENGINE)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        recompute_calls(prompts, [3, -1], **CALL_ENGINE)
    assert p.recompute_calls(prompts, lengths) == calls
    for tp in (1, 4):
        want = POOL_S * tp + sum(call_s(kind, tp, t) for kind, t, *_ in calls)
        assert p.recompute_seconds(tp, prompts, lengths) == pytest.approx(want, 1e-12)
    # Nothing to rebuild: the fixed part only (none profiled at tp 2).
    assert p.recompute_seconds(4, [], []) == pytest.approx(POOL_S * 4)
    assert p.recompute_seconds(2, [], []) == 0.0
    # Between and above the profiled buckets: linear; below the smallest: its value.
    assert float(p.call_seconds("extend", 2, 48)) == pytest.approx(call_s("extend", 2, 48))
    assert float(p.call_seconds("extend", 2, 128)) == pytest.approx(call_s("extend", 2, 128))
    assert float(p.call_seconds("prefill", 2, 8)) == pytest.approx(call_s("prefill", 2, 16))
    # switch_cost prices the recompute with the engine's calls onto the target TP, and
    # T_move over the rows the migrate moves: prompt rows 78 and response rows 145, each
    # padded to a multiple of lcm(dp 8, dp 1) = 8 (not the running requests' contexts).
    contexts = [20 + 12, 32 + 40]
    c = pat.switch_cost(
        p,
        tp_src=1,
        tp_dst=8,
        contexts=contexts,
        cached=True,
        resident=prompts,
        live_lengths=lengths,
    )
    want = POOL_S * 8 + sum(call_s(k, 8, t) for k, t, *_ in calls)
    assert c.recompute_s == pytest.approx(want, 1e-12)
    assert c.move_s == pytest.approx(pat.kv_rank_bytes(MODEL, [80 + 152], 1) / 1e6)
    # Without the engine's layout: Eq. 3-4, and T_move over the contexts (Eq. 1).
    eq34 = pat.switch_cost(p, tp_src=1, tp_dst=8, contexts=contexts, cached=True)
    assert eq34.move_s == pytest.approx(pat.kv_rank_bytes(MODEL, contexts, 1) / 1e6)
    l_rms = math.sqrt(np.mean(np.square(contexts)))
    assert eq34.recompute_s == pytest.approx(1e-3 * 2 * l_rms / 8, 1e-9)


def test_profile_without_kv_calls_loads_and_falls_back_to_eq_3_4(tmp_path):
    new = with_kv_calls(make_profile(linear))
    path = new.save(tmp_path / "new.json")
    assert pat.Profile.load(path) == new
    d = json.loads(path.read_text())
    del d["kv_calls"]  # a profile written before the recompute's calls were profiled
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(d))
    old = pat.Profile.load(old_path)
    assert old.kv_calls == ()
    p = pat.Predictor(old)
    assert not p.has_kv_calls
    contexts = [10, 20, 30]
    c = pat.switch_cost(
        p, tp_src=2, tp_dst=8, contexts=contexts, cached=True, resident=[8], live_lengths=[3]
    )
    l_rms = math.sqrt((100 + 400 + 900) / 3)
    assert c.recompute_s == pytest.approx(1e-3 * 3 * l_rms / 8, 1e-9)
    with pytest.raises(pat.PatError, match="no kv_calls"):
        p.recompute_seconds(8, [8], [3])


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["kv_calls"][0].update(kind="decode"), r"kv_calls\[0\].kind must be one of"),
        (lambda d: d["kv_calls"][1].update(l=0), r"kv_calls\[1\].l must be an int >= 1"),
        (lambda d: d["kv_calls"][2].update(tp=3), r"kv_calls\[2\].tp must be one of"),
        (lambda d: d["kv_calls"][3].pop("seconds"), r"kv_calls\[3\].seconds must be a finite"),
        (lambda d: d["kv_calls"][4].update(median=-1.0), r"kv_calls\[4\].median must be"),
        (lambda d: d.update(kv_calls={}), "kv_calls must be a list"),
        (lambda d: d["engine"].pop("extend_batch"), r"engine must hold \['extend_batch'\]"),
        (
            lambda d: d.update(kv_calls=[r for r in d["kv_calls"] if r["kind"] == "prefill"]),
            "kv_calls has no 'extend' row for tp=1",
        ),
    ],
)
def test_bad_kv_calls_name_the_field(tmp_path, edit, match):
    d = with_kv_calls(make_profile(linear)).to_dict()
    edit(d)
    with pytest.raises(pat.PatError, match=match):
        pat.Profile.from_dict(json.loads(json.dumps(d)), source="p.json")


def _state(tp, slots, lengths, remaining, *, waiting=False, cached=True):
    lengths = np.asarray(lengths)
    return pat.EngineState(
        tp=tp,
        dp=8 // tp,
        slots=slots,
        lengths=lengths,
        prompts=np.full(lengths.shape, 16),
        remaining=np.asarray(remaining),
        waiting=waiting,
        cells=slots,
        prompt_len=16,
        response_len=256,
        steps_per_call=8,
        max_slots=64,
        cached=lambda dp, tp, s: cached,
    )


# Per-step seconds that fall with TP at a small batch per DP group and rise with it at a
# large one (the paper's Fig. 4 shape).
def tp_pays_small(tp, b, t):
    return 1e-2 / tp + 2e-3 * b * tp + 1e-7 * t


def test_controller_switches_when_tp_pays_and_not_when_it_does_not():
    p = pat.Predictor(make_profile(tp_pays_small))
    # 64 slots at tp 1 (8 per DP group) with 3 long requests left: tp 8 merges them
    # into 4 slots (B = 4 per group) and each step costs far less.
    st = _state(1, 64, [40, 50, 60], [200, 180, 150])
    d = pat.decide(p, st, (1, 2, 4, 8))
    assert d.switch and d.tp > 1 and d.best_s < d.now_s
    assert d.slots == pat.merged_slots(3, 8 // d.tp, 64)
    assert set(d.candidates) == {1, 2, 4, 8}
    # Never with a waiting request (the tail only), nor with nothing live.
    assert not pat.decide(p, _state(1, 64, [40], [200], waiting=True), (1, 8)).switch
    assert not pat.decide(p, _state(1, 64, [], []), (1, 8)).switch
    # A profile where tp 1 is always fastest: no TP switch, but the 3 live requests are
    # compacted from 64 slots (B = 8) into 8 (B = 1) at tp 1, weights unmoved.
    slow_tp = pat.Predictor(make_profile(lambda tp, b, t: 1e-3 * tp + 1e-4 * b + 1e-7 * t))
    d = pat.decide(slow_tp, st, (1, 2, 4, 8))
    assert d.switch and (d.tp, d.slots) == (1, 8) and d.cost.weights_s == 0
    assert d.candidates[1] == d.best_s < d.now_s
    # Compaction is weighed like a TP switch: with a slot count that costs the same,
    # nothing pays for the K/V move.
    flat_b = pat.Predictor(make_profile(lambda tp, b, t: 1e-3 * tp + 1e-7 * t))
    assert not pat.decide(flat_b, st, (1, 2, 4, 8)).switch
    # A switch that would pay but for a large cost (an uncached compile) is not made.
    costly = pat.Predictor(make_profile(tp_pays_small, compile_s=1e6))
    assert not pat.decide(costly, _state(1, 64, [40], [20], cached=False), (1, 8)).switch
    assert pat.decide(costly, _state(1, 64, [40], [20], cached=True), (1, 8)).switch
    # ... unless its compile is spread over the generations that reuse the program.
    reuse = pat.decide(costly, _state(1, 64, [40], [20], cached=False), (1, 8), compile_reuse=10**8)
    assert reuse.switch and reuse.cost.compile_s == pytest.approx(1e6 / 10**8)


def test_controller_switches_several_times():
    # Large batches per DP group favour tp 1, small ones a larger TP: as requests finish
    # the choice moves. 12 live: compacted at tp 1 into 16 slots (B 2: 0.014 s a step,
    # tp 2 at B 4 would cost 0.021); 2 live: tp 2 in 4 slots (B 1: 0.009 s; tp 1 in 8
    # slots 0.012, tp 4 in 2 slots 0.0105).
    p = pat.Predictor(make_profile(tp_pays_small, bs=(1, 2, 4, 8, 16, 32)))
    tp, slots, picks = 1, 64, []
    for live in (64, 12, 2):
        st = _state(tp, slots, [30] * live, [100] * live)
        d = pat.decide(p, st, (1, 2, 4, 8))
        if d.switch:
            tp, slots = d.tp, d.slots
        picks.append((tp, slots))
    assert picks == [(1, 64), (1, 16), (2, 4)]


def test_engine_rem_time_follows_windows():
    p = pat.Predictor(make_profile(linear))
    st = _state(2, 8, [0, 0], [40, 10])
    # Windows of response_len 256: 64, 128, 256; steps 0..39, calls of 8 steps.
    got = pat.engine_rem_time(p, st, 2, 8)
    # The longest active length at step k is k; a call starting at step s reads the first
    # window >= s + 8 + 1; T = (cells 8 x prompt 16 + slots 8 x window) / dp 4, B = 8 / 4.
    ws = [next(w for w in (64, 128, 256) if w >= (k // 8) * 8 + 9) for k in range(40)]
    assert ws[0] == 64 and ws[-1] == 64
    st = _state(2, 8, [100, 0], [40, 10])  # longest 100: calls from step 24 read 256
    ws = [next(w for w in (64, 128, 256) if w >= 100 + (k // 8) * 8 + 9) for k in range(40)]
    assert ws[0] == 128 and ws[-1] == 256
    want = sum(linear(2, 2, (8 * 16 + 8 * w) / 4) for w in ws)
    assert pat.engine_rem_time(p, st, 2, 8) == pytest.approx(want, 1e-12)
    assert got == pytest.approx(40 * linear(2, 2, (8 * 16 + 8 * 64) / 4), 1e-12)
    assert pat.decode_windows(256) == [64, 128, 256]
    assert pat.decode_windows(32) == [16, 32]
    assert pat.merged_slots(3, 2, 64) == 4 and pat.merged_slots(3, 8, 64) == 8
    assert pat.merged_slots(70, 1, 64) == 64


def test_profile_round_trip_and_bad_files(tmp_path):
    prof = make_profile(linear)
    path = prof.save(tmp_path / "p.json")
    back = pat.Profile.load(path)
    assert back == prof
    with pytest.raises(pat.PatError, match="nope.json: no such file"):
        pat.Profile.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(pat.PatError, match="bad.json: not JSON"):
        pat.Profile.load(bad)
    d = json.loads(path.read_text())
    d["decode"][3]["seconds"] = -1
    bad.write_text(json.dumps(d))
    with pytest.raises(pat.PatError, match=r"bad.json: decode\[3\].seconds must be"):
        pat.Profile.load(bad)
    d = json.loads(path.read_text())
    d["decode"][0]["tp"] = 3
    bad.write_text(json.dumps(d))
    with pytest.raises(pat.PatError, match=r"decode\[0\].tp must be one of .* got 3"):
        pat.Profile.load(bad)
    d = json.loads(path.read_text())
    del d["kv_bytes_per_s"]
    bad.write_text(json.dumps(d))
    with pytest.raises(pat.PatError, match="kv_bytes_per_s must be a finite number"):
        pat.Profile.load(bad)
    d["format"] = "other"
    bad.write_text(json.dumps(d))
    with pytest.raises(pat.PatError, match="format must be"):
        pat.Profile.load(bad)


def test_check_candidates():
    assert pat.check_candidates([8, 1, 2], devices=8, kv_heads=8) == (1, 2, 8)
    with pytest.raises(pat.PatError, match=r"tp_candidates: 4 must be one of .* kv heads \(2\)"):
        pat.check_candidates([1, 4], devices=8, kv_heads=2)
    with pytest.raises(pat.PatError, match="empty"):
        pat.check_candidates([], devices=8, kv_heads=8)


def test_replay_predicts_static_and_pat():
    p = pat.Predictor(make_profile(tp_pays_small, bs=(1, 2, 4, 8, 16, 32)))
    active = [64] * 20 + [8] * 20 + [1] * 60
    context = [a * (40 + k) for k, a in enumerate(active)]
    rep = pat.replay(p, active, context, check_every_steps=8)
    assert rep["label"] == "PREDICTION"
    # Static: the sum of the per-step predictions at B / dp, T / dp.
    want = sum(
        float(p.step_seconds(2, math.ceil(a / 4), c / 4))
        for a, c in zip(active, context, strict=True)
    )
    assert rep["static"][2] == pytest.approx(want, 1e-9)
    assert rep["start_tp"] == min(rep["static"], key=rep["static"].get)
    assert rep["switches"] and rep["pat"] < min(rep["static"].values())
    with pytest.raises(pat.PatError, match="replay: active"):
        pat.replay(p, [1, 2], [3])


# ----------------------------------------------------------------------------- end to end

# The engine shapes of tests/rollout/test_pat_switch.py (shared compiled programs).
E2E_CFG = dict(slots=8, groups=4, group_size=4, prompt_len=16, response_len=32, steps_per_call=4)
E2E_LENGTHS = [[3, 7, 26, 11], [5, 19, 2], [28]]


def favour_tp(tp, b, t):
    """Small batches per DP group favour a larger TP: tp 1 -> 2 with 8 live requests,
    -> 4 once one is left (see test_e2e_controller_switches_and_keeps_greedy_tokens)."""
    return 1e-2 / tp + 1e-3 * b * tp + 1e-9 * t


@pytest.fixture(scope="module")
def tiny():
    model = Decoder(ModelConfig.tiny(num_heads=8, num_kv_heads=8, head_dim=8), seed=0)
    return model, nnx.split(model, nnx.Param)[1]


def _generate(model, weights, on_call=None):
    eng = RolloutEngine(model, ContinuousConfig(**E2E_CFG), mesh=make_mesh(8, 1))
    rng = np.random.RandomState(5)
    groups = [
        eng.submit(
            rng.randint(1, 256, 10).tolist(),
            n=len(m),
            forced_lengths=m,
            temperature=0.0,
            seed=i,
        )
        for i, m in enumerate(E2E_LENGTHS)
    ]
    eng.run(eng.place(weights), on_call=on_call)
    return [r.result() for g in groups for r in g.requests]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_e2e_controller_switches_and_keeps_greedy_tokens(tiny):
    model, weights = tiny
    # K/V moves cost ~1e-4 s; a prefill at tp 2 costs 1e3 s (-> migrate), at tp 4 nothing
    # (-> recompute): one generation switches with both modes.
    prof = make_profile(
        favour_tp,
        lambda tp, b, l: 1e3 if tp == 2 else 1e-9,
        bs=(1, 2, 4, 8),
        model=dict(num_layers=2, num_kv_heads=8, head_dim=8, compute_dtype="float32"),
        kv_bytes_per_s=1e9,
        compile_s=0.0,
        weights_bytes_per_s=1e12,
    )
    ctl = pat.PatController(pat.Predictor(prof), candidates=(1, 2, 4, 8), check_every=1)
    ctl.begin()
    got = _generate(model, weights, on_call=ctl)
    steps = [(e["src"][1], e["dst"][1], e["mode"]) for e in ctl.timeline]
    # tp 1 -> 2, then at tp 2 the live requests compacted into fewer slots, then -> 4.
    assert steps == [(1, 2, "migrate"), (2, 2, "migrate"), (2, 4, "recompute")], steps
    assert ctl.timeline[1]["dst"][2] < ctl.timeline[1]["src"][2]
    assert [e["info"]["mode"] for e in ctl.timeline] == ["migrate", "migrate", "recompute"]
    assert all(e["predicted_gain_s"] > 0 for e in ctl.timeline)
    ref = _generate(model, weights)
    for (t, lp), (t_ref, lp_ref) in zip(got, ref, strict=True):
        assert t.tolist() == t_ref.tolist()
        np.testing.assert_allclose(lp, lp_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_controller_decides_at_the_first_call_then_every_check(tiny):
    """Alg. 1 runs after the first decode call (a start layout that fits the whole
    generation badly is left at once), then every ``check_every`` calls."""
    model, weights = tiny
    ctl = pat.PatController(pat.Predictor(_e2e_profile()), candidates=(1, 2, 4), check_every=4)
    ctl.begin()
    calls = []
    _generate(model, weights, on_call=lambda e, w: (calls.append(1), ctl(e, w))[1])
    assert ctl.timeline and ctl.timeline[0]["call"] == 1, ctl.timeline
    assert all(e["call"] == 1 or e["call"] % 4 == 0 for e in ctl.timeline)
    assert ctl.checks == 1 + len(calls) // 4


def _e2e_profile(**kw):
    return make_profile(
        favour_tp,
        lambda tp, b, l: 1e3 if tp == 2 else 1e-9,
        bs=(1, 2, 4, 8),
        model=dict(num_layers=2, num_kv_heads=8, head_dim=8, compute_dtype="float32"),
        kv_bytes_per_s=1e9,
        compile_s=0.0,
        weights_bytes_per_s=1e12,
        **kw,
    )


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_episodes_rollout_with_pat_matches_and_resets(tiny):
    """The trainer's rollout path: the hook's re-placed weights are used by later calls,
    trajectories equal those without PAT, the engine ends on its construction mesh."""
    model, weights = tiny
    tok, task = ByteTokenizer(), make_task(TaskKind.ARITHMETIC, max_operand=9, ops="+-")
    problems = task.generate(np.random.default_rng(0), 2)
    sampler = ContinuousSampler(
        model,
        ContinuousConfig(**E2E_CFG),
        temperature=0.0,
        max_new_tokens=24,
        mesh=make_mesh(8, 1),
    )
    ctl = pat.PatController(pat.Predictor(_e2e_profile()), candidates=(1, 2, 4), check_every=1)
    kw = dict(group_size=4, key=jax.random.PRNGKey(3))
    ctl.begin()
    got, _ = rollout(sampler, weights, tok, task, problems, on_call=ctl, **kw)
    assert ctl.timeline and ctl.timeline[0]["src"][1] == 1
    v = sampler.engine.view()
    assert (v.dp, v.tp, v.slots) == (8, 1, E2E_CFG["slots"])
    ref, _ = rollout(sampler, weights, tok, task, problems, **kw)
    assert [t.tokens.tolist() for t in got] == [t.tokens.tolist() for t in ref]


def _trainer_raw(tmp_path, **pat_section):
    return dict(
        model=dict(preset="tiny"),
        task=dict(kind="arithmetic", max_operand=9, ops="+-"),
        sft=dict(steps=0),
        rollout=dict(prompts_per_step=2, group_size=2, max_new_tokens=4, pat=pat_section),
        steps=1,
        eval=dict(num_problems=0),
        out_dir=str(tmp_path),
        console=False,
        mesh=dict(dp=1),
    )


def test_pat_config_validation(tmp_path):
    cfg = from_dict(TrainerConfig, _trainer_raw(tmp_path))
    assert cfg.rollout.pat.enabled is False and cfg.rollout.pat.tp_candidates == (1, 2, 4, 8)
    with pytest.raises(ConfigError, match="rollout.pat.profile='' must name a profile"):
        from_dict(TrainerConfig, _trainer_raw(tmp_path, enabled=True))
    with pytest.raises(ConfigError, match=r"rollout.pat.tp_candidates\[1\]=3 must be one of"):
        from_dict(TrainerConfig, _trainer_raw(tmp_path, tp_candidates=[1, 3]))
    with pytest.raises(ConfigError, match="rollout.pat.check_every=0 must be > 0"):
        from_dict(TrainerConfig, _trainer_raw(tmp_path, check_every=0))
    raw = _trainer_raw(tmp_path, enabled=True, profile="p.json")
    raw["rollout"]["engine"] = "static"
    with pytest.raises(ConfigError, match="rollout.pat.enabled=true .* rollout.engine=continuous"):
        from_dict(TrainerConfig, raw)


def test_trainer_refuses_pat_without_a_mesh(tmp_path):
    path = _e2e_profile().save(tmp_path / "p.json")
    cfg = from_dict(TrainerConfig, _trainer_raw(tmp_path, enabled=True, profile=str(path)))
    with pytest.raises(ConfigError, match="rollout.pat.enabled=true needs .* mesh"):
        Trainer(cfg)


def test_profile_grid_levels_and_checks():
    cfg = ContinuousConfig(slots=32, groups=8, group_size=4, prompt_len=8, response_len=64)
    grid = pat_profile.ProfileGrid(engine=cfg)
    assert grid.slot_levels(8) == [8, 16, 32]
    assert grid.slot_levels(1) == [1, 2, 4, 8, 16, 32]
    three = dataclasses.replace(grid, levels=3)
    assert three.slot_levels(1) == [1, 4, 32] and three.slot_levels(2) == [2, 8, 32]
    assert three.points(8)[:3] == [(1, 8), (1, 16), (1, 32)]
    with pytest.raises(pat.PatError, match="slots=32 is not a multiple of dp=3"):
        grid.slot_levels(3)
    with pytest.raises(pat.PatError, match="slots=32 > groups x group_size = 4 x 4"):
        pat_profile.ProfileGrid(engine=dataclasses.replace(cfg, groups=4))
    with pytest.raises(pat.PatError, match="ProfileGrid.levels=-1"):
        pat_profile.ProfileGrid(engine=cfg, levels=-1)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_profile_engine_times_the_engines_own_programs(tiny, tmp_path):
    model, weights = tiny
    cfg = ContinuousConfig(
        slots=8, groups=2, group_size=4, prompt_len=8, response_len=16, steps_per_call=4
    )
    grid = pat_profile.ProfileGrid(engine=cfg, repeats=1, tps=(1, 2))
    eng = RolloutEngine(model, cfg, mesh=make_mesh(8, 1))
    prof = pat_profile.profile_engine(model, weights, grid, engine=eng)
    # Points: tp 1 at 8 slots (B 1), tp 2 at 4 and 8 slots (B 1, 2); one window (16).
    # T = (Q M P + slots x window) / dp = (2 x 4 x 8 + slots x 16) / dp.
    assert [(r["tp"], r["b"], r["l"], r["t"]) for r in prof.decode] == [
        (1, 1, 16, 24),
        (2, 1, 16, 32),
        (2, 2, 16, 48),
    ]
    assert [(r["tp"], r["b"], r["l"]) for r in prof.prefill] == [(1, 1, 8), (2, 1, 8), (2, 2, 8)]
    # One prefill call per prompt bucket (8) and one extend call per response bucket (16),
    # per TP: what a recompute switch runs.
    # "pool": a recompute's fixed part, from the profiler's idle recompute reshards.
    assert [(r["kind"], r["tp"], r["l"]) for r in prof.kv_calls] == [
        ("prefill", 1, 8),
        ("extend", 1, 16),
        ("pool", 1, 8),
        ("prefill", 2, 8),
        ("extend", 2, 16),
        ("pool", 2, 8),
    ]
    assert all(0 < r["seconds"] <= r["median"] and r["n"] >= 1 for r in prof.kv_calls)
    assert all(r["n"] == 5 for r in prof.kv_calls if r["kind"] != "pool")
    assert all(
        0 < r["seconds"] <= r["median"] and r["n"] >= 1 and r["cv"] >= 0 for r in prof.decode
    )
    # Every timed step over its point's fastest, pooled: at least 1.
    assert 1.0 <= prof.decode_scale < 10.0
    assert prof.devices == 8 and prof.mesh_axes == ("dp", "tp") and prof.steps_per_call == 4
    assert prof.engine["slots"] == 8 and prof.engine["group_size"] == 4 and prof.window == 16
    assert prof.weights_bytes_per_s > 0 and prof.kv_bytes_per_s > 0 and prof.compile_s >= 0
    assert prof.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(weights))
    assert prof.model["num_kv_heads"] == 8 and prof.platform == jax.devices()[0].platform
    assert pat.Profile.load(prof.save(tmp_path / "p.json")) == prof
    # The engine is back on its mesh, idle, and holds every profiled program: a
    # generation on the profiled shapes compiles nothing.
    assert eng.view().slots == 8 and eng.mesh.devices.shape == (8, 1) and not eng.pending()
    traces = eng.trace_count
    for i in range(2):
        eng.submit([1 + i] * 8, n=4, forced_lengths=[3, 16, 9, 16])
    eng.run(eng.place(weights))
    assert eng.trace_count == traces
    with pytest.raises(pat.PatError, match="no TP of"):
        pat_profile.profile_engine(model, weights, dataclasses.replace(grid, tps=(3,)))
    with pytest.raises(pat.PatError, match="the engine's config .* is not the grid's"):
        other = dataclasses.replace(cfg, steps_per_call=2)
        pat_profile.profile_engine(
            model, weights, grid, engine=RolloutEngine(model, other, mesh=make_mesh(8, 1))
        )


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_trainer_warns_when_the_profile_timed_another_engine_shape(tmp_path):
    path = tmp_path / "p.json"
    _e2e_profile(engine=dict(slots=999)).save(path)
    raw = _trainer_raw(tmp_path, enabled=True, profile=str(path), tp_candidates=[1, 2])
    raw["mesh"] = dict(dp=8, tp=1)
    raw["rollout"]["prompts_per_step"] = 4  # 8 sequences: one per dp rank
    with pytest.warns(RuntimeWarning, match=r"another engine shape .*slots: profiled 999, here 8"):
        trainer = Trainer(from_dict(TrainerConfig, raw))
    # A profile of this run's engine: no warning.
    ours = dataclasses.asdict(trainer.sampler.engine.config)
    _e2e_profile(engine=ours).save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trainer._make_pat() is not None
