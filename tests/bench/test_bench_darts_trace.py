"""``dtarl bench darts --trace`` at a tiny size: both arms on the same draws, DARTS'
early stop cancels candidates on the real engine, the JSON rows. No timing assertions."""

from __future__ import annotations

import numpy as np
import pytest

from dtarl import cli
from dtarl.bench import darts_trace as D
from dtarl.errors import ConfigError
from dtarl.model import ModelConfig
from dtarl.traces import default_polytrace_root

pytestmark = pytest.mark.skipif(
    not (default_polytrace_root() / "verl").is_dir(), reason="needs the PolyTrace data"
)

TINY = dict(prompts=2, group_size=2, pool=2, max_new_tokens=24, prompt_len=8, steps_per_call=4,
            rounds=1, steps=1, warmup_steps=0, engine="dense")  # fmt: skip


def test_arms_share_draws_and_early_stop_cancels():
    cfg = D.TraceBenchConfig(**TINY, slots=8, lam=0.01)  # all candidates decode at once
    b = D.TraceBench(cfg, ModelConfig.tiny())
    b.pool, desc = D.load_pool(cfg)
    assert "verl" in desc and all(p.lengths.max() <= 24 for p in b.pool)
    picks = D.draws(b.pool, cfg, 0, 0)
    assert [x[1].tolist() for x in picks] == [x[1].tolist() for x in D.draws(b.pool, cfg, 0, 0)]
    g = b.step("grpo", 0, 0)
    assert g["candidates"] == 4 and g["cancelled_tokens"] == 0
    # All candidates decode at once, so the rollout ran exactly as many decode steps as
    # its longest forced length (a call ends when its last request finishes).
    assert g["decode_steps"] == max(int(x[1][:2].max()) for x in picks)
    assert g["decode_calls"] == -(-g["decode_steps"] // cfg.steps_per_call)
    # GRPO generated exactly the first M draws of each prompt (forced lengths).
    assert g["generated_tokens"] == sum(int(x[1][:2].sum()) for x in picks)
    # A state whose EMAs put every prompt at M_up: both early-stopped.
    b.state.mean_len, b.state.std_len = 4.0, 4.0
    b.state.prompt_std = {p.key: 1.0 for p in b.pool}
    d = b.step("darts", 0, 0)
    assert d["candidates"] == 8 and d["early_stop_groups"] == 2
    # Each prompt stops once 2 candidates complete (checked after each decode call of
    # 4 steps): the kept ones are complete draws that finished by the call in which the
    # second-shortest complete draw did.
    spc, ends = cfg.steps_per_call, []
    for (_, lens, trunc), kept in zip(picks, np.reshape(d["kept_lens"], (2, 2)), strict=True):
        ok = np.sort(lens[~trunc])
        if ok.size >= 2:
            assert set(kept) <= set(ok.tolist()) and min(kept) == ok[0]
            assert max(kept) < ok[1] + spc
        # the group ends in the call in which its second complete candidate finished
        ends.append(int(ok[1]) if ok.size >= 2 else int(lens.max()))
    assert max(ends) <= d["decode_steps"] <= max(-(-e // spc) * spc for e in ends)
    assert d["generated_tokens"] - d["cancelled_tokens"] <= sum(int(x[1].sum()) for x in picks)
    assert d["cancelled_tokens"] > 0 or all(len(set(x[1].tolist())) == 1 for x in picks)
    s = D.summarize([g | {"compiled": False}, d | {"compiled": False}])
    assert s["length_bias"] == pytest.approx(d["kept_len_mean"] / g["kept_len_mean"])
    # One (round, step) pair on the same draws; a pair where an arm compiled is left out.
    assert s["paired_steps"] == 1
    assert s["paired_speedup"]["step_s"] == pytest.approx(g["step_s"] / d["step_s"])
    assert g["other_s"] == pytest.approx(g["step_s"] - g["rollout_s"] - g["train_s"])
    assert s["decode_steps_ratio"] == pytest.approx(g["decode_steps"] / d["decode_steps"])
    assert s["decode_steps_median_ratio"] == pytest.approx(g["decode_steps"] / d["decode_steps"])
    s = D.summarize([g | {"compiled": True}, d | {"compiled": False}])
    assert s["paired_steps"] == 0
    # counters, not clocks: a pair that compiled still counts for the decode steps
    assert s["decode_steps_ratio"] == pytest.approx(g["decode_steps"] / d["decode_steps"])
    # lam="auto" is resolved by run(); a step before that says so
    b.lam = None
    with pytest.raises(ConfigError, match="lam='auto'"):
        b.step("darts", 0, 0)


def test_warmup_steps_are_epochs_over_the_pool():
    # DARTS' per-prompt EMAs are "over preceding epochs": pool / N warm-up steps show
    # every pool prompt once (random picks would leave about a quarter unseen).
    cfg = D.TraceBenchConfig(prompts=3, group_size=2, pool=6, lam=0.6)
    pool = [D.PromptDist(f"p{i}", (1, 2), np.arange(1, 5), np.zeros(4, bool)) for i in range(6)]
    keys = [[p.key for p, _, _ in D.draws(pool, cfg, -1, s)] for s in range(4)]
    assert sorted(keys[0] + keys[1]) == [f"p{i}" for i in range(6)]  # one epoch
    assert keys[2:] == keys[:2]  # the next epoch repeats the order
    assert all(len(set(k)) == 3 for k in keys)
    assert cfg.warmup == 2  # the default: one epoch (6 prompts / 3 per step)
    assert D.TraceBenchConfig(prompts=32, pool=128).warmup == 4
    assert D.TraceBenchConfig(prompts=8, pool=8).warmup == 2  # at least 2 (compiles)
    assert D.TraceBenchConfig(warmup_steps=0).warmup == 0
    with pytest.raises(ConfigError, match="warmup_steps=-1"):
        D.TraceBenchConfig(warmup_steps=-1)
    timed = [p.key for p, _, _ in D.draws(pool, cfg, 0, 0)]
    assert len(set(timed)) == 3 and timed == [p.key for p, _, _ in D.draws(pool, cfg, 0, 0)]


def test_auto_lambda_puts_the_trace_spread_at_the_paper_budget():
    # Two prompts of constant lengths 10 and 30, both drawn every step: each step's
    # N x M lengths have std 10 and mean 20, so rho = 0.5 and lambda' = 0.5 / 1.5.
    cfg = D.TraceBenchConfig(prompts=2, group_size=4, pool=2, lam="auto")
    pool = [D.PromptDist(f"p{i}", (1, 2), np.full(4, n), np.zeros(4, bool))
            for i, n in enumerate((10, 30))]  # fmt: skip
    rho = D.length_spread(pool, cfg, steps=3)
    assert rho == pytest.approx(0.5)
    assert D.resolve_lambda("auto", rho) == pytest.approx(0.5 / 1.5)
    assert D.resolve_lambda(0.6, rho) == 0.6
    with pytest.raises(ConfigError, match=r"lam='auto'.*rho=0\.0"):
        D.resolve_lambda("auto", 0.0)
    for bad in (0, -1.0, "fast", True):
        with pytest.raises(ConfigError, match="must be a number > 0 or 'auto'"):
            D.TraceBenchConfig(lam=bad)


def test_cli_lambda_flag_accepts_auto_or_a_number(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        cli.main(["bench", "darts", "--trace", "verl_math", "--lambda", "fast"])
    assert e.value.code == 2
    assert "--lambda: 'fast': a number > 0 or 'auto'" in capsys.readouterr().err
    # a number the config refuses: the ConfigError names the field and accepted values
    assert cli.main(["bench", "darts", "--trace", "verl_math", "--lambda", "0"]) == 2
    assert "lam=0.0: must be a number > 0 or 'auto'" in capsys.readouterr().err


def test_bad_trace_names_the_accepted_values(capsys):
    want = r"trace='gsm8k': accepted values \['rllm', 'search_r1', 'verl_math'\]"
    with pytest.raises(ConfigError, match=want):
        D.TraceBenchConfig(trace="gsm8k")
    assert cli.main(["bench", "darts", "--trace", "gsm8k"]) == 2
    assert "accepted values" in capsys.readouterr().err
