"""rollout.streaming in the trainer: a PPO step with the critic and the reference policy
streamed equals the same step without streaming; config errors name the field."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtarl.rl.config import ConfigError, StreamedModel, TrainerConfig, from_dict, load_config
from dtarl.rl.episodes import rl_batch, rollout
from dtarl.rl.trainer import Trainer
from dtarl.rollout.stream import Stream

PPO = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=0",
    "steps=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=3",
    "rollout.max_new_tokens=10",
    "rollout.warmup=false",
    "algo.algorithm=ppo",
    "algo.kl_coef=0.1",
    "algo.engine=dense",
    "eval.num_problems=0",
    "console=false",
    "mesh.dp=1",
]


def _reward(problem, completion) -> float:
    """Rewards that differ between samples (the task's are all 0 for this untrained
    model): nonzero advantages, so the step has a policy gradient."""
    return float(sum(map(ord, completion)) % 3)


def _perturbed(tree, seed: int, scale: float):
    """Every leaf times (1 + scale * N(0, 1)), elementwise."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [
        x * (1 + scale * jax.random.normal(k, x.shape, x.dtype))
        for x, k in zip(leaves, keys, strict=True)
    ]
    return treedef.unflatten(noisy)


class _RefApart(Trainer):
    """The reference policy starts a perturbation away from the policy (not as its
    copy), so the KL term and the reference logprobs it reads are far from 0: a wrong
    streamed reference logprob moves ``kl`` and ``loss``."""

    def _start_rl(self):
        super()._start_rl()
        self.ref_params = _perturbed(self.ref_params, seed=1, scale=0.3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One PPO + KL step run without and with rollout.streaming (ref and critic; the
    scorers on device 1, beside the rollout's decode on device 0). Varied rewards, a
    reference apart from the policy and a nonzero critic head (it starts at 0, which
    would make every value 0 in both runs), so every compared metric is far from 0."""
    out = {}
    for on in (False, True):
        d = tmp_path_factory.mktemp(f"stream_{on}")
        stream = f"rollout.streaming={{enabled: {on}, chunk: 4, device: 1}}"
        cfg = load_config(None, [*PPO, f"out_dir={d}", stream])
        tr = _RefApart(cfg, reward_fn=_reward)
        e = tr.model.cfg.hidden_size
        head = {"w": jax.random.normal(jax.random.PRNGKey(2), (e,)) / 4, "b": jnp.float32(0.5)}
        tr.value.params = {**tr.value.params, "head": head}
        out[on] = (tr, tr.run().history[-1])
    return out


def test_ppo_step_streamed_equals_not_streamed(runs):
    """The step's values, KL, losses: streamed = not streamed. (Parameters after the
    step are not compared: Adam's first update is about lr x sign(g), which rounding
    flips where a gradient entry is ~0.)"""
    (plain, a), (streamed, b) = runs[False], runs[True]
    assert set(streamed.streamers) == {StreamedModel.REF, StreamedModel.CRITIC}
    assert all(sc.device == jax.devices()[1] for sc in streamed.streamers.values())
    assert not plain.streamers and "stream_tokens" not in a
    assert b["stream_tokens"] > 0 and b["stream_lag_tokens"] >= 0
    names = ("reward_mean", "num_tokens", "value_mean", "value_loss", "kl", "loss", "grad_norm")
    for name in names:
        assert name in a, name
        np.testing.assert_allclose(b[name], a[name], atol=1e-5, rtol=1e-5, err_msg=name)
    # Values the comparison can tell apart: none is ~0, so a 1e-3 error in the streamed
    # reference logprobs (the KL, and through the KL penalty the advantages and the
    # gradient) or values (GAE) moves them past the 1e-5 tolerance. Not ``loss``: with
    # whitened advantages and on-policy ratios it is -mean(A) = 0 up to rounding.
    for name in ("reward_mean", "value_mean", "value_loss", "kl", "grad_norm"):
        assert abs(a[name]) > 1e-3, (name, a[name])
    assert a["post_rollout_forward_seconds"] > 0 and b["post_rollout_forward_seconds"] >= 0


def test_streamed_batch_arrays_equal_not_streamed(runs):
    """rl_batch with the critic and the reference streamed: the trajectories' values and
    the batch's reference logprobs and GAE advantages equal the post-rollout forwards'."""
    tr = runs[True][0]
    common = dict(
        sampler=tr.sampler,
        params=tr.params,
        tokenizer=tr.tokenizer,
        task=tr.task,
        # Rewards that differ between samples: with the task's (all 0 for this untrained
        # model) the advantages are KL noise of std ~0.006 and whitening divides fp32
        # rounding by it.
        reward_fn=lambda problem, completion: float(sum(map(ord, completion)) % 3),
        key=jax.random.PRNGKey(3),
        value=tr.value,
    )
    problems = tr.task.generate(np.random.default_rng(5), 2)
    streams = [
        Stream(tr.streamers[StreamedModel.REF], tr.ref_params),
        Stream(tr.streamers[StreamedModel.CRITIC], tr.value.params),
    ]
    trajs, stats = rollout(
        tr.sampler, tr.params, tr.tokenizer, tr.task, problems, group_size=3,
        key=jax.random.PRNGKey(3), stream=streams,
    )  # fmt: skip
    assert stats["stream_tokens"] == sum(t.tokens.size - t.prompt_len for t in trajs)
    dense_v = tr.value.values([t.tokens for t in trajs])
    for t, v in zip(trajs, dense_v, strict=True):
        np.testing.assert_allclose(t.values[t.prompt_len :], v[t.prompt_len :], atol=1e-5)
        assert np.abs(v[t.prompt_len :]).min() > 1e-2  # the fixture's critic head is not 0
    got, _ = rl_batch(tr.cfg, problems, stream=streams, **common)
    want, _ = rl_batch(
        tr.cfg, problems, reference=functools.partial(tr.scorer, tr.ref_params), **common
    )
    for x, y, m in zip(got.token_advantages, want.token_advantages, want.loss_mask, strict=True):
        assert m.any()
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    for x, y, m in zip(got.ref_logprobs, want.ref_logprobs, want.loss_mask, strict=True):
        np.testing.assert_allclose(x[m > 0], y[m > 0], atol=1e-5, rtol=1e-5)


def test_streaming_config_errors(tmp_path):
    base = dict(out_dir=str(tmp_path), rollout=dict(streaming=dict(enabled=True)))
    cfg = from_dict(TrainerConfig, {**base, "algo": dict(algorithm="ppo")})
    assert cfg.streamed_models() == (StreamedModel.CRITIC,)
    cfg = from_dict(TrainerConfig, {**base, "algo": dict(algorithm="ppo", kl_coef=0.1)})
    assert cfg.streamed_models() == (StreamedModel.REF, StreamedModel.CRITIC)
    bad = [
        (dict(), {}, r"no forward-only model to stream: it needs algo.kl_coef > 0"),
        (dict(kl_coef=0.1), dict(models=["critic"]), r"models=\['critic'\].*algo.algorithm=ppo"),
        (dict(algorithm="ppo"), dict(models=["ref"]), r"models=\['ref'\].*algo.kl_coef > 0"),
        (dict(kl_coef=0.1), dict(models=["ref", "ref"]), "names a model twice"),
        (dict(kl_coef=0.1), dict(models=["policy"]), r"models\[0\]='policy' is not valid"),
        (dict(kl_coef=0.1), dict(chunk=0), "chunk"),
        (dict(kl_coef=0.1), dict(device=-2), r"rollout.streaming.device=-2 must be -1"),
    ]
    for algo, st, match in bad:
        raw = {**base, "algo": algo, "rollout": dict(streaming=dict(enabled=True, **st))}
        with pytest.raises(ConfigError, match=match):
            from_dict(TrainerConfig, raw)
    with pytest.raises(ConfigError, match=r"rollout.streaming.device=99 is not a device index"):
        Trainer(
            load_config(
                None, [*PPO, f"out_dir={tmp_path}", "rollout.streaming={enabled: true, device: 99}"]
            )
        )
    with pytest.raises(ConfigError, match="rollout.engine=continuous"):
        from_dict(
            TrainerConfig,
            {
                **base,
                "algo": dict(kl_coef=0.1),
                "rollout": dict(engine="static", streaming=dict(enabled=True)),
            },
        )
