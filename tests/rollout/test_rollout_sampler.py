"""The KV-cache sampler: greedy == argmax of the full forward, no retrace, resumable state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dtarl.model import ModelConfig, init_model
from dtarl.rollout.sampler import (
    FinishReason,
    Sampler,
    SamplerError,
    SamplingParams,
    cancel,
    filter_logits,
)

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10]]


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def weights(model):
    return nnx.split(model, nnx.Param)[1]


@pytest.fixture(scope="module")
def greedy(model):
    return Sampler(model, SamplingParams.greedy(max_new_tokens=10, stop_tokens=(2,)))


@pytest.fixture(scope="module")
def sampled(model):
    sampler = Sampler(
        model,
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=10, stop_tokens=(2,)),
    )
    return sampler.reserve(prompts=4, rows=16, prompt_len=8, response=16)


@jax.jit
def _forward(weights, tokens_1xT):
    model = nnx.merge(_GRAPHDEF[0], weights)
    t = tokens_1xT.shape[1]
    return model(tokens_1xT, jnp.arange(t)[None])[0][0]


_GRAPHDEF = []


def full_logits(model, seq):
    """Full-forward logits of ``seq`` (padded to 32: causal, so the padding is invisible)."""
    graphdef, weights = nnx.split(model, nnx.Param)
    _GRAPHDEF[:] = [graphdef]
    padded = np.zeros((1, 32), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(_forward(weights, padded))[: len(seq)]


def test_greedy_equals_argmax_of_full_forward(model, weights, greedy):
    res = greedy.generate(weights, PROMPTS, num_samples=2)
    assert len(res.tokens) == 4
    assert res.prompt_index.tolist() == [0, 0, 1, 1]
    for i, toks in enumerate(res.tokens):
        prompt = PROMPTS[res.prompt_index[i]]
        seq = np.concatenate([prompt, toks])
        logits = full_logits(model, seq)
        p = len(prompt)
        np.testing.assert_array_equal(np.argmax(logits[p - 1 : -1], -1), toks)
        lp = jax.nn.log_softmax(logits[p - 1 : -1])[np.arange(len(toks)), toks]
        np.testing.assert_allclose(res.raw_logprobs[i], lp, atol=1e-5)
        assert res.finish[i] in (FinishReason.STOP, FinishReason.LENGTH)
        if res.finish[i] == FinishReason.LENGTH:
            assert len(toks) == 10
        else:
            assert toks[-1] == 2 and 2 not in toks[:-1]


def test_no_retrace_across_batches(weights, sampled):
    sampled.generate(weights, PROMPTS, num_samples=3, seed=0)
    count = sampled.trace_count
    sampled.generate(weights, [[1, 2, 3, 4, 5, 6, 7]], num_samples=5, seed=1)
    sampled.generate(weights, PROMPTS * 2, num_samples=4, seed=2, max_new_tokens=[3] * 16)
    assert sampled.trace_count == count


def test_sampling_is_batch_independent_and_resumable(weights, sampled):
    ref = sampled.generate(weights, PROMPTS, num_samples=3, seed=7)
    state, index = sampled.init(weights, PROMPTS, num_samples=3, seed=7)
    state = sampled.step(weights, state, 2)
    assert int(state.step) == 2
    # A controller may take the state off the device (PAT: onto another mesh) and continue.
    state = jax.tree.map(np.asarray, state)
    state = sampled.step(weights, state, 3)
    state = sampled.step(weights, state)
    res = sampled.results(state, index)
    for a, b, la, lb in zip(ref.tokens, res.tokens, ref.logprobs, res.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(ref.finish, res.finish)


def test_forced_lengths_and_per_sequence_max(weights, sampled):
    res = sampled.generate(weights, PROMPTS, num_samples=2, forced_lengths=[1, 4, 7, 10])
    assert res.lengths.tolist() == [1, 4, 7, 10]
    assert all(f == FinishReason.LENGTH for f in res.finish)
    res = sampled.generate(weights, PROMPTS, num_samples=2, max_new_tokens=[2, 2, 3, 3])
    assert res.lengths.max() <= 3


def test_cancel_marks_aborted(weights, sampled):
    state, index = sampled.init(weights, PROMPTS, num_samples=1, forced_lengths=[10, 10])
    state = cancel(state, np.array([True] + [False] * (state.batch - 1)))
    state = sampled.step(weights, state)
    res = sampled.results(state, index)
    assert res.finish.tolist() == [FinishReason.ABORTED, FinishReason.LENGTH]
    assert res.lengths.tolist() == [1, 10]


def test_policy_logprobs_are_normalised_under_the_filter(weights, sampled):
    res = sampled.generate(weights, PROMPTS, num_samples=4, seed=3)
    for lp, raw in zip(res.logprobs, res.raw_logprobs, strict=True):
        # top-k/top-p renormalise: the policy puts at least as much mass on a kept token.
        assert np.all(lp >= raw - 1e-5) and np.all(lp <= 0)


def test_raw_logprobs_are_those_of_logits_over_the_temperature(model, weights):
    """raw_logprobs = log_softmax(logits / T) untruncated (what a training engine at T
    recomputes); logprobs are the truncated policy's, renormalised."""
    t = 0.7
    sampler = Sampler(model, SamplingParams(temperature=t, top_k=8, max_new_tokens=6))
    res = sampler.generate(weights, PROMPTS, num_samples=2, seed=5)
    for i, toks in enumerate(res.tokens):
        prompt = PROMPTS[res.prompt_index[i]]
        logits = full_logits(model, np.concatenate([prompt, toks]))[len(prompt) - 1 : -1]
        at_t = jax.nn.log_softmax(logits / t)[np.arange(len(toks)), toks]
        np.testing.assert_allclose(res.raw_logprobs[i], at_t, atol=1e-5)
        at_one = jax.nn.log_softmax(logits)[np.arange(len(toks)), toks]
        assert np.abs(res.raw_logprobs[i] - at_one).max() > 1e-3
        assert np.all(res.logprobs[i] > res.raw_logprobs[i])  # top-8 of 256 renormalised


