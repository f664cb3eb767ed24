"""bf16 compute with fp32 master weights: every engine against dense-bf16.

Setting. ``compute_dtype=bfloat16``, ``param_dtype=float32``: the decoder casts each
fp32 parameter to bf16 where it is used, so the parameters are rounded to bf16 once
here (``_rounded``) and every engine reads *identical* bf16 weights; they also see
the same batch (a multi-turn tree whose deep group prefix_reuse hands to its DFS
program, and GRPO groups). Any difference between two engines is then rounding
only: u = 2^-8 is bf16's unit roundoff, 2^-24 fp32's.

Per-token logprobs (``logprob_bound``). The engines run the same decoder code, so
their forward programs perform the same R = 14 L + 1 bf16 roundings per token
(per layer: input norm, q/k/v projections, q and k norms, RoPE, attention
probabilities, attention output, o_proj, residual add, post norm, gate and up,
silu * up, down_proj, residual add; then the final norm); logits, log-softmax and
the LSE are fp32 in all of them. What differs is only how fp32 reductions are
blocked and ordered (a prefix K/V split against one softmax row, chunked against
whole matmuls, padding), a relative change of at most gamma = k 2^-24 (k <= 256
terms) before each bf16 rounding. To first order that moves a logit by at most
R gamma A, A = max_{t,v} sum_e |h_te W_ev| (fp32 final hidden h, head W), and a
logprob (logit minus the LSE) by twice that. A bf16 rounding can also flip by one
ulp (2u relative) when a reassociated value straddles a rounding boundary; we
allow one such flip per token in the final hidden state, 2 * 2u * max |h_te W_ev|
on a logprob. Bound = 2 R gamma A + 4u max |h W| (5.2e-3 here, 10x below the
old 5e-2); observed: under 1e-6 for every engine here (README, "Precision").
A program that XLA partitions (``ShardedEngine`` at dp=2) fuses differently and
keeps other bf16 intermediates in fp32 (excess precision): 4.2e-3 measured, 0.0 with
``--xla_allow_excess_precision=false``; not run here (its compile is not cheap).
Limit: the tiny model's logits are small (near-uniform predictions), so one extra
misplaced rounding moves logprobs by less than this bound (bf16 logits in DFS:
9.5e-4); the check catches errors above rounding level (masks, positions, a lost
prefix, fp16), 10x finer than the old 5e-2.

Gradients (``grad_bounds``). The backward is bf16 too (activation cotangents take
the primal's dtype), but two former sources of difference are gone:
(i) no program rounds a parameter gradient to bf16: the decoder's cast helpers
(``cast_einsum`` for every projection and the LM head, ``cast_scale`` for the
norm weights, ``cast_bias``, ``cast_embed``) form each weight-gradient product from
the bf16 operands with fp32 accumulation and keep it fp32, so the partial weight
gradients (dense: per microbatch; DFS: per chunk step; prefix_reuse: per suffix
microbatch and per prefix) and their sums differ only by fp32 reassociation;
(ii) no program rounds a partial K/V or query cotangent: the attention takes q
and the chunk's and prefix's K/V as fp32-typed bf16 values (products in bf16,
cotangents accumulated in fp32), DFS and prefix_reuse hand in their prefixes in
fp32 and get the chunk's K/V back in fp32, so a key's cotangent (from its own
chunk and, through the fp32 carry, from every descendant) and a query's (prefix
and chunk parts) is summed in fp32 and rounded once, where dense rounds it.
(Measured on unshared sequences with excess precision off: DFS at chunk 8 against
one chunk per sequence differed 8.9e-3 from dense before, 2.0e-3 now, as at one
chunk.) What still differs, per term of a gradient's sum:
(iii) XLA keeps some fused bf16 intermediates in fp32 (excess precision), which
ones depending on the program (dense against dense_remat, the same engine,
differs through this alone; with ``--xla_allow_excess_precision=false`` they are
equal): about one per layer, L = 2;
(iv) a tree engine computes a shared prefix token once: its backward rounds the
sum of the copies' cotangents where dense rounds each copy's (then sums them in
fp32 in the weight-gradient product). Each side rounds each such value once, an
error of at most u of the rounded value: one rounding on each side, 2.
C = 2 + 2 = 4 roundings (6 before: two for the partial weight gradients and two
for the K/V carry, now gone, but (iv) was not counted), each a relative error u
of a term, so per tensor T

    ||g_T^engine - g_T^dense|| / ||g_T^dense|| <= C u kappa_T,
    kappa_T = sum_i ||g_T,i|| / ||sum_i g_T,i||     (fp32 per-sequence gradients),

kappa_T measuring the cancellation between the sum's terms (2.3 to 4.8 here: the
small norm-weight gradients cancel most), so C u kappa_T is 3.6e-2 to 7.5e-2
(5.4e-2 to 1.1e-1 before) -- not far below 5e-2: a single bf16 rounding of a term
already moves a tensor by u kappa_T (0.9e-2 to 1.9e-2 here), and (iii) and (iv)
are intrinsic to bf16 activation cotangents (the second to computing a shared
prefix once). This is a first-order model, not a proof: (iii) and (iv) act at
many rounding points, each counted here as one rounding per side (a worst-case
sum over all of them would exceed 1; their errors are independent and largely
cancel).
Observed: at most 1.0 u kappa_T, 0.25 of the bound (1.5e-2 on a norm weight, 1.05e-2
on the matrices, dense_remat alike); dfs and prefix_reuse now produce the same
gradients (equal with excess precision off, where they differ from dense by
1.8e-2 / 8.8e-3: (iv) alone). Before: 2.9 u kappa_T (4.2e-2 on a norm weight).

AdamW trajectory (``test_adamw_trajectories_track_dense_bf16``): see there.

fp32 activations (``activation_dtype="float32"``): the same comparisons with
activations and cotangents in fp32 and only the matmul operands in bf16; the
bound, 4.7e-3 to 9.9e-3 per tensor, is derived in ``f32act_bounds`` (observed
1.1e-6 here, 3.0e-3 at a point where an operand rounding flips).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_equivalence import LOSSES, REF_LEN, _model, _reference_fn

from dtarl.engines import AutoEngine, DFSEngine, RolloutBatch, make_engine
from dtarl.engines.prefix_reuse import deep_sequences
from dtarl.model import ModelFamily, init_model
from dtarl.model.decoder import (
    KVCache,
    attend_xla,
    cast_bias,
    cast_einsum,
    cast_embed,
    cast_matmul,
    cast_scale,
    token_logprobs,
)
from dtarl.rl.config import OptimSection, Schedule
from dtarl.rl.optim import make_optimizer
from dtarl.testing import grpo_groups
from dtarl.tree import build_tree

U = 2.0**-8  # bf16 unit roundoff
LAYERS = 2
ROUNDINGS = 14 * LAYERS + 1  # bf16 roundings on a token's forward path (R above)
GAMMA = 256 * 2.0**-24  # an fp32 reduction of at most 256 terms, reassociated
GRAD_ROUNDINGS = 4  # C above
LOSS = LOSSES["grpo_kl"]
ENGINES = {
    "dense_remat": {},
    # One prefix level, no row/wide pops: the fewest switch branches to compile.
    "dfs": dict(chunk_len=8, prefix_levels=1, leaf_rows=1, wide_chunks=1),
    "prefix_reuse": dict(microbatch=4),
}


@functools.cache
def _models():
    """(bf16-compute model, fp32 model, fp32 params already rounded to bf16)."""
    m32, params = _model(ModelFamily.QWEN3)  # shares test_equivalence's reference program
    assert m32.cfg.num_layers == LAYERS and m32.cfg.param_dtype == "float32"
    m16 = init_model(m32.cfg.replace(compute_dtype="bfloat16"), seed=1)
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    return m16, m32, rounded


@functools.cache
def _batch() -> RolloutBatch:
    """A two-turn tree (prompt, 2 x 2 forks: a deep group) and two GRPO groups."""
    rs = np.random.RandomState(3)
    seqs = [list(rs.randint(3, 256, 9))]
    for _ in range(2):
        seqs = [q + list(rs.randint(3, 256, 5)) for q in seqs for _ in range(2)]
    grpo = grpo_groups(num_groups=2, group_size=3, prompt_len=12, response_len=(3, 9), seed=7)
    toks = seqs + list(grpo.tokens)
    return RolloutBatch.create(
        tokens=toks,
        advantages=rs.randn(len(toks)),
        old_logprobs=[-(rs.rand(len(t)) * 3 + 3) for t in toks],
        ref_logprobs=[-(rs.rand(len(t)) * 3 + 3) for t in toks],
        group_ids=[0] * len(seqs) + [1 + g for g in grpo.group_ids],
    )


@functools.cache
def _engine(kind: str):
    m16, _, _ = _models()
    if kind == "auto":  # shares the other engines' programs
        return AutoEngine(m16, engines={k: _engine(k) for k in ("dense", "dfs", "prefix_reuse")})
    return make_engine(kind, m16, **ENGINES.get(kind, {}))


def logprob_bound() -> float:
    """2 R gamma A + 4 u max|h W| (module docstring), from the fp32 forward."""
    a_sum, a_max = _logit_sums()
    return 2 * ROUNDINGS * GAMMA * a_sum + 4 * U * a_max


def _logit_scale() -> float:
    """A = max_{t,v} sum_e |h_te W_ev| (module docstring), from the fp32 forward."""
    return _logit_sums()[0]


@functools.cache
def _logit_sums() -> tuple[float, float]:
    """(max_{t,v} sum_e |h_te W_ev|, max |h_te W_ev|) from the fp32 forward."""
    _, m32, params = _models()
    graphdef = nnx.split(m32, nnx.Param)[0]
    batch = _batch()
    toks = np.zeros((batch.num_sequences, REF_LEN), np.int32)
    for i, t in enumerate(batch.tokens):
        toks[i, : len(t)] = t
    valid = (np.arange(REF_LEN)[None] < batch.lengths[:, None])[:, :, None, None]

    @jax.jit
    def sums(params):
        model = nnx.merge(graphdef, params)
        h, _ = model(toks, jnp.broadcast_to(jnp.arange(REF_LEN), toks.shape), return_hidden=True)
        # [N, T, E, V]: |h_te W_ev| at the real (causal: unaffected by padding) positions
        terms = jnp.where(valid, jnp.abs(h)[..., None] * jnp.abs(model.lm_head_weight()), 0.0)
        return terms.sum(axis=2).max(), terms.max()

    return tuple(float(x) for x in sums(params))


@functools.cache
def grad_bounds():
    """C u kappa_T per parameter tensor (module docstring), from fp32 per-sequence grads."""
    _, m32, params = _models()
    batch = _batch()
    fn = _reference_fn(m32, LOSS)
    w = batch.sequence_weights(LOSS.norm, LOSS.norm_constant)
    mass, total = None, None
    for i, toks in enumerate(batch.tokens):
        n = toks.shape[0]
        pad = lambda x, n=n: np.concatenate([x, np.zeros(REF_LEN - n, np.float32)])  # noqa: E731
        _, g = fn(
            params,
            np.concatenate([toks, np.zeros(REF_LEN - n, np.int32)]),
            pad(batch.loss_mask[i]),
            pad(batch.old_logprobs[i]),
            pad(batch.ref_logprobs[i]),
            np.full(REF_LEN, np.nan, np.float32),
            batch.advantages[i],
            w[i],
            n,
        )
        norms = jax.tree.map(jnp.linalg.norm, g)
        mass = norms if mass is None else jax.tree.map(jnp.add, mass, norms)
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    return jax.tree.map(
        lambda m, t: GRAD_ROUNDINGS * U * float(m / jnp.linalg.norm(t)), mass, total
    )


def _rounded_away(x) -> bool:
    """Whether some entry of an fp32 array is not a bf16 value."""
    return bool(jnp.any(x != x.astype(jnp.bfloat16).astype(jnp.float32)))


def test_cast_helpers_give_fp32_weight_gradients():
    """bf16 x with an fp32 weight: the forward is the bf16 op on the rounded weight,
    the weight's gradient is the fp32-accumulated product of the bf16 operands (not
    rounded to bf16, as plain autodiff of ``w.astype(bf16)`` does), the input's
    gradient is plain autodiff's; in fp32 every helper is the plain op."""
    rs = np.random.RandomState(0)
    bf, f32 = jnp.bfloat16, jnp.float32
    x = jnp.asarray(rs.randn(2, 3, 16), bf)
    w = jnp.asarray(rs.randn(16, 8), f32)
    r = jnp.asarray(rs.randn(2, 3, 8), bf)
    plain = lambda x, w: jnp.einsum("bte,ef->btf", x, w.astype(x.dtype))  # noqa: E731
    cast = lambda x, w: cast_einsum("bte,ef->btf", x, w)  # noqa: E731
    assert jnp.array_equal(cast(x, w), plain(x, w))
    dx, dw = jax.grad(lambda x, w: jnp.sum(cast(x, w) * r).astype(f32), argnums=(0, 1))(x, w)
    px, pw = jax.grad(lambda x, w: jnp.sum(plain(x, w) * r).astype(f32), argnums=(0, 1))(x, w)
    assert dw.dtype == f32 and jnp.array_equal(dx, px)
    want = jnp.einsum("bte,btf->ef", x, r, preferred_element_type=f32)
    assert jnp.array_equal(dw, want) and _rounded_away(dw) and not _rounded_away(pw)
    # wide (fp32 logits): the same with an fp32 cotangent
    r32 = jnp.asarray(rs.randn(2, 3, 8), f32)
    dw = jax.grad(lambda w: jnp.sum(cast_einsum("bte,ef->btf", x, w, wide=True) * r32))(w)
    assert jnp.array_equal(dw, jnp.einsum("bte,btf->ef", x, r32, preferred_element_type=f32))
    # norm scale and bias: summed over the leading axes in fp32
    v = jnp.asarray(rs.randn(8) + 1, f32)
    for helper, want_v in (
        (cast_scale, jnp.sum(r.astype(f32) * r.astype(f32), axis=(0, 1))),
        (cast_bias, jnp.sum(r.astype(f32), axis=(0, 1))),
    ):
        got = jax.grad(lambda v, h=helper: jnp.sum(h(r, v) * r).astype(f32))(v)
        assert got.dtype == f32 and jnp.allclose(got, want_v, rtol=1e-6), helper.__name__
    # embedding: scatter-added in fp32 (token 1 appears twice)
    table = jnp.asarray(rs.randn(5, 8), f32)
    toks = jnp.asarray([[1, 3, 1]])
    assert jnp.array_equal(cast_embed(table, toks, bf), table.astype(bf)[toks])
    got = jax.grad(lambda t: jnp.sum(cast_embed(t, toks, bf) * r[:1]).astype(f32))(table)
    want_t = jnp.zeros((5, 8), f32).at[toks].add(r[:1].astype(f32))
    assert got.dtype == f32 and jnp.array_equal(got, want_t)
    # fp32 compute: the plain ops and their gradients
    x32, r32b = x.astype(f32), r.astype(f32)
    g_cast = jax.grad(lambda x, w: jnp.sum(cast(x, w) * r32b), argnums=(0, 1))(x32, w)
    g_plain = jax.grad(lambda x, w: jnp.sum(plain(x, w) * r32b), argnums=(0, 1))(x32, w)
    for a, b in zip(g_cast, g_plain, strict=True):
        assert jnp.allclose(a, b, rtol=1e-6, atol=1e-6)
    # an fp32 prefix K/V (bf16 values) in bf16 attention: its cotangent stays fp32
    q = jnp.asarray(rs.randn(1, 2, 4, 8), bf)
    kv_new = jnp.asarray(rs.randn(1, 2, 2, 8), bf)
    kp = jnp.asarray(rs.randn(1, 3, 2, 8), bf).astype(f32)
    plen = jnp.array([3])
    out = attend_xla(q, kp, kp, plen, kv_new, kv_new)
    assert jnp.array_equal(out, attend_xla(q, kp.astype(bf), kp.astype(bf), plen, kv_new, kv_new))
    dk = jax.grad(lambda k: jnp.sum(attend_xla(q, k, k, plen, kv_new, kv_new)).astype(f32))(kp)
    assert dk.dtype == f32 and _rounded_away(dk)
    # the decoder: given an fp32 prefix (a tree engine's carry) the chunk's K/V leave
    # in fp32 with the same (bf16) values; without one, in the compute dtype
    m16, _, _ = _models()
    toks, pos = jnp.asarray([[5, 9, 7]]), jnp.arange(3)[None]
    h16, kv16 = m16(toks, pos, return_hidden=True)
    h32, kv32 = m16(toks, pos, KVCache.zeros(m16.cfg, 1, 0, f32), return_hidden=True)
    assert kv16.k.dtype == bf and kv32.k.dtype == f32 and kv32.v.dtype == f32
    assert jnp.array_equal(kv32.k, kv16.k.astype(f32)) and jnp.array_equal(h32, h16)


