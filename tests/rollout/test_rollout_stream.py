"""Token streaming: incremental forward-only logprobs equal the dense forward."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rl.episodes import Scorer
from dtarl.rollout.engine import ContinuousConfig, EngineError, RolloutEngine
from dtarl.rollout.stream import Stream, StreamingScorer

CFG = ModelConfig.tiny()
SHAPE = ContinuousConfig(slots=4, groups=2, group_size=4, prompt_len=32, response_len=40)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=1)


@pytest.fixture(scope="module")
def weights(model):
    return nnx.split(model, nnx.Param)[1]


def _dense(model, weights, seq, temperature=1.0):
    return Scorer(model, temperature=temperature)(weights, [np.asarray(seq, np.int32)])[0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_streamed_equals_dense_forward(model, weights, temperature):
    rng = np.random.RandomState(0)
    sc = StreamingScorer(model, SHAPE, chunk=4, rows=2, temperature=temperature)
    sc.warmup(weights)
    traces = sc.trace_count
    prompts = [rng.randint(1, 256, 9), rng.randint(1, 256, 17)]
    seqs = {}
    for key, g in [("a", 0), ("b", 0), ("c", 1)]:  # a, b share their prompt row
        sc.open(key, g, prompts[g])
        seqs[key] = list(prompts[g])
    for step in range(6):  # ragged chunks, flushed between "decode steps"
        for key in seqs:
            new = rng.randint(1, 256, int(rng.randint(0, 6))).tolist()
            sc.add(key, new)
            seqs[key] += new
        sc.flush(weights, max_calls=1 if step % 2 else None)
    sc.flush(weights)
    for key, g in [("a", 0), ("b", 0), ("c", 1)]:
        p = len(prompts[g])
        want = _dense(model, weights, seqs[key], temperature)[p:]
        np.testing.assert_allclose(sc.result(key), want, atol=1e-5, rtol=1e-5)
        sc.close(key)
    assert sc.trace_count == traces  # nothing compiled after warm-up
    assert sc.lag == 0


def test_stream_of_engine_callbacks_multi_turn_and_cancel(model, weights):
    """Driven by the rollout engine's on_tokens: generated + tool tokens, a cancelled request."""
    eng = RolloutEngine(model, ContinuousConfig(**{**SHAPE.__dict__, "stream_chunk": 3}))
    sc = StreamingScorer(model, SHAPE, chunk=4, rows=4)
    prompt = np.random.RandomState(3).randint(1, 256, 12)
    seqs = {j: list(prompt) for j in range(3)}

    def on_tokens(req, toks, lps):
        sc.add(req.index, toks)
        seqs[req.index] += toks.tolist()

    for j in range(3):
        sc.open(j, "g", prompt)
    g = eng.submit(prompt, n=3, forced_lengths=[7, 9, 30], hold=True, on_tokens=on_tokens)
    while eng.pending():
        eng.step(weights)
        sc.flush(weights, max_calls=1)  # interleaved with decode
        if len(g.requests[2].tokens) >= 10 and eng.pending():
            eng.cancel(g.requests[2])
    r0 = g.requests[0]
    tool = [5, 6, 7]
    sc.add(0, tool)
    seqs[0] += tool
    eng.extend(r0, tool, max_new_tokens=4)
    eng.run(weights)
    sc.flush(weights)
    assert len(seqs[0]) == 12 + 7 + 3 + 4 and 10 <= len(seqs[2]) - 12 < 30
    for j in range(3):
        want = _dense(model, weights, seqs[j])[len(prompt) :]
        np.testing.assert_allclose(sc.close(j), want, atol=1e-5, rtol=1e-5)


def test_bad_use(model):
    sc = StreamingScorer(model, SHAPE)
    with pytest.raises(EngineError, match="prompt of 0 tokens"):
        sc.open("x", 0, [])
    sc.open("x", 0, [1, 2])
    with pytest.raises(EngineError, match="already open"):
        sc.open("x", 0, [1, 2])
    with pytest.raises(EngineError, match="response_len"):
        sc.add("x", list(range(41)))


def test_trainer_streams_the_reference_policy(tmp_path):
    """rollout.streaming: the batch's reference logprobs equal the dense Scorer's."""
    import jax

    from dtarl.rl.config import ConfigError, StreamedModel, TrainerConfig, from_dict
    from dtarl.rl.episodes import rl_batch
    from dtarl.rl.trainer import Trainer

    raw = dict(
        model=dict(preset="tiny"),
        task=dict(kind="calculator", max_operand=3),
        sft=dict(steps=0),
        rollout=dict(
            prompts_per_step=2,
            group_size=3,
            max_new_tokens=12,
            temperature=0.8,
            streaming=dict(enabled=True, chunk=4),
        ),
        algo=dict(engine="dense", kl_coef=0.1),
        steps=1,
        eval=dict(num_problems=0),
        out_dir=str(tmp_path),
        console=False,
        mesh=dict(dp=1),
    )
    tr = Trainer(from_dict(TrainerConfig, raw))
    tr._start_rl()
    probs = tr._problems(2, 0, 2)
    batch, m = rl_batch(
        tr.cfg,
        probs,
        sampler=tr.sampler,
        params=tr.params,
        tokenizer=tr.tokenizer,
        task=tr.task,
        reward_fn=tr.reward_fn,
        key=jax.random.PRNGKey(0),
        stream=[Stream(tr.streamers[StreamedModel.REF], tr.ref_params)],
    )
    assert m["stream_tokens"] > 0 and "post_rollout_forward_seconds" in m
    dense = tr.scorer(tr.ref_params, list(batch.tokens))
    for got, want, mask in zip(batch.ref_logprobs, dense, batch.loss_mask, strict=True):
        p = int(np.argmax(mask > 0))  # first trained token
        np.testing.assert_allclose(got[p:], want[p:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="algo.kl_coef > 0"):
        from_dict(TrainerConfig, {**raw, "algo": dict(kl_coef=0.0)})
