"""Device programs of the continuous-batching engine (``dtarl.rollout.engine``).

The K/V lives in two pools, one array per layer (so a step updates each layer's
buffer in place)::

    prompt pool   [Q, P, K, D]   one row per *group*: the prompt's K/V, stored once
    response pool [N, R, K, D]   one row per decode *slot*: that request's own K/V

A group's members read its prompt row; each member owns only its response row.
Inside a program the per-layer arrays are stacked ([L, ...], ``_stacked``) and the
layers run under ``jax.lax.scan`` (``Decoder.scan_layers``) with the response pool in
the scan's carry, so a program holds one layer's body whatever the depth; the
arrays go back to per-layer form at the program's end (``_unstacked``).
Attention of a decode query is a *cascade*: the prompt part is computed with the
queries grouped by their prompt (a ``[Q, M]`` table of slots, so every prompt row
is read once per step for all of its members), the response part per slot, and
the two partial softmaxes are merged by their maxima and sums::

    o = (O_p e^{m_p - m} + O_r e^{m_r - m}) / (l_p e^{m_p - m} + l_r e^{m_r - m})

The prompt's last token is not in the prompt pool: it is every member's first
decode input (response row 0), so prefill samples nothing and every token of a
request is drawn by the same decode program with the same key rule.

Sampling is per slot (temperature, top-k, top-p are arrays, not statics): token
at position ``pos`` of a request uses ``fold_in(key, pos)`` and one uniform draw
(inverse CDF), so it depends only on the request's key, its position and the
logits, never on the slot or the batch. The recorded logprob is that of the
training policy, ``log_softmax(logits / T)`` (T = 1 for greedy), before top-k/p.

Letters: N slots, Q prompt slots (groups), M members per group, P prompt rows,
R response rows, T chunk tokens, E rows of an extend/prefill call, L layers,
H query heads, K kv heads, G = H / K, D head dim, V vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dtarl.model.config import Remat
from dtarl.model.decoder import Decoder, rope_inv_freq

_NEG = -1e30

RUNNING, STOP, LENGTH, CANCELLED = 0, 1, 2, 3


class Pool(NamedTuple):
    """The engine's K/V (tuples hold one array per layer)."""

    prompt_k: tuple[jax.Array, ...]  # L x [Q, P, K, D]
    prompt_v: tuple[jax.Array, ...]
    prompt_len: jax.Array  # [Q] int32 valid prompt rows
    resp_k: tuple[jax.Array, ...]  # L x [N, R, K, D]
    resp_v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg, *, groups: int, prompt_len: int, slots: int, response_len: int) -> Pool:
        """An empty pool in the model's compute dtype."""
        cd = jnp.dtype(cfg.compute_dtype)
        kv = (cfg.num_kv_heads, cfg.head_dim)

        def layers(rows, length):
            return tuple(jnp.zeros((rows, length) + kv, cd) for _ in range(cfg.num_layers))

        return cls(
            prompt_k=layers(groups, prompt_len),
            prompt_v=layers(groups, prompt_len),
            prompt_len=jnp.zeros((groups,), jnp.int32),
            resp_k=layers(slots, response_len),
            resp_v=layers(slots, response_len),
        )


class Slots(NamedTuple):
    """Per-slot decode state (host-owned; uploaded with every decode call)."""

    group: jax.Array  # [N] int32 prompt slot of the request
    cell: jax.Array  # [N] int32 group * M + member: the slot's cell of the table
    length: jax.Array  # [N] int32 response rows written
    token: jax.Array  # [N] int32 next input token (at position prompt_len + length)
    active: jax.Array  # [N] bool decoding
    budget: jax.Array  # [N] int32 tokens this turn may still produce
    forced: jax.Array  # [N] bool ignore stop ids (trace replay)
    key: jax.Array  # [N, 2] uint32 the request's key
    temperature: jax.Array  # [N] f32 (0 = greedy)
    top_p: jax.Array  # [N] f32 (1 = off)
    top_k: jax.Array  # [N] int32 (0 = off)
    stop_ids: jax.Array  # [N, S] int32 (-1 = unused)