def rel_diffs(got, want):
    return jax.tree.map(lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)), got, want)


def test_engines_match_dense_bf16_on_rounded_params():
    """dense_remat, dfs, prefix_reuse (its deep group in its DFS program) and auto
    against dense-bf16: logprobs within ``logprob_bound``, every gradient tensor
    within ``C u kappa_T``; params and gradients stay fp32."""
    m16, _, params = _models()
    batch = _batch()
    assert deep_sequences(build_tree(batch.tokens)).sum() == 4  # the deep group exists
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    want_loss, want_g, want_aux = _engine("dense").value_and_grad(params, batch, LOSS)
    lp_bound, g_bounds = logprob_bound(), grad_bounds()
    assert lp_bound < 1e-2  # 10x below the old 5e-2
    assert max(jax.tree.leaves(g_bounds)) < 8e-2  # 4 u kappa_T (6 u kappa_T: 1.1e-1)
    for kind in (*ENGINES, "auto"):
        got = _engine(kind).value_and_grad(params, batch, LOSS)
        _assert_within(kind, got, (want_loss, want_g, want_aux), lp_bound, g_bounds, "C u kappa_T")


def _assert_within(kind, got, want, lp_bound, g_bounds, bound_name):
    """``got`` = (loss, grads, aux) of engine ``kind`` against ``want``: fp32 gradients,
    logprobs and loss within ``lp_bound``, every gradient tensor within its bound."""
    (loss, g, aux), (want_loss, want_g, want_aux) = got, want
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.float32)}, kind
    lp_diff = max(
        float(np.abs(a - b).max()) for a, b in zip(aux.logprobs, want_aux.logprobs, strict=True)
    )
    assert lp_diff <= lp_bound, f"{kind}: logprob |diff| {lp_diff:.2e} > {lp_bound:.2e}"
    assert abs(float(loss) - float(want_loss)) <= lp_bound * abs(float(want_loss)) + 1e-6
    over = {
        jax.tree_util.keystr(path): (d, b)
        for (path, d), b in zip(
            jax.tree_util.tree_flatten_with_path(rel_diffs(g, want_g))[0],
            jax.tree.leaves(g_bounds),
            strict=True,
        )
        if d > b
    }
    assert not over, f"{kind}: gradient tensors over {bound_name}: {over}"


