"""``engine="auto"``: pick dense, prefix_reuse or dfs per batch with a cost model.

The choice is made on the host: every candidate engine prepares the batch (host
work only: tree, plan, padding to its shape buckets) and reports what its device
program will compute, padding included (``work_flops``, ``work_steps`` in its
stats); a ``CostModel`` (per-engine seconds per FLOP and per step, fitted by
``AutoEngine.calibrate`` from a short timed run; uncalibrated it is
``CostModel.default()``) turns that into predicted seconds. The chosen engine runs
its already-prepared batch; ``AutoEngine`` has the same API and delegates, and its
stats say which engine ran and why. Counting the padded work rather than the
batch's ideal FLOPs is what makes the prediction track the real programs (dense
pads every sequence to a length bucket, dfs pads steps to full chunks and
attends over prefix buckets, prefix_reuse pads suffix rows).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from dtarl.engines import base
from dtarl.engines.batch import RolloutBatch
from dtarl.engines.cost import ENGINES, CostModel, EngineWork, engine_work, fit_cost_model
from dtarl.engines.dense import DenseEngine
from dtarl.engines.dfs import DFSEngine
from dtarl.engines.prefix_reuse import PrefixActivations, PrefixReuseEngine
from dtarl.model.decoder import Decoder
from dtarl.rl.losses import MaskedNLLLoss
from dtarl.tree.trie import build_tree


class _DelegatingJit:
    """The ``JitCache`` face of ``AutoEngine``: compiled programs live in (and are
    shared with) the inner engines' own caches; ``trace_count`` is their sum."""

    def __init__(self, auto: AutoEngine):
        self._auto = auto

    def get(self, loss, static):
        kind, inner = static
        return self._auto.engines[kind].jit.get(loss, inner)

    def __call__(self, loss, static, params, args):
        return self.get(loss, static)(params, *args)

    def lower(self, loss, static, params, args):
        return self.get(loss, static).lower(params, *args)

    @property
    def trace_count(self) -> int:
        return sum(e.jit.trace_count for e in self._auto.engines.values())