class ChunkOut(NamedTuple):
    """What a decode call produced: token i of slot n this call at [n, i]."""

    tokens: jax.Array  # [N, C] int32
    logprobs: jax.Array  # [N, C] f32
    count: jax.Array  # [N] int32 tokens produced this call
    finish: jax.Array  # [N] int32 RUNNING | STOP | LENGTH
    batch: jax.Array  # [C] int32 active slots at each step (PAT's B)
    context: jax.Array  # [C] int32 context tokens attended at each step (PAT's T)
    steps: jax.Array  # [] int32 steps run


def _stacked(pool: Pool) -> Pool:
    """The pool with each per-layer tuple stacked into one [L, ...] array."""
    stack = lambda t: jnp.stack(t) if isinstance(t, tuple) else t  # noqa: E731
    return pool._replace(
        prompt_k=stack(pool.prompt_k),
        prompt_v=stack(pool.prompt_v),
        resp_k=stack(pool.resp_k),
        resp_v=stack(pool.resp_v),
    )


def _unstacked(pool: Pool) -> Pool:
    """The pool's [L, ...] arrays back as per-layer tuples (the engine's form)."""
    split = lambda a: tuple(a[i] for i in range(a.shape[0])) if not isinstance(a, tuple) else a  # noqa: E731
    return pool._replace(
        prompt_k=split(pool.prompt_k),
        prompt_v=split(pool.prompt_v),
        resp_k=split(pool.resp_k),
        resp_v=split(pool.resp_v),
    )


