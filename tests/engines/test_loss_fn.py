"""engine.loss_fn: the tree loss as a jax.custom_vjp function of the parameters.

For every engine (dense, dfs, prefix_reuse, auto, and ShardedEngine on a 2-device
CPU mesh) and every loss written against the open interface (GSPO, CISPO and a
loss defined in this file), jax.grad of ``a * f(params, prepared) + l2(params)``
equals the same composition of the dense per-sequence reference (jax.grad, fp32,
1e-5), as do the loss and the per-token logprobs from ``has_aux``. Also: jit ==
no-jit inside an optax.MultiSteps step, no retrace across two batches of one
bucket, the eager path runs the engine's own compiled program, and forward mode /
differentiating the batch or the aux are clear errors.
"""

import dataclasses
import functools
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dtarl.batch import LossNorm, RolloutBatch
from dtarl.engines import AutoEngine, DenseEngine, DFSEngine, PrefixReuseEngine
from dtarl.engines.function import LossAux, TreeLoss
from dtarl.losses import CISPOLoss, GSPOLoss, SequenceData, SequenceLoss, TokenData
from dtarl.model import ModelConfig, init_model
from dtarl.parallel.mesh import make_mesh
from dtarl.parallel.sharded import ShardedEngine
from dtarl.testing import grpo_groups
from tests.engines.test_equivalence import RTOL, reference, rel_errors, with_logprob_data

A = 0.5  # the tree loss's factor in the composed objective
L2 = 1e-2


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReinforceWithBaselineKL:
    """A user-defined loss, written only against dtarl.losses.SequenceLoss (not part
    of the library): REINFORCE on (A_i - b) with a squared-log-ratio penalty to the
    reference and a per-sequence length bonus, summed over the masked tokens."""

    baseline: float = 0.1
    beta: float = 0.05
    norm: LossNorm = LossNorm.SEQUENCE_SUM
    norm_constant: float | None = None
    needs_old_logprobs = False
    needs_ref_logprobs = True
    needs_entropy = False

    def __call__(self, logp_S, tok: TokenData, seq: SequenceData) -> jax.Array:
        pg = -(seq.advantage - self.baseline) * logp_S
        kl = 0.5 * jnp.square(logp_S - tok.ref_logprobs)
        per_seq = jnp.sum(tok.mask * (pg + self.beta * kl))
        return seq.weight * per_seq * (1.0 + 0.01 * jnp.sum(tok.mask))


LOSSES = {
    "gspo": GSPOLoss(eps_low=0.2, eps_high=0.25),  # wide enough that some clip, some not
    "cispo": CISPOLoss(eps_low=0.5, eps_high=0.2),
    "user": ReinforceWithBaselineKL(),
}
KINDS = ["dense", "dfs", "prefix_reuse", "auto", "sharded"]


@functools.cache
def _model():
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
    model = init_model(cfg, seed=1)
    return model, nnx.split(model, nnx.Param)[1]


def _batch(seed: int) -> RolloutBatch:
    """GRPO groups with a deep branch (a node below the prompt with two leaves)."""
    batch = grpo_groups(num_groups=2, group_size=3, prompt_len=11, response_len=(1, 13), seed=seed)
    rs = np.random.RandomState(seed + 9)
    stem = list(batch.tokens[0][:11])
    deep = [stem + list(rs.randint(3, 256, 4)) + list(rs.randint(3, 256, k)) for k in (2, 5)]
    deep = [deep[0], deep[0][:15] + deep[1][15:]]
    tokens = list(batch.tokens) + [np.asarray(s) for s in deep]
    masks = list(batch.loss_mask) + [(np.arange(len(s)) >= 11).astype(np.float32) for s in deep]
    adv = np.concatenate([batch.advantages, rs.randn(2)])
    return with_logprob_data(
        RolloutBatch.create(tokens=tokens, loss_mask=masks, advantages=adv), seed=seed
    )


@functools.cache
def _engine(kind: str):
    model, _ = _model()
    if kind == "dense":
        return DenseEngine(model, microbatch=4)
    if kind == "dfs":  # one prefix level: the fewest switch branches to compile
        return DFSEngine(model, chunk_len=8, prefix_levels=1)
    if kind == "prefix_reuse":
        return PrefixReuseEngine(model, microbatch=4)
    if kind == "auto":  # delegates to (and shares the compiled programs of) the dfs engine;
        # one candidate: a pick between close ones follows measured host seconds
        engines = {k: _engine(k) for k in ("dense", "dfs", "prefix_reuse")}
        return AutoEngine(model, engines=engines, candidates=("dfs",), autotune=False)
    # dp=2 over 2 of the 8 fake CPU devices (tests/conftest.py), a dense engine per rank
    mesh = make_mesh(dp=2, tp=1, devices=jax.devices()[:2])
    return ShardedEngine(engine=DenseEngine(model, microbatch=4), mesh=mesh)


