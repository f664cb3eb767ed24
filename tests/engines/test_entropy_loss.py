"""The entropy bonus: losses that read per-token entropy, through every engine.

Reference = an independent jnp implementation (full forward per sequence,
log_softmax, H_t = -sum_v p log p computed directly), differentiated with
jax.grad; every engine must match it (fp32, per-tensor relative error <= 1e-5).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_math
from flax import nnx
from test_equivalence import rel_errors, with_logprob_data

from dtarl.batch import LossNorm
from dtarl.engines import (
    Capacity,
    DenseEngine,
    DFSEngine,
    PrefixActivations,
    PrefixReuseEngine,
    RolloutBatch,
)
from dtarl.losses import ClippedSurrogateLoss, MaskedNLLLoss, SequenceData, TokenData
from dtarl.model import ModelConfig, ModelFamily, init_model
from dtarl.testing import grpo_groups

RTOL = 1e-5  # fp32, max over parameter tensors of ||a - b|| / ||b||; never loosen
REF_LEN = 48  # every test sequence is shorter

LOSSES = {
    "grpo": ClippedSurrogateLoss.grpo(kl_coef=0.1, entropy_coef=0.01),
    "dapo": ClippedSurrogateLoss.dapo(entropy_coef=0.01),
}


@functools.cache
def _model():
    cfg = ModelConfig.tiny(ModelFamily.QWEN3, param_dtype="float32", compute_dtype="float32")
    model = init_model(cfg, seed=1)
    _, params = nnx.split(model, nnx.Param)
    return model, params


@functools.cache
def _engine(kind: str, mode: PrefixActivations = PrefixActivations.OFFLOAD):
    """Pre-sized buckets: one compilation per (engine, loss) for the whole module."""
    model, _ = _model()
    if kind == "dense":
        return DenseEngine(model, microbatch=4).reserve(Capacity(sequences=16, length=48))
    if kind == "prefix_reuse":
        engine = PrefixReuseEngine(
            model, microbatch=4, prefix_activations=mode, offload_on_cpu=True
        )
        return engine.reserve(
            Capacity(
                sequences=16, length=48, group_size=8, groups=2, prompt_len=24, response_len=32
            )
        )
    if kind == "dfs":  # both batches within the reserve: one program per loss
        return DFSEngine(model, chunk_len=8, prefix_levels=1).reserve(
            Capacity(sequences=16, length=48, group_size=8, groups=2)
        )
    raise ValueError(kind)


@functools.cache
def _reference_fn(loss, temperature=1.0):
    """jax.grad of one sequence's loss, logprobs and entropies from a plain full forward.

    The sequence is padded at the end to REF_LEN, which cannot change its values
    (causal attention); the padding is masked out of the loss. Both of logits / T."""
    model, _ = _model()
    graphdef, _ = nnx.split(model, nnx.Param)

    def one(params, toks, mask, old, ref, adv, w, n):
        m = nnx.merge(graphdef, params)
        logits, _ = m(toks[None], jnp.arange(REF_LEN)[None])
        logq_TxV = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32) / temperature, axis=-1)
        lp = jnp.take_along_axis(logq_TxV, toks[1:, None], axis=-1)[:, 0]
        ent = -jnp.sum(jnp.exp(logq_TxV) * logq_TxV, axis=-1)
        valid = jnp.arange(REF_LEN) < n
        lp = jnp.where(valid, jnp.concatenate([jnp.zeros(1), lp]), 0.0)
        ent = jnp.where(valid, jnp.concatenate([jnp.zeros(1), ent]), 0.0)
        nan = jnp.full(REF_LEN, jnp.nan)
        tok = TokenData(
            mask=mask,
            old_logprobs=jnp.where(valid, old, 0.0),
            ref_logprobs=jnp.where(valid, ref, 0.0),
            advantages=nan,
            entropy=ent,
        )
        return loss(lp, tok, SequenceData(adv, w)), lp

    return jax.jit(jax.value_and_grad(one, has_aux=True))


def reference(batch: RolloutBatch, loss, temperature=1.0):
    """sum_i w_i loss_i and its jax.grad, one sequence at a time."""
    _, params = _model()
    fn = _reference_fn(loss, temperature)
    w = batch.sequence_weights(loss.norm, loss.norm_constant)
    total, grads, logps = 0.0, None, []
    for i, toks in enumerate(batch.tokens):
        n = toks.shape[0]
        assert n <= REF_LEN

        def pad(x, n=n):
            return np.concatenate([x, np.zeros(REF_LEN - n, np.float32)]).astype(np.float32)

        (val, lp), g = fn(
            params,
            np.concatenate([toks, np.zeros(REF_LEN - n, np.int32)]),
            pad(batch.loss_mask[i]),
            pad(batch.old_logprobs[i]),
            pad(batch.ref_logprobs[i]),
            batch.advantages[i],
            w[i],
            n,
        )
        total = total + val
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        logps.append(np.asarray(lp)[:n])
    return total, grads, logps


def grpo_batch() -> RolloutBatch:
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=3)
    return with_logprob_data(batch)


def tree_batch() -> RolloutBatch:
    """Branching below the prompt, a sequence ending at the prompt node, a duplicate."""
    rs = np.random.RandomState(7)
    stem = list(rs.randint(3, 256, 9))
    mid = stem + list(rs.randint(3, 256, 6))
    seqs = [
        stem,
        stem + list(rs.randint(3, 256, 12)),
        mid + list(rs.randint(3, 256, 5)),
        mid + list(rs.randint(3, 256, 9)),
        mid,
        list(mid),
        list(rs.randint(3, 256, 20)),
    ]
    masks = []
    for s in seqs:
        m = (rs.rand(len(s)) < 0.8).astype(np.float32)
        m[0] = 0
        masks.append(m)
    batch = RolloutBatch.create(tokens=seqs, loss_mask=masks, advantages=rs.randn(len(seqs)))
    return with_logprob_data(batch, seed=1)


BATCHES = {"grpo_groups": grpo_batch, "tree": tree_batch}


def check(engine, batch: RolloutBatch, loss, temperature=1.0):
    _, params = _model()
    want_loss, want_grads, want_logp = reference(batch, loss, temperature)
    got_loss, got_grads, aux = engine.value_and_grad(params, batch, loss)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=RTOL, atol=1e-7)
    for got, want in zip(aux.logprobs, want_logp, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    worst = max(rel_errors(got_grads, want_grads))
    assert worst <= RTOL, f"{engine.name}: worst per-tensor relative grad error {worst:.2e}"
    cfg = _model()[0].cfg
    reference_math.check(
        cfg,
        params,
        batch,
        loss,
        got_loss,
        got_grads,
        aux.logprobs,
        name=engine.name,
        temperature=temperature,
    )


# ------------------------------------------------------------------ the loss


def test_needs_entropy_flags():
    assert not MaskedNLLLoss().needs_entropy
    assert not ClippedSurrogateLoss().needs_entropy
    assert not ClippedSurrogateLoss.grpo(entropy_coef=0.0).needs_entropy
    for loss in (
        ClippedSurrogateLoss.grpo(entropy_coef=0.01),
        ClippedSurrogateLoss.dapo(entropy_coef=0.01),
        ClippedSurrogateLoss.dr_grpo(max_len=16, entropy_coef=0.01),
        ClippedSurrogateLoss.ppo(entropy_coef=0.01),
    ):
        assert loss.needs_entropy
        assert loss.entropy_coef == 0.01
    # Presets keep their normalisation when given an entropy bonus.
    assert ClippedSurrogateLoss.dapo(entropy_coef=0.01).norm is LossNorm.TOKEN
    assert ClippedSurrogateLoss.grpo(entropy_coef=0.01).norm is LossNorm.SEQUENCE


@pytest.mark.parametrize("coef", [-0.01, math.nan, math.inf, -math.inf])
def test_entropy_coef_rejected(coef):
    with pytest.raises(ValueError, match="entropy_coef"):
        ClippedSurrogateLoss(entropy_coef=coef)
    with pytest.raises(ValueError, match="entropy_coef"):
        ClippedSurrogateLoss.grpo(entropy_coef=coef)


def _token_data(s=6, entropy=None, seed=0):
    rs = np.random.RandomState(seed)
    mask = np.array([0, 1, 1, 0, 1, 1], np.float32)[:s]
    return TokenData(
        mask=jnp.asarray(mask),
        old_logprobs=jnp.asarray(-rs.rand(s) - 1, jnp.float32),
        ref_logprobs=jnp.asarray(-rs.rand(s) - 1, jnp.float32),
        advantages=jnp.full(s, jnp.nan),
        entropy=entropy,
    )


def test_entropy_bonus_hand_computed():
    """loss(coef) - loss(0) = -coef * w * sum_t m_t H_t, the policy term's aggregation."""
    logp = jnp.asarray([0.0, -1.2, -0.7, -2.0, -0.3, -1.5], jnp.float32)
    ent = np.array([0.0, 2.0, 1.5, 9.0, 0.5, 3.0], np.float32)
    tok = _token_data(entropy=jnp.asarray(ent))
    seq = SequenceData(advantage=jnp.float32(0.8), weight=jnp.float32(0.25))
    for make in (ClippedSurrogateLoss.grpo, ClippedSurrogateLoss.dapo):
        with_bonus = float(make(entropy_coef=0.1)(logp, tok, seq))
        without = float(make()(logp, tok, seq))
        # masked: 2.0 + 1.5 + 0.5 + 3.0 = 7.0 (the 9.0 at a masked position is ignored)
        np.testing.assert_allclose(with_bonus - without, -0.1 * 0.25 * 7.0, rtol=1e-6)
    # d loss / d H_t = -coef * w * m_t
    g = jax.grad(
        lambda h: ClippedSurrogateLoss.grpo(entropy_coef=0.1)(logp, tok._replace(entropy=h), seq)
    )(jnp.asarray(ent))
    np.testing.assert_allclose(g, -0.1 * 0.25 * np.asarray(tok.mask), rtol=1e-6)