def test_adamw_trajectories_track_dense_bf16():
    """10 AdamW steps (fp32 master weights, bf16 compute, the trainer's optimiser:
    clip 1.0, lr 1e-3, b1 0.9, b2 0.99) from the same rounded parameters on the
    same batch: dfs and prefix_reuse track dense-bf16.

    Bound. Adam's step lr m^/(sqrt(v^) + eps) is invariant to the gradient's scale:
    to first order a relative perturbation rho of the gradients moves m^ by rho and
    sqrt(v^) by rho, so the step by at most 2 rho relative. Summed over the steps,
    the distance between two trajectories relative to the distance travelled,
    ||theta_e - theta_d|| / ||theta_d - theta_0|| per tensor, is at most 2 max_k rho_k,
    with rho_k the tensor's gradient spread at step k (bounded by C u kappa_T at
    the start and measured along the way, since the trajectories drift apart and
    kappa_T changes). Observed: drift <= 0.098 of the travel, <= 0.46 of the bound
    (dense_remat, the same engine: 0.043, 0.15)."""
    _adamw_tracking(_engine, _batch())


def _adamw_tracking(engine, batch):
    """10 AdamW steps of ``engine(kind)`` for dense, dfs and prefix_reuse from the
    rounded parameters on ``batch``; checks each tree engine's drift from dense
    against 2 max_k rho_k and returns {kind: (drift, rho)} (per-tensor trees)."""
    _, _, params0 = _models()
    opt = make_optimizer(
        lr=1e-3, warmup=0, total=10, schedule=Schedule.CONSTANT, cfg=OptimSection()
    )

    def run(kind):
        params, state, grads = params0, opt.init(params0), []
        for _ in range(10):
            _, g, _ = engine(kind).value_and_grad(params, batch, LOSS)
            grads.append(g)
            params, state = opt.apply(params, g, state)
        leaves = jax.tree.leaves(params)
        assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}
        # fp32 master weights: steps below a bf16 ulp are kept, not rounded away.
        assert any(bool(jnp.any(x != x.astype(jnp.bfloat16).astype(x.dtype))) for x in leaves)
        return params, grads

    want, want_grads = run("dense")
    out = {}
    for kind in ("dfs", "prefix_reuse"):
        got, grads = run(kind)
        rho = functools.reduce(
            lambda a, b: jax.tree.map(max, a, b),
            [rel_diffs(g, w) for g, w in zip(grads, want_grads, strict=True)],
        )
        drift = jax.tree.map(
            lambda a, b, c: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b - c)),
            got,
            want,
            params0,
        )
        over = {
            jax.tree_util.keystr(path): (d, 2 * r)
            for (path, d), r in zip(
                jax.tree_util.tree_flatten_with_path(drift)[0], jax.tree.leaves(rho), strict=True
            )
            if d > 2 * r
        }
        assert not over, f"{kind}: parameter drift over 2 max_k rho_k: {over}"
        out[kind] = drift, rho
    return out


