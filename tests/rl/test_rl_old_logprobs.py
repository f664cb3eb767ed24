"""Old-policy logprobs: the sampling temperature reaches the training engine (its
logprobs are those of logits / T, the sampler's), and ``algo.recompute_old_logprobs``
takes them from the training engine instead of the sampler."""

import dataclasses

import numpy as np
import pytest

from dtarl.engines import DenseEngine
from dtarl.rl.config import ConfigError, load_config
from dtarl.rl.trainer import Trainer

T = 0.7
TINY = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "steps=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=3",
    "rollout.max_new_tokens=6",
    f"rollout.temperature={T}",
    "eval.num_problems=0",
    "console=false",
    "mesh.dp=1",
]


def trainer(tmp_path, *extra) -> Trainer:
    """A trainer in its RL phase that records each step's (batch, params before it)."""
    t = Trainer(load_config(None, [*TINY, f"out_dir={tmp_path}", *extra]))
    t.opt_state = t.rl_opt.init(t.params)
    t.seen = []
    update = t._update

    def recording(batch, *a, **k):
        t.seen.append((batch, t.params))
        return update(batch, *a, **k)

    t._update = recording
    return t


def max_diff(logps, olds, masks) -> float:
    """max |logp - old| over the trained tokens."""
    pairs = zip(logps, olds, masks, strict=True)
    return max(float(np.abs(lp - old)[m > 0].max(initial=0.0)) for lp, old, m in pairs)


def test_on_policy_at_a_sampling_temperature(tmp_path):
    """Sampled at T = 0.7 (top-k truncated), the trainer's logprobs equal the sampler's
    recorded ones to 1e-5, so the first update's ratio is 1 and nothing is clipped;
    at T = 1 (the old behaviour) they are far apart."""
    t = trainer(tmp_path, "algo.engine=dfs", "rollout.top_k=20")
    assert t.engine.temperature == T
    m = t.rl_step(0)
    assert m["skipped"] == 0 and "recompute_old_logprobs" not in m
    assert abs(m["ratio_max"] - 1) <= 1e-5 and abs(m["ratio_min"] - 1) <= 1e-5
    assert m["clip_fraction"] == 0.0
    ((batch, params),) = t.seen
    for temperature, close in ((T, True), (1.0, False)):
        engine = DenseEngine(t.model, temperature=temperature)
        _, _, aux = engine.value_and_grad(params, batch, t.loss)
        diff = max_diff(aux.logprobs, batch.old_logprobs, batch.loss_mask)
        assert diff <= 1e-5 if close else diff > 1e-2


def test_recompute_old_logprobs_fp32(tmp_path):
    """With the recompute on (fp32), the old logprobs equal the sampler's to 1e-5 and
    the metrics say so. Two minibatches: the first update's own forward gives the
    first's, one more engine pass the second's, both at the pre-update params."""
    t = trainer(
        tmp_path, "algo.engine=dense", "algo.recompute_old_logprobs=true", "algo.minibatches=2"
    )
    m = t.rl_step(0)
    assert m["skipped"] == 0
    assert m["recompute_old_logprobs"] == 1 and m["recompute_seconds"] > 0
    assert 0 < m["old_logprob_diff_max"] <= 1e-5
    assert 0 < m["old_logprob_diff_mean"] <= m["old_logprob_diff_max"]


def test_recompute_old_logprobs_bf16(tmp_path):
    """bf16 compute: the sampler's logprobs (KV-cache decode) differ from the training
    engine's, so without the recompute the first update's ratio is not 1; with it, the
    ratio of the first update is exactly 1."""
    t = trainer(
        tmp_path,
        "model.overrides={num_layers: 1, compute_dtype: bfloat16}",
        "algo.engine=dense",
        "algo.recompute_old_logprobs=true",
    )
    assert t.model.cfg.compute_dtype == "bfloat16"
    m = t.rl_step(0)
    assert m["skipped"] == 0 and m["recompute_old_logprobs"] == 1
    assert m["old_logprob_diff_max"] > 0  # the sampler's numerics differ
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_fraction"] == 0.0
    # Two passes: the second pass's old logprobs are the first update's forward.
    algo = t.cfg.algo
    t.cfg = t.cfg.replace(algo=dataclasses.replace(algo, updates_per_batch=2))
    m = t.rl_step(1)
    assert m["skipped"] == 0 and m["recompute_old_logprobs"] == 1
    assert np.isfinite(m["ratio_max"]) and np.isfinite(m["loss"])
    # Without the recompute the first update's ratio is the sampler's mismatch.
    t.cfg = t.cfg.replace(algo=dataclasses.replace(algo, recompute_old_logprobs=False))
    m = t.rl_step(2)
    assert "recompute_old_logprobs" not in m
    assert m["ratio_max"] != 1.0 or m["ratio_min"] != 1.0


def test_recompute_flag_is_a_bool():
    with pytest.raises(ConfigError, match=r"algo.recompute_old_logprobs=.*true or false"):
        load_config(None, ["algo.recompute_old_logprobs=2"])


def test_temperature_reaches_every_logprob(tmp_path):
    """rollout.temperature is the engine's and the KL reference scorer's; SFT trains the
    model itself (T = 1, its own engine); greedy rollouts (T = 0) train at T = 1."""
    t = Trainer(
        load_config(
            None,
            [*TINY, f"out_dir={tmp_path}", "algo.kl_coef=0.1", "sft.steps=1", "algo.engine=dfs"],
        )
    )
    assert t.engine.temperature == T and t.scorer.temperature == T
    assert t.sft_engine is not t.engine and t.sft_engine.temperature == 1.0
    assert t.sampler.params.temperature == T
    greedy = Trainer(load_config(None, [*TINY, f"out_dir={tmp_path}", "rollout.temperature=0"]))
    assert greedy.engine.temperature == 1.0 and greedy.sft_engine is greedy.engine
    for e in greedy.engine.engines.values():  # auto's candidates
        assert e.temperature == 1.0


@pytest.mark.parametrize("value", ["-0.5", ".inf", "hot"])
def test_bad_rollout_temperature_names_the_field(value):
    with pytest.raises(ConfigError, match=r"rollout.temperature="):
        load_config(None, [f"rollout.temperature={value}"])
