"""A second, independent reference for the equivalence contract, written from the
equations (DESIGN.md "The functional core", dtarl/losses.py, dtarl.batch.LossNorm).

test_equivalence.py's reference differentiates the library's own ``Decoder.__call__``,
loss objects and ``RolloutBatch.sequence_weights``: a bug in any of those (a
sign-flipped RoPE, a wrong normalisation) is shared by engines and reference and
passes. This one shares none of them. It reads only the parameter pytree
(``nnx.to_pure_dict``), the ``ModelConfig`` numbers and the loss's public fields, and
spells out with plain ``jnp``, one unpadded-causal sequence at a time:

    x_0      = E[tokens]                                          embedding
    rms(x)   = x / sqrt(mean(x^2) + eps) * w                      RMSNorm
    q, k, v  = rms(x) Wq (+ bq), rms(x) Wk (+ bk), rms(x) Wv (+ bv)  (Qwen2: biases)
    q, k     = rms_head(q), rms_head(k)                           (Qwen3: per-head q/k norm)
    rope(x)  = [x1 cos - x2 sin, x2 cos + x1 sin], angle = pos * theta^(-2j/D)
               (Llama 3: low frequencies divided by ``factor``, a smooth ramp between)
    att_h    = softmax(q_h k_{h // G}^T / sqrt(D) + causal) v_{h // G}   GQA
    x        = x + att Wo;  x = x + (silu(rms(x) Wg) * rms(x) Wu) Wd    SwiGLU
    logits   = rms(x) W_head   (W_head = E^T when the embeddings are tied)
    logp_t   = log_softmax(logits_{t-1} / T)[token_t],  H_t = -sum_v p log p

and the losses

    NLL:       l_t = -A_t logp_t
    surrogate: l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
                     + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) - c H_t,
               r_t = exp(logp_t - old_t)   (old = stop_gradient(logp) when absent)

aggregated over the batch by each ``LossNorm``'s equation (S_i = sum_t m_it l_it,
M_i = sum_t m_it, N sequences):

    TOKEN         L = sum_i S_i / sum_i M_i
    SEQUENCE      L = 1/N sum_{i: M_i > 0} S_i / M_i
    SEQUENCE_SUM  L = 1/N sum_i S_i
    CONSTANT      L = 1/(N c) sum_i S_i

The batch gradient is sum_i (dL/dS_i) grad S_i, dL/dS_i by jax.grad of the
aggregation above. Letters: T = tokens of one sequence (padded to ``length``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl.batch import LossNorm
from dtarl.model.config import AttentionBackend

RTOL = 1e-5  # fp32, as test_equivalence; never loosen


def _rms(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(cfg) -> np.ndarray:
    d = cfg.head_dim
    inv = np.array([cfg.rope_theta ** (-(2.0 * j) / d) for j in range(d // 2)])
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    out = []
    for f in inv:
        wavelength = 2 * np.pi / f
        if wavelength < rs.original_max_position_embeddings / rs.high_freq_factor:
            out.append(f)  # high frequency: unchanged
        elif wavelength > rs.original_max_position_embeddings / rs.low_freq_factor:
            out.append(f / rs.factor)  # low frequency: scaled down
        else:
            a = rs.original_max_position_embeddings / wavelength - rs.low_freq_factor
            smooth = a / (rs.high_freq_factor - rs.low_freq_factor)
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return np.array(out)


def _rope(x_TxHxD, inv_freq):
    t = x_TxHxD.shape[0]
    ang = np.arange(t)[:, None] * inv_freq[None, :]  # [T, D/2], positions 0..T-1
    cos = jnp.asarray(np.cos(ang), jnp.float32)[:, None, :]
    sin = jnp.asarray(np.sin(ang), jnp.float32)[:, None, :]
    half = x_TxHxD.shape[-1] // 2
    x1, x2 = x_TxHxD[..., :half], x_TxHxD[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def logits(cfg, p: dict, tokens_T):
    """[T, V] logits of one sequence (positions 0..T-1), from the parameter dict."""
    eps = cfg.rms_norm_eps
    inv_freq = _inv_freq(cfg)
    t = tokens_T.shape[0]
    g = cfg.num_heads // cfg.num_kv_heads
    causal_TxT = np.tril(np.ones((t, t), bool))
    x = p["embed_tokens"][tokens_T]
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda w, i=i: w[i], p["layers"])  # layer i of the stacked [L, ...]
        a = lp["self_attn"]
        h = _rms(x, lp["input_layernorm"]["weight"], eps)
        q = jnp.einsum("te,ehd->thd", h, a["q_proj"])
        k = jnp.einsum("te,ekd->tkd", h, a["k_proj"])
        v = jnp.einsum("te,ekd->tkd", h, a["v_proj"])
        if "q_bias" in a:
            q, k, v = q + a["q_bias"], k + a["k_bias"], v + a["v_bias"]
        if "q_norm" in a:
            q = _rms(q, a["q_norm"]["weight"], eps)
            k = _rms(k, a["k_norm"]["weight"], eps)
        q, k = _rope(q, inv_freq), _rope(k, inv_freq)
        heads = []
        for head in range(cfg.num_heads):
            kv = head // g
            s_TxT = q[:, head] @ k[:, kv].T / np.sqrt(cfg.head_dim)
            s_TxT = jnp.where(causal_TxT, s_TxT, -jnp.inf)
            heads.append(jax.nn.softmax(s_TxT, axis=-1) @ v[:, kv])
        x = x + jnp.einsum("thd,hde->te", jnp.stack(heads, axis=1), a["o_proj"])
        h = _rms(x, lp["post_attention_layernorm"]["weight"], eps)
        mlp = lp["mlp"]
        x = x + (jax.nn.silu(h @ mlp["gate_proj"]) * (h @ mlp["up_proj"])) @ mlp["down_proj"]
    x = _rms(x, p["norm"]["weight"], eps)
    head = p["embed_tokens"].T if cfg.tie_word_embeddings else p["lm_head"]
    return x @ head


@functools.cache
def _sequence_fn(cfg, kind: str, temperature: float, length: int):
    """jax.value_and_grad of S = sum_t m_t l_t for one sequence padded to ``length``
    (padding is after the sequence, so causal attention keeps its values; m = 0 there)."""

    def one(p, toks, mask, old, ref, tadv, adv, eps_low, eps_high, beta, c):
        logq_TxV = jax.nn.log_softmax(logits(cfg, p, toks)[:-1] / temperature, axis=-1)
        logp = jnp.concatenate([jnp.zeros(1), logq_TxV[jnp.arange(length - 1), toks[1:]]])
        ent = jnp.concatenate([jnp.zeros(1), -jnp.sum(jnp.exp(logq_TxV) * logq_TxV, -1)])
        a = jnp.where(jnp.isnan(tadv), adv, tadv)
        if kind == "nll":
            per_token = -a * logp
        else:
            old = jnp.where(jnp.isnan(old), jax.lax.stop_gradient(logp), old)
            r = jnp.exp(logp - old)
            per_token = -jnp.minimum(r * a, jnp.clip(r, 1 - eps_low, 1 + eps_high) * a)
            per_token = per_token + beta * (jnp.exp(ref - logp) - (ref - logp) - 1)
            per_token = per_token - c * ent
        return jnp.sum(mask * per_token), logp

    return jax.jit(jax.value_and_grad(one, has_aux=True))


def aggregate(norm: LossNorm, constant, s_N, m_N):
    """The batch loss L from the per-sequence masked sums S_i and mask counts M_i."""
    n = s_N.shape[0]
    if norm is LossNorm.TOKEN:
        total = jnp.sum(m_N)
        return jnp.where(total > 0, jnp.sum(s_N) / jnp.where(total > 0, total, 1.0), 0.0)
    if norm is LossNorm.SEQUENCE:
        per_seq = jnp.where(m_N > 0, s_N / jnp.where(m_N > 0, m_N, 1.0), 0.0)
        return jnp.sum(per_seq) / n
    if norm is LossNorm.SEQUENCE_SUM:
        return jnp.sum(s_N) / n
    if norm is LossNorm.CONSTANT:
        return jnp.sum(s_N) / (n * constant)
    raise AssertionError(f"no equation for {norm}")


def reference(cfg, params, batch, loss, temperature: float = 1.0, length: int = 64):
    """(L, grads as a pure dict, per-token logprobs) of ``batch`` under ``loss``."""
    p = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    kind = "nll" if type(loss).__name__ == "MaskedNLLLoss" else "surrogate"
    coefs = (
        (0.0, 0.0, 0.0, 0.0)
        if kind == "nll"
        else (loss.eps_low, loss.eps_high, loss.kl_coef, loss.entropy_coef)
    )
    # logits_chunk and the attention backend change how the library computes, not what.
    cfg = cfg.replace(logits_chunk=0, attention_backend=AttentionBackend.XLA)
    fn = _sequence_fn(cfg, kind, float(temperature), length)
    sums, masks, grads, logps = [], [], [], []
    for i, toks in enumerate(batch.tokens):
        n = len(toks)
        assert n <= length, f"sequence {i} has {n} tokens; the reference pads to {length}"

        def pad(x, fill=0.0, n=n):
            x = np.asarray(x, np.float32)
            return np.concatenate([x, np.full(length - n, fill, np.float32)])

        nan = np.full(n, np.nan, np.float32)
        old = nan if batch.old_logprobs is None else batch.old_logprobs[i]
        # Absent reference logprobs only meet beta = 0: any finite value will do.
        ref = np.zeros(n) if batch.ref_logprobs is None else batch.ref_logprobs[i]
        tadv = nan if batch.token_advantages is None else batch.token_advantages[i]
        (s, lp), g = fn(
            p,
            np.concatenate([np.asarray(toks, np.int32), np.zeros(length - n, np.int32)]),
            pad(batch.loss_mask[i]),
            pad(old),
            pad(ref),
            pad(tadv, np.nan),
            np.float32(batch.advantages[i]),
            *map(np.float32, coefs),
        )
        sums.append(s)
        masks.append(float(np.sum(batch.loss_mask[i])))
        grads.append(g)
        logps.append(np.asarray(lp)[:n])
    s_N = np.asarray([np.float32(s) for s in sums], np.float32)
    m_N = np.asarray(masks, np.float32)
    total, dl_ds = _aggregate_fn(loss.norm, loss.norm_constant)(s_N, m_N)
    dl_ds = np.asarray(dl_ds)  # host scalars: no device op per sequence to index them
    grad = jax.tree.map(lambda *gs: sum(c * x for c, x in zip(dl_ds, gs, strict=True)), *grads)
    return total, grad, logps


@functools.cache
def _aggregate_fn(norm: LossNorm, constant):
    """(L, dL/dS) of ``aggregate`` as one program per batch size N (op by op, each of
    its operations would compile on its own for every new N)."""
    return jax.jit(jax.value_and_grad(functools.partial(aggregate, norm, constant)))


def check(cfg, params, batch, loss, got_loss, got_grads, got_logprobs, *, name, temperature=1.0):
    """An engine's (loss, grads, logprobs) against this reference (fp32, RTOL)."""
    want_loss, want_grads, want_logp = reference(cfg, params, batch, loss, temperature)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=RTOL, atol=1e-7)
    for got, want in zip(got_logprobs, want_logp, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    got = nnx.to_pure_dict(got_grads) if isinstance(got_grads, nnx.State) else got_grads
    assert jax.tree.structure(got) == jax.tree.structure(want_grads)
    errs = jax.tree.leaves(
        jax.tree.map(
            lambda a, b: float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)),
            got,
            want_grads,
        )
    )
    worst = max(errs)
    assert worst <= RTOL, f"{name}: worst grad error {worst:.2e} against the equations"
