"""The ``Rollout`` protocol: both samplers implement it, agree on greedy tokens, and
refuse what they do not declare with an error naming the argument."""

import warnings

import numpy as np
import pytest
from flax import nnx

from dtarl.model import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import ContinuousConfig, EngineError
from dtarl.rollout.protocol import ARGUMENT, Feature, Rollout, require
from dtarl.rollout.sampler import FinishReason, Sampler, SamplerError, SamplingParams

CFG = ModelConfig.tiny()
SMALL = ContinuousConfig(
    slots=4, groups=3, group_size=4, prompt_len=32, response_len=48, steps_per_call=8
)
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=0)


@pytest.fixture(scope="module")
def weights(model):
    return nnx.split(model, nnx.Param)[1]


@pytest.fixture(scope="module")
def static(model):
    return Sampler(model, SamplingParams.greedy(max_new_tokens=10))


@pytest.fixture(scope="module")
def continuous(model):
    return ContinuousSampler(model, SMALL, temperature=0.0, max_new_tokens=10)


def test_both_samplers_are_rollouts_and_declare_their_features(static, continuous):
    assert isinstance(static, Rollout) and isinstance(continuous, Rollout)
    assert static.features == frozenset()
    assert continuous.features == frozenset(Feature)
    assert static.max_new_tokens == continuous.max_new_tokens == 10
    assert not isinstance(object(), Rollout)


def test_greedy_tokens_agree(weights, static, continuous):
    """Per-prompt sample counts through the protocol's ``generate``: the same greedy
    tokens, finish reasons and training logprobs on both samplers."""
    counts = [1, 3, 2]
    a = static.generate(weights, PROMPTS, num_samples=counts, seed=3)
    b = continuous.generate(weights, PROMPTS, num_samples=counts, seed=3)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    assert a.finish.tolist() == b.finish.tolist()
    assert a.prompt_index.tolist() == b.prompt_index.tolist() == [0, 1, 1, 1, 2, 2]
    for x, y in zip(a.raw_logprobs, b.raw_logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    assert a.finish_rank is None and sorted(b.finish_rank.tolist()) == list(range(6))


def test_on_turn_continues_on_the_samples_own_kv(weights, static, continuous):
    """``on_turn`` (Feature.EXTEND): a tool output appended to turn 0 and continued in
    place gives the tokens the static sampler draws after re-prefilling the history."""
    tool = np.asarray([33, 34, 35], np.int32)
    seen = []

    def on_turn(row, tokens, raw_logprobs, finish):
        seen.append((row, tokens.tolist(), finish))
        return tool if sum(r == row for r, _, _ in seen) == 1 else None

    res = continuous.generate(weights, PROMPTS[:2], num_samples=1, on_turn=on_turn)
    first = {row: toks for row, toks, _ in seen[:2]}
    assert sorted(first) == [0, 1] and len(seen) == 4
    for i, prompt in enumerate(PROMPTS[:2]):
        history = np.concatenate([prompt, first[i], tool])
        want = static.generate(weights, [history], num_samples=1)
        assert res.tokens[i].tolist() == want.tokens[0].tolist()
        assert FinishReason(int(res.finish[i])) is FinishReason(int(want.finish[0]))


def test_a_missing_feature_names_the_argument(weights, static):
    asked = dict(
        on_call=dict(on_call=lambda engine, w: None),
        index_offset=dict(index_offset=2),
        early_stop=dict(early_stop=[1]),
        stream=dict(stream=[object()]),
        on_turn=dict(on_turn=lambda *a: None),
    )
    for name, kw in asked.items():
        with pytest.raises(SamplerError, match=rf"^{name}: needs a sampler with Feature\."):
            static.generate(weights, PROMPTS[:1], **kw)
    assert set(ARGUMENT.values()) == set(asked)
    with pytest.raises(SamplerError, match=r"^index_offset: needs .*Feature.SHARE.*declares none"):
        require(static, Feature.SHARE)
    with pytest.raises(SamplerError, match=r"^counts: needs .*Feature.CANDIDATES"):
        require(object(), Feature.CANDIDATES, "counts")
    require(ContinuousSampler.__new__(ContinuousSampler), Feature.STREAM)  # declared: no error


def test_warmup_and_reserve_as_the_trainer_calls_them(model, weights, static, continuous):
    """Static ``warmup`` compiles nothing; ``ContinuousSampler.reserve`` with the
    trainer's arguments (a history-long ``prompt_len``) keeps the engine it was built
    with; bad sizes are refused by name."""
    before = static.trace_count
    static.warmup(weights, extend=True)
    assert static.trace_count == before
    engine = continuous.engine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        continuous.reserve(prompts=3, rows=12, prompt_len=200, response=10)
    assert continuous.engine is engine
    for name in ("prompts", "rows", "prompt_len", "response"):
        kw = {**dict(prompts=1, rows=1, prompt_len=1, response=1), name: 0}
        with pytest.raises(EngineError, match=rf"reserve: {name}=0 must be an int >= 1"):
            continuous.reserve(**kw)
        with pytest.raises(SamplerError, match=rf"reserve: {name}=0 must be an int >= 1"):
            static.reserve(**kw)
    grown = ContinuousSampler(model, SMALL, temperature=0.0, max_new_tokens=10)
    with pytest.warns(RuntimeWarning, match="response_len=64"):
        grown.reserve(prompts=1, rows=1, prompt_len=8, response=60)
    assert grown.engine.config.response_len == 64


def test_continuous_checks_per_prompt_arguments(weights, continuous):
    with pytest.raises(EngineError, match=r"early_stop: need 2 ints >= 0"):
        continuous.generate(weights, PROMPTS[:2], early_stop=[1])
    with pytest.raises(EngineError, match=r"index_offset: need an int >= 0"):
        continuous.generate(weights, PROMPTS[:2], index_offset=-1)