# ------------------------------------------------------------- fp32 activations
# ``activation_dtype="float32"`` with bf16 compute: bf16 matmul operands, fp32
# everything else (activations and their cotangents). ``f32act_bounds`` derives
# the bound.

FP32_ULP = 2.0**-24  # fp32 unit roundoff
F32ACT_CASTS = 8 * LAYERS + 1  # bf16 operand casts on a token's path (C below)
F32ACT_LAMBDA = 10.0  # Chebyshev: the flip error exceeds lambda RMS w.p. <= 1 / lambda^2


@functools.cache
def _f32act_engine(kind: str):
    m16, _, _ = _models()
    model = init_model(m16.cfg.replace(activation_dtype="float32"), seed=1)
    return make_engine(kind, model, **ENGINES.get(kind, {}))


def _bf16_primitives(fn, *args) -> set[str]:
    """The primitives of ``fn``'s jaxpr (sub-jaxprs included) with a bf16 input or output."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            avals = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")]
            if any(getattr(a, "dtype", None) == jnp.bfloat16 for a in avals):
                found.add(eqn.primitive.name)
            if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.dtype == jnp.bfloat16:
                assert eqn.params["preferred_element_type"] == jnp.float32, eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_f32act_rounds_only_matmul_operands():
    """With fp32 activations every bf16 value in the forward *and* backward program is
    a matmul operand (bf16 x bf16 -> fp32 products) or a parameter read as bf16
    (cast back to fp32); no arithmetic, reduction or cotangent is bf16. The helpers:
    fp32 in, fp32 out, the product of the bf16-rounded operands, an unrounded fp32
    input cotangent; the decoder: fp32 hidden states and K/V, for every family
    (biases, q/k norms, untied head), the program checked being a chunk's forward
    and backward over an fp32 prefix; the same forward over the prefix's K/V in a
    bf16 cache (the samplers') is identical."""
    rs = np.random.RandomState(0)
    bf, f32 = jnp.bfloat16, jnp.float32
    x = jnp.asarray(rs.randn(2, 3, 16), f32)
    w = jnp.asarray(rs.randn(16, 8), f32)
    r = jnp.asarray(rs.randn(2, 3, 8), f32)
    m16, _, _ = _models()
    cfg = m16.cfg.replace(activation_dtype="float32")
    y = cast_matmul(cfg, "bte,ef->btf", x, w)
    want = jnp.einsum("bte,ef->btf", x.astype(bf), w.astype(bf), preferred_element_type=f32)
    assert y.dtype == f32 and jnp.array_equal(y, want) and _rounded_away(y)
    dx, dw = jax.grad(lambda x, w: jnp.sum(cast_matmul(cfg, "bte,ef->btf", x, w) * r), (0, 1))(x, w)
    assert dx.dtype == f32 and jnp.allclose(dx, r @ w.astype(bf).astype(f32).T, rtol=1e-6)
    assert _rounded_away(dx)  # the input cotangent is not rounded to bf16
    assert jnp.allclose(dw, jnp.einsum("bte,btf->ef", x.astype(bf).astype(f32), r), rtol=1e-6)
    # the default policy's product is bf16, as before
    assert cast_matmul(m16.cfg, "bte,ef->btf", x.astype(bf), w).dtype == bf
    # norm weights and biases are read as bf16 values, fp32 out
    v = jnp.asarray(rs.randn(8), f32)
    assert jnp.array_equal(cast_scale(r, v, bf), r * v.astype(bf).astype(f32))
    assert jnp.array_equal(cast_bias(r, v, bf), r + v.astype(bf).astype(f32))
    toks, pos = jnp.asarray([[5, 9, 7, 3]]), jnp.arange(4)[None]
    allowed = {"dot_general", "convert_element_type", "gather", "transpose", "reshape"}
    allowed |= {"broadcast_in_dim", "squeeze", "expand_dims", "pjit", "jit", "custom_vjp_call"}
    allowed |= {"custom_vjp_call_jaxpr"}
    # The layers' scan carries the stacked bf16 parameters in; its body is walked too.
    allowed |= {"scan"}
    for family in ModelFamily:
        c = m16.cfg.replace(family=family, activation_dtype="float32")
        model = init_model(c.replace(tie_word_embeddings=family is not ModelFamily.LLAMA3), seed=1)
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params, kv, graphdef=graphdef):
            m = nnx.merge(graphdef, params)
            h, kv_new = m(toks[:, 2:], pos[:, 2:], kv, return_hidden=True)
            lp, _ = token_logprobs(m.lm_head_weight(), h, toks[:, 2:], dtype="bfloat16")
            return jnp.sum(lp) + jnp.sum(kv_new.k) + jnp.sum(kv_new.v)

        @jax.jit
        def forward(params, graphdef=graphdef):
            m = nnx.merge(graphdef, params)
            h, kv = m(toks[:, :2], pos[:, :2], return_hidden=True)
            h32, _ = m(toks[:, 2:], pos[:, 2:], kv, return_hidden=True)
            bf_kv = KVCache(kv.k.astype(bf), kv.v.astype(bf))  # the sampler's bf16 cache
            return h, kv, h32, m(toks[:, 2:], pos[:, 2:], bf_kv, return_hidden=True)[0]

        h, kv, h32, h16 = forward(params)
        assert h.dtype == h32.dtype == f32 and kv.k.dtype == f32 and _rounded_away(kv.k), family
        # a bf16 cache of the K/V gives the same forward: K/V only enter bf16 products
        assert jnp.array_equal(h16, h32), family
        prims = _bf16_primitives(jax.value_and_grad(loss, argnums=(0, 1)), params, kv)
        assert "dot_general" in prims and prims <= allowed, (family, prims - allowed)


