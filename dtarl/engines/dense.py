"""The dense baseline: every sequence run separately as a padded batch.

    L(theta) = sum_i loss(logp_i(theta), [H_i(theta),] ...)   with logp_i (and the
    per-token entropies H_i, only when ``loss.needs_entropy``) from one full
    forward of sequence i; grads = jax.grad(L).

Sequences are padded to a bucketed length and processed in microbatches of
``microbatch`` sequences inside one ``lax.scan`` (gradients summed in fp32), with
optional per-layer rematerialisation (``remat=True``: the papers' "Dense + CKPT").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dtarl.batch import RolloutBatch
from dtarl.engines import base
from dtarl.engines.config import Capacity, DenseConfig, configured
from dtarl.engines.cost import dense_partition_cost, token_flops
from dtarl.model.decoder import Decoder, token_logprobs
from dtarl.tree.plan import bucket, fine_bucket


class DenseStatic(NamedTuple):
    """The program's shapes: ``microbatches`` scan steps of ``microbatch`` rows of
    ``length`` tokens."""

    microbatches: int
    microbatch: int
    length: int


class DenseHost(NamedTuple):
    lengths: np.ndarray  # [N] tokens of each sequence


class DenseEngine(base.BucketState):
    """Every sequence as one padded row (``DenseConfig``: microbatch, remat); logprobs
    of logits / ``temperature`` (``base.logprob_temperature``)."""

    def __init__(
        self,
        model: Decoder,
        config: DenseConfig | None = None,
        /,
        *,
        name: str = "dense",
        temperature: float = 1.0,
        **settings,
    ):
        config = configured(DenseConfig, config, settings)
        self._init_engine(model, config, name=name, temperature=temperature)
        self._min = dict(length=8, seqs=1, flat=1)

    @property
    def trace_count(self) -> int:
        return self.jit.trace_count

    def reserve(self, capacity: Capacity) -> DenseEngine:
        """Grows the shape buckets to ``capacity`` so that smaller batches never recompile.

        The reserved row length is the capacity's own (rounded up to a multiple of 8),
        not its quarter-octave bucket: every batch within it runs that one program, and
        a run whose sequences reach the cap (prompt 512 + 64 new tokens: 576) does not
        pay for a 640-token row (+11% tokens, +23% attention)."""
        self._min["length"] = max(self._min["length"], -(-capacity.length // 8) * 8)
        for key, value in (("seqs", capacity.sequences), ("flat", capacity.tokens)):
            self._min[key] = max(self._min[key], bucket(value))
        return self

    # ------------------------------------------------------------ device side

    def device_fn(self, loss, static: DenseStatic):
        num_mb, mb, t = static
        # Entropy only when the loss uses it: otherwise the program is unchanged.
        with_entropy = bool(getattr(loss, "needs_entropy", False))

        def microbatch_loss(params, tokens_BxT, rows_B, seq):
            model = nnx.merge(self.graphdef, params)
            b = tokens_BxT.shape[0]
            pos = jnp.broadcast_to(jnp.arange(t), (b, t))
            hidden, _ = model(tokens_BxT, pos, return_hidden=True, remat=self.config.remat)
            lp_pred, ent_pred = token_logprobs(
                model.lm_head_weight(),
                hidden[:, :-1],
                tokens_BxT[:, 1:],
                chunk=self.cfg.logits_chunk,
                entropy=with_entropy,
                temperature=self.temperature,
                dtype=self.cfg.compute_dtype,
            )
            zero_Bx1 = jnp.zeros((b, 1), jnp.float32)
            logp_BxT = jnp.concatenate([zero_Bx1, lp_pred], axis=1)
            if with_entropy:
                ent_BxT = jnp.concatenate([zero_Bx1, ent_pred], axis=1)
                per_seq = jax.vmap(lambda lp, ent, sid: base.sequence_loss(loss, lp, seq, sid, ent))
                return jnp.sum(per_seq(logp_BxT, ent_BxT, rows_B)), logp_BxT
            per_seq = jax.vmap(lambda lp, sid: base.sequence_loss(loss, lp, seq, sid))
            return jnp.sum(per_seq(logp_BxT, rows_B)), logp_BxT

        grad_fn = jax.value_and_grad(microbatch_loss, has_aux=True)

        def run(params, tokens_NxT, rows_N, seq):
            def body(acc, xs):
                total, grads = acc
                (val, logp), g = grad_fn(params, xs[0], xs[1], seq)
                grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
                return (total + val, grads), logp

            xs = (tokens_NxT.reshape(num_mb, mb, t), rows_N.reshape(num_mb, mb))
            init = (jnp.zeros((), jnp.float32), base.zeros_like_f32(params))
            (total, grads), logp = jax.lax.scan(body, init, xs)
            return total, grads, logp.reshape(num_mb * mb, t)

        return run

    # -------------------------------------------------------------- host side

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> base.Prepared:
        base.check_batch(batch, loss, self.cfg.vocab_size)
        w = base.sequence_weights(batch, loss, weights)
        n = batch.num_sequences
        lengths = batch.lengths
        # The current (e.g. reserved) length when the batch fits it, else a
        # quarter-octave bucket: attention is quadratic in the padding.
        longest = int(lengths.max())
        if longest > self._min["length"]:
            self._min["length"] = fine_bucket(longest)
        t_pad = self._min["length"]
        self._min["seqs"] = n_rows = bucket(n, self._min["seqs"])
        mb = min(self.config.microbatch, n_rows)
        n_rows = -(-n_rows // mb) * mb
        self._min["flat"] = f_pad = bucket(batch.num_tokens, self._min["flat"])
        seq = base.flat_sequence_data(batch, w, n_pad=n_rows, f_pad=f_pad, pad=t_pad)
        tokens = np.zeros((n_rows, t_pad), np.int32)
        for i, tk in enumerate(batch.tokens):
            tokens[i, : tk.shape[0]] = tk
        rows = np.arange(n_rows, dtype=np.int32)
        rows[n:] = -1
        stats = dict(
            num_tokens=int(lengths.sum()),
            computed_tokens=int(n_rows * t_pad),
            padded_length=t_pad,
        )
        return base.Prepared(
            static=DenseStatic(microbatches=n_rows // mb, microbatch=mb, length=t_pad),
            args=(tokens, rows, seq),
            host=DenseHost(lengths=lengths),
            stats=stats,
        )

    def features(self, prepared: base.Prepared) -> base.WorkFeatures:
        """Every padded row runs forward and backward (and, with remat, forward again)
        over its whole length; its attention covers the full padded row."""
        st = prepared.static
        f0, fa = token_flops(self.cfg)
        tokens = float(st.microbatches * st.microbatch * st.length)
        passes = 4.0 if self.config.remat else 3.0
        return base.WorkFeatures(
            lin_flops=passes * tokens * f0,
            attn_flops=passes * tokens * st.length * fa,
            steps=float(st.microbatches),
            tokens=tokens,
            program=self.name,
        )

    def partition_cost(self, batch: RolloutBatch):
        """The dp partition's price of this engine's work (``dtarl.engines.cost``): one
        padded row per sequence at the row length ``prepare`` would pad ``batch`` to
        (the current bucket, grown to the longest sequence; buckets are not changed)."""
        longest = int(batch.lengths.max())
        t = self._min["length"] if longest <= self._min["length"] else fine_bucket(longest)
        return dense_partition_cost(self.cfg, t, passes=4.0 if self.config.remat else 3.0)

    def finish(self, prepared: base.Prepared, out) -> tuple[np.ndarray, ...]:
        logp = np.asarray(out)
        return tuple(logp[i, :ln].copy() for i, ln in enumerate(prepared.host.lengths))

    def compiled_memory(self, params, batch: RolloutBatch, loss, *, weights=None):
        """XLA's memory analysis of the compiled program for this batch's buckets."""
        prepared = self.prepare(batch, loss, weights=weights)
        return (
            self.jit.lower(loss, prepared.static, params, prepared.args).compile().memory_analysis()
        )

    def value_and_grad(self, params, batch: RolloutBatch, loss, *, weights=None):
        return base.run_value_and_grad(self, params, batch, loss, weights)
