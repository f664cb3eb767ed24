"""The DFS tree-training engine (AREAL-DTA §3).

The batch's sequences become a prefix tree (``dtarl.tree``); a host-side
compiler turns it into a bucketed push/pop plan (``dtarl.tree.plan``), and one
``jit``-compiled loop runs the plan's real steps (a ``fori_loop`` to the last
non-NOOP step: the step bucket's padding, e.g. 120 of a reserved 128 steps, is never
run; each step takes its own VJP, so the loop is not differentiated). It carries

    stack_k/v   [L, 1, S+C, K, D]  K/V of the current root-to-node path (model dtype)
    dstack_k/v  [L, 1, S+C, K, D]  accumulated cotangent of that K/V (fp32)
    logp        [S+C+1]            logprob of every path position's token
    dlogp       [S+C+1]            accumulated cotangent of those logprobs (fp32)
    ent, dent   [S+C+1]            the same for the predictive entropy, when the
                                   loss asks for it (``loss.needs_entropy``)
    grads       params-shaped      parameter gradient accumulator (fp32)
    hidden      [L, 1, S+C, E]     each layer's output on the path (activation
                                   dtype), with ``keep_layer_outputs``

PUSH runs a chunk forward against the stack and appends its K/V and logprobs.
POP re-runs the chunk forward under ``jax.vjp`` w.r.t. (params, stack K/V),
evaluates the losses of the sequences that end at the node (on its last chunk),
injects d(loss)/d(logp) plus the dK/dV that the node's descendants accumulated,
adds the parameter cotangent to ``grads`` and the prefix cotangent to the stack
accumulator. Live memory is O(longest path); every tree token is run forward
once (leaves) or twice (stacked nodes) and backward once.

With ``keep_layer_outputs`` (default when ``model.remat`` is full) a PUSH also keeps
its chunk's layer outputs in ``hidden``, and the POP of a pushed chunk (``saved`` in
the plan) runs only the backward pass from them (``dtarl.model.reverse``): one
layer recompute and its VJP per layer, where ``jax.vjp`` of the rematerialised
forward runs the forward, then each layer again inside the backward. A stacked
token then costs 1 + 3 passes, as under dense training with remat (1 + 1 + 2). The
loop body is then a forward switch (PUSH, and the POP of a chunk never pushed,
which writes the same buffers at its start, column by column) followed by a
backward switch (POP), so the program holds one forward and one backward body.

A POP may hold several short sibling leaves as separate segments (packed by the
plan; the model's segment mask keeps them apart), and a POP_ROWS step pops up to
``leaf_rows`` chunks of sibling leaves as a batch of rows over one shared stack
prefix (the model attends every row to the single stack copy). Their sequences' losses are
then evaluated on the path logprobs with that segment's chunk entries scattered
in. A POP_WIDE step pops up to ``leaf_rows`` rows of ``wide_chunks`` chunks
(leaves longer than a chunk, or a long leaf's tail) the same way, so a leaf
that shares nothing is computed once forward and once backward, batched, as in
dense training.

The loop's body is one ``lax.switch`` with one branch per op: noop, push, pop and,
when the plan has them, row pop (``leaf_rows`` > 1) and wide pop (leaves longer
than a chunk). By default (``bucket_bodies=None``) a step's prefix bucket is data
that only the attention reads: ``Decoder(prefix_sizes=...)`` puts a small
``lax.switch`` around each layer's attention, one branch per prefix size, and the
branch attends the first ``prefix_sizes[b]`` stack rows, b the smallest bucket
holding the step's ``start``; the weight products, the loss and the stack updates
exist once per op. ``bucket_bodies=True`` holds one whole-model branch per (op,
prefix bucket) (the program grows with the buckets); ``bucket_bodies=False`` one
branch per op attending the whole path buffer, masked past ``start`` (scores -inf,
cotangents exactly 0), which pays attention over the masked rows. The defaults
``chunk_len=256, leaf_rows=1`` leave one backward body (pop): sibling leaves pack
into a 256-token chunk instead of two 128-token rows, so the pop steps are as wide
as the per-bucket program's row pops. Measured in engines.md, "Program bodies".

Letters: L layers, S path buffer, C chunk, K kv heads, D head dim, T steps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl.batch import RolloutBatch
from dtarl.engines import base
from dtarl.engines.config import Capacity, DFSConfig, configured
from dtarl.engines.cost import token_flops, tree_partition_cost
from dtarl.engines.dfs_steps import (
    ENTRY_FILL,
    PlanEntries,
    PlanSteps,
    Step,
    expand_step,
    sequence_logprobs,
)
from dtarl.model.config import Remat
from dtarl.model.decoder import Decoder, KVCache, token_logprobs
from dtarl.model.reverse import vjp_from_layer_outputs
from dtarl.tree.plan import Op, SegmentPlan, bucket, compile_plan, fine_bucket
from dtarl.tree.trie import PrefixTree


class DFSStatic(NamedTuple):
    """The program's shapes: the path buffer, the tree's token slots, the prefix
    bucket sizes, rows per POP_ROWS step, chunks per POP_WIDE row and the chunk."""

    path_len: int
    tree_size: int
    prefix_sizes: tuple[int, ...]
    rows: int
    wide: int
    chunk_len: int


class DFSHost(NamedTuple):
    tree: PrefixTree
    num_sequences: int


class _Carry(NamedTuple):
    stack_k: jax.Array
    stack_v: jax.Array
    dstack_k: jax.Array
    dstack_v: jax.Array
    logp: jax.Array
    dlogp: jax.Array
    ent: jax.Array
    dent: jax.Array
    grads: nnx.State
    tree_logp: jax.Array
    seq_loss: jax.Array
    hidden: jax.Array  # [L, 1, S+C, E] layer outputs of the path (keep_layer_outputs)


class DFSEngine(base.BucketState):
    """Tree training by depth-first push/pop over the batch's prefix tree
    (``DFSConfig``: chunk_len, order, pack_leaves, leaf_rows, wide_chunks, ...);
    logprobs of logits / ``temperature`` (``base.logprob_temperature``)."""

    def __init__(
        self,
        model: Decoder,
        config: DFSConfig | None = None,
        /,
        *,
        name: str = "dfs",
        temperature: float = 1.0,
        **settings,
    ):
        config = configured(DFSConfig, config, settings)
        self._init_engine(model, config, name=name, temperature=temperature)
        self._single_segment = not self.config.pack_leaves
        # Buckets only grow, so a smaller batch reuses the last program.
        # Loss slots are cheap (O(path) each); 8 covers most packed steps.
        self._min = dict(
            steps=1, path=1, slots=8, seqs=1, flat=1, tree=1, wide=0, entries=1, chunk=1
        )

    # ------------------------------------------------------------ device side

    @property
    def keeps_layer_outputs(self) -> bool:
        """Whether pops run from the layer outputs their push kept (``DFSConfig``)."""
        keep = self.config.keep_layer_outputs
        return self.cfg.remat is Remat.FULL if keep is None else keep

    def _chunk_forward(
        self, params, stack_k, stack_v, st: Step, rows: int = 1, ent=False, sizes=None, outs=False
    ):
        """Forward of a step's ``rows`` rows (flat [rows * C] entries) over the
        stack prefix (batch 1, shared by the rows); logprobs and entropies (zeros
        unless ``ent``) flat [rows * C], and the rows' K/V (and, with ``outs``, the
        layer outputs [L, rows, C, E])."""
        model = nnx.merge(self.graphdef, params)
        shape = (rows, st.inputs.shape[0] // rows)
        hidden, kv_new, *layer_outs = model(
            st.inputs.reshape(shape),
            st.positions.reshape(shape),
            KVCache(stack_k, stack_v),
            jnp.broadcast_to(st.start, (rows,)),
            return_hidden=True,
            segment_ids_BxT=self._segments(st, shape),
            prefix_sizes=sizes,
            layer_outputs=outs,
        )
        logp, entropy = self._head(st, shape, ent)(model, hidden)
        return (logp.reshape(-1), entropy.reshape(-1), kv_new.k, kv_new.v, *layer_outs)

    def _segments(self, st: Step, shape):
        return None if self._single_segment else st.seg.reshape(shape)

    def _head(self, st: Step, shape, ent: bool):
        """(model, normed hidden) -> the step's logprobs and entropies [rows, C]; the
        logits built ``logits_chunk * logits_rows`` tokens at a time (``DFSConfig``)."""
        block = self.cfg.logits_chunk * self.config.logits_rows
        return lambda model, hidden: token_logprobs(
            model.lm_head_weight(),
            hidden,
            st.targets.reshape(shape),
            chunk=max(block // shape[0], 1) if block else 0,
            entropy=ent,
            temperature=self.temperature,
            dtype=self.cfg.compute_dtype,
        )

    @property
    def trace_count(self) -> int:
        return self.jit.trace_count

    def device_fn(self, loss, static: DFSStatic):
        s, tree_size, sizes, rows, wide, c = static
        return lambda params, steps, seq: self._run_plan(
            loss, s, tree_size, sizes, rows, wide, c, params, steps, seq
        )

    def _run_plan(
        self,
        loss,
        s,
        tree_size,
        sizes,
        rows,
        wide,
        c,
        params,
        steps: PlanSteps,
        seq: base.SeqData,
    ):
        cfg = self.cfg
        entries, steps = steps.entries, steps._replace(entries=None)  # loop over the [T] rest
        with_ent = bool(getattr(loss, "needs_entropy", False))
        buf = s + c
        cd = jnp.dtype(cfg.compute_dtype)
        keep = self.keeps_layer_outputs
        kv_shape = (cfg.num_layers, 1, buf, cfg.num_kv_heads, cfg.head_dim)
        carry = _Carry(
            stack_k=jnp.zeros(kv_shape, cd),
            stack_v=jnp.zeros(kv_shape, cd),
            dstack_k=jnp.zeros(kv_shape, jnp.float32),
            dstack_v=jnp.zeros(kv_shape, jnp.float32),
            logp=jnp.zeros(buf + 1, jnp.float32),
            dlogp=jnp.zeros(buf + 1, jnp.float32),
            ent=jnp.zeros(buf + 1 if with_ent else 1, jnp.float32),
            dent=jnp.zeros(buf + 1 if with_ent else 1, jnp.float32),
            grads=base.zeros_like_f32(params),
            tree_logp=jnp.zeros(tree_size, jnp.float32),
            seq_loss=jnp.zeros(seq.off.shape[0], jnp.float32),
            hidden=jnp.zeros(
                (cfg.num_layers, 1, buf, cfg.hidden_size) if keep else (1,), cfg.act_dtype
            ),
        )
        oob = buf + 1  # scatter index that mode="drop" discards

        def put(buf_, x, at, axis):
            return jax.lax.dynamic_update_slice_in_dim(buf_, x, at, axis=axis)

        def noop(cr: _Carry, st: Step) -> _Carry:
            return cr

        def first(st: Step, n: int) -> Step:
            """A step's first n entries (the rest are padding for wider ops)."""
            per_entry = ("positions", "inputs", "targets", "seg", "tree_idx")
            return st._replace(**{f: getattr(st, f)[:n] for f in per_entry})

        row0 = functools.partial(first, n=c)  # PUSH / POP: one chunk

        def push(p: int, cr: _Carry, st: Step) -> _Carry:
            # Reads the first p stack rows; writes the chunk's K/V, logprobs (and layer
            # outputs) at st.start, column by column: a PUSH is a single contiguous
            # segment there. With ``keep`` this is also the forward of a POP that was
            # not pushed, whose columns (packed leaves: several segments) its pop then
            # reads back; nothing else reads the stack past a step's start.
            st = row0(st)
            valid = st.seg >= 0
            logp, ent, k, v, *outs = self._chunk_forward(
                params,
                cr.stack_k[:, :, :p],
                cr.stack_v[:, :, :p],
                st,
                ent=with_ent,
                sizes=attn,
                outs=keep,
            )
            if keep:
                cr = cr._replace(
                    hidden=put(cr.hidden, outs[0].astype(cr.hidden.dtype), st.start, 2)
                )
            cr = cr._replace(
                stack_k=put(cr.stack_k, k.astype(cd), st.start, 2),
                stack_v=put(cr.stack_v, v.astype(cd), st.start, 2),
                logp=put(cr.logp, jnp.where(valid, logp, 0.0), st.start + 1, 0),
            )
            if with_ent:
                cr = cr._replace(ent=put(cr.ent, jnp.where(valid, ent, 0.0), st.start + 1, 0))
            return cr

        def visit(chunk, st: Step, path):
            """Losses of the sequences visited here, and d loss / d chunk, d loss / d path.

            ``chunk`` and ``path`` are (logp, entropy) pairs (entropy None unless the
            loss needs it); the gradients come back in the same structure.
            """
            valid = st.seg >= 0
            tpos = jnp.where(valid, st.positions + 1, oob)

            def one(sid, sseg):
                mine = valid & (st.seg == sseg)
                idx = jnp.where(mine, tpos, oob)
                covered = jnp.zeros(s, jnp.float32).at[idx].set(1.0, mode="drop")
                xs = jax.tree.map(
                    lambda path_x, chunk_x: path_x[:s].at[idx].set(chunk_x, mode="drop"),
                    path,
                    chunk,
                )
                val, d = jax.value_and_grad(
                    lambda x: base.sequence_loss(loss, x[0], seq, sid, x[1])
                )(xs)
                d_chunk = jax.tree.map(
                    lambda g: jnp.where(mine, g.at[tpos].get(mode="fill", fill_value=0.0), 0.0), d
                )
                return val, d_chunk, jax.tree.map(lambda g: g * (1.0 - covered), d)

            vals, d_chunk, d_path = jax.vmap(one)(st.slots, st.slot_seg)
            total = functools.partial(jnp.sum, axis=0)
            return vals, jax.tree.map(total, d_chunk), jax.tree.map(total, d_path)

        def prefix32(cr: _Carry, p: int):
            """The stack's first p rows in fp32 (exact: values of the compute dtype).
            The chunk's K/V then leave in fp32 too (``Decoder``), so the cotangents
            for the prefix come back fp32 into the dstack carry, and the carried
            cotangent of the chunk's own K/V enters in fp32: a key's cotangent is
            summed in fp32 and rounded to the compute dtype once, as in dense."""
            return cr.stack_k[:, :, :p].astype(jnp.float32), cr.stack_v[:, :, :p].astype(
                jnp.float32
            )

        def accumulate(grads, dparams):
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, dparams)

        def path_of(cr: _Carry):
            return (cr.logp, cr.ent if with_ent else None)

        def pop(p: int, cr: _Carry, st: Step) -> _Carry:
            st = row0(st)
            valid = st.seg >= 0
            if keep:  # the push (or this step's forward) left logprobs and layer outputs
                logp = jax.lax.dynamic_slice_in_dim(cr.logp, st.start + 1, c)
                ent = jax.lax.dynamic_slice_in_dim(cr.ent, st.start + 1, c) if with_ent else logp
                backward = functools.partial(pop_backward, p, cr, st)
            else:
                fwd = lambda prm, sk, sv: self._chunk_forward(prm, sk, sv, st, 1, with_ent, attn)
                (logp, ent, _, _), vjp = jax.vjp(fwd, params, *prefix32(cr, p))

                def backward(cotangents):
                    dparams, dk, dv = vjp(cotangents)
                    return accumulate(cr.grads, dparams), dk, dv

            logp = jnp.where(valid, logp, 0.0)
            ent = jnp.where(valid, ent, 0.0) if with_ent else None
            losses, (d_chunk, d_chunk_ent), (d_path, d_path_ent) = visit(
                (logp, ent), st, path_of(cr)
            )
            tpos = jnp.where(valid, st.positions + 1, oob)
            kpos = jnp.where(valid, st.positions, oob)

            def descendants(acc):  # what this chunk's descendants left at its positions
                return jnp.where(valid, acc.at[tpos].get(mode="fill", fill_value=0.0), 0.0)

            dlogp = cr.dlogp.at[:s].add(d_path)
            g_logp = d_chunk + descendants(dlogp)
            g_ent, dent = jnp.zeros_like(g_logp), cr.dent
            if with_ent:
                dent = dent.at[:s].add(d_path_ent)
                g_ent = d_chunk_ent + descendants(dent)
                dent = dent.at[tpos].set(0.0, mode="drop")
            take = lambda a: jnp.where(
                valid[None, None, :, None, None],
                a.at[:, :, kpos].get(mode="fill", fill_value=0.0),
                0.0,
            )
            g_k, g_v = take(cr.dstack_k), take(cr.dstack_v)
            grads, dk, dv = backward((g_logp, g_ent, g_k, g_v))  # fp32 K/V cotangents
            dstack_k = cr.dstack_k.at[:, :, :p].add(dk.astype(jnp.float32))
            dstack_v = cr.dstack_v.at[:, :, :p].add(dv.astype(jnp.float32))
            real = st.slots >= 0
            tidx = jnp.where(valid, st.tree_idx, tree_size)
            return cr._replace(
                # This chunk's cotangents are consumed: clear them for its siblings.
                dstack_k=dstack_k.at[:, :, kpos].set(0.0, mode="drop"),
                dstack_v=dstack_v.at[:, :, kpos].set(0.0, mode="drop"),
                dlogp=dlogp.at[tpos].set(0.0, mode="drop"),
                dent=dent,
                grads=grads,
                tree_logp=cr.tree_logp.at[tidx].set(logp, mode="drop"),
                seq_loss=cr.seq_loss.at[jnp.where(real, st.slots, 0)].add(
                    jnp.where(real, losses, 0.0)
                ),
            )

        def pop_backward(p: int, cr: _Carry, st: Step, cotangents):
            """``pop``'s VJP from the layer outputs kept at ``st.start``: only the
            backward pass (``dtarl.model.reverse``), its parameter cotangent added
            to the carried gradients where it arises."""
            g_logp, g_ent, g_k, g_v = cotangents
            shape = (1, c)
            grads, d_prefix = vjp_from_layer_outputs(
                self.graphdef,
                params,
                st.inputs.reshape(shape),
                st.positions.reshape(shape),
                KVCache(*prefix32(cr, p)),
                jnp.broadcast_to(st.start, (1,)),
                jax.lax.dynamic_slice_in_dim(cr.hidden, st.start, c, axis=2),
                self._head(st, shape, with_ent),
                (g_logp.reshape(shape), g_ent.reshape(shape)),
                KVCache(g_k, g_v),
                cr.grads,
                segment_ids_BxT=self._segments(st, shape),
                prefix_sizes=attn,
            )
            return grads, d_prefix.k, d_prefix.v

        def pop_rows(n_rows: int, width: int, p: int, cr: _Carry, st: Step) -> _Carry:
            # ``n_rows`` rows of ``width`` entries (POP_ROWS: R rows of C; POP_WIDE: R
            # rows of W*C). Only leaves: no descendant cotangents wait in dstack/dlogp
            # past ``start``, and nothing stacked reads these rows' K/V.
            st = first(st, n_rows * width)
            valid = st.seg >= 0
            fwd = lambda prm, sk, sv: self._chunk_forward(prm, sk, sv, st, n_rows, with_ent, attn)
            (logp, ent, k_new, v_new), vjp = jax.vjp(fwd, params, *prefix32(cr, p))
            logp = jnp.where(valid, logp, 0.0)
            ent = jnp.where(valid, ent, 0.0) if with_ent else None
            losses, (d_chunk, d_chunk_ent), (d_path, d_path_ent) = visit(
                (logp, ent), st, path_of(cr)
            )
            g_ent = d_chunk_ent if with_ent else jnp.zeros_like(d_chunk)
            dparams, dk, dv = vjp((d_chunk, g_ent, jnp.zeros_like(k_new), jnp.zeros_like(v_new)))
            real = st.slots >= 0
            tidx = jnp.where(valid, st.tree_idx, tree_size)
            return cr._replace(
                dstack_k=cr.dstack_k.at[:, :, :p].add(dk.astype(jnp.float32)),
                dstack_v=cr.dstack_v.at[:, :, :p].add(dv.astype(jnp.float32)),
                dlogp=cr.dlogp.at[:s].add(d_path),
                dent=cr.dent.at[:s].add(d_path_ent) if with_ent else cr.dent,
                grads=accumulate(cr.grads, dparams),
                tree_logp=cr.tree_logp.at[tidx].set(logp, mode="drop"),
                seq_loss=cr.seq_loss.at[jnp.where(real, st.slots, 0)].add(
                    jnp.where(real, losses, 0.0)
                ),
            )

        # One body per op over the whole path buffer (None: the attention reads the
        # step's prefix bucket; False: all of it, masked past ``start``), or one per
        # (op, prefix bucket) (True). ``attn`` is read by the bodies when traced.
        bucketed = self.config.bucket_bodies is True
        bodies = sizes if bucketed else sizes[-1:]
        attn = sizes if self.config.bucket_bodies is None else None
        is_op = lambda op: lambda st: st.op == op
        leaves = []
        if rows > 1:
            leaves.append((is_op(Op.POP_ROWS), functools.partial(pop_rows, rows, c)))
        if wide > 1:
            leaves.append((is_op(Op.POP_WIDE), functools.partial(pop_rows, rows, wide * c)))
        if keep:  # a forward (PUSH, or a POP not pushed), then a backward (POP)
            unpushed = lambda st: (st.op == Op.PUSH) | ((st.op == Op.POP) & ~st.saved)
            stages = [[(unpushed, push)], [(is_op(Op.POP), pop)]] + ([leaves] if leaves else [])
        else:  # one switch: PUSH, POP (forward and backward), leaf pops
            stages = [[(is_op(Op.PUSH), push), (is_op(Op.POP), pop)] + leaves]

        def stage(cases):
            """A switch over ``cases`` ((step -> bool, body) pairs): noop when none
            holds; with per-bucket bodies one branch per (case, prefix bucket)."""
            branches, starts = [noop], []
            for _, fn in cases:
                starts.append(len(branches))
                branches += [functools.partial(fn, p) for p in bodies]

            def run(cr, st):
                offset = st.pbucket if bucketed else 0
                index = jnp.select([when(st) for when, _ in cases], [i + offset for i in starts], 0)
                return jax.lax.switch(index, branches, cr, st)

            return run

        stages = [stage(cases) for cases in stages]

        def body(cr, plan_step: PlanSteps):
            st = expand_step(plan_step, entries, rows * max(wide, 1) * c)
            for run in stages:
                cr = run(cr, st)
            return cr

        # Only the real steps run: the plan is padded at its end to the step bucket
        # (reserved for the largest batch, e.g. 128 steps where 8 are real), and a NOOP
        # step still passes the whole carry (the path buffers and the params-sized
        # gradients) through the switch. The loop is not differentiated (each step
        # takes its own VJP), so a dynamic trip count is fine.
        t = steps.op.shape[0]
        n_real = jnp.max(jnp.where(steps.op != Op.NOOP, jnp.arange(1, t + 1), 0))

        def loop(i, cr):
            return body(cr, jax.tree.map(lambda a: a[i], steps))

        out = jax.lax.fori_loop(0, n_real, loop, carry)
        return jnp.sum(out.seq_loss), out.grads, out.tree_logp

    # -------------------------------------------------------------- host side

    def reserve(self, capacity: Capacity) -> DFSEngine:
        """Grows the shape buckets to ``capacity`` (e.g. before a run) so that batches
        within it never trigger a recompilation. Buckets only grow."""
        path = capacity.length
        chunk = self._chunk(path)
        for key, value in (
            ("steps", capacity.plan_steps(chunk)),
            ("path", path),
            ("slots", capacity.group_size),
            ("seqs", capacity.sequences),
            ("flat", capacity.tokens),
            ("tree", capacity.tree_tokens + 1),  # +1: the plan's trailing slot
            ("entries", 2 * capacity.tree_tokens),  # each tree token popped, pushed <= once
        ):
            self._min[key] = max(self._min[key], bucket(value))
        wide = self.config.wide_chunks
        if path > chunk and wide >= 2:  # leaves this long pop wide
            self._min["wide"] = max(self._min["wide"], min(wide, -(-path // chunk)))
        return self

    def _chunk(self, longest: int) -> int:
        """The plan's chunk: ``chunk_len``, or the power-of-two bucket of the longest
        sequence seen (``reserve``'d or planned) when that is shorter, so that a batch
        of short sequences does not pad every step to ``chunk_len`` tokens (each
        padded position still runs the layers and the [tokens, vocab] head). A
        monotone bucket, agreed across ranks like the others."""
        chunk = min(self.config.chunk_len, bucket(longest, self._min["chunk"]))
        self._min["chunk"] = max(self._min["chunk"], chunk)
        return self._min["chunk"]

    def plan(self, tree: PrefixTree) -> SegmentPlan:
        plan = compile_plan(
            tree,
            chunk_len=self._chunk(tree.stats.longest_path),
            order=self.config.order,
            pack_leaves=not self._single_segment,
            rows=self.config.leaf_rows,
            wide=self.config.wide_chunks,
            token_flops=self.cfg.flops_per_token,
            wide_slack=self.config.wide_slack,
            prefix_levels=self.config.prefix_levels,
            min_steps=self._min["steps"],
            min_path=self._min["path"],
            min_slots=self._min["slots"],
            min_wide=self._min["wide"],
        )
        self._min["wide"] = plan.wide
        self._min["steps"] = plan.op.shape[0]
        self._min["path"] = plan.path_len
        self._min["slots"] = plan.slots.shape[1]
        return plan

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> base.Prepared:
        base.check_batch(batch, loss, self.cfg.vocab_size)
        w = base.sequence_weights(batch, loss, weights)
        tree = batch.prefix_tree()
        plan = self.plan(tree)
        n = batch.num_sequences
        self._min["seqs"] = n_pad = bucket(n, self._min["seqs"])
        self._min["flat"] = f_pad = bucket(batch.num_tokens, self._min["flat"])
        # +1: a trailing slot that padding entries write into and nothing reads.
        tree_size = bucket(int(tree.token_data.shape[0]) + 1, self._min["tree"])
        self._min["tree"] = tree_size
        seq = base.flat_sequence_data(batch, w, n_pad=n_pad, f_pad=f_pad, pad=plan.path_len)
        steps = self.device_plan(plan)
        stats = dict(
            num_tokens=tree.stats.num_tokens,
            tree_tokens=tree.stats.tree_tokens,
            computed_tokens=plan.computed_tokens,
            pushed_tokens=plan.pushed_tokens,
            peak_path=plan.peak_path,
            num_steps=plan.num_steps,
            packed_steps=plan.packed_steps,
            row_steps=plan.row_steps,
            wide_steps=plan.wide_steps,
            padded_steps=int(plan.op.shape[0]),
            path_buffer=plan.path_len + plan.chunk_len,
        )
        static = DFSStatic(
            path_len=plan.path_len,
            tree_size=tree_size,
            prefix_sizes=plan.prefix_sizes,
            rows=plan.rows,
            wide=plan.wide,
            chunk_len=plan.chunk_len,
        )
        return base.Prepared(
            static=static,
            args=(steps, seq),
            host=DFSHost(tree=tree, num_sequences=n),
            stats=stats,
        )

    def device_plan(self, plan: SegmentPlan) -> PlanSteps:
        """The plan's compact arrays as the program takes them (``PlanSteps`` with its
        ``PlanEntries``), the flat entries padded to the ``entries`` bucket (a quarter
        octave, ``fine_bucket``: they are the bulk of the input; it grows to fit) plus E."""
        n = plan.num_entries
        self._min["entries"] = n_pad = fine_bucket(n, self._min["entries"])
        ptr = plan.entry_ptr
        steps = PlanSteps(
            op=plan.op,
            saved=plan.saved,
            start=plan.start,
            pbucket=plan.pbucket,
            slots=plan.slots,
            slot_seg=plan.slot_seg,
            first=ptr[:-1].astype(np.int32),
            count=np.diff(ptr).astype(np.int32),
            entries=None,
        )

        def flat(a: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(n_pad + plan.width, fill, np.int32)
            out[:n] = a
            return out

        entries = PlanEntries(
            col=flat(plan.entry_col, 0),
            **{k: flat(plan.entries[k], ENTRY_FILL[k]) for k in ENTRY_FILL},
        )
        return steps._replace(entries=entries)

    def features(self, prepared: base.Prepared) -> base.WorkFeatures:
        """Each step's entries: PUSH and POP run one chunk of C, POP_ROWS ``rows``
        chunks, POP_WIDE ``rows`` rows of ``wide`` chunks; a push is a forward, a pop
        a recomputed forward and a backward (with kept layer outputs, a pop never
        pushed runs its forward too). Every entry attends its prefix bucket
        (``bucket_bodies`` None or True; False: the whole path buffer, masked) and its whole row
        (C, or C * wide for a wide row). NOOP padding steps are not counted: the
        program's loop stops at the plan's last real step (``_run_plan``)."""
        steps, st = prepared.args[0], prepared.static
        f0, fa = token_flops(self.cfg)
        sizes = np.asarray(st.prefix_sizes, np.float64)
        op = np.asarray(steps.op)
        c = st.chunk_len
        width = np.where(op == Op.NOOP, 0.0, 1.0)
        width = np.where(op == Op.POP_ROWS, float(st.rows), width)
        width = np.where(op == Op.POP_WIDE, float(st.rows * st.wide), width)
        # With kept outputs a POP never pushed runs its forward first (4 passes).
        unpushed = (op == Op.POP) & ~np.asarray(steps.saved) & self.keeps_layer_outputs
        passes = np.where(op == Op.PUSH, 1.0, np.where(unpushed, 4.0, 3.0)) * width
        masked = self.config.bucket_bodies is False
        prefix = sizes[-1] if masked else sizes[np.asarray(steps.pbucket)]
        ctx = prefix + np.where(op == Op.POP_WIDE, c * st.wide, c)
        return base.WorkFeatures(
            lin_flops=float(c * f0 * passes.sum()),
            attn_flops=float(c * fa * (passes * ctx).sum()),
            steps=float(np.count_nonzero(op != Op.NOOP)),
            tokens=float(c * width.sum()),
            program=self.name,
        )

    def partition_cost(self, batch: RolloutBatch):
        """The dp partition's price of this engine's work (``dtarl.engines.cost``): every
        tree token once, pushed (1 pass) and popped (3), attending its prefix and its
        chunk of ``chunk_len`` tokens (chunk padding and prefix buckets not priced)."""
        del batch  # the price per tree token does not depend on the batch
        return tree_partition_cost(self.cfg, passes=4.0, context=float(self.config.chunk_len))

    def finish(self, prepared: base.Prepared, out) -> tuple[np.ndarray, ...]:
        tree, n = prepared.host
        return sequence_logprobs(tree, np.asarray(out), n)

    def compiled_memory(self, params, batch: RolloutBatch, loss, *, weights=None):
        """XLA's memory analysis of the compiled program for this batch's buckets."""
        prepared = self.prepare(batch, loss, weights=weights)
        lowered = self.jit.lower(loss, prepared.static, params, prepared.args)
        return lowered.compile().memory_analysis()

    def value_and_grad(self, params, batch: RolloutBatch, loss, *, weights=None):
        return base.run_value_and_grad(self, params, batch, loss, weights)


__all__ = ["DFSEngine", "Op", "PlanEntries", "PlanSteps", "expand_step", "sequence_logprobs"]