def _reduction_lengths(cfg, s_max: int, n_tok: int) -> tuple[int, int]:
    """(forward, backward): the summed lengths of the fp32 reductions on one
    gradient path (S_f, S_b in ``test_engines_match_dense_f32act_on_rounded_params``)."""
    e, f, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    hd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
    g = cfg.num_heads // cfg.num_kv_heads
    # input and post norms (E), q/k norms (D each), q/k/v (E), scores (D), softmax
    # and probs @ V (S each), o_proj (H D), gate/up (E), down (F)
    layer_f = 2 * e + 2 * d + e + d + 2 * s_max + hd + e + f
    # their transposes: norms (E, D, D), q/k/v (H D + 2 K D), scores (dq: S, dk: every
    # query of every sequence, G n_tok), softmax (S), probs @ V (dp: D, dv: G n_tok),
    # o_proj (E), gate/up (2 F), down (E)
    layer_b = 2 * e + 2 * d + hd + 2 * kd + 2 * s_max + d + 2 * g * n_tok + e + 2 * f + e
    fwd = cfg.num_layers * layer_f + 2 * e + v  # + final norm, head, log-sum-exp
    bwd = cfg.num_layers * layer_b + e + v + n_tok  # + final norm, head, the token sum
    return fwd, bwd


@functools.cache
def f32act_spread() -> float:
    """eta: the largest relative fp32 spread ||h_t' - h_t|| / ||h_t|| of a token's
    final hidden state between the whole forward and a chunked one (chunks of 4
    over an fp32 K/V carry, split where the tree engines split this batch: at 8
    for DFS, at 12 for the GRPO prompts), fp32 activations, every sequence."""
    m16, _, params = _models()
    cfg = m16.cfg.replace(activation_dtype="float32")
    graphdef = nnx.split(init_model(cfg, seed=1), nnx.Param)[0]
    batch = _batch()
    toks = np.zeros((batch.num_sequences, 24), np.int32)
    for i, t in enumerate(batch.tokens):
        toks[i, : len(t)] = t
    valid = np.arange(24)[None] < batch.lengths[:, None]
    pos = np.broadcast_to(np.arange(24), toks.shape)

    @functools.partial(jax.jit, static_argnums=1)
    def spread(params, chunk):
        model = nnx.merge(graphdef, params)
        whole, _ = model(toks, pos, return_hidden=True)
        kv, parts = KVCache.zeros(cfg, toks.shape[0], 0, jnp.float32), []
        for s in range(0, 24, chunk):
            h, new = model(toks[:, s : s + chunk], pos[:, s : s + chunk], kv, return_hidden=True)
            kv = KVCache(*(jnp.concatenate([a, b], axis=2) for a, b in zip(kv, new, strict=True)))
            parts.append(h)
        diff = jnp.linalg.norm(jnp.concatenate(parts, axis=1) - whole, axis=-1)
        return jnp.max(jnp.where(valid, diff / jnp.linalg.norm(whole, axis=-1), 0.0))

    assert max(batch.lengths) <= 24
    return float(spread(params, 4))