def l2(params) -> jax.Array:
    return L2 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))


def _objective(f: TreeLoss, prepared):
    def obj(params):
        loss, aux = f(params, prepared)
        return A * loss + l2(params), aux

    return obj


def _expected(params, batch, loss):
    """(a * L + l2, its gradient, logprobs) from the dense per-sequence reference."""
    model, _ = _model()
    want_loss, want_grads, want_logp = reference(model, params, batch, loss)
    reg, reg_grads = jax.value_and_grad(l2)(params)
    grads = jax.tree.map(lambda g, r: A * g + r, want_grads, reg_grads)
    return A * want_loss + reg, grads, want_logp


def _check(got_value, got_grads, got_logp, expected):
    want_value, want_grads, want_logp = expected
    np.testing.assert_allclose(float(got_value), float(want_value), rtol=RTOL, atol=1e-7)
    worst = max(rel_errors(got_grads, want_grads))
    assert worst <= RTOL, f"worst per-tensor relative grad error {worst:.2e}"
    for got, want in zip(got_logp, want_logp, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    return worst


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
@pytest.mark.parametrize("kind", KINDS)
def test_regularised_grad_matches_dense(kind, loss_name):
    """jax.value_and_grad(a * f + l2, has_aux=True) == the dense reference composed alike;
    the eager path runs the engine's compiled program (the one value_and_grad runs)."""
    _, params = _model()
    engine, loss = _engine(kind), LOSSES[loss_name]
    batch = _batch(3)
    f = engine.loss_fn(loss, has_aux=True)
    prepared = f.prepare(batch)
    (value, aux), grads = jax.value_and_grad(_objective(f, prepared), has_aux=True)(params)
    assert isinstance(aux, LossAux)
    worst = _check(value, grads, f.logprobs(prepared, aux), _expected(params, batch, loss))
    print(f"loss_fn {kind} {loss_name}: worst relative grad error {worst:.2e}")  # -s shows it
    if kind == "auto":
        assert prepared.stats["chosen_engine"] == "dfs"
    traces = engine.trace_count
    engine.value_and_grad(params, batch, loss)
    assert engine.trace_count == traces  # the same compiled program


def _step(f: TreeLoss, opt):
    """A user's own training step: optax.MultiSteps over the composed objective."""

    def step(params, opt_state, prepared):
        step.traces += 1
        (value, aux), grads = jax.value_and_grad(_objective(f, prepared), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads, aux

    step.traces = 0
    return step


@pytest.mark.parametrize("kind", ["dfs", "sharded"])
def test_jit_matches_eager_no_retrace(kind):
    """A jitted optax.MultiSteps step equals the same step run eagerly (no jit); two
    batches of one bucket trace it once; the accumulated update moves the params."""
    _, params = _model()
    engine, loss = _engine(kind), LOSSES["cispo"]
    f = engine.loss_fn(loss, has_aux=True)
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    # Buckets only grow: the larger batch first, so that both are prepared in its bucket.
    second = f.prepare(_batch(5))
    first = f.prepare(_batch(3))
    assert jax.tree.structure(first) == jax.tree.structure(second)
    step = _step(f, opt)
    jitted = jax.jit(step)
    state = opt.init(params)
    outs = []
    for prepared in (first, second):  # same params and state: only the batch changes
        out_jit, out_eager = jitted(params, state, prepared), step(params, state, prepared)
        _same(f, prepared, out_jit, out_eager)
        outs.append((out_jit, out_eager))
    assert step.traces == 3  # one jit trace for both batches + two eager calls
    # The second micro-step applies the mean of the two gradients: params move.
    (p_jit, s_jit, *_), (p_eager, s_eager, *_) = outs[0]
    last_jit, last_eager = jitted(p_jit, s_jit, second), step(p_eager, s_eager, second)
    _same(f, second, last_jit, last_eager)
    assert max(rel_errors(last_jit[0], params)) > 1e-4


def _same(f, prepared, got, want):
    """jit == no-jit: params, value, grads and logprobs of two step outputs (1e-5)."""
    (p_got, _, v_got, g_got, aux_got), (p_want, _, v_want, g_want, aux_want) = got, want
    np.testing.assert_allclose(float(v_got), float(v_want), rtol=RTOL)
    assert max(rel_errors(g_got, g_want)) <= RTOL
    assert max(rel_errors(p_got, p_want)) <= RTOL
    pairs = zip(f.logprobs(prepared, aux_got), f.logprobs(prepared, aux_want), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_errors_are_clear():
    """Forward mode, gradients w.r.t. the batch or through the aux, a batch from another
    prepare, and an object that is not a SequenceLoss: one-line errors."""
    _, params = _model()
    engine, loss = _engine("dense"), LOSSES["gspo"]
    f = engine.loss_fn(loss)
    prepared = f.prepare(_batch(3))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda p: f(p, prepared), (params,), (params,))
    seq = prepared.args[-1]

    def wrt_batch(weight):
        args = (*prepared.args[:-1], seq._replace(weight=weight))
        return f(params, dataclasses.replace(prepared, args=args))

    with pytest.raises(ValueError, match="with respect to prepared"):
        jax.grad(wrt_batch)(jnp.asarray(seq.weight))
    g = engine.loss_fn(loss, has_aux=True)
    with pytest.raises(ValueError, match="LossAux .* is not differentiable"):
        jax.grad(lambda p: g(p, prepared)[1].grad_norm)(params)
    with pytest.raises(TypeError, match="must be the Prepared"):
        f(params, _batch(3))
    with pytest.raises(TypeError, match="is not a SequenceLoss: it lacks norm"):
        engine.loss_fn(lambda logp, tok, seq: jnp.sum(logp))
    assert isinstance(loss, SequenceLoss) and isinstance(LOSSES["user"], SequenceLoss)


def test_custom_step_example_runs():
    """examples/custom_step.py (the example in docs/loss_fn.md) runs and its loss falls."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_step.py")
    out = runpy.run_path(path, run_name="example")
    losses = out["run"](steps=3)
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_gspo_and_cispo_hand_computed():
    """GSPO's and CISPO's value and d/dlogp against their formulas (no model)."""
    logp = jnp.array([0.0, -1.0, -2.0, -0.5, -3.0])
    old = jnp.array([0.0, -1.2, -1.9, -0.7, -9.0])
    mask = jnp.array([0.0, 1.0, 1.0, 1.0, 0.0])  # the last token's huge ratio is masked
    tok = TokenData(mask, old, jnp.full(5, jnp.nan), jnp.full(5, jnp.nan))
    seq = SequenceData(advantage=jnp.float32(1.5), weight=jnp.float32(0.25))
    s = np.exp(np.sum(np.asarray(mask * (logp - old))) / 3)  # exp(0.1): 1.105
    for eps_high, clipped in ((0.2, False), (0.05, True)):
        loss = GSPOLoss(eps_low=0.2, eps_high=eps_high)
        value, grad = jax.value_and_grad(loss)(logp, tok, seq)
        ratio = min(s, 1 + eps_high)
        np.testing.assert_allclose(float(value), -0.25 * 3 * ratio * 1.5, rtol=1e-6)
        want = np.zeros(5) if clipped else -0.25 * 1.5 * s * np.asarray(mask)
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=1e-7)
    loss = CISPOLoss(eps_low=0.1, eps_high=0.1)
    r = np.clip(np.exp(np.asarray(logp - old)), 0.9, 1.1)  # 1.1, 0.9, 1.1 on the mask
    value, grad = jax.value_and_grad(loss)(logp, tok, seq)
    want = -0.25 * np.sum(np.asarray(mask) * r * 1.5 * np.asarray(logp))
    np.testing.assert_allclose(float(value), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), -0.25 * np.asarray(mask) * r * 1.5, rtol=1e-6)
    with pytest.raises(ValueError, match="eps_low=1.5 must be in"):
        CISPOLoss(eps_low=1.5)
    with pytest.raises(ValueError, match="norm_constant must be > 0"):
        GSPOLoss(norm=LossNorm.CONSTANT)


def test_program_store_eager_and_jit(store):
    """With the program store on (the trainer's compile cache), the eager path runs the
    stored program and a jitted step traces the engine's device function instead."""
    model, params = _model()
    engine, loss = DenseEngine(model, microbatch=4), LOSSES["user"]
    f = engine.loss_fn(loss)
    prepared = f.prepare(_batch(3))
    want = jax.value_and_grad(lambda p: A * f(p, prepared) + l2(p))
    got = jax.jit(jax.value_and_grad(lambda p, prep: A * f(p, prep) + l2(p)))(params, prepared)
    eager = want(params)
    assert any(name.startswith("dense_engine") for name in os.listdir(store.path))
    np.testing.assert_allclose(float(got[0]), float(eager[0]), rtol=RTOL)
    assert max(rel_errors(got[1], eager[1])) <= RTOL
