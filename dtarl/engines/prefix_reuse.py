"""Schedule-level shared-prefix reuse (docs/papers.md): prefix once, suffixes batched.

For every *group* of sequences sharing a prefix, one ``jit``-compiled program runs

    1. prefix forward, once:      (logp_P, K_P, V_P) = f(theta, prefix tokens)
    2. suffix microbatches:       rows of B suffixes read (K_P, V_P) through
                                  ``prefix_len`` and evaluate every sequence's
                                  loss on its full path [prefix logp | suffix logp];
                                  accumulate (fp32) dtheta, dK_P, dV_P and dlogp_P
    3. prefix backward, once:     dtheta += vjp_f(dlogp_P, dK_P, dV_P)

which is the chain rule of the dense loss reordered (exact in real arithmetic):
the prefix's outputs that the suffixes read are only its K/V and its logprobs,
so their accumulated cotangents are all the prefix backward needs. Losses that
are non-separable across the prefix/suffix boundary (sequence-level
normalisation, ratios, KL) stay exact because the loss of a sequence is always
evaluated on its whole path.

Groups are nodes of the batch's prefix tree (``group_nodes``): the top-level
nodes (the children of the virtual root), or the nodes below a short prefix that
every prompt shares (a BOS token, a chat template); for GRPO, one group per
prompt, its node = the prompt, and its prefix the whole path to it. The fork
trick of ``dtarl.tree.plan`` applies: the prefix node X covering path positions
[0, b) runs inputs [0, b-1) (its K/V are the first b-1 rows) and each suffix row
starts with X's last token at position b-1, so the fork logit that predicts a
child's first token is evaluated by the child that needs it.

Deeper trees (``deep_trees``). A group is *deep* when nodes below its prefix
are shared by several leaves enough that one row per leaf would recompute more
than 10% of its suffix tokens (multi-turn trees that branch after the first
turn; not GRPO responses that happen to share a first token). With
``DeepTrees.DFS`` (the default) deep groups go to the DFS engine
(``dtarl.engines.dfs``): the top-level prefix is pushed once and every node
below it is computed once, depth-first; the shallow groups (prompt + G
responses) run the schedule above. Both programs run in the same ``jit`` and
their losses and gradients add up (sequence weights come from the whole batch,
so every normalisation stays exact). With ``DeepTrees.ROWS`` every leaf below
the top fork is one dense suffix row (a node shared below the top level is
recomputed once per leaf; sequences ending at internal nodes ride on the row of
a leaf under them): exact too, and one program, but it repeats shared turns.
Once a batch had deep groups the engine keeps the two-program form (a monotone
bucket, like the shapes), using a zero-weight one-sequence stand-in for an empty
side, so that ranks of a sharded run agree on one program.

Entropy: when the loss ``needs_entropy``, the per-token entropies travel with
the logprobs everywhere above (prefix outputs, path buffers, their accumulated
cotangents): a "path" is then the pair (logp_S, ent_S) instead of (logp_S,).
Otherwise no entropy is computed and the program is unchanged.

Prefix activations other than K/V (``PrefixActivations``):

* ``REMAT``: kept nowhere; the prefix forward is re-run under ``jax.vjp`` in
  step 3 (4 prefix passes instead of 3, the smallest suffix-phase memory);
* ``KEEP``: the prefix's VJP residuals stay in device memory across step 2;
* ``OFFLOAD`` (default): as KEEP, but the residuals of the weight matmuls live
  in host memory (``jax.checkpoint`` with an offload policy to the
  ``pinned_host`` memory kind) and the rest is rematerialised; a plain KEEP on
  backends without a ``pinned_host`` memory kind, and on the CPU, where host
  memory is device memory: there offloading saves nothing and its copies and
  rematerialisation cost about 10% of a step (GRPO G=4 and G=8, prompt 512,
  tiny model: KEEP's step was 0.92x and 0.89x OFFLOAD's). ``offload_on_cpu=True``
  runs the offload program on the CPU anyway (the tests check its equality there).

Shapes are bucketed (groups, prefix length, rows per group, row length, loss
slots, path length, sequences, flat token data) and only grow, so a new batch
does not recompile unless it needs a larger bucket (``reserve`` pre-sizes them).

Letters: G groups, P prefix inputs, M microbatches per group, B rows per
microbatch, C suffix row length, K loss slots per row, K0 loss slots per
prefix, S path buffer, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl.batch import RolloutBatch
from dtarl.engines import base
from dtarl.engines.config import (
    Capacity,
    DeepTrees,
    PrefixActivations,
    PrefixReuseConfig,
    configured,
)
from dtarl.engines.cost import token_flops, tree_partition_cost
from dtarl.engines.dfs import DFSEngine, DFSStatic
from dtarl.engines.prefix_plan import (
    GroupPlan,
    deep_sequences,
    group_nodes,
    group_plan,
    sequence_groups,
)
from dtarl.model.decoder import Decoder, KVCache, token_logprobs
from dtarl.tree.plan import bucket, fine_bucket
from dtarl.tree.trie import build_tree


def offload_supported() -> bool:
    """Whether the default device has a ``pinned_host`` memory kind to offload to."""
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # pragma: no cover - backends without memory-kind support
        return False
    return "pinned_host" in kinds


class RowsStatic(NamedTuple):
    """The rows program's shapes: ``groups`` groups with prefixes of ``prefix``
    tokens and ``microbatches`` x ``microbatch`` suffix rows of ``row_len`` tokens."""

    groups: int
    prefix: int
    microbatches: int
    microbatch: int
    row_len: int
    slots: int
    prefix_slots: int
    sequences: int
    flat: int
    path: int


class RowsHost(NamedTuple):
    plan: GroupPlan
    prefix_end: np.ndarray  # [G] path position where each group's prefix ends
    lengths: np.ndarray  # [N]


class SplitStatic(NamedTuple):
    """Shallow groups as rows and deep groups through the DFS program, one jit."""

    rows: RowsStatic
    dfs: DFSStatic


class SplitHost(NamedTuple):
    num_sequences: int
    rows_index: np.ndarray  # the batch's sequences in the rows part
    rows: base.Prepared
    dfs_index: np.ndarray  # ... and in the DFS part
    dfs: base.Prepared


class _Groups(NamedTuple):
    inputs: jax.Array  # [G, P] int32: prefix tokens [0, b-1)
    targets: jax.Array  # [G, P] int32: prefix tokens [1, b)
    n_in: jax.Array  # [G] int32: b - 1, the valid prefix inputs (= suffix start)
    slots: jax.Array  # [G, K0] int32: sequences ending at the prefix node (-1 empty)


class _Rows(NamedTuple):
    inputs: jax.Array  # [G, M, B, C] int32: path tokens [b-1, n-1)
    targets: jax.Array  # [G, M, B, C] int32: path tokens [b, n)
    n_valid: jax.Array  # [G, M, B] int32
    slots: jax.Array  # [G, M, B, K] int32: sequences evaluated on this row (-1 empty)


class PrefixReuseEngine(base.BucketState):
    """Prefix forward once, suffixes as batched microbatches, prefix backward once.

    Settings (``PrefixReuseConfig``):
      microbatch: suffix rows per microbatch (B); a group's rows run in
        ceil(rows / B) microbatches, so a whole group need not fit at once.
      prefix_activations: see ``PrefixActivations`` (default OFFLOAD).
      deep_trees: see ``DeepTrees`` (default DFS) and the module docstring.
      dfs_chunk_len: the DFS engine's chunk length for deep groups.
      offload_on_cpu: OFFLOAD really offloads on a CPU backend too (to test that
        program); by default it runs as KEEP there (module docstring).

    ``temperature``: logprobs of logits / T (``base.logprob_temperature``; the deep
    groups' DFS engine gets the same).
    """

    def __init__(
        self,
        model: Decoder,
        config: PrefixReuseConfig | None = None,
        /,
        *,
        name: str = "prefix_reuse",
        temperature: float = 1.0,
        **settings,
    ):
        config = configured(PrefixReuseConfig, config, settings)
        self._init_engine(model, config, name=name, temperature=temperature)
        self.dfs = None  # the deep groups' DFS engine (DeepTrees.DFS)
        if self.config.deep_trees is DeepTrees.DFS:
            self.dfs = DFSEngine(
                self.model, chunk_len=self.config.dfs_chunk_len, temperature=self.temperature
            )
        self._min = dict(groups=1, prefix=1, rows=1, row_len=1, slots=1, pslots=1, path=1)
        self._min.update(seqs=1, flat=1, split=0)
        # Set by ``reserve`` with prompt and response bounds: the group shapes are
        # then fixed (see ``reserve``).
        self._sealed = False

    @property
    def trace_count(self) -> int:
        return self.jit.trace_count

    @property
    def _fit(self) -> tuple[int, int] | None:
        """(prefix, row) lengths the groups must fit once reserved (``group_nodes``)."""
        return (self._min["prefix"], self._min["row_len"]) if self._sealed else None

    @property
    def offloads(self) -> bool:
        """True when prefix residuals really go to host memory on this backend
        (OFFLOAD, a ``pinned_host`` memory kind, and not a CPU unless
        ``offload_on_cpu``)."""
        if (
            self.config.prefix_activations is not PrefixActivations.OFFLOAD
            or not offload_supported()
        ):
            return False
        return self.config.offload_on_cpu or jax.devices()[0].platform != "cpu"

    @property
    def buckets(self) -> base.Buckets:
        """Its own buckets and, named ``dfs.*``, those of the deep groups' DFS program."""
        own = base.Buckets.of(self._min)
        return own if self.dfs is None else own.merge(self.dfs.buckets.with_prefix("dfs."))

    def merge_buckets(self, buckets: base.Buckets) -> None:
        inner = buckets.under("dfs.")
        if inner.sizes:
            if self.dfs is None:
                raise ValueError(f"{self.name}: dfs.* buckets given, but deep_trees is ROWS")
            self.dfs.merge_buckets(inner)
        own = {k: v for k, v in buckets.sizes if not k.startswith("dfs.")}
        super().merge_buckets(base.Buckets.of(own))

    def reserve(self, capacity: Capacity) -> PrefixReuseEngine:
        """Grows the buckets of sequences, tokens, slots and the longest path to
        ``capacity`` (the deep groups' DFS program too), so that batches within it
        never recompile. The group buckets (groups, rows, prefix and suffix lengths)
        are reserved only when ``capacity`` bounds the prompt and the response;
        otherwise they grow with the batches: their bound is then the longest
        sequence, and padding every group to it costs more than a few compiles.

        Reserved group shapes stay fixed: a group whose responses share their first
        tokens (its top-level node reaches past the reserved prefix) runs the shared
        part in its suffix rows, and, unless ``capacity.turns`` > 1 reserved the
        two-program form, a batch with deep groups runs them as rows (exact, shared
        nodes below the prefix recomputed; ``DeepTrees.ROWS``) rather than compiling
        the two-program form mid-run."""
        if self.dfs is not None:
            self.dfs.reserve(capacity)
            if capacity.turns > 1:
                self._min["split"] = 1
        for key, value in (
            ("slots", capacity.group_size),
            ("pslots", capacity.group_size),
            ("path", capacity.length),
            ("seqs", capacity.sequences),
            ("flat", capacity.tokens),
        ):
            self._min[key] = max(self._min[key], bucket(value))
        if capacity.prompt_len is not None and capacity.response_len is not None:
            for key, value, fn in (
                ("groups", capacity.groups, bucket),
                ("rows", capacity.group_size, bucket),
                ("prefix", capacity.prompt_len, fine_bucket),
                ("row_len", capacity.response_len, fine_bucket),
            ):
                self._min[key] = max(self._min[key], fn(value))
            self._sealed = True
        return self

    # ------------------------------------------------------------ device side

    def _prefix_forward(self, params, inputs_P, targets_P, entropy: bool = False, rows: int = 1):
        """(per-token, K, V [L, 1, P, K, D]) of one prefix.

        per-token = (logp [P],) or, with ``entropy``, (logp [P], entropy [P]);
        entry t is token t+1's (its logprob, the entropy of its predictor).
        ``rows``: the suffix microbatch B. With ``logits_chunk`` the prefix's one row
        builds its logits ``rows * logits_chunk`` positions at a time, the [tokens, V]
        block of a suffix microbatch's chunk (and dense's): ``logits_chunk`` positions
        of one row would be a head product B times narrower, run B times as often.
        """
        model = nnx.merge(self.graphdef, params)
        p = inputs_P.shape[0]
        # An empty fp32 prefix: the K/V leave in fp32 (compute-dtype values), so the
        # suffixes' fp32 K/V cotangent enters the prefix's VJP unrounded.
        empty = KVCache.zeros(self.cfg, 1, 0, jnp.float32)
        hidden, kv = model(inputs_P[None], jnp.arange(p)[None], empty, return_hidden=True)
        logp, ent = token_logprobs(
            model.lm_head_weight(),
            hidden,
            targets_P[None],
            chunk=self.cfg.logits_chunk * rows,
            entropy=entropy,
            temperature=self.temperature,
            dtype=self.cfg.compute_dtype,
        )
        per_tok = (logp[0], ent[0]) if entropy else (logp[0],)
        return per_tok, kv.k, kv.v

    def _suffix_loss(
        self, loss, params, k32, v32, paths_S, n_in, inputs, targets, n_valid, slots, seq
    ):
        """Sum of the losses evaluated on one microbatch of suffix rows.

        k32/v32: the group's prefix K/V [L, 1, P, K, D] in fp32 (values of the
        compute dtype; one copy read by all B rows as the decoder's shared prefix,
        cast to the compute dtype inside the attention's products, so their
        cotangent is summed over the rows inside one product and returned in fp32);
        paths_S: (logp_S,) or (logp_S, ent_S), the prefix's per-token values on the
        path (entry t = token t, 0 from b on).
        """
        model = nnx.merge(self.graphdef, params)
        b, c = inputs.shape
        kv = KVCache(k32, v32)  # batch 1: shared by the B rows, never copied (Decoder)
        pos = jnp.broadcast_to(n_in + jnp.arange(c, dtype=jnp.int32), (b, c))
        hidden, _ = model(inputs, pos, kv, jnp.full((b,), n_in, jnp.int32), return_hidden=True)
        with_entropy = len(paths_S) > 1
        logp_BxC, ent_BxC = token_logprobs(
            model.lm_head_weight(),
            hidden,
            targets,
            chunk=self.cfg.logits_chunk,
            entropy=with_entropy,
            temperature=self.temperature,
            dtype=self.cfg.compute_dtype,
        )
        valid_BxC = jnp.arange(c)[None] < n_valid[:, None]
        rows_BxC = (logp_BxC, ent_BxC) if with_entropy else (logp_BxC,)
        rows_BxC = tuple(jnp.where(valid_BxC, x, 0.0) for x in rows_BxC)
        s = paths_S[0].shape[0]

        def row_path(path_S, x_C):
            buf = jnp.concatenate([path_S, jnp.zeros(c, jnp.float32)])
            return jax.lax.dynamic_update_slice_in_dim(buf, x_C, n_in + 1, axis=0)[:s]

        paths_BxS = tuple(
            jax.vmap(row_path, in_axes=(None, 0))(pth, x)
            for pth, x in zip(paths_S, rows_BxC, strict=True)
        )
        per_slot = jax.vmap(
            jax.vmap(lambda pth, sid: _path_loss(loss, pth, seq, sid), in_axes=(None, 0))
        )
        return jnp.sum(per_slot(paths_BxS, slots)), rows_BxC[0]

    def _suffix_phase(self, loss, params, grads, k32, v32, paths_S, n_in, rows, seq):
        """Phase B: every suffix microbatch of one group, accumulating in fp32
        (loss, dtheta, dK, dV, dpaths). ``rows`` fields are [M, B, ...]; ``paths_S``
        is (logp_S,) or (logp_S, ent_S) (see ``_suffix_loss``)."""
        vg = jax.value_and_grad(
            lambda p, k, v, pth, *r: self._suffix_loss(loss, p, k, v, pth, n_in, *r, seq),
            argnums=(0, 1, 2, 3),
            has_aux=True,
        )

        def body(acc, r):
            total, gr, dk, dv, dpath = acc
            (val, logp), (gp, gk, gv, gpath) = vg(params, k32, v32, paths_S, *r)
            gr = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), gr, gp)
            dpath = tuple(a + g for a, g in zip(dpath, gpath, strict=True))
            return (total + val, gr, dk + gk, dv + gv, dpath), logp

        init = (
            jnp.zeros((), jnp.float32),
            grads,
            jnp.zeros_like(k32),
            jnp.zeros_like(v32),
            tuple(jnp.zeros_like(x) for x in paths_S),
        )
        return jax.lax.scan(body, init, tuple(rows))

    def device_fn(self, loss, static: RowsStatic | SplitStatic):
        if isinstance(static, SplitStatic):  # shallow groups here, deep ones in the DFS engine
            f_rows = self.device_fn(loss, static.rows)
            f_dfs = self.dfs.device_fn(loss, static.dfs)

            def run(params, rows_args, dfs_args):
                t_rows, g_rows, o_rows = f_rows(params, *rows_args)
                t_dfs, g_dfs, o_dfs = f_dfs(params, *dfs_args)
                return t_rows + t_dfs, jax.tree.map(jnp.add, g_rows, g_dfs), (o_rows, o_dfs)

            return run
        s = static.path
        return lambda params, groups, rows, seq: self._run(loss, s, params, groups, rows, seq)

    def _run(self, loss, s: int, params, groups: _Groups, rows: _Rows, seq: base.SeqData):
        mode = self.config.prefix_activations
        # Entropy only when the loss uses it: otherwise the program is unchanged.
        with_entropy = bool(getattr(loss, "needs_entropy", False))
        offload = self.offloads
        policy = None
        if offload:
            policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")

        def group(carry, g):
            total, grads = carry
            g_in, g_tg, n_in, g_slots, r_in, r_tg, r_nv, r_slots = g
            p = g_in.shape[0]

            def fwd(prm):
                return self._prefix_forward(prm, g_in, g_tg, with_entropy, r_in.shape[1])

            if mode is PrefixActivations.REMAT:
                per_P, k, v = fwd(params)
            else:
                f = jax.checkpoint(fwd, policy=policy) if offload else fwd
                (per_P, k, v), vjp = jax.vjp(f, params)
            valid_P = jnp.arange(p) < n_in
            per_P = tuple(jnp.where(valid_P, x, 0.0) for x in per_P)
            paths_S = tuple(
                jnp.concatenate([jnp.zeros(1), x, jnp.zeros(max(0, s - p - 1))])[:s] for x in per_P
            )
            # Sequences that end at the prefix node: their loss needs the prefix only.
            val0, dpath0 = jax.value_and_grad(
                lambda pth: jnp.sum(jax.vmap(lambda sid: _path_loss(loss, pth, seq, sid))(g_slots))
            )(paths_S)
            (val, grads, dk, dv, dpath), logp_rows = self._suffix_phase(
                loss,
                params,
                grads,
                k.astype(jnp.float32),
                v.astype(jnp.float32),
                paths_S,
                n_in,
                _Rows(r_in, r_tg, r_nv, r_slots),
                seq,
            )
            g_per = tuple(
                jnp.where(valid_P, jnp.concatenate([a + b, jnp.zeros(p + 1)])[1 : p + 1], 0.0)
                for a, b in zip(dpath, dpath0, strict=True)
            )
            if mode is PrefixActivations.REMAT:
                _, vjp = jax.vjp(fwd, params)
            (dparams,) = vjp((g_per, dk.astype(k.dtype), dv.astype(v.dtype)))
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, dparams)
            return (total + val0 + val, grads), (per_P[0], logp_rows)

        init = (jnp.zeros((), jnp.float32), base.zeros_like_f32(params))
        xs = (*groups, *rows)
        (total, grads), out = jax.lax.scan(group, init, xs)
        return total, grads, out

    # -------------------------------------------------------------- host side

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> base.Prepared:
        base.check_batch(batch, loss, self.cfg.vocab_size)
        w = base.sequence_weights(batch, loss, weights)
        tree = batch.prefix_tree()
        if self.dfs is None:
            return self._prepare_rows(batch, loss, w, tree)
        deep = deep_sequences(tree, fit=self._fit)
        if deep.any() and not self._sealed:
            self._min["split"] = 1
        if not self._min["split"]:
            return self._prepare_rows(batch, loss, w, tree)
        parts = []
        for ix in (np.flatnonzero(~deep), np.flatnonzero(deep)):
            if ix.size:
                parts.append((ix, batch.select(ix), w[ix]))
            else:  # a stand-in with weight 0: same program, no contribution
                parts.append((ix, batch.select([0]), np.zeros(1, np.float32)))
        (ix_rows, b_rows, w_rows), (ix_dfs, b_dfs, w_dfs) = parts
        p_rows = self._prepare_rows(b_rows, loss, w_rows, build_tree(b_rows.tokens))
        p_dfs = self.dfs.prepare(b_dfs, loss, weights=w_dfs)
        stats = dict(
            num_tokens=tree.stats.num_tokens,
            tree_tokens=tree.stats.tree_tokens,
            deep_sequences=int(ix_dfs.size),
            computed_tokens=p_rows.stats["computed_tokens"] + p_dfs.stats["computed_tokens"],
            dfs_steps=p_dfs.stats["num_steps"],
        )
        host = SplitHost(
            num_sequences=batch.num_sequences,
            rows_index=ix_rows,
            rows=p_rows,
            dfs_index=ix_dfs,
            dfs=p_dfs,
        )
        return base.Prepared(
            static=SplitStatic(rows=p_rows.static, dfs=p_dfs.static),
            args=(p_rows.args, p_dfs.args),
            host=host,
            stats=stats,
        )

    def _prepare_rows(self, batch: RolloutBatch, loss, w, tree) -> base.Prepared:
        plan = group_plan(tree, self._fit)
        ng = len(plan.prefix_nodes)
        b_end = plan.prefix_end.copy()
        if self._sealed:
            # A prefix past its reserved bucket (responses sharing their first tokens)
            # ends at the bucket; the rest of the shared node runs in every row.
            # Not when a sequence ends at the prefix node: its loss reads the prefix only.
            cap = self._min["prefix"] + 1
            for g in range(ng):
                if b_end[g] > cap and not plan.prefix_slots[g]:
                    b_end[g] = cap
        row_lens = [
            [int(tree.start[y] + tree.length[y]) - int(b_end[g]) for y in leaves]
            for g, leaves in enumerate(plan.row_leaf)
        ]
        m = self._min
        m["groups"] = g_pad = bucket(ng, m["groups"])
        m["prefix"] = p_pad = fine_bucket(int(b_end.max()) - 1, m["prefix"])
        m["rows"] = r_pad = bucket(max(len(r) for r in plan.row_leaf), m["rows"])
        m["row_len"] = c_pad = fine_bucket(max(max(r, default=1) for r in row_lens), m["row_len"])
        most = max((len(s) for rs in plan.row_slots for s in rs), default=1)
        m["slots"] = k_pad = bucket(most, m["slots"])
        m["pslots"] = k0_pad = bucket(max(len(s) for s in plan.prefix_slots), m["pslots"])
        m["path"] = s_pad = bucket(int(tree.stats.longest_path), m["path"])
        n = batch.num_sequences
        m["seqs"] = n_pad = bucket(n, m["seqs"])
        m["flat"] = f_pad = bucket(batch.num_tokens, m["flat"])
        mb = min(self.config.microbatch, r_pad)
        n_mb = -(-r_pad // mb)

        g_in = np.zeros((g_pad, p_pad), np.int32)
        g_tg = np.zeros((g_pad, p_pad), np.int32)
        n_in = np.zeros(g_pad, np.int32)
        g_slots = np.full((g_pad, k0_pad), -1, np.int32)
        r_in = np.zeros((g_pad, n_mb * mb, c_pad), np.int32)
        r_tg = np.zeros((g_pad, n_mb * mb, c_pad), np.int32)
        r_nv = np.zeros((g_pad, n_mb * mb), np.int32)
        r_slots = np.full((g_pad, n_mb * mb, k_pad), -1, np.int32)
        computed = 0
        for g, x in enumerate(plan.prefix_nodes):
            b = int(b_end[g])
            toks = tree.path_tokens(x)  # the group's prefix: the whole path to x
            g_in[g, : b - 1] = toks[: b - 1]
            g_tg[g, : b - 1] = toks[1:b]
            n_in[g] = b - 1
            g_slots[g, : len(plan.prefix_slots[g])] = plan.prefix_slots[g]
            computed += b - 1
            for r, y in enumerate(plan.row_leaf[g]):
                path = tree.path_tokens(y)
                c = path.shape[0] - b
                r_in[g, r, :c] = path[b - 1 : -1]
                r_tg[g, r, :c] = path[b:]
                r_nv[g, r] = c
                r_slots[g, r, : len(plan.row_slots[g][r])] = plan.row_slots[g][r]
                computed += c
        groups = _Groups(inputs=g_in, targets=g_tg, n_in=n_in, slots=g_slots)
        rows = _Rows(
            inputs=r_in.reshape(g_pad, n_mb, mb, c_pad),
            targets=r_tg.reshape(g_pad, n_mb, mb, c_pad),
            n_valid=r_nv.reshape(g_pad, n_mb, mb),
            slots=r_slots.reshape(g_pad, n_mb, mb, k_pad),
        )
        seq = base.flat_sequence_data(batch, w, n_pad=n_pad, f_pad=f_pad, pad=s_pad)
        prefix_tokens = int(n_in.sum())
        stats = dict(
            num_tokens=tree.stats.num_tokens,
            tree_tokens=tree.stats.tree_tokens,
            computed_tokens=computed,
            prefix_tokens=prefix_tokens,
            suffix_tokens=computed - prefix_tokens,
            padded_tokens=g_pad * (p_pad + n_mb * mb * c_pad),
            num_groups=ng,
            suffix_rows=sum(len(r) for r in plan.row_leaf),
            microbatch=mb,
            microbatches_per_group=n_mb,
            prefix_activations=self.config.prefix_activations.value,
            offloaded=self.offloads,
        )
        static = RowsStatic(
            groups=g_pad,
            prefix=p_pad,
            microbatches=n_mb,
            microbatch=mb,
            row_len=c_pad,
            slots=k_pad,
            prefix_slots=k0_pad,
            sequences=n_pad,
            flat=f_pad,
            path=s_pad,
        )
        host = RowsHost(plan=plan, prefix_end=b_end, lengths=batch.lengths)
        return base.Prepared(static=static, args=(groups, rows, seq), host=host, stats=stats)

    def features(self, prepared: base.Prepared) -> base.WorkFeatures:
        """Every padded group's prefix runs forward, is kept (or re-run with REMAT)
        and runs backward once; every padded suffix row runs forward and backward
        against the whole prefix and its own row. Deep groups' DFS program is a
        sub-program, priced by its own engine's rule."""
        if isinstance(prepared.static, SplitStatic):
            rows = self.features(prepared.host.rows)
            return dataclasses.replace(rows, sub=(self.dfs.features(prepared.host.dfs),))
        st = prepared.static
        f0, fa = token_flops(self.cfg)
        kp = 4.0 if self.config.prefix_activations is PrefixActivations.REMAT else 3.0
        pre = float(st.groups * st.prefix)
        suf = float(st.groups * st.microbatches * st.microbatch * st.row_len)
        return base.WorkFeatures(
            lin_flops=f0 * (kp * pre + 3.0 * suf),
            attn_flops=fa * (kp * pre * st.prefix + 3.0 * suf * (st.prefix + st.row_len)),
            steps=float(st.groups * (st.microbatches + 1)),
            tokens=pre + suf,
            program=self.name,
        )

    def partition_cost(self, batch: RolloutBatch):
        """The dp partition's price of this engine's work (``dtarl.engines.cost``): every
        tree token once, forward and backward, at its causal context (padding, a suffix
        row's whole-row attention and the prefix's remat pass are not priced)."""
        del batch
        return tree_partition_cost(self.cfg, passes=3.0, context=1.0)

    def finish(self, prepared: base.Prepared, out) -> tuple[np.ndarray, ...]:
        if isinstance(prepared.host, SplitHost):
            h = prepared.host
            res: list = [None] * h.num_sequences
            for ix, part in (
                (h.rows_index, self.finish(h.rows, out[0])),
                (h.dfs_index, self.dfs.finish(h.dfs, out[1])),
            ):
                # A stand-in part has ix empty (its one logprob row is dropped).
                for i, logp in zip(ix.tolist(), part, strict=False):
                    res[i] = logp
            return tuple(res)
        plan, b_end, lengths = prepared.host
        logp_GxP, logp_rows = (np.asarray(x) for x in out)
        g_pad, n_mb, mb, c = logp_rows.shape
        logp_rows = logp_rows.reshape(g_pad, n_mb * mb, c)
        res = []
        zero = np.zeros(1, np.float32)
        for i, ln in enumerate(lengths):
            g, r = int(plan.seq_group[i]), int(plan.seq_row[i])
            b = int(b_end[g])
            if r < 0:
                res.append(np.concatenate([zero, logp_GxP[g, : b - 1]]))
            else:
                res.append(np.concatenate([zero, logp_GxP[g, : b - 1], logp_rows[g, r, : ln - b]]))
        return tuple(x.astype(np.float32) for x in res)

    def value_and_grad(self, params, batch: RolloutBatch, loss, *, weights=None):
        return base.run_value_and_grad(self, params, batch, loss, weights)

    # ----------------------------------------------------------------- memory

    def compiled_memory(self, params, batch: RolloutBatch, loss, *, weights=None):
        """XLA's memory analysis of the whole compiled program for this batch's buckets."""
        prepared = self.prepare(batch, loss, weights=weights)
        lowered = self.jit.lower(loss, prepared.static, params, prepared.args)
        return lowered.compile().memory_analysis()

    def suffix_phase_memory(self, params, batch: RolloutBatch, loss, *, weights=None):
        """XLA's memory analysis of phase B alone (one group's suffix microbatches),
        compiled with the group's prefix K/V, path logprobs and the gradient
        accumulator as inputs: the paper's "Phase-B peak"."""
        prepared = self.prepare(batch, loss, weights=weights)
        if isinstance(prepared.host, SplitHost):  # the shallow groups' phase B
            prepared = prepared.host.rows
        groups, rows, seq = prepared.args
        cfg = self.cfg
        p = groups.inputs.shape[1]
        kv = jax.ShapeDtypeStruct(
            (cfg.num_layers, 1, p, cfg.num_kv_heads, cfg.head_dim), jnp.float32
        )
        s = prepared.static.path

        def phase(prm, grads, k32, v32, paths_S, n_in, rows_g, seq_):
            return self._suffix_phase(loss, prm, grads, k32, v32, paths_S, n_in, rows_g, seq_)

        rows0 = jax.tree.map(lambda a: a[0], rows)
        grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), params)
        n_paths = 2 if getattr(loss, "needs_entropy", False) else 1
        paths = (jax.ShapeDtypeStruct((s,), jnp.float32),) * n_paths
        lowered = jax.jit(phase).lower(params, grads, kv, kv, paths, np.int32(p), rows0, seq)
        return lowered.compile().memory_analysis()


def _path_loss(loss, paths_S, seq: base.SeqData, sid) -> jax.Array:
    """``base.sequence_loss`` on a path (logp_S,) or (logp_S, ent_S)."""
    return base.sequence_loss(loss, paths_S[0], seq, sid, *paths_S[1:])


__all__ = [
    "GroupPlan",
    "PrefixActivations",
    "PrefixReuseEngine",
    "deep_sequences",
    "group_nodes",
    "group_plan",
    "offload_supported",
    "sequence_groups",
]