@functools.cache
def f32act_bounds():
    """(logprob bound, per-tensor gradient bounds) of an engine against dense, both
    with fp32 activations (``activation_dtype="float32"``, bf16 compute), on the
    same rounded parameters and batch as the default policy's test.

    What rounds, and where. Every parameter is read as its bf16 value (identical in
    every engine: the parameters are the same). Every matmul/einsum casts its two
    operands to bf16 and accumulates the product in fp32 without rounding it; the
    backward's products multiply the fp32 cotangent by the bf16-valued operand in
    fp32. Everything else -- residual stream, norms, RoPE, scores and softmax, SiLU,
    logits, and every activation cotangent -- is fp32. So there is no bf16
    rounding in the backward at all, and the forward's bf16 roundings are the C =
    8 L + 1 operand casts on a token's path (per layer: the q/k/v input, q and k
    for the scores, the probabilities and V, the o_proj input, the gate/up input,
    the down input; then the head's input). The default policy's two leading
    sources are gone: no program rounds a cotangent, so a tree engine's summed
    prefix cotangent and dense's per-copy cotangents are fp32 sums of the same
    terms ((iv) above); and no fused bf16 intermediate can be kept wider by XLA in
    one program and not another ((iii)), since the only bf16 values are operands
    of products. What remains:
    (a) fp32 reassociation. The engines block and order their fp32 reductions
    differently (prefix/chunk splits of a softmax row, per-chunk against
    per-sequence weight-gradient sums, a key's cotangent summed over a tree's
    descendants). A reduction of k terms computed in two orders differs by at most
    2 k 2^-24 of its terms' absolute sum; to first order, summed over the
    reductions on a gradient's path (forward S_f, backward S_b, from
    ``_reduction_lengths``), a tensor moves by 2 (S_f + S_b) 2^-24 kappa_T
    (kappa_T as above: the per-sequence gradient terms' cancellation).
    (b) operand-rounding flips. An operand x whose fp32 value differs by delta
    between two engines rounds to the same bf16 value unless a rounding boundary
    lies between the two: probability |delta| / ulp(x) (x uniform in its rounding
    cell), and then the two casts differ by one ulp(x) <= 2u |x|. The flips of one
    cast form an error of mean squared norm sum_j |delta_j| ulp(x_j) <= 2u ||delta||
    ||x||, a relative RMS error sqrt(2u eta), eta = ||delta|| / ||x|| the operand's
    relative fp32 spread; the C casts on a path flip independently (their squares
    add): RMS sqrt(2u C eta). Flips are rare and unequal (one flip in a large
    element moves its token by up to 2u, and the tokens attending to it), so the
    error is heavy-tailed: by Chebyshev it exceeds lambda times its RMS with
    probability <= 1 / lambda^2; we take lambda = 10 (1%). It propagates like (a).
    eta is measured, not derived (``f32act_spread``: the final hidden states of
    chunked against whole forwards, the most downstream operand, taken for every
    cast).
    Bound per tensor: B_T = kappa_T (2 (S_f + S_b) 2^-24 + lambda sqrt(2u C eta));
    per logprob (logit minus LSE, as ``logprob_bound``):
    2 (2 S_f 2^-24 + lambda sqrt(2u C eta)) A.
    Like the default policy's, a first-order model, not a proof. Here S_f = 1452,
    S_b = 3356, C = 17, eta = 1.6e-7: (a) 5.7e-4 and (b) 1.5e-3 before kappa_T
    (2.3 to 4.8), so B_T = 4.7e-3 to 9.9e-3: 5x to 10x below the old 5e-2 and
    7.6x below the default policy's 4 u kappa_T; logprobs 3.9e-3. The flip term
    dominates; without flips the spread would be 1.3e-3 to 2.8e-3.
    Observed at this point: 1.1e-6 (a q_norm weight), dense_remat identical to
    dense, logprobs 4.8e-7 apart: no flip with a visible effect. Elsewhere flips do
    show: two steps of AdamW (lr 1e-4, on-policy old logprobs) later, dfs and dense
    differ by 3.0e-3 on identical parameters (fp32 engines there: 1.6e-6), their
    logprobs by 1.1e-3 on one GRPO group (a flip in its shared prompt), within that
    step's bounds.
    """
    m16, _, _ = _models()
    batch = _batch()
    s_f, s_b = _reduction_lengths(m16.cfg, max(batch.lengths), int(sum(batch.lengths)))
    eta = f32act_spread()
    assert 0 < eta < 1e-5  # an fp32 spread (a bf16 rounding would be ~4e-3)
    flips = F32ACT_LAMBDA * np.sqrt(2 * U * F32ACT_CASTS * eta)
    kappa = jax.tree.map(lambda b: b / (GRAD_ROUNDINGS * U), grad_bounds())
    g_bounds = jax.tree.map(lambda k: k * (2 * (s_f + s_b) * FP32_ULP + flips), kappa)
    return 2 * (2 * s_f * FP32_ULP + flips) * _logit_scale(), g_bounds


