"""The DFS tree-training engine (AREAL-DTA, papers/000 §3).

The batch's sequences become a prefix tree (``dtarl.tree``); a host-side
compiler turns it into a bucketed push/pop plan (``dtarl.tree.plan``), and one
``jit``-compiled ``lax.scan`` runs the plan. The scan carries

    stack_k/v   [L, 1, S+C, K, D]  K/V of the current root-to-node path (model dtype)
    dstack_k/v  [L, 1, S+C, K, D]  accumulated cotangent of that K/V (fp32)
    logp        [S+C+1]            logprob of every path position's token
    dlogp       [S+C+1]            accumulated cotangent of those logprobs (fp32)
    grads       params-shaped      parameter gradient accumulator (fp32)

PUSH runs a chunk forward against the stack and appends its K/V and logprobs.
POP re-runs the chunk forward under ``jax.vjp`` w.r.t. (params, stack K/V),
evaluates the losses of the sequences that end at the node (on its last chunk),
injects d(loss)/d(logp) plus the dK/dV that the node's descendants accumulated,
adds the parameter cotangent to ``grads`` and the prefix cotangent to the stack
accumulator. Live memory is O(longest path); every tree token is run forward
once (leaves) or twice (stacked nodes) and backward once.

Letters: L layers, S path buffer, C chunk, K kv heads, D head dim, T steps.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl.engines import base
from dtarl.engines.batch import RolloutBatch
from dtarl.model.decoder import Decoder, KVCache, token_logprobs
from dtarl.tree.order import DFSOrder
from dtarl.tree.plan import Op, SegmentPlan, bucket, compile_plan
from dtarl.tree.trie import PrefixTree, build_tree


class _Step(NamedTuple):
    op: jax.Array
    start: jax.Array
    n_valid: jax.Array
    inputs: jax.Array
    targets: jax.Array
    tree_off: jax.Array
    slots: jax.Array


class _Carry(NamedTuple):
    stack_k: jax.Array
    stack_v: jax.Array
    dstack_k: jax.Array
    dstack_v: jax.Array
    logp: jax.Array
    dlogp: jax.Array
    grads: nnx.State
    tree_logp: jax.Array
    seq_loss: jax.Array


def sequence_logprobs(tree: PrefixTree, tree_logp: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Per-sequence logprobs from the per-tree-token logprobs (host side)."""
    out = []
    cache: dict[int, np.ndarray] = {}
    for i in range(n):
        x = int(tree.seq_node[i])
        if x not in cache:
            parts = []
            y = x
            while y > 0:
                o, ln = int(tree.offset[y]), int(tree.length[y])
                parts.append(tree_logp[o : o + ln])
                y = int(tree.parent[y])
            cache[x] = np.concatenate(parts[::-1]).astype(np.float32)
        out.append(cache[x].copy())
    return tuple(out)


