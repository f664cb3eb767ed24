"""The decoder's call contract: prefix K/V, bottom-right masks, packing, backends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dtarl.model import (
    AttentionBackend,
    ConfigError,
    KVCache,
    ModelConfig,
    ModelFamily,
    init_model,
    token_logprobs,
)

FAMILIES = list(ModelFamily)


@nnx.jit(static_argnames=("return_hidden",))
def run(model, tokens, positions, kv=None, prefix_len=None, segment_ids=None, return_hidden=False):
    """One compiled call (eager mode would compile every op separately)."""
    return model(
        tokens, positions, kv, prefix_len, return_hidden=return_hidden, segment_ids_BxT=segment_ids
    )


def _tokens(b, t, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, 256, (b, t)))


def _pos(b, start, t):
    return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_kv_forward_equals_full_forward(family):
    model = init_model(ModelConfig.tiny(family), seed=0)
    toks = _tokens(2, 13)
    full, kv_full = run(model, toks, _pos(2, 0, 13))
    head, kv = run(model, toks[:, :8], _pos(2, 0, 8))
    tail, kv_tail = run(model, toks[:, 8:], _pos(2, 8, 5), kv)
    np.testing.assert_allclose(jnp.concatenate([head, tail], 1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(kv_tail.k, kv_full.k[:, :, 8:], atol=1e-5)
    # A padded prefix buffer with garbage past prefix_len gives the same result.
    pad = ((0, 0), (0, 0), (0, 4), (0, 0), (0, 0))
    junk = KVCache(
        jnp.pad(kv.k, pad, constant_values=7.0), jnp.pad(kv.v, pad, constant_values=-3.0)
    )
    tail2, _ = run(model, toks[:, 8:], _pos(2, 8, 5), junk, jnp.array([8, 8]))
    np.testing.assert_allclose(tail2, tail, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_equals_full_forward(family):
    model = init_model(ModelConfig.tiny(family), seed=1)
    toks = _tokens(1, 10, seed=2)
    full, _ = run(model, toks, _pos(1, 0, 10))
    cache = KVCache.zeros(model.cfg, 1, 16)
    for t in range(10):
        logits, kv = run(model, toks[:, t : t + 1], _pos(1, t, 1), cache, jnp.array([t]))
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
        cache = KVCache(
            jax.lax.dynamic_update_slice_in_dim(cache.k, kv.k, t, axis=2),
            jax.lax.dynamic_update_slice_in_dim(cache.v, kv.v, t, axis=2),
        )


def test_jit_equals_eager_and_hidden_logprobs():
    model = init_model(ModelConfig.tiny(logits_chunk=3), seed=0)
    graphdef, params = nnx.split(model)
    toks = _tokens(2, 9)

    def f(params, toks):
        m = nnx.merge(graphdef, params)
        return m(toks, _pos(2, 0, 9))[0]

    np.testing.assert_allclose(jax.jit(f)(params, toks), f(params, toks), atol=1e-5, rtol=1e-5)
    logits = f(params, toks)
    hidden, _ = run(model, toks, _pos(2, 0, 9), return_hidden=True)
    want = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), toks[:, 1:, None], -1)[..., 0]
    # Chunked over positions (3 at a time): never the full [T, V] logits.
    got, ent = token_logprobs(
        model.lm_head_weight(), hidden[:, :-1], toks[:, 1:], chunk=3, entropy=True
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    p = jax.nn.softmax(logits[:, :-1])
    np.testing.assert_allclose(ent, -jnp.sum(p * jnp.log(p), -1), atol=1e-4)


def test_segment_packing_equals_separate_continuations():
    model = init_model(ModelConfig.tiny(), seed=0)
    pre, a, b = _tokens(1, 6, 1), _tokens(1, 4, 2), _tokens(1, 3, 3)
    _, kv = run(model, pre, _pos(1, 0, 6))
    la, _ = run(model, a, _pos(1, 6, 4), kv)
    lb, _ = run(model, b, _pos(1, 6, 3), kv)
    pos = jnp.concatenate([jnp.arange(6, 10), jnp.arange(6, 9)])[None]
    seg = jnp.array([[0, 0, 0, 0, 1, 1, 1]])
    lp, _ = run(model, jnp.concatenate([a, b], 1), pos, kv, segment_ids=seg)
    np.testing.assert_allclose(lp[:, :4], la, atol=1e-5)
    np.testing.assert_allclose(lp[:, 4:], lb, atol=1e-5)


def test_pallas_backend_matches_xla():
    cfg = ModelConfig.tiny()
    xla = init_model(cfg, seed=3)
    pal = init_model(cfg.replace(attention_backend=AttentionBackend.PALLAS), seed=3)
    toks = _tokens(2, 12, 4)
    _, kv = run(xla, toks[:, :7], _pos(2, 0, 7))
    want, _ = run(xla, toks[:, 7:], _pos(2, 7, 5), kv)
    got, _ = run(pal, toks[:, 7:], _pos(2, 7, 5), kv)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)

    def loss(model, kv):
        return jnp.sum(model(toks[:, 7:], _pos(2, 7, 5), kv)[0] ** 2) * 1e-3

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    gx = grad(xla, kv)
    gp = grad(pal, kv)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(jnp.abs(b).max())), rtol=1e-4)


def test_presets_have_published_sizes():
    # Parameter counts of the real checkpoints (embeddings included).
    assert abs(ModelConfig.qwen3_0p6b().num_params() / 1e6 - 596) < 5
    assert abs(ModelConfig.qwen2p5_0p5b().num_params() / 1e6 - 494) < 5
    assert abs(ModelConfig.llama3p2_1b().num_params() / 1e9 - 1.236) < 0.01
    assert abs(ModelConfig.llama3p1_8b().num_params() / 1e9 - 8.03) < 0.01
    for name in ModelConfig.PRESETS:
        ModelConfig.preset(name)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(num_heads=3), "multiple of num_kv_heads"),
        (dict(head_dim=15), "even"),
        (dict(param_dtype="float8"), "param_dtype"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(activation_dtype="bfloat16"), "activation_dtype='bfloat16' with compute_dtype"),
        (dict(compute_dtype="bfloat16", activation_dtype="float16"), "activation_dtype"),
        (dict(compute_dtype="float16", activation_dtype="float32"), "only with compute_dtype"),
    ],
)
def test_config_errors_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.tiny(**overrides)


def test_from_hf_config_rejects_unknown(tmp_path):
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})
    bad = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_scaling={"rope_type": "yarn", "factor": 2.0},
    )
    with pytest.raises(ConfigError, match="'yarn' is not supported"):
        ModelConfig.from_hf_config(bad)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json:1"):
        ModelConfig.from_hf_config(tmp_path)


def test_bad_prefix_shape_is_rejected():
    model = init_model(ModelConfig.tiny())
    wrong = KVCache(jnp.zeros((2, 1, 3, 4, 16)), jnp.zeros((2, 1, 3, 4, 16)))
    with pytest.raises(ValueError, match="kv_prefix"):
        model(_tokens(1, 2), _pos(1, 3, 2), wrong)


@pytest.mark.parametrize("backend", list(AttentionBackend))
def test_shared_prefix_equals_broadcast_prefix(backend):
    """A batch-1 prefix is shared by all rows: same values and gradients as a copy per row
    (its cotangent is the sum over the rows), also with per-row prefix lengths."""
    model = init_model(ModelConfig.tiny().replace(attention_backend=backend), seed=2)
    _, kv = run(model, _tokens(1, 9, 5), _pos(1, 0, 9))
    toks, pos, plen = _tokens(3, 4, 6), _pos(3, 9, 4), jnp.array([9, 9, 6])

    def loss(model, kv):
        return jnp.sum(model(toks, pos, kv, plen)[0] ** 2) * 1e-3

    def copies(kv):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (a.shape[0], 3) + a.shape[2:]), kv)

    grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
    v_shared, (gm_shared, gkv_shared) = grad(model, kv)
    v_copies, (gm_copies, gkv_copies) = grad(model, copies(kv))
    np.testing.assert_allclose(v_shared, v_copies, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gm_shared), jax.tree.leaves(gm_copies), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(jnp.abs(b).max())))
    for a, b in zip(gkv_shared, gkv_copies, strict=True):
        np.testing.assert_allclose(a[:, 0], b.sum(axis=1), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ stacked layers


def _grads(model, tokens, remat=None):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, _pos(2, 0, tokens.shape[1]), remat=remat)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

    return jax.jit(jax.value_and_grad(loss))(params)


def test_layers_are_stacked_and_scanned():
    """One [L, ...] parameter per layer weight (logical axis ``layers`` first), and the
    decoder's program holds one layer body: its jaxpr has as many equations at 6
    layers as at 2 (the layers run under one ``scan``)."""
    sizes = {}
    for n in (2, 6):
        model = init_model(ModelConfig.tiny(num_layers=n), seed=0)
        flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        q = flat[("layers", "self_attn", "q_proj")]
        assert q.shape == (n, 64, 4, 16)
        assert q.get_metadata()["axes"] == ("layers", "embed", "heads", "head_dim")
        assert all(p[0] != "layers" or v.shape[0] == n for p, v in flat.items())
        graphdef, params = nnx.split(model, nnx.Param)

        def total(p, t, graphdef=graphdef):
            return nnx.merge(graphdef, p)(t, _pos(2, 0, 8))[0].sum()

        jaxpr = jax.make_jaxpr(jax.grad(total))(params, _tokens(2, 8))
        sizes[n] = len(jaxpr.eqns)
        assert any(e.primitive.name == "scan" for e in jaxpr.eqns)
    assert sizes[2] == sizes[6]


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "offload"])
def test_remat_policies_keep_the_gradient(remat):
    """Every ``model.remat`` policy recomputes the same values: the loss and the
    gradients equal those without rematerialisation (fp32)."""
    cfg = ModelConfig.tiny(num_layers=3)
    tokens = _tokens(2, 12, seed=3)
    want_loss, want = _grads(init_model(cfg, seed=1), tokens)
    got_loss, got = _grads(init_model(cfg.replace(remat=remat), seed=1), tokens)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match=r"remat='some'; accepted: \['none', 'full'"):
        cfg.replace(remat="some")