@dataclasses.dataclass(eq=False)
class AutoEngine:
    """Delegates each batch to the engine the cost model predicts fastest.

    Args:
      model: the decoder.
      microbatch: dense microbatch and prefix_reuse suffix microbatch (rows).
      chunk_len: the dfs chunk length.
      prefix_activations: prefix_reuse's ``PrefixActivations``.
      cost_model: coefficients (default ``CostModel.default()``; see ``calibrate``).
      candidates: the engines it may pick from (default all three).
      engines: prebuilt engines by name (to share buckets and compiled programs);
        missing ones are built from the arguments above.
    """

    model: Decoder
    microbatch: int = 8
    chunk_len: int = 64
    prefix_activations: PrefixActivations = PrefixActivations.OFFLOAD
    cost_model: CostModel | None = None
    candidates: tuple[str, ...] = ENGINES
    engines: dict | None = None
    name: str = "auto"

    def __post_init__(self):
        bad = [c for c in self.candidates if c not in ENGINES]
        if bad or not self.candidates:
            raise ValueError(f"candidates={self.candidates!r}: each must be one of {ENGINES}")
        self.cost_model = self.cost_model or CostModel.default()
        self.cfg = self.model.cfg
        given = dict(self.engines or {})
        unknown = [k for k in given if k not in ENGINES]
        if unknown:
            raise ValueError(f"engines: unknown names {unknown}; accepted: {ENGINES}")
        build = {
            "dense": lambda: DenseEngine(self.model, microbatch=self.microbatch),
            "prefix_reuse": lambda: PrefixReuseEngine(
                self.model,
                microbatch=self.microbatch,
                prefix_activations=self.prefix_activations,
            ),
            "dfs": lambda: DFSEngine(self.model, chunk_len=self.chunk_len),
        }
        self.engines = {k: given[k] if k in given else build[k]() for k in ENGINES}
        self.jit = _DelegatingJit(self)

    @property
    def trace_count(self) -> int:
        return self.jit.trace_count

    def reserve(self, **per_engine: dict) -> AutoEngine:
        """Pre-sizes each engine's buckets: ``reserve(dense=dict(length=..), dfs=dict(..),
        prefix_reuse=dict(..))`` with each engine's own ``reserve`` keywords."""
        for kind, kw in per_engine.items():
            if kind not in self.engines:
                raise ValueError(f"reserve: unknown engine {kind!r}; accepted: {ENGINES}")
            self.engines[kind].reserve(**kw)
        return self

    # ----------------------------------------------------------------- choice

    def work(self, batch: RolloutBatch) -> dict[str, EngineWork]:
        pr = self.engines["prefix_reuse"]
        return engine_work(
            self.cfg,
            build_tree(batch.tokens),
            microbatch=self.engines["dense"].microbatch,
            suffix_microbatch=pr.microbatch,
            chunk_len=self.engines["dfs"].chunk_len,
            prefix_remat=pr.prefix_activations is PrefixActivations.REMAT,
        )

    def prepared_work(
        self, batch: RolloutBatch, loss=None, *, weights=None
    ) -> tuple[dict[str, EngineWork], dict[str, base.Prepared]]:
        """Each candidate prepares the batch; its padded work and its ``Prepared``."""
        loss = loss if loss is not None else MaskedNLLLoss()
        prepared = {
            k: self.engines[k].prepare(batch, loss, weights=weights) for k in self.candidates
        }
        fallback = None
        work = {}
        for k, prep in prepared.items():
            if "work_flops" in prep.stats:
                work[k] = EngineWork(
                    engine=k,
                    flops=float(prep.stats["work_flops"]),
                    steps=int(prep.stats["work_steps"]),
                )
            else:  # an engine that does not report its padded work: the tree estimate
                fallback = fallback or self.work(batch)
                work[k] = fallback[k]
        return work, prepared

    def choose(
        self, batch: RolloutBatch, loss=None, *, weights=None
    ) -> tuple[str, str, dict[str, float]]:
        """(engine, reason, predicted seconds per engine) for this batch."""
        kind, reason, pred, _ = self._choose(batch, loss, weights)
        return kind, reason, pred

    def _choose(self, batch, loss, weights):
        work, prepared = self.prepared_work(batch, loss, weights=weights)
        pred = {e: self.cost_model.coefs[e].predict(w) for e, w in work.items()}
        best = min(pred, key=lambda e: (pred[e], ENGINES.index(e)))
        dense = work.get("dense")
        ratio = ""
        if dense is not None:
            ratio = ", ".join(
                f"{e} {dense.flops / w.flops:.2f}x fewer FLOPs"
                for e, w in work.items()
                if e != "dense"
            )
        others = ", ".join(f"{e} {pred[e] * 1e3:.3g} ms" for e in pred if e != best)
        reason = (
            f"{best}: predicted {pred[best] * 1e3:.3g} ms (vs {others or 'no other candidate'}); "
            f"{ratio or 'no dense baseline'}; steps "
            + ", ".join(f"{e}={w.steps}" for e, w in work.items())
        )
        return best, reason, pred, prepared

    # --------------------------------------------------------- engine contract

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> base.Prepared:
        kind, reason, pred, prepared = self._choose(batch, loss, weights)
        inner = prepared[kind]
        stats = dict(
            inner.stats,
            chosen_engine=kind,
            choice_reason=reason,
            predicted_seconds=pred,
        )
        return base.Prepared(
            static=(kind, inner.static), args=inner.args, host=(kind, inner), stats=stats
        )

    def device_fn(self, loss, static):
        kind, inner = static
        return self.engines[kind].device_fn(loss, inner)

    def finish(self, prepared: base.Prepared, out) -> tuple[np.ndarray, ...]:
        kind, inner = prepared.host
        return self.engines[kind].finish(inner, out)

    def value_and_grad(self, params, batch: RolloutBatch, loss, *, weights=None):
        return base.run_value_and_grad(self, params, batch, loss, weights)

    # ------------------------------------------------------------ calibration

    def calibrate(
        self, params, batches: Sequence[RolloutBatch], loss, *, repeats: int = 2
    ) -> CostModel:
        """Times every candidate on ``batches`` (after one warm-up call each, so
        compilation is excluded) and refits ``self.cost_model``; returns it."""
        samples = []
        for batch in batches:
            work, prepared_by_kind = self.prepared_work(batch, loss)
            for kind in self.candidates:
                engine = self.engines[kind]
                prepared = prepared_by_kind[kind]
                fn = engine.jit.get(loss, prepared.static)
                jax.block_until_ready(fn(params, *prepared.args))
                best = float("inf")
                for _ in range(max(repeats, 1)):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(params, *prepared.args))
                    best = min(best, time.perf_counter() - t0)
                samples.append((kind, work[kind], best))
        self.cost_model = fit_cost_model(samples, self.cost_model)
        self.calibration_samples = samples
        return self.cost_model


__all__ = ["AutoEngine"]