def test_loss_without_entropy_data_raises():
    logp = jnp.zeros(6, jnp.float32)
    seq = SequenceData(advantage=jnp.float32(1.0), weight=jnp.float32(1.0))
    with pytest.raises(ValueError, match="TokenData.entropy is None"):
        ClippedSurrogateLoss.grpo(entropy_coef=0.01)(logp, _token_data(), seq)
    # Without a bonus the entropy is never read.
    ClippedSurrogateLoss.grpo()(logp, _token_data(), seq)


# ---------------------------------------------------------------- the engines


def test_reference_entropy_term_matters():
    """The bonus moves the gradient far beyond the tolerance, so the checks can fail."""
    batch = grpo_batch()
    _, with_bonus, _ = reference(batch, LOSSES["grpo"])
    _, without, _ = reference(batch, ClippedSurrogateLoss.grpo(kl_coef=0.1))
    assert max(rel_errors(with_bonus, without)) > 100 * RTOL


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_entropy_dense(loss_name, batch_name):
    check(_engine("dense"), BATCHES[batch_name](), LOSSES[loss_name])


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
@pytest.mark.parametrize(
    "loss_name,mode",
    # One compilation each: the default mode (OFFLOAD, offloading on a CPU too; KEEP
    # where the backend has no pinned_host), and REMAT, which re-runs the prefix
    # forward (entropy included) for its VJP.
    [("grpo", PrefixActivations.OFFLOAD), ("dapo", PrefixActivations.REMAT)],
)
def test_entropy_prefix_reuse(loss_name, mode, batch_name):
    check(_engine("prefix_reuse", mode), BATCHES[batch_name](), LOSSES[loss_name])


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_entropy_dfs(loss_name, batch_name):
    engine = _engine("dfs")
    reserved = engine.buckets
    check(engine, BATCHES[batch_name](), LOSSES[loss_name])
    assert engine.buckets == reserved, f"batch outgrew the reserve: {engine.buckets}"