@functools.cache
def _f32act_dense():
    _, _, params = _models()
    return _f32act_engine("dense").value_and_grad(params, _batch(), LOSS)


def _check_f32act(kinds):
    """Each engine against dense, both with fp32 activations: within ``f32act_bounds``."""
    _, _, params = _models()
    batch = _batch()
    want_loss, want_g, want_aux = _f32act_dense()
    assert {x.dtype for x in jax.tree.leaves(want_g)} == {jnp.dtype(jnp.float32)}
    lp_bound, g_bounds = f32act_bounds()
    assert lp_bound < 5e-3 and max(jax.tree.leaves(g_bounds)) < 1.2e-2  # 4x below 5e-2
    for kind in kinds:
        got = _f32act_engine(kind).value_and_grad(params, batch, LOSS)
        want = (want_loss, want_g, want_aux)
        _assert_within(kind, got, want, lp_bound, g_bounds, "the fp32-activation bound")


def test_dense_remat_and_dfs_match_dense_f32act():
    """dense_remat and dfs against dense, fp32 activations: logprobs and every
    gradient tensor within ``f32act_bounds`` (two orders of magnitude below the
    default policy's); the policy changes dense's gradients by bf16 rounding
    level, not more."""
    _, _, params = _models()
    _, g16, _ = _engine("dense").value_and_grad(params, _batch(), LOSS)
    assert 0 < max(jax.tree.leaves(rel_diffs(g16, _f32act_dense()[1]))) < 0.1
    _check_f32act(("dense_remat", "dfs"))