@dataclasses.dataclass(eq=False)
class DFSEngine:
    """Tree training by depth-first push/pop over the batch's prefix tree."""

    model: Decoder
    chunk_len: int = 64
    order: DFSOrder = DFSOrder.GREEDY
    name: str = "dfs"

    def __post_init__(self):
        if self.chunk_len < 1:
            raise ValueError(f"chunk_len={self.chunk_len} must be >= 1")
        self.graphdef, _ = base.split_model(self.model)
        self.cfg = self.model.cfg
        self.jit = base.JitCache(self)
        # Buckets only grow, so a smaller batch reuses the last program.
        self._min = dict(steps=1, path=1, slots=1, seqs=1, flat=1, tree=1)

    # ------------------------------------------------------------ device side

    def _chunk_forward(self, params, stack_k, stack_v, start, inputs_C, targets_C):
        model = nnx.merge(self.graphdef, params)
        c = inputs_C.shape[0]
        pos = (start + jnp.arange(c, dtype=jnp.int32))[None]
        hidden, kv_new = model(
            inputs_C[None], pos, KVCache(stack_k, stack_v), start[None], return_hidden=True
        )
        logp, _ = token_logprobs(
            model.lm_head_weight(), hidden, targets_C[None], chunk=self.cfg.logits_chunk
        )
        return logp[0], kv_new.k, kv_new.v

    @property
    def trace_count(self) -> int:
        return self.jit.trace_count

    def device_fn(self, loss, static):
        s, tree_size = static
        return lambda params, steps, seq: self._run_plan(loss, s, tree_size, params, steps, seq)

    def _run_plan(self, loss, s: int, tree_size: int, params, steps: _Step, seq: base.SeqData):
        cfg = self.cfg
        c = steps.inputs.shape[1]
        buf = s + c
        cd = jnp.dtype(cfg.compute_dtype)
        kv_shape = (cfg.num_layers, 1, buf, cfg.num_kv_heads, cfg.head_dim)
        carry = _Carry(
            stack_k=jnp.zeros(kv_shape, cd),
            stack_v=jnp.zeros(kv_shape, cd),
            dstack_k=jnp.zeros(kv_shape, jnp.float32),
            dstack_v=jnp.zeros(kv_shape, jnp.float32),
            logp=jnp.zeros(buf + 1, jnp.float32),
            dlogp=jnp.zeros(buf + 1, jnp.float32),
            grads=base.zeros_like_f32(params),
            tree_logp=jnp.zeros(tree_size + c, jnp.float32),
            seq_loss=jnp.zeros(seq.off.shape[0], jnp.float32),
        )

        def put(buf_, x, at, axis):
            return jax.lax.dynamic_update_slice_in_dim(buf_, x, at, axis=axis)

        def take(buf_, at, size, axis):
            return jax.lax.dynamic_slice_in_dim(buf_, at, size, axis=axis)

        def noop(cr: _Carry, st: _Step) -> _Carry:
            return cr

        def push(cr: _Carry, st: _Step) -> _Carry:
            valid = jnp.arange(c) < st.n_valid
            logp, k, v = self._chunk_forward(
                params, cr.stack_k, cr.stack_v, st.start, st.inputs, st.targets
            )
            return cr._replace(
                stack_k=put(cr.stack_k, k.astype(cd), st.start, 2),
                stack_v=put(cr.stack_v, v.astype(cd), st.start, 2),
                logp=put(cr.logp, jnp.where(valid, logp, 0.0), st.start + 1, 0),
            )

        def pop(cr: _Carry, st: _Step) -> _Carry:
            valid = jnp.arange(c) < st.n_valid
            fwd = lambda p, sk, sv: self._chunk_forward(p, sk, sv, st.start, st.inputs, st.targets)
            (logp, _, _), vjp = jax.vjp(fwd, params, cr.stack_k, cr.stack_v)
            logp = jnp.where(valid, logp, 0.0)
            path_logp = put(cr.logp, logp, st.start + 1, 0)
            # Visit: losses of the sequences ending here, and d loss / d logp.
            per_slot = jax.vmap(
                jax.value_and_grad(lambda lp, sid: base.sequence_loss(loss, lp, seq, sid)),
                in_axes=(None, 0),
            )
            losses, dlp = per_slot(path_logp[:s], st.slots)
            dlogp = cr.dlogp.at[:s].add(jnp.sum(dlp, axis=0))
            g_logp = jnp.where(valid, take(dlogp, st.start + 1, c, 0), 0.0)
            g_k = take(cr.dstack_k, st.start, c, 2)
            g_v = take(cr.dstack_v, st.start, c, 2)
            dparams, dk, dv = vjp((g_logp, g_k.astype(cd), g_v.astype(cd)))
            zeros_kv = jnp.zeros_like(g_k)
            real = st.slots >= 0
            return _Carry(
                stack_k=cr.stack_k,
                stack_v=cr.stack_v,
                dstack_k=put(cr.dstack_k + dk.astype(jnp.float32), zeros_kv, st.start, 2),
                dstack_v=put(cr.dstack_v + dv.astype(jnp.float32), zeros_kv, st.start, 2),
                logp=path_logp,
                dlogp=put(dlogp, jnp.zeros(c, jnp.float32), st.start + 1, 0),
                grads=jax.tree.map(lambda a, g: a + g.astype(jnp.float32), cr.grads, dparams),
                # Only the valid entries: the padding must not clobber a neighbour.
                tree_logp=put(
                    cr.tree_logp,
                    jnp.where(valid, logp, take(cr.tree_logp, st.tree_off, c, 0)),
                    st.tree_off,
                    0,
                ),
                seq_loss=cr.seq_loss.at[jnp.where(real, st.slots, 0)].add(
                    jnp.where(real, losses, 0.0)
                ),
            )

        def body(cr, st):
            return jax.lax.switch(st.op, [noop, push, pop], cr, st), None

        out, _ = jax.lax.scan(body, carry, steps)
        return jnp.sum(out.seq_loss), out.grads, out.tree_logp

    # -------------------------------------------------------------- host side

    def reserve(
        self,
        *,
        steps: int = 1,
        path: int = 1,
        slots: int = 1,
        sequences: int = 1,
        tokens: int = 1,
    ) -> DFSEngine:
        """Pre-sizes the shape buckets (e.g. before a run) so batches up to these
        sizes never trigger a recompilation. Buckets only grow."""
        for key, value in (
            ("steps", steps),
            ("path", path),
            ("slots", slots),
            ("seqs", sequences),
            ("flat", tokens),
            ("tree", tokens),
        ):
            self._min[key] = max(self._min[key], bucket(value))
        return self

    def plan(self, tree: PrefixTree) -> SegmentPlan:
        plan = compile_plan(
            tree,
            chunk_len=self.chunk_len,
            order=self.order,
            min_steps=self._min["steps"],
            min_path=self._min["path"],
            min_slots=self._min["slots"],
        )
        self._min["steps"] = plan.op.shape[0]
        self._min["path"] = plan.path_len
        self._min["slots"] = plan.slots.shape[1]
        return plan

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> base.Prepared:
        base.check_batch(batch, loss, self.cfg.vocab_size)
        w = base.sequence_weights(batch, loss, weights)
        tree = build_tree(batch.tokens)
        plan = self.plan(tree)
        n = batch.num_sequences
        self._min["seqs"] = n_pad = bucket(n, self._min["seqs"])
        self._min["flat"] = f_pad = bucket(batch.num_tokens, self._min["flat"])
        self._min["tree"] = tree_size = bucket(int(tree.token_data.shape[0]), self._min["tree"])
        seq = base.flat_sequence_data(batch, w, n_pad=n_pad, f_pad=f_pad, pad=plan.path_len)
        steps = _Step(
            op=plan.op,
            start=plan.start,
            n_valid=plan.n_valid,
            inputs=plan.inputs,
            targets=plan.targets,
            tree_off=plan.tree_off,
            slots=plan.slots,
        )
        stats = dict(
            num_tokens=tree.stats.num_tokens,
            tree_tokens=tree.stats.tree_tokens,
            computed_tokens=plan.computed_tokens,
            pushed_tokens=plan.pushed_tokens,
            peak_path=plan.peak_path,
            num_steps=plan.num_steps,
            padded_steps=int(plan.op.shape[0]),
            path_buffer=plan.path_len + plan.chunk_len,
        )
        return base.Prepared(
            static=(plan.path_len, tree_size), args=(steps, seq), host=(tree, n), stats=stats
        )

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


__all__ = ["DFSEngine", "Op", "sequence_logprobs"]