@pytest.mark.parametrize("kind", ["dense", "dfs", "prefix_reuse"])
def test_entropy_at_a_sampling_temperature(kind):
    """At T = 0.7 the entropy bonus is that of softmax(logits / T), like the logprobs,
    in every engine (the tree batch has deep groups: prefix_reuse's inner DFS too)."""
    model, _ = _model()
    t = 0.7
    if kind == "dense":
        engine = DenseEngine(model, microbatch=4, temperature=t)
    elif kind == "dfs":
        engine = DFSEngine(model, chunk_len=8, prefix_levels=1, temperature=t)
    else:
        engine = PrefixReuseEngine(model, microbatch=4, offload_on_cpu=True, temperature=t)
    assert engine.temperature == t
    check(engine, tree_batch(), LOSSES["grpo"], temperature=t)
    _, at_t, _ = reference(tree_batch(), LOSSES["grpo"], t)
    _, at_one, _ = reference(tree_batch(), LOSSES["grpo"])
    assert max(rel_errors(at_t, at_one)) > 100 * RTOL


def test_dfs_kept_layer_outputs_entropy_and_temperature():
    """A loss that reads the entropy: the push keeps it on the path, the pop's head
    VJP gives its cotangent; sampling temperature 0.7 on the head (the entropy
    tests' reference; the model has no remat, so ``keep_layer_outputs`` is set, and the
    kept outputs are the same as under remat)."""
    model, _ = _model()
    engine = DFSEngine(model, chunk_len=8, keep_layer_outputs=True, temperature=0.7)
    batch = tree_batch()  # internal nodes that end sequences, a duplicate
    check(engine, batch, LOSSES["grpo"], temperature=0.7)