def test_prefix_reuse_matches_dense_f32act():
    """prefix_reuse (its deep group in its DFS program) against dense, fp32
    activations: within ``f32act_bounds``."""
    _check_f32act(("prefix_reuse",))


def test_adamw_trajectories_track_dense_f32act():
    """The AdamW trajectory test above (same batch, optimiser, 10 steps) with fp32
    activations: dfs and prefix_reuse track dense within 2 max_k rho_k, the
    argument there (the first step's rho_0, on identical parameters, is the
    engine tests' comparison, within ``f32act_bounds``). Later rho_k are not
    within those bounds: with the batch's random old logprobs many ratios sit
    near the clip range, and a token that the engines' small logprob spread puts
    on opposite sides of a clip boundary has its term on in one gradient and off
    in the other (a jump of about 1/n_tok of the gradient: the loss's
    discontinuity, not rounding), after which the trajectories and their
    gradients differ. Observed: rho_k up to 8.1e-2 (dfs) and 1.1e-1
    (prefix_reuse), as in the default policy (1.4e-1), but drift 1.9e-3 and
    8.5e-3 of the distance travelled, against 9.4e-2 and 9.2e-2 in the default
    policy: 11x to 50x closer."""
    _adamw_tracking(_f32act_engine, _batch())


def test_dfs_kept_layer_outputs_within_the_bf16_bounds():
    """bf16 compute: dfs from kept outputs against dense-bf16 within this module's
    bounds (logprobs ``logprob_bound``, every gradient tensor ``C u kappa_T``), as
    the other engines."""
    m16, _, params = _models()
    batch = _batch()
    want = _engine("dense").value_and_grad(params, batch, LOSS)
    engine = DFSEngine(m16, keep_layer_outputs=True, **ENGINES["dfs"])
    got = engine.value_and_grad(params, batch, LOSS)
    bounds = (logprob_bound(), grad_bounds())
    _assert_within("dfs kept", got, want, *bounds, "C u kappa_T")
