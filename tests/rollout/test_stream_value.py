"""Token streaming of the PPO critic: streamed values equal ``ValueModel.values``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rl.value import ValueModel
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine
from dtarl.rollout.stream import ScoreKind, StreamingScorer

CFG = ModelConfig.tiny()
SHAPE = ContinuousConfig(slots=4, groups=2, group_size=4, prompt_len=32, response_len=40)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=1)


@pytest.fixture(scope="module")
def critic(model):
    """A critic whose trunk differs from the policy's and whose head is not zero."""
    vm = ValueModel(model)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(7), 3)
    leaves, tree = jax.tree.flatten(vm.params["trunk"])
    noise = jax.random.split(k1, len(leaves))
    leaves = [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, noise, strict=True)
    ]
    vm.params = {
        "trunk": jax.tree.unflatten(tree, leaves),
        "head": {
            "w": jax.random.normal(k2, (CFG.hidden_size,), jnp.float32),
            "b": jax.random.normal(k3, (), jnp.float32),
        },
    }
    return vm


def _dense(vm, seq):
    return vm.values([np.asarray(seq, np.int32)])[0]


def test_streamed_values_equal_value_model(model, critic):
    """Ragged chunks, two trajectories sharing a prompt row, flushed between steps."""
    rng = np.random.RandomState(0)
    sc = StreamingScorer(model, SHAPE, chunk=4, rows=2, kind=ScoreKind.VALUES)
    sc.warmup(critic.params)
    traces = sc.trace_count
    prompts = [rng.randint(1, 256, 9), rng.randint(1, 256, 17)]
    seqs = {}
    for key, g in [("a", 0), ("b", 0), ("c", 1)]:
        sc.open(key, g, prompts[g])
        seqs[key] = list(prompts[g])
    for step in range(5):
        for key in seqs:
            new = rng.randint(1, 256, int(rng.randint(0, 7))).tolist()
            sc.add(key, new)
            seqs[key] += new
        sc.flush(critic.params, max_calls=1 if step % 2 else None)
    sc.flush(critic.params)
    for key, g in [("a", 0), ("b", 0), ("c", 1)]:
        p = len(prompts[g])
        got = sc.close(key)
        assert got.shape == (len(seqs[key]) - p,)
        np.testing.assert_allclose(got, _dense(critic, seqs[key])[p:], atol=1e-5, rtol=1e-5)
    assert sc.trace_count == traces  # nothing compiled after warm-up
    assert np.abs(_dense(critic, seqs["a"])).max() > 1e-2  # the values are not all 0


def test_streamed_values_multi_turn_and_cancel(model, critic):
    """Driven by the engine's on_tokens: a tool output in the context, a cancelled request;
    the scorer on its own device (a separate slice), decode on the default one."""
    eng = RolloutEngine(model, ContinuousConfig(**{**SHAPE.__dict__, "stream_chunk": 3}))
    dev = jax.devices()[1]
    sc = StreamingScorer(model, SHAPE, chunk=4, rows=4, kind=ScoreKind.VALUES, device=dev)
    cw = sc.place(critic.params)
    assert {d for x in jax.tree.leaves(cw) for d in x.devices()} == {dev}
    weights = eng.place(jax.tree.map(lambda x: x, critic.params["trunk"]))
    assert jax.tree.leaves(weights)[0].devices() == {jax.devices()[0]}
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
        sc.flush(cw, max_calls=1)  # interleaved with decode
        if len(g.requests[2].tokens) >= 10 and eng.pending():
            eng.cancel(g.requests[2])
    tool = [5, 6, 7]
    sc.add(0, tool)
    seqs[0] += tool
    eng.extend(g.requests[0], tool, max_new_tokens=4)
    eng.run(weights)
    assert len(seqs[0]) == 12 + 7 + 3 + 4 and 10 <= len(seqs[2]) - 12 < 30
    for j in range(3):
        got = sc.close(j, cw)  # scores what is still queued, frees the slot
        np.testing.assert_allclose(got, _dense(critic, seqs[j])[12:], atol=1e-5, rtol=1e-5)
    assert sc.lag == 0 and not sc.is_open(0)
