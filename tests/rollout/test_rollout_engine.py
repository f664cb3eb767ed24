"""The continuous-batching rollout engine: exactness, determinism, control, no recompiles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rollout.config import decode_windows, length_buckets
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import (
    ContinuousConfig,
    EngineError,
    RolloutEngine,
    Status,
    complete,
)
from dtarl.rollout.programs import ProgramKey, ProgramKind
from dtarl.rollout.sampler import FinishReason, Sampler, SamplingParams

CFG = ModelConfig.tiny()
SMALL = ContinuousConfig(
    slots=4, groups=3, group_size=4, prompt_len=32, response_len=48, steps_per_call=8
)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=0)


@pytest.fixture(scope="module")
def weights(model):
    return nnx.split(model, nnx.Param)[1]


@pytest.fixture(scope="module")
def engine(model, weights):
    """One warmed engine shared by the tests below (the no-recompile tests use it)."""
    return RolloutEngine(model, SMALL).warmup(weights, extend=True)


def _prompts(n, seed=0, lo=2, hi=30):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, CFG.vocab_size, rng.randint(lo, hi)).tolist() for _ in range(n)]


_REF_LEN = 128  # the reference forward pads to this (causal: padding after is unseen)


@functools.cache
def _forward(model):
    """The full causal forward over a padded sequence (one compiled program)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(state, seq_T):
        m = nnx.merge(graphdef, state)
        return m(seq_T[None], jnp.arange(seq_T.shape[0])[None])[0][0]

    return lambda seq: np.asarray(
        logits(state, jnp.asarray(np.pad(np.asarray(seq, np.int32), (0, _REF_LEN - len(seq)))))
    )[: len(seq)]