def test_filter_logits_top_k_top_p():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    z = np.asarray(filter_logits(logits, SamplingParams(top_k=2)))
    assert np.isfinite(z).tolist() == [[True, True, False, False]]
    z = np.asarray(filter_logits(logits, SamplingParams(top_p=0.7)))
    assert np.isfinite(z).tolist() == [[True, True, False, False]]
    z = np.asarray(filter_logits(logits, SamplingParams(top_p=0.5)))
    assert np.isfinite(z).tolist() == [[True, False, False, False]]


def test_bad_input_names_the_argument(weights, greedy):
    with pytest.raises(SamplerError, match="prompts\\[1\\]"):
        greedy.generate(weights, [[1, 2], []])
    with pytest.raises(SamplerError, match="max_new_tokens"):
        greedy.generate(weights, [[1, 2]], max_new_tokens=[99])
    with pytest.raises(SamplerError, match="top_p"):
        SamplingParams(top_p=0.0)
    # Prompt ids are checked before the int32 cast: 5.7 is not 5, 2**32 + 1 is not 1.
    with pytest.raises(SamplerError, match=r"^prompts\[1\]: token ids must have an integer dtype"):
        greedy.generate(weights, [[1, 2], [5.7]])
    with pytest.raises(SamplerError, match=r"^prompts\[0\]\[1\] = 4294967297 is not a token id"):
        greedy.generate(weights, [[1, 2**32 + 1]])


def test_multi_token_stop_sequences(model, weights):
    """A row stops when its generated tokens end with a stop sequence (kept in the
    output); single-token sequences and stop tokens still work; no recompiles."""
    free = Sampler(model, SamplingParams.greedy(max_new_tokens=10))
    ref = free.generate(weights, PROMPTS)
    u = ref.tokens[0].tolist()
    # The first position k >= 1 whose pair (u[k-1], u[k]) has not occurred before.
    k = next(
        k for k in range(1, 10) if (u[k - 1], u[k]) not in zip(u[: k - 1], u[1:k], strict=True)
    )
    pair = (u[k - 1], u[k])
    stopped = Sampler(model, SamplingParams.greedy(max_new_tokens=10, stop_sequences=[pair]))
    res = stopped.generate(weights, PROMPTS)
    assert res.tokens[0].tolist() == u[: k + 1] and res.finish[0] == FinishReason.STOP
    w = ref.tokens[1].tolist()
    pairs1 = list(zip(w[:-1], w[1:], strict=True))
    j = pairs1.index(pair) + 2 if pair in pairs1 else 10
    assert res.tokens[1].tolist() == w[:j]
    assert stopped.trace_count == 2  # prefill + decode loop: traced once, not per step
    stopped.generate(weights, [[1, 3, 4], [1, 9]])
    assert stopped.trace_count == 2
    # One-token sequences behave as stop tokens.
    single = Sampler(model, SamplingParams.greedy(max_new_tokens=10, stop_sequences=[(u[2],)]))
    by_token = Sampler(model, SamplingParams.greedy(max_new_tokens=10, stop_tokens=(u[2],)))
    a, b = single.generate(weights, PROMPTS), by_token.generate(weights, PROMPTS)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    assert a.tokens[0].tolist() == u[: u.index(u[2]) + 1]
    with pytest.raises(SamplerError, match=r"stop_sequences\[0\] is empty"):
        SamplingParams(stop_sequences=[()])


def test_stop_strings_use_the_run_tokenizer():
    from dtarl.model.tokenizer import ByteTokenizer
    from dtarl.rl.config import ConfigError, load_config
    from dtarl.rl.trainer import stop_sequences

    cfg = load_config(None, ['rollout.stop=["=\\n", "!"]'])
    assert cfg.rollout.stop == ("=\n", "!")
    assert stop_sequences(ByteTokenizer(), cfg.rollout.stop) == ((61, 10), (33,))
    with pytest.raises(ConfigError, match=r"rollout.stop\[0\]='' must be a non-empty"):
        load_config(None, ["rollout.stop=['']"])