def _layers(model: Decoder, x, positions, attend, carry):
    """The decoder stack under ``jax.lax.scan`` with a custom attention
    ``attend(i, q, k, v, carry) -> (o, carry)`` (i: the layer index, traced; carry:
    e.g. the stacked response pool, updated in place): (final hidden, carry)."""
    inv = rope_inv_freq(model.cfg)
    n = model.cfg.num_layers

    def body(layer, xc, i):
        x, carry = xc
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv)
        o, carry = attend(i, q, k, v, carry)
        x = x + layer.self_attn.out(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return (x, carry), None

    (x, carry), _ = model.scan_layers(body, (x, carry), jnp.arange(n), remat=Remat.NONE)
    return model.norm(x), carry


def _partial(s, ok, v, eq_in, eq_out):
    """Unnormalised softmax pieces of masked scores: (max, sum, weighted values)."""
    s = jnp.where(ok, s, _NEG)
    m = jnp.max(s, axis=-1)
    e = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum(f"{eq_in},{eq_out}", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, jnp.sum(e, axis=-1), o


def cascade_decode(q_NxHxD, pk_QxPxKxD, pv, plen_Q, table_QxM, cell_N, rk_NxRxKxD, rv, rlen_N):
    """One query per slot over [its group's prompt rows, its own response rows]."""
    n, h, d = q_NxHxD.shape
    nq, p, kh, _ = pk_QxPxKxD.shape
    r = rk_NxRxKxD.shape[1]
    g = h // kh
    m_cells = table_QxM.shape[1]
    q = (q_NxHxD.astype(jnp.float32) / np.sqrt(d)).astype(q_NxHxD.dtype).reshape(n, kh, g, d)
    # Prompt part: queries grouped by prompt, each prompt row read once.
    q_pad = jnp.concatenate([q, jnp.zeros((1, kh, g, d), q.dtype)], axis=0)
    qg = q_pad[table_QxM]  # [Q, M, K, G, D]; empty cells read the zero row
    s_p = jnp.einsum("qmkgd,qpkd->qmkgp", qg, pk_QxPxKxD, preferred_element_type=jnp.float32)
    ok_p = (jnp.arange(p)[None, :] < plen_Q[:, None])[:, None, None, None, :]
    m_p, l_p, o_p = _partial(s_p, ok_p, pv, "qmkgp", "qpkd->qmkgd")
    flat = lambda a: a.reshape((nq * m_cells,) + a.shape[2:])[cell_N]  # noqa: E731
    m_p, l_p, o_p = flat(m_p), flat(l_p), flat(o_p)
    # Response part: each slot over its own rows.
    s_r = jnp.einsum("nkgd,nrkd->nkgr", q, rk_NxRxKxD, preferred_element_type=jnp.float32)
    ok_r = (jnp.arange(r)[None, :] < rlen_N[:, None])[:, None, None, :]
    m_r, l_r, o_r = _partial(s_r, ok_r, rv, "nkgr", "nrkd->nkgd")
    m = jnp.maximum(m_p, m_r)
    a, b = jnp.exp(m_p - m), jnp.exp(m_r - m)
    o = (o_p * a[..., None] + o_r * b[..., None]) / (l_p * a + l_r * b)[..., None]
    return o.reshape(n, h, d).astype(q_NxHxD.dtype)


def _filter(z_NxV, top_k_N, top_p_N):
    """Per-row top-k then top-p; excluded entries become -inf."""
    v = z_NxV.shape[-1]
    zs = -jnp.sort(-z_NxV, axis=-1)
    kth = jnp.take_along_axis(zs, jnp.clip(top_k_N - 1, 0, v - 1)[:, None], axis=-1)
    kth = jnp.where(top_k_N[:, None] > 0, kth, -jnp.inf)
    z = jnp.where(z_NxV < kth, -jnp.inf, z_NxV)
    zs = jnp.where(zs < kth, -jnp.inf, zs)
    probs = jax.nn.softmax(zs, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < top_p_N[:, None]
    thresh = jnp.min(jnp.where(keep, zs, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(z < thresh, -jnp.inf, z)


def sample(logits_NxV, slots: Slots, position_N, *, filtered: bool):
    """(token [N], logprob of the token under logits / T [N])."""
    greedy = slots.temperature <= 0
    z = logits_NxV / jnp.where(greedy, 1.0, slots.temperature)[:, None]
    logp = jax.nn.log_softmax(z, axis=-1)
    if filtered:
        probs = jax.nn.softmax(_filter(z, slots.top_k, slots.top_p), axis=-1)
    else:
        probs = jnp.exp(logp)
    keys = jax.vmap(jax.random.fold_in)(slots.key, position_N)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), minval=1e-7))(keys)
    cdf = jnp.cumsum(probs, axis=-1)
    drawn = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
    drawn = jnp.minimum(drawn, logits_NxV.shape[-1] - 1)
    tok = jnp.where(greedy, jnp.argmax(logits_NxV, axis=-1), drawn).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def decode_step(
    model: Decoder, pool: Pool, slots: Slots, table_QxM, *, filtered: bool, window: int = 0
):
    """Feeds every active slot's token, writes its K/V and samples the next one
    (``pool``: per-layer tuples or stacked, returned in the same form).

    ``window`` > 0: attention reads only response rows [0, window) (every active
    slot's length must stay below it; the host picks it per call)."""
    if isinstance(pool.resp_k, tuple):
        pool, tok, lp = decode_step(
            model, _stacked(pool), slots, table_QxM, filtered=filtered, window=window
        )
        return _unstacked(pool), tok, lp
    n = slots.token.shape[0]
    r = pool.resp_k.shape[2]
    rows = jnp.arange(n)
    plen_N = pool.prompt_len[slots.group]
    at_N = plen_N + slots.length  # position of the input token
    write = jnp.where(slots.active, slots.length, r)  # r: dropped
    cd = model.cfg.compute_dtype
    x = model.embed_tokens[...].astype(cd)[slots.token][:, None]

    def attend(i, q, k, v, resp):
        rk_all, rv_all = resp
        rk_all = rk_all.at[i, rows, write].set(k[:, 0].astype(rk_all.dtype), mode="drop")
        rv_all = rv_all.at[i, rows, write].set(v[:, 0].astype(rv_all.dtype), mode="drop")
        rk, rv = rk_all[i], rv_all[i]
        o = cascade_decode(
            q[:, 0],
            pool.prompt_k[i],
            pool.prompt_v[i],
            pool.prompt_len,
            table_QxM,
            slots.cell,
            rk[:, :window] if window else rk,
            rv[:, :window] if window else rv,
            slots.length + 1,
        )
        return o[:, None], (rk_all, rv_all)

    h, (resp_k, resp_v) = _layers(model, x, at_N[:, None], attend, (pool.resp_k, pool.resp_v))
    h = h[:, 0]
    logits = jnp.einsum(
        "ne,ev->nv", h, model.lm_head_weight().astype(h.dtype), preferred_element_type=jnp.float32
    )
    tok, lp = sample(logits, slots, at_N + 1, filtered=filtered)
    return pool._replace(resp_k=resp_k, resp_v=resp_v), tok, lp


def decode_chunk(
    model: Decoder,
    pool: Pool,
    slots: Slots,
    table_QxM,
    *,
    steps: int,
    filtered: bool,
    window: int = 0,
):
    """Up to ``steps`` decode steps (fewer when every slot is done): (pool, slots, ChunkOut)."""
    pool = _stacked(pool)
    n = slots.token.shape[0]
    r = pool.resp_k.shape[2]
    rows = jnp.arange(n)
    out = ChunkOut(
        tokens=jnp.zeros((n, steps), jnp.int32),
        logprobs=jnp.zeros((n, steps), jnp.float32),
        count=jnp.zeros((n,), jnp.int32),
        finish=jnp.zeros((n,), jnp.int32),
        batch=jnp.zeros((steps,), jnp.int32),
        context=jnp.zeros((steps,), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
    )

    def cond(carry):
        _, st, o = carry
        return jnp.any(st.active) & (o.steps < steps)

    def body(carry):
        pool, st, o = carry
        act = st.active
        i = o.steps
        ctx = jnp.sum(jnp.where(act, pool.prompt_len[st.group] + st.length + 1, 0))
        pool, tok, lp = decode_step(model, pool, st, table_QxM, filtered=filtered, window=window)
        length = st.length + act
        budget = st.budget - act
        hit = jnp.any((tok[:, None] == st.stop_ids) & (st.stop_ids >= 0), axis=1) & ~st.forced
        full = (budget <= 0) | (length >= r)
        reason = jnp.where(hit, STOP, jnp.where(full, LENGTH, RUNNING))
        reason = jnp.where(act, reason, RUNNING).astype(jnp.int32)
        col = jnp.where(act, o.count, steps)  # inactive slots write nothing
        o = o._replace(
            tokens=o.tokens.at[rows, col].set(tok, mode="drop"),
            logprobs=o.logprobs.at[rows, col].set(lp, mode="drop"),
            count=o.count + act,
            finish=jnp.where(act, reason, o.finish),
            batch=o.batch.at[i].set(jnp.sum(act)),
            context=o.context.at[i].set(ctx),
            steps=i + 1,
        )
        st = st._replace(
            length=length,
            token=jnp.where(act, tok, st.token),
            budget=budget,
            active=act & (reason == RUNNING),
        )
        return pool, st, o

    pool, slots, out = jax.lax.while_loop(cond, body, (pool, slots, out))
    return _unstacked(pool), slots, out


def prefill(model: Decoder, pool: Pool, qslot_E, tokens_ExT, len_E):
    """Writes prompts' K/V into prompt rows ``qslot`` (``Q`` = padding, dropped)."""
    e, t = tokens_ExT.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (e, t))
    _, kv = model(tokens_ExT, pos, return_hidden=True)
    pool = _stacked(pool)
    pk = pool.prompt_k.at[:, qslot_E, :t].set(kv.k.astype(pool.prompt_k.dtype), mode="drop")
    pv = pool.prompt_v.at[:, qslot_E, :t].set(kv.v.astype(pool.prompt_v.dtype), mode="drop")
    plen = pool.prompt_len.at[qslot_E].set(len_E.astype(jnp.int32), mode="drop")
    return _unstacked(pool._replace(prompt_k=pk, prompt_v=pv, prompt_len=plen))


def extend(model: Decoder, pool: Pool, slot_E, group_E, length_E, tokens_ExT, count_E):
    """Appends ``count`` tokens to slots' response rows from row ``length`` on (multi-turn:
    tool output), attending to the prompt and the slot's own history; ``N`` = padding."""
    return _extend(model, pool, slot_E, group_E, length_E, tokens_ExT, count_E)[0]


def extend_score(
    model: Decoder, pool: Pool, slot_E, group_E, length_E, tokens_ExT, count_E, targets_ExT, temp
):
    """``extend`` that also returns log softmax(logits / temp)[target] at every fed
    position ([E, T] f32; 0 past ``count``): the incremental forward of token streaming,
    where token t's target is the token generated after it."""
    pool, h = _extend(model, pool, slot_E, group_E, length_E, tokens_ExT, count_E)
    logits = jnp.einsum(
        "bte,ev->btv",
        h,
        model.lm_head_weight().astype(h.dtype),
        preferred_element_type=jnp.float32,
    )
    lp = jax.nn.log_softmax(logits / temp, axis=-1)
    picked = jnp.take_along_axis(lp, targets_ExT[..., None], axis=-1)[..., 0]
    valid = jnp.arange(tokens_ExT.shape[1])[None, :] < count_E[:, None]
    return pool, jnp.where(valid, picked, 0.0)


def extend_values(
    model: Decoder, pool: Pool, slot_E, group_E, length_E, tokens_ExT, count_E, w_H, b
):
    """``extend`` that also returns a linear value head on the final hidden state at
    every fed position, ``h_t . w + b`` ([E, T] f32; 0 past ``count``): the incremental
    forward of a streamed critic (dtarl.rl.value: fed token t - 1 gives V[t])."""
    pool, h = _extend(model, pool, slot_E, group_E, length_E, tokens_ExT, count_E)
    v = h.astype(jnp.float32) @ w_H + b
    valid = jnp.arange(tokens_ExT.shape[1])[None, :] < count_E[:, None]
    return pool, jnp.where(valid, v, 0.0)


def _extend(model: Decoder, pool: Pool, slot_E, group_E, length_E, tokens_ExT, count_E):
    pool = _stacked(pool)
    e, t = tokens_ExT.shape
    nslots, r = pool.resp_k.shape[1:3]
    p = pool.prompt_k.shape[2]
    cd = model.cfg.compute_dtype
    safe = jnp.minimum(slot_E, nslots - 1)
    plen_E = pool.prompt_len[group_E]
    offs = jnp.arange(t)
    valid = offs[None, :] < count_E[:, None]
    row_ExT = jnp.where(valid, length_E[:, None] + offs[None, :], r)
    pos = plen_E[:, None] + length_E[:, None] + offs[None, :]
    x = model.embed_tokens[...].astype(cd)[tokens_ExT]
    er = jnp.arange(e)[:, None]

    def attend(i, q, k, v, resp):
        rk_all, rv_all = resp
        rk = rk_all[i][safe].at[er, row_ExT].set(k.astype(rk_all.dtype), mode="drop")
        rv = rv_all[i][safe].at[er, row_ExT].set(v.astype(rv_all.dtype), mode="drop")
        keep = jnp.where(slot_E < nslots, slot_E, nslots)
        rk_all = rk_all.at[i, keep].set(rk, mode="drop")
        rv_all = rv_all.at[i, keep].set(rv, mode="drop")
        keys = jnp.concatenate([pool.prompt_k[i][group_E], rk], axis=1).astype(q.dtype)
        vals = jnp.concatenate([pool.prompt_v[i][group_E], rv], axis=1).astype(q.dtype)
        b, tq, h, d = q.shape
        kh = keys.shape[2]
        qh = q.reshape(b, tq, kh, h // kh, d)
        s = jnp.einsum("btkgd,bskd->bkgts", qh, keys, preferred_element_type=jnp.float32)
        s = s / np.sqrt(d)
        kpos = jnp.arange(p + r)
        ok_prompt = (kpos[None, :] < plen_E[:, None])[:, None, :]  # [E, 1, S]
        resp_row = kpos - p
        ok_resp = (kpos[None, None, :] >= p) & (
            resp_row[None, None, :] <= (length_E[:, None] + offs[None, :])[:, :, None]
        )
        ok = (ok_prompt | ok_resp)[:, None, None]
        probs = jax.nn.softmax(jnp.where(ok, s, _NEG), axis=-1).astype(vals.dtype)
        o = jnp.einsum("bkgts,bskd->btkgd", probs, vals, preferred_element_type=jnp.float32)
        return o.reshape(b, tq, h, d).astype(q.dtype), (rk_all, rv_all)

    h, (resp_k, resp_v) = _layers(model, x, pos, attend, (pool.resp_k, pool.resp_v))
    return _unstacked(pool._replace(resp_k=resp_k, resp_v=resp_v)), h