def _full_forward_greedy(model, prompt, n):
    """Reference: the full forward over the whole sequence at every step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(_forward(model)(seq)[-1])))
    return seq[len(prompt) :]


def _policy_logprobs(model, prompt, tokens, temperature):
    """log softmax(logits / T) of each generated token, from one full forward."""
    seq = np.concatenate([prompt, tokens]).astype(np.int32)
    lp = jax.nn.log_softmax(jnp.asarray(_forward(model)(seq)) / temperature, axis=-1)
    p = len(prompt)
    return np.asarray(lp[p - 1 : -1][np.arange(len(tokens)), tokens])


def _tokens(group):
    return [r.result()[0].tolist() for r in group.requests]


def test_greedy_equals_full_forward_reference(model, weights, engine):
    prompts = _prompts(3, seed=1)
    groups = [engine.submit(p, n=2, max_new_tokens=10, temperature=0.0) for p in prompts]
    engine.run(weights)
    for p, g in zip(prompts, groups, strict=True):
        want = _full_forward_greedy(model, p, 10)
        assert _tokens(g) == [want, want]
        assert all(r.finish is FinishReason.LENGTH for r in g.requests)


def test_greedy_equals_static_sampler_with_more_requests_than_slots(model, weights, engine):
    prompts = _prompts(5, seed=2)
    ref = Sampler(model, SamplingParams.greedy(max_new_tokens=20)).generate(
        weights, prompts, num_samples=3
    )
    groups = [engine.submit(p, n=3, max_new_tokens=20, temperature=0.0) for p in prompts]
    done = engine.run(weights)
    assert len(done) == 15
    got = [t for g in groups for t in _tokens(g)]
    assert got == [t.tolist() for t in ref.tokens]
    lps = [r.result()[1] for g in groups for r in g.requests]
    for a, b in zip(lps, ref.raw_logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_training_policy(model, weights, engine, temperature):
    """Recorded logprobs = log softmax(logits / T) of a full forward, fp32 <= 1e-5."""
    prompts = _prompts(2, seed=3)
    groups = [
        engine.submit(p, n=3, max_new_tokens=16, temperature=temperature, seed=i)
        for i, p in enumerate(prompts)
    ]
    engine.run(weights)
    for p, g in zip(prompts, groups, strict=True):
        for r in g.requests:
            toks, lps = r.result()
            want = _policy_logprobs(model, np.asarray(p), toks, temperature)
            np.testing.assert_allclose(lps, want, atol=1e-5, rtol=1e-5)


def test_tokens_independent_of_batch_slot_and_order(weights, engine):
    p = _prompts(1, seed=4)[0]
    alone = engine.submit(p, n=3, max_new_tokens=24, seed=11)
    engine.run(weights)
    others = _prompts(12, seed=5)
    for i, q in enumerate(others[:6]):
        engine.submit(q, n=2, max_new_tokens=int(5 + 3 * i), seed=100 + i)
    crowd = engine.submit(p, n=3, max_new_tokens=24, seed=11)
    for i, q in enumerate(others[6:]):
        engine.submit(q, n=1, max_new_tokens=30, seed=200 + i)
    engine.run(weights)
    assert _tokens(alone) == _tokens(crowd)
    assert len({tuple(t) for t in _tokens(alone)}) == 3  # members differ from each other


def test_no_compiles_after_warmup_with_varied_lengths_and_arrivals(weights, engine):
    before = engine.trace_count
    rng = np.random.RandomState(6)
    live = []
    for step in range(6):
        for q in _prompts(int(rng.randint(1, 4)), seed=10 + step, lo=1, hi=33):
            live.append(
                engine.submit(
                    q,
                    n=int(rng.randint(1, 5)),
                    max_new_tokens=int(rng.randint(1, 40)),
                    temperature=float(rng.choice([0.0, 1.0])),
                    top_k=int(rng.choice([0, 5])),
                    seed=step,
                )
            )
        for _ in range(2):
            engine.step(weights)
    engine.run(weights)
    assert all(g.done for g in live)
    assert engine.trace_count == before


def test_program_cache_is_keyed_by_kind_and_statics(engine):
    keys = engine.programs.keys()
    assert all(isinstance(k, ProgramKey) and k.mesh_shape == (1, 1) for k in keys)
    by_kind = {kind: [k for k in keys if k.kind is kind] for kind in ProgramKind}
    windows = sorted({k.window for k in by_kind[ProgramKind.DECODE]})
    assert windows == decode_windows(SMALL.response_len)  # warmup: one per window ...
    assert {k.filtered for k in by_kind[ProgramKind.DECODE]} == {False, True}  # ... and mode
    lengths = sorted({k.length for k in by_kind[ProgramKind.PREFILL]})
    assert lengths == length_buckets(SMALL.prompt_len)
    lengths = sorted({k.length for k in by_kind[ProgramKind.EXTEND]})
    assert lengths == length_buckets(SMALL.response_len)
    same = ProgramKey(**{f: getattr(keys[0], f) for f in keys[0].__dataclass_fields__})
    before = engine.trace_count
    assert engine.programs.get(same) is engine.programs.get(keys[0])
    assert engine.trace_count == before and len(engine.programs) == len(keys)
    with pytest.raises(TypeError, match="ProgramKey.kind='decode' must be a ProgramKind"):
        ProgramKey(kind="decode", mesh=None, slots=4)


def test_time_bucket_call_on_an_idle_engine(model, weights):
    eng = RolloutEngine(model, SMALL)
    with pytest.raises(EngineError, match=r"kind='decode' must be 'prefill' or 'extend'"):
        eng.time_bucket_call("decode", 16, weights)
    with pytest.raises(EngineError, match=r"length=20 must be one of \[16, 32\]"):
        eng.time_bucket_call("prefill", 20, weights)
    assert eng.time_bucket_call("prefill", 16, weights) > 0
    assert eng.stats().prefill_calls == 0  # a timing call counts in no stats
    g = eng.submit([1, 2, 3], n=1, max_new_tokens=2, hold=True)
    eng.run(weights)
    with pytest.raises(EngineError, match="holds requests"):
        eng.time_bucket_call("extend", 16, weights)
    eng.release(g.requests[0])
    assert eng.time_bucket_call("extend", 16, weights) > 0
    with pytest.raises(EngineError, match="built without a mesh"):
        eng.move_idle((1, 1), weights)


def test_continuous_batching_refills_slots(model, weights):
    """Short requests free their slots for waiting ones: fewer steps than static batches."""
    eng = RolloutEngine(model, SMALL)
    lengths = [2, 3, 40, 2, 3, 2, 3, 2]
    g = eng.submit(_prompts(1)[0], n=4, forced_lengths=lengths[:4], max_new_tokens=40)
    h = eng.submit(_prompts(1, seed=9)[0], n=4, forced_lengths=lengths[4:], max_new_tokens=40)
    eng.run(weights)
    assert [len(r.tokens) for r in g.requests + h.requests] == lengths
    st = eng.stats()
    # Static batches of 4 (or the groups one after the other) would run 40 + 3 steps;
    # the engine admits the second group as soon as slots free up (at the next call of
    # steps_per_call steps) and runs it alongside the long request, so the whole run
    # takes exactly the long request's 40 steps, every step-slot a generated token.
    assert st.decode_steps == max(lengths)
    assert st.active_per_step.sum() == sum(lengths) == st.generated_tokens
    assert st.active_per_step.max() <= SMALL.slots


def test_kv_bytes_prompt_once(model, weights):
    cfg = ContinuousConfig(slots=16, groups=1, group_size=16, prompt_len=512, response_len=32)
    eng = RolloutEngine(model, cfg)
    prompt = np.random.RandomState(0).randint(1, 256, 512)
    eng.submit(prompt, n=16, forced_lengths=[32] * 16, max_new_tokens=32)
    eng.run(weights)
    per_token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    # the prompt once (511 rows; its last token is each member's row 0) + 16 x 32 rows
    assert eng.stats().peak_kv_bytes == (511 + 16 * 32) * per_token
    static = 16 * (512 + 32) * per_token  # every row copies the prompt
    assert eng.stats().peak_kv_bytes * 8 <= static


def test_cancel_group_stop_and_callbacks(weights, engine):
    seen, finished = {}, []

    def on_tokens(req, toks, lps):
        assert toks.shape == lps.shape
        seen.setdefault(req.index, []).extend(toks.tolist())

    def on_finish(req, reason):
        finished.append((req.index, reason))

    g = engine.submit(
        _prompts(1, seed=7)[0],
        n=4,
        max_new_tokens=40,
        forced_lengths=[3, 4, 40, 40],
        on_tokens=on_tokens,
        on_finish=on_finish,
        until=lambda grp: sum(r.finish is FinishReason.LENGTH for r in grp.requests) >= 2,
    )
    engine.run(weights)
    reasons = [r.finish for r in g.requests]
    assert reasons[:2] == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert reasons[2:] == [FinishReason.ABORTED, FinishReason.ABORTED]
    assert all(len(r.tokens) < 40 for r in g.requests[2:])
    for r in g.requests:  # streamed tokens are exactly the request's tokens
        assert seen.get(r.index, []) == r.tokens
    assert sorted(i for i, _ in finished) == [0, 1, 2, 3]
    assert all(r.status is Status.RELEASED for r in g.requests)


def test_complete_predicate_counts_stops(model, weights, engine):
    p = _prompts(1, seed=14)[0]
    first = _full_forward_greedy(model, p, 1)[0]
    g = engine.submit(p, n=3, max_new_tokens=30, temperature=0.0, stop_ids=[first])
    engine.run(weights)  # every member stops after its first token
    assert [r.tokens for r in g.requests] == [[first]] * 3
    assert complete(3)(g) and not complete(4)(g)
    # Members finishing in the same call all count before the predicate cancels others.
    h = engine.submit(p, n=4, max_new_tokens=30, temperature=0.0, stop_ids=[first],
                      until=complete(1))  # fmt: skip
    engine.run(weights)
    assert [r.finish for r in h.requests] == [FinishReason.STOP] * 4


@pytest.fixture(scope="module")
def streaming(model):
    cfg = ContinuousConfig(
        slots=4, groups=2, group_size=4, prompt_len=16, response_len=32, stream_chunk=4
    )
    return RolloutEngine(model, cfg)


def test_stream_chunks(weights, streaming):
    chunks = []
    streaming.submit([1, 2, 3], n=1, forced_lengths=[10],
                     on_tokens=lambda r, t, lp: chunks.append(len(t)))  # fmt: skip
    streaming.run(weights)
    assert chunks == [4, 4, 2]


def test_failing_callback_cancels_only_its_request(weights, streaming):
    def boom(req, toks, lps):
        if req.index == 1:
            raise RuntimeError("boom")

    g = streaming.submit([4, 5, 6], n=3, forced_lengths=[20, 20, 20], on_tokens=boom)
    with pytest.warns(RuntimeWarning, match="boom"):
        streaming.run(weights)
    assert [r.finish for r in g.requests] == [
        FinishReason.LENGTH,
        FinishReason.ABORTED,
        FinishReason.LENGTH,
    ]
    assert len(g.requests[1].tokens) < 20 and "boom" in g.requests[1].error
    assert streaming.errors[-1][0] == g.requests[1].id
    assert not streaming.pending()
    # The engine goes on serving.
    h = streaming.submit([4, 5, 6], n=2, forced_lengths=[5, 6])
    streaming.run(weights)
    assert [len(r.tokens) for r in h.requests] == [5, 6]


def test_stop_sequence_rolls_back_and_continuation_is_exact(model, weights, engine):
    """A multi-token stop ends the turn at the match; extend continues from exactly there."""
    p = _prompts(1, seed=8)[0]
    free = _full_forward_greedy(model, p, 12)
    seq = tuple(free[3:5])  # the greedy run's tokens 3..4 form the stop sequence
    g = engine.submit(p, n=1, max_new_tokens=20, temperature=0.0, stop_sequences=[seq], hold=True)
    engine.run(weights)
    r = g.requests[0]
    assert r.finish is FinishReason.STOP and r.tokens == free[:5]
    assert r.status is Status.FINISHED and r.slot is not None
    tool = [7, 8, 9]
    engine.extend(r, tool, max_new_tokens=6)
    engine.run(weights)
    want = _full_forward_greedy(model, p + free[:5] + tool, 6)
    assert r.tokens == want and r.finish is FinishReason.LENGTH
    engine.release(r)
    assert r.status is Status.RELEASED and not engine.pending()


def test_multi_turn_logprobs_match_full_forward(model, weights, engine):
    p = _prompts(1, seed=12)[0]
    g = engine.submit(p, n=2, max_new_tokens=5, temperature=1.0, seed=3, hold=True)
    engine.run(weights)
    first = [r.result()[0] for r in g.requests]
    for r in g.requests:
        engine.extend(r, [5, 6], max_new_tokens=7)
    engine.run(weights)
    for r, t0 in zip(g.requests, first, strict=True):
        toks, lps = r.result()
        hist = np.concatenate([p, t0, [5, 6]])
        np.testing.assert_allclose(lps, _policy_logprobs(model, hist, toks, 1.0), atol=1e-5)
        engine.release(r)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=list(range(40))), "prompt_len"),
        (dict(prompt=[1, 2], n=0), "n=0"),
        (dict(prompt=[1, 2], n=5), "group_size"),
        (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt=[1, 300]), r"\[0, 256\)"),
        (dict(prompt=[1, -1]), r"prompt\[1\] = -1"),
        (dict(prompt=[1, 2], stop_ids=[999]), "stop_ids"),
        (dict(prompt=[1, 2], temperature=-1.0), "temperature"),
        (dict(prompt=[1, 2], top_p=0.0), "top_p"),
    ],
)
def test_bad_input_names_the_field(engine, kwargs, match):
    with pytest.raises(EngineError, match=match):
        engine.submit(**kwargs)


def test_unknown_handle_and_bad_extend(model, weights, engine):
    """A handle from another engine is refused whatever its ids (the other engine's
    first group has id 0, like a group of the shared engine), and stays untouched."""
    other = RolloutEngine(model, SMALL)
    g = other.submit([1, 2, 3], n=1)
    with pytest.raises(EngineError, match="unknown request"):
        engine.cancel(g.requests[0])  # submitted to another engine
    with pytest.raises(EngineError, match="unknown group handle"):
        engine.cancel(g)
    with pytest.raises(EngineError, match="unknown request"):
        engine.cancel(object())
    assert g.requests[0].status is Status.WAITING and other.pending()
    h = engine.submit([1, 2, 3], n=1, max_new_tokens=2)
    engine.run(weights)
    with pytest.raises(EngineError, match="hold=True"):
        engine.extend(h.requests[0], [1])


def test_config_validation():
    with pytest.raises(EngineError, match="slots"):
        ContinuousConfig(slots=0)
    with pytest.raises(EngineError, match="max_position_embeddings"):
        RolloutEngine(Decoder(CFG.replace(max_position_embeddings=64)), SMALL.__class__())


def test_sampler_interface(model, weights):
    cs = ContinuousSampler(
        model, SMALL, temperature=0.0, max_new_tokens=12, stop_sequences=[(1, 2)]
    )
    prompts = _prompts(2, seed=13)
    res = cs.generate(weights, prompts, num_samples=2)
    ref = Sampler(
        model, SamplingParams.greedy(max_new_tokens=12, stop_sequences=[(1, 2)])
    ).generate(weights, prompts, num_samples=2)
    assert [t.tolist() for t in res.tokens] == [t.tolist() for t in ref.tokens]
    assert res.finish.tolist() == ref.finish.tolist()
    assert res.prompt_index.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("dp, tp", [(8, 1), (4, 2), (2, 4)])
def test_mesh_equals_single_device(model, weights, dp, tp):
    """Slots over dp, heads over tp: the same tokens and logprobs as one device."""
    from dtarl.parallel.mesh import make_mesh

    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    cfg = ContinuousConfig(
        slots=8, groups=4, group_size=4, prompt_len=16, response_len=16, steps_per_call=8
    )
    prompts = _prompts(3, seed=21, hi=16)

    def run(eng):
        w = eng.place(weights)
        gs = [eng.submit(p, n=3, max_new_tokens=12, seed=i) for i, p in enumerate(prompts)]
        gs.append(eng.submit(prompts[0], n=2, max_new_tokens=9, temperature=0.0))
        eng.run(w)
        return [r.result() for g in gs for r in g.requests]

    ref = run(RolloutEngine(model, cfg))
    eng = RolloutEngine(model, cfg, mesh=make_mesh(dp, tp))
    got = run(eng)
    assert eng.pool.arrays.resp_k[0].sharding.spec[0] == "dp"
    for (t, lp), (t_ref, lp_ref) in zip(got, ref, strict=True):
        assert t.tolist() == t_ref.tolist()
        np.testing.assert_allclose(lp, lp_ref, atol=1e-5, rtol=1e-5)
    before = eng.trace_count
    run(eng)  # same shapes and shardings: nothing compiles again
    assert eng.trace_count == before


def test_sampler_grows_for_a_long_prompt(model, weights):
    cs = ContinuousSampler(model, SMALL, temperature=0.0, max_new_tokens=4)
    long_prompt = _prompts(1, seed=15, lo=40, hi=41)[0]
    with pytest.warns(RuntimeWarning, match="rebuilding with prompt_len=64"):
        res = cs.generate(weights, [long_prompt], num_samples=5)
    assert cs.engine.config.prompt_len == 64 and cs.engine.config.group_size == 8
    assert [t.tolist() for t in res.tokens] == [_full_forward_greedy(model, long_prompt, 4)] * 5


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6)]
)
def test_sampling_distribution(temperature, top_k, top_p):
    """Inverse-CDF draws follow softmax(logits / T) restricted by top-k / top-p."""
    from dtarl.rollout import kernels

    n, v = 20000, 6
    logits = jnp.broadcast_to(jnp.asarray([2.0, 1.5, 1.0, 0.0, -1.0, -3.0]), (n, v))
    slots = kernels.Slots(
        group=None, cell=None, length=None, token=None, active=None, budget=None, forced=None,
        key=jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(n)),
        temperature=jnp.full((n,), temperature), top_p=jnp.full((n,), top_p),
        top_k=jnp.full((n,), top_k, jnp.int32), stop_ids=None,
    )  # fmt: skip
    filtered = top_k > 0 or top_p < 1
    tok, lp = kernels.sample(logits, slots, jnp.zeros((n,), jnp.int32), filtered=filtered)
    p = np.asarray(jax.nn.softmax(logits[0] / temperature))
    np.testing.assert_allclose(np.asarray(lp), np.log(p)[np.asarray(tok)], rtol=1e-5)
    want = p.copy()
    if top_k:
        want[top_k:] = 0
    if top_p < 1:
        before = np.cumsum(want) - want
        want[before >= top_p] = 0
    want /= want.sum()
    freq = np.bincount(np.asarray(tok), minlength=v) / n
    assert np.all(freq[want == 0] == 0)
    tol = 4 * np.sqrt(want * (1 - want) / n) + 1e-3
    assert np.all(np.abs(freq - want) <= tol), (freq, want)
