"""``engine="auto"``: pick dense, prefix_reuse or dfs per batch: a cost model, then
measurements per compiled program (autotuning).

The choice is made on the host: every candidate engine prepares the batch (host
work only: tree, plan, padding to its shape buckets) and reports what its device
program will compute, padding included (``engine.features(prepared)``: FLOPs
and sequential steps); a ``CostModel`` (per-engine seconds per FLOP and per step, fitted by
``AutoEngine.calibrate`` from a short timed run; uncalibrated it is
``CostModel.default()``) turns that into predicted seconds. Counting the padded
work rather than the batch's ideal FLOPs is what makes the prediction track the
real programs (dense pads every sequence to a length bucket, dfs pads steps to
full chunks and attends over prefix buckets, prefix_reuse pads suffix rows).

A linear model fitted on a few batches still picked an engine 13-25% slower than
the best on some shapes (small batches, unshared sequences, GRPO G=4 in
``dtarl bench train``), so ``value_and_grad`` also autotunes, like
XLA's autotuner, per compiled program. A program is fixed by
``(engine, prepared.static, loss)`` (its shape bucket). Every candidate whose
estimate is within ``tune_margin`` times the best estimate and whose program has
not been timed yet is timed on this batch, side by side with the candidates in
margin whose programs were timed before (``timer``, default ``time_programs``:
one warm-up call each, which compiles, then interleaved rounds; each time is the
median of at least ``tune_repeats`` calls). What is timed is a whole training
step with that engine (its ``value_and_grad``: host prepare, device program,
finish), since on small batches the host work decides. Interleaving matters
because two engines are often within a few percent of each other while the
machine drifts by more than that between consecutive timings. The measurements
and the predictions for that batch are kept, and from then on a batch whose
candidate has a timed program gets the estimate

    estimate = predicted * measured_then / predicted_then        (per-bucket correction)

(predicted_then: the current model's prediction of the timed batch's work, so a
refit of the model keeps the timed buckets' estimates), and the others keep the
cost model's prediction of the device program plus the host prepare time of
this batch (measured). The margin is checked again
after every timing round, so the pick in ``value_and_grad`` is always a measured
program. Tuning happens once per bucket; later batches in the same buckets are
neither timed nor recompiled. ``prepare`` (what the sharded runner calls) uses the
corrected estimates but never times. The chosen engine runs its already-prepared
batch; ``AutoEngine`` has the same API and delegates, and its stats say which
engine ran, why (``choice_basis``: "measured", "reused", "cached" or "predicted",
``choice_reason``), and how long this batch's tuning took (``autotune_seconds``,
0 when none).

In a run (after ``reserve``), the candidates' programs are fixed (one per engine and
loss), so the first batch of each loss times all of them within the wider
``reserve_margin`` (the others are never compiled), and compiles ahead of time the
ones it does not time (tuning budget spent; after a cached choice only the engines
the cache file names for that loss). A later batch
whose signature is new may pick another engine among the compiled programs (the
cost model's pick, corrected by what was timed), but it never compiles or tunes.
The signature that ``reuse_choices`` compares is bucketed (depth included),
``budget_seconds`` bounds the tuning, and
``cache_path`` carries measured choices over to the next run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from dtarl.batch import RolloutBatch
from dtarl.engines import base
from dtarl.engines.autotune import ChoiceCache, Timer, Timing
from dtarl.engines.config import AutoConfig, Capacity, EngineConfig, EngineKind, configured
from dtarl.engines.cost import CostModel, fit_cost_model
from dtarl.engines.dense import DenseEngine
from dtarl.engines.dfs import DFSEngine
from dtarl.engines.prefix_reuse import PrefixReuseEngine
from dtarl.losses import MaskedNLLLoss
from dtarl.model.decoder import Decoder
from dtarl.timing import time_program, time_programs
from dtarl.tree.plan import bucket, fine_bucket


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Choice:
    kind: str
    reason: str
    basis: str  # "measured" | "predicted" | "reused" (a measured choice, same signature)
    predicted: dict[str, float]  # the cost model's
    estimated: dict[str, float]  # after the per-bucket corrections
    measured: dict[str, float]  # seconds of the candidates whose program was timed
    timed_now: tuple[str, ...]
    tune_seconds: float
    prepared: dict[str, base.Prepared]


class AutoStatic(NamedTuple):
    kind: str  # the engine that runs
    inner: Any  # its static


class AutoHost(NamedTuple):
    kind: str
    inner: base.Prepared  # the batch as that engine prepared it


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


class AutoEngine:
    """Delegates each batch to the engine predicted (and, with ``autotune``, measured)
    fastest.

    Args:
      model: the decoder.
      config: ``AutoConfig`` (or its fields as keywords): the settings below.
      engine_config: ``EngineConfig`` whose dense / dfs / prefix_reuse settings
        build the candidates (default ``EngineConfig()``).
      engines: prebuilt engines by name (to share buckets and compiled programs);
        missing ones are built from ``engine_config``. Their ``temperature`` must
        be auto's.
      cost_model: coefficients (default ``CostModel.default()``; see ``calibrate``).
      timer: ``timer({kind: run}) -> {kind: seconds}``, where each ``run()`` is one
        whole step with that engine on the batch; default ``time_programs`` (side
        by side) with ``tune_repeats``. Tests inject fixed times here.
      host_seconds: ``host_seconds(kind, batch) -> seconds`` of host preparation
        added to each candidate's estimate; default: the seconds its ``prepare``
        took on this batch, measured. Tests inject fixed costs here, so that no
        choice they check depends on this machine's speed.
      temperature: logprobs of logits / T in every candidate
        (``base.logprob_temperature``; default 1.0).

    Settings (``AutoConfig``):
      candidates: the engines it may pick from (default all three).
      autotune: time the programs of the candidates within ``tune_margin`` of the
        best estimate, once per shape bucket, in ``value_and_grad`` (module docstring).
      tune_margin: a candidate is timed when its estimate is at most this many times
        the best estimate (>= 1; 1 times only the predicted best).
      tune_all_below: when the best estimate is at most this many seconds, every
        candidate is timed, whatever its estimate: small batches are where host
        work and fixed costs decide and a FLOP model is least reliable (a fitted
        per-step term of 18-64 ms made dense look 3x slower than prefix_reuse on
        a batch where it was 15% faster), and their programs are cheap to time.
      reserve_margin: after ``reserve``, the first batch of a loss times every
        candidate whose estimate is within this many times the best estimate (all of
        them when the best is under ``tune_all_below``); the others are neither
        timed nor compiled, and no later batch of the run picks them (later picks
        are among the compiled programs). Wider than ``tune_margin`` because no
        later batch tunes; it spares a candidate the cost model puts far behind
        (e.g. a program padded to the reserve's capacity) its compile and its
        timing rounds. None: every candidate (compiled, and timed within the budget).
      prefer_dense_within: a tree engine whose measured step (timed side by side with
        dense's) is faster than dense's by at most this fraction is not picked: dense
        is (``choice_reason`` says so). Such a gain is within the timing noise, and a
        tree engine's program costs several times dense's to compile and to read
        back from the compile cache (e.g. 1.55 s for dfs in a warm 200-step run of
        the stalls config whose steps take 0.12 s). 0: the measured fastest.
      tune_repeats: timed calls per program after its warm-up (the median counts).
      reuse_choices: in ``value_and_grad``, a batch with the same signature as an
        earlier batch whose pick was measured (same loss; same buckets of sequences,
        tokens, tree tokens, longest path and leaves; same depth) is given to that
        engine directly, and only that engine prepares it, provided its program is
        one already timed (otherwise the full choice runs). This removes the other
        candidates' host work (about 1 ms a step) from steady-state training.
      recheck_every: with ``reuse_choices``, every this many batches of one
        signature go through the full choice again (every candidate prepares; the
        timed buckets' corrected estimates decide; a new bucket in margin is
        timed), so batches that share a signature but not a best engine are caught;
        0 never re-checks.
      budget_seconds: the most seconds of tuning (timing rounds, whose first calls
        compile) this engine spends in all; checked before each round, so one round
        may overrun it. Once spent, batches whose candidates in margin were not
        timed go to the cost model's pick (corrected by the buckets already timed),
        with ``choice_basis`` "predicted (autotune budget spent)". None: no bound.
      cache_path: a JSON file of measured choices (``ChoiceCache``), keyed by the
        model's and engines' configs, the device kind and the batch signature: a
        run (with ``autotune`` and ``reuse_choices``) reads the choices of earlier
        runs (``choice_basis`` "cached": only that engine prepares, nothing is timed
        or re-checked) and writes its own. None (the default): no file.
    """

    def __init__(
        self,
        model: Decoder,
        config: AutoConfig | None = None,
        /,
        *,
        engine_config: EngineConfig | None = None,
        engines: dict | None = None,
        cost_model: CostModel | None = None,
        timer: Timer | None = None,
        host_seconds: Callable[[str, RolloutBatch], float] | None = None,
        name: str = "auto",
        temperature: float = 1.0,
        **settings,
    ):
        self.model = model
        self.config = configured(AutoConfig, config, settings)
        self.temperature = base.logprob_temperature(temperature)
        self.engine_config = engine_config or EngineConfig()
        self.cost_model = cost_model or CostModel.default()
        self.timer = timer
        self.host_seconds = host_seconds
        self.name = name
        self.cfg = model.cfg
        given = dict(engines or {})
        names = [k.value for k in EngineKind.auto_candidates()]
        unknown = [k for k in given if k not in names]
        if unknown:
            raise ValueError(f"engines: unknown names {unknown}; accepted: {names}")
        for k, e in given.items():
            if getattr(e, "temperature", 1.0) != self.temperature:
                raise ValueError(
                    f"engines[{k!r}].temperature={getattr(e, 'temperature', 1.0)!r} differs "
                    f"from auto's temperature={self.temperature!r}; build them with the same"
                )
        ec, t = self.engine_config, self.temperature
        build = {
            "dense": lambda: DenseEngine(model, ec.dense, temperature=t),
            "prefix_reuse": lambda: PrefixReuseEngine(model, ec.prefix_reuse, temperature=t),
            "dfs": lambda: DFSEngine(model, ec.dfs, temperature=t),
        }
        self.engines = {k: given[k] if k in given else build[k]() for k in names}
        self.jit = _DelegatingJit(self)
        # (kind, inner static, loss) -> Timing: the autotuning table.
        self.timings: dict[tuple, Timing] = {}
        # batch signature -> the engine a measured choice picked for it.
        self.choices: dict[tuple, str] = {}
        self._reused: dict[tuple, int] = {}  # signature -> batches given the reused pick
        # Signatures deeper than this count as this deep (``reserve`` sets it).
        self._depth_cap: int | None = None
        self.reserved = False  # ``reserve`` was called: each candidate's programs are fixed
        # (kind, inner static, loss) of every program compiled through auto (timed, run,
        # or compiled ahead of time by ``value_and_grad``'s first batch of a loss).
        self.compiled: set[tuple] = set()
        self._warm_losses: list = []  # losses whose candidates are all compiled (reserved)
        # loss -> the candidates its first reserved batch left out (``reserve_margin``).
        self._skipped: dict[Any, list[str]] = {}
        self.tune_seconds_total = 0.0  # all tuning so far (``budget_seconds`` bounds it)
        self.cache = ChoiceCache(self.config.cache_path, self._cache_scope())

    @property
    def candidates(self) -> tuple[str, ...]:
        return self.config.candidates

    @property
    def trace_count(self) -> int:
        return self.jit.trace_count

    def reserve(self, capacity: Capacity) -> AutoEngine:
        """Grows every candidate's buckets to ``capacity``, as if each ran alone (the
        programs auto times and runs are the candidates' own).

        From then on every candidate has one program per loss for all batches within
        ``capacity``, so the first ``value_and_grad`` of each loss times every
        candidate (within ``budget_seconds``; ``tune_margin`` is ignored for it) and
        compiles ahead of time, without running, the ones it does not time (budget
        spent, ``autotune`` off; after a cached choice, the ones the cache names for
        the loss, and later picks are made among the compiled programs): no later
        batch, whatever its signature and pick, compiles or tunes anything."""
        for engine in self.engines.values():
            engine.reserve(capacity)
        self.reserved = True
        # Depths within the capacity's range share a signature: the candidates'
        # programs are reserved for all of them (the depth a run's trees reach with
        # forks in the responses and tool turns varies from batch to batch).
        self._depth_cap = max(self._depth_cap or 0, bucket(1 + 2 * capacity.turns))
        return self

    def _cache_scope(self) -> str:
        """What a cached choice is valid for besides its signature: the model's and the
        engines' configs and the device kind."""
        dev = jax.devices()[0]
        key = repr((self.cfg, [(k, e.config) for k, e in self.engines.items()], self.candidates))
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return f"{digest}|{dev.platform}:{dev.device_kind}x{jax.device_count()}"

    # ----------------------------------------------------------------- choice

    def prepared_work(
        self, batch: RolloutBatch, loss=None, *, weights=None
    ) -> tuple[dict[str, base.WorkFeatures], dict[str, base.Prepared]]:
        """Each candidate prepares the batch; its padded work and its ``Prepared``."""
        loss = loss if loss is not None else MaskedNLLLoss()
        batch.prefix_tree()  # built once, before the candidates' prepare is timed
        prepared = {}
        for k in self.candidates:
            t0 = time.perf_counter()
            prepared[k] = self.engines[k].prepare(batch, loss, weights=weights)
            measured = time.perf_counter() - t0
            prepared[k].stats["prepare_seconds"] = (
                measured if self.host_seconds is None else float(self.host_seconds(k, batch))
            )
        work = {k: self.engines[k].features(prep) for k, prep in prepared.items()}
        return work, prepared

    def choose(
        self, batch: RolloutBatch, loss=None, *, weights=None
    ) -> tuple[str, str, dict[str, float]]:
        """(engine, reason, estimated seconds per engine) for this batch, without
        timing anything: the cost model's prediction, corrected per bucket by the
        programs already timed."""
        c = self._choose(batch, loss, weights)
        return c.kind, c.reason, c.estimated

    def _estimate(self, kind: str, key: tuple, pred: float) -> float:
        t = self.timings.get(key)
        if t is None:
            return pred
        # The correction is taken against the current model, so it survives a refit.
        then = self.cost_model.coefs[kind].predict(t.work)
        return t.measured if then <= 0 else pred * (t.measured / then)

    def signature(self, batch: RolloutBatch, loss) -> tuple:
        """What ``reuse_choices`` compares: the loss and the batch's size buckets. The
        depth is bucketed too (powers of two), and after ``reserve`` every depth past
        the capacity's ``1 + 2 * turns`` counts as that: a fork in the responses
        adds a level without changing the reserved programs."""
        st = batch.prefix_tree().stats
        depth = bucket(st.depth)
        if self._depth_cap is not None:
            depth = min(depth, self._depth_cap)
        return (
            loss,
            bucket(st.num_sequences),
            fine_bucket(st.num_tokens),
            fine_bucket(st.tree_tokens),
            bucket(st.longest_path),
            bucket(st.num_leaves),
            depth,
        )

    @property
    def budget_spent(self) -> bool:
        """Whether ``budget_seconds`` of tuning have been spent (never without one)."""
        budget = self.config.budget_seconds
        return budget is not None and self.tune_seconds_total >= budget

    def _reuse(self, batch, loss, weights) -> _Choice | None:
        """The remembered measured choice for this batch's signature, if its engine's
        program for this batch is one already timed."""
        sig = self.signature(batch, loss)
        kind = self.choices.get(sig)
        if kind is None:
            return self._cached(sig, batch, loss, weights)
        self._reused[sig] = n = self._reused.get(sig, 0) + 1
        if self.config.recheck_every and n % self.config.recheck_every == 0:
            return None  # the full choice, from the candidates' corrected estimates
        prep = self.engines[kind].prepare(batch, loss, weights=weights)
        timing = self.timings.get((kind, prep.static, loss))
        if timing is None:  # a bucket grew: choose afresh
            return None
        return _Choice(
            kind=kind,
            reason=f"{kind}: measured {timing.measured * 1e3:.3g} ms on a batch with the "
            "same signature (reused choice; the other candidates did not prepare)",
            basis="reused",
            predicted={},
            estimated={},
            measured={kind: timing.measured},
            timed_now=(),
            tune_seconds=0.0,
            prepared={kind: prep},
        )

    def _cached(self, sig, batch, loss, weights) -> _Choice | None:
        """The choice the cache file holds for this signature (a measured choice of an
        earlier run on the same model, engines and device), if any: only that engine
        prepares; nothing is timed, and it is not re-checked."""
        entry = self.cache.get(sig)
        if entry is None:
            return None
        kind = entry["kind"]
        if kind not in self.candidates:
            return None
        prep = self.engines[kind].prepare(batch, loss, weights=weights)
        seconds = float(entry.get("measured_seconds", float("nan")))
        return _Choice(
            kind=kind,
            reason=f"{kind}: measured {seconds * 1e3:.3g} ms on a batch with the same "
            f"signature in an earlier run (cache {self.cache.path})",
            basis="cached",
            predicted={},
            estimated={},
            measured={},
            timed_now=(),
            tune_seconds=0.0,
            prepared={kind: prep},
        )

    def _choose(self, batch, loss, weights, params=None) -> _Choice:
        """The choice; with ``params`` (and ``autotune``) it times the programs in margin."""
        loss = loss if loss is not None else MaskedNLLLoss()
        tune = self.config.autotune and params is not None
        if tune and self.config.reuse_choices:
            reused = self._reuse(batch, loss, weights)
            if reused is not None:
                return reused
        work, prepared = self.prepared_work(batch, loss, weights=weights)
        pred = {e: self.cost_model.coefs[e].predict(w) for e, w in work.items()}
        keys = {e: (e, prepared[e].static, loss) for e in work}
        timed_now: list[str] = []
        over_budget = False
        # After ``reserve`` only the first batch of a loss tunes: its programs are the
        # run's. A later batch whose candidates were not timed (the first batch took a
        # cached choice, or a bucket outgrew the reserve) gets the cost model's pick,
        # corrected by what was timed, and is not timed mid-run.
        settled = self.reserved and loss in self._warm_losses
        first = self._first_of(loss)
        t0 = time.perf_counter()
        # A step is host work (prepare, finish) plus the device program. A timed
        # candidate was timed a whole step at a time, so its (bucket-corrected)
        # estimate is a step's; an untimed one's estimate is the device program's,
        # to which its prepare time, measured above, is added.
        host = {e: float(prepared[e].stats.get("prepare_seconds", 0.0)) for e in work}
        # A settled batch picks among the programs already compiled (every candidate
        # unless the first batch took a cached choice: then the ones the cache names).
        pool = [e for e in work if keys[e] in self.compiled] if settled else []
        pool = pool or list(work)
        while True:
            est = {e: self._estimate(e, keys[e], pred[e]) for e in work}
            total = {e: est[e] + (0.0 if keys[e] in self.timings else host[e]) for e in work}
            best = min(
                pool, key=lambda e: (total[e], EngineKind.auto_candidates().index(EngineKind(e)))
            )
            # Time every candidate on a small batch (host work and fixed costs decide).
            # On the first batch of a loss after ``reserve`` (its programs are the run's
            # only ones for that loss: timed now, no later batch tunes) the margin is
            # ``reserve_margin``: a candidate predicted further off is neither timed nor
            # compiled, and no later batch of the run picks it.
            cheap = total[best] <= self.config.tune_all_below
            margin = self.config.tune_margin
            if first:
                cheap = cheap or self.config.reserve_margin is None
                margin = self.config.reserve_margin or margin
            in_margin = [e for e in work if cheap or total[e] <= margin * total[best]]
            todo = [e for e in in_margin if keys[e] not in self.timings]
            if not tune or settled or not todo:
                break
            if self.budget_spent:  # checked before each round: one round may overrun it
                over_budget = True
                break
            # The new programs are timed side by side with the programs in margin
            # that were timed before (those are timed again, on this batch), so that
            # a close pick compares samples from one stretch of the machine's time.
            t_round = time.perf_counter()
            seconds = self._time(in_margin, batch, loss, weights, params)
            self.tune_seconds_total += time.perf_counter() - t_round
            for e in in_margin:
                self.timings[keys[e]] = Timing(
                    measured=float(seconds[e]), predicted=pred[e], work=work[e]
                )
                self.compiled.add(keys[e])
                if e not in timed_now:
                    timed_now.append(e)
        best, tie_note = self._prefer_dense(best, pool, keys, total)
        tune_s = time.perf_counter() - t0 if timed_now else 0.0
        if first and params is not None:  # what ``_compile_rest`` leaves out
            self._skipped[loss] = sorted(
                e for e in work if e not in in_margin and keys[e] not in self.timings
            )
        measured = {e: self.timings[keys[e]].measured for e in work if keys[e] in self.timings}
        basis = "measured" if best in measured else "predicted"
        budget_note = ""
        if over_budget and basis == "predicted":
            basis = "predicted (autotune budget spent)"
            budget_note = (
                f"; autotune budget of {self.config.budget_seconds:g} s spent "
                f"({self.tune_seconds_total:.3g} s): cost-model prediction"
            )
        if tune and basis == "measured":
            sig = self.signature(batch, loss)
            if self.config.reuse_choices:
                self.choices[sig] = best
            self.cache.put(sig, best, measured[best])
        return _Choice(
            kind=best,
            reason=self._reason(best, work, pred, est, measured, timed_now)
            + budget_note
            + tie_note
            + "; host prepare "
            + ", ".join(f"{e} {host[e] * 1e3:.2g} ms" for e in work),
            basis=basis,
            predicted=pred,
            estimated=est,
            measured=measured,
            timed_now=tuple(timed_now),
            tune_seconds=tune_s,
            prepared=prepared,
        )

    def _prefer_dense(self, best, pool, keys, total) -> tuple[str, str]:
        """(pick, note): dense instead of ``best`` when both were timed and dense's step is
        within ``prefer_dense_within`` of it. A gain that small is within the timing
        noise of a step (interleaved medians still move by a few percent), while a tree
        engine's program is several times dense's to compile and, in a warm run, to
        read back from the compile cache."""
        tol = self.config.prefer_dense_within
        if (
            best == "dense"
            or "dense" not in pool
            or keys[best] not in self.timings
            or keys["dense"] not in self.timings
            or total["dense"] > (1.0 + tol) * total[best]
        ):
            return best, ""
        gain = 1.0 - total[best] / total["dense"] if total["dense"] > 0 else 0.0
        return "dense", (
            f"; {best} measured {gain:.1%} faster, within prefer_dense_within={tol:g}: dense"
        )

    def _time(self, kinds, batch, loss, weights, params) -> dict[str, float]:
        """Seconds of a whole step (prepare, device program, finish: what a training
        step with that engine costs) of each engine in ``kinds`` on ``batch``,
        timed side by side. The programs are the ones just prepared (same buckets)."""
        runs = {}
        for kind in kinds:
            engine = self.engines[kind]
            runs[kind] = lambda engine=engine: engine.value_and_grad(
                params, batch, loss, weights=weights
            )[1]
        timer = self.timer or (lambda r: time_programs(r, repeats=self.config.tune_repeats))
        return timer(runs)

    def _reason(self, best, work, pred, est, measured, timed_now) -> str:
        """``"<pick>: <basis> <ms> (vs <others>); <FLOP ratios>; steps ..."``, where a
        basis is "predicted" (cost model), "measured" (timed on this batch) or
        "bucket-measured xF" (the prediction times F, its bucket's measured/predicted)."""

        def how(e):
            if e in timed_now:
                return "measured"
            if e in measured:
                return f"bucket-measured x{est[e] / pred[e]:.2f}" if pred[e] > 0 else "measured"
            return "predicted"

        others = ", ".join(f"{e} {how(e)} {est[e] * 1e3:.3g} ms" for e in est if e != best)
        dense = work.get("dense")
        ratio = ""
        if dense is not None:
            ratio = ", ".join(
                f"{e} {dense.flops / w.flops:.2f}x fewer FLOPs"
                for e, w in work.items()
                if e != "dense"
            )
        return (
            f"{best}: {how(best)} {est[best] * 1e3:.3g} ms (vs {others or 'no other candidate'}); "
            f"{ratio or 'no dense baseline'}; steps "
            + ", ".join(f"{e}={w.total_steps:.0f}" for e, w in work.items())
        )

    def _prepared(self, c: _Choice) -> base.Prepared:
        return self.delegated(
            c.kind,
            c.prepared[c.kind],
            choice_reason=c.reason,
            choice_basis=c.basis,
            predicted_seconds=c.predicted,
            estimated_seconds=c.estimated,
            measured_seconds=c.measured,
            autotuned=list(c.timed_now),
            autotune_seconds=c.tune_seconds,
        )

    def delegated(self, kind: str, inner: base.Prepared, **stats) -> base.Prepared:
        """``inner`` (a batch prepared by ``self.engines[kind]``) as auto's own
        ``Prepared``: it runs that engine's program and is finished by it."""
        return base.Prepared(
            static=AutoStatic(kind=kind, inner=inner.static),
            args=inner.args,
            host=AutoHost(kind=kind, inner=inner),
            stats=dict(inner.stats, chosen_engine=kind, **stats),
        )

    def shard_choice(self, batch: RolloutBatch, loss, *, weights=None) -> str:
        """The engine every dp rank of a sharded run uses (``ShardedEngine`` asks):
        the pick for the whole batch from the corrected estimates, never timed. One
        engine for all ranks keeps one program on the mesh."""
        return self._choose(batch, loss, weights).kind

    # --------------------------------------------------------- engine contract

    def prepare(self, batch: RolloutBatch, loss, *, weights=None) -> base.Prepared:
        """The engine picked from the corrected estimates (never times anything)."""
        return self._prepared(self._choose(batch, loss, weights))

    def device_fn(self, loss, static):
        kind, inner = static
        return self.engines[kind].device_fn(loss, inner)

    def finish(self, prepared: base.Prepared, out) -> tuple[np.ndarray, ...]:
        kind, inner = prepared.host
        return self.engines[kind].finish(inner, out)

    def features(self, prepared: base.Prepared) -> base.WorkFeatures:
        """The work of the engine that runs."""
        kind, inner = prepared.host
        return self.engines[kind].features(inner)

    def loss_fn(self, loss, *, has_aux: bool = False):
        """The picked engine's loss as a ``jax.custom_vjp`` function (``TreeLoss``)."""
        return base.BucketState.loss_fn(self, loss, has_aux=has_aux)

    def value_and_grad(self, params, batch: RolloutBatch, loss, *, weights=None):
        """Prepares every candidate, autotunes the new buckets in margin, runs the pick.

        ``host_seconds`` in the stats excludes the tuning (``autotune_seconds``)."""
        t0 = time.perf_counter()
        choice = self._choose(batch, loss, weights, params=params)
        host_s = time.perf_counter() - t0 - choice.tune_seconds
        prepared = self._prepared(choice)
        if self._first_of(loss):
            prepared.stats.update(self._compile_rest(choice, params, batch, loss, weights))
        self.compiled.add((choice.kind, choice.prepared[choice.kind].static, loss))
        return base.run_prepared(self, params, prepared, loss, host_seconds=host_s)

    def _first_of(self, loss) -> bool:
        """Whether this is the first batch of ``loss`` since ``reserve``."""
        return self.reserved and loss not in self._warm_losses

    def _compile_rest(self, choice: _Choice, params, batch, loss, weights) -> dict[str, Any]:
        """After ``reserve``, on the first batch of ``loss``: compiles ahead of time
        (lowered and compiled, not run) every candidate's program that is neither
        timed nor the pick, so that a later batch picking it compiles nothing. After
        a cached choice only the engines the cache names for ``loss`` (what a later
        cached signature may pick; a signature the cache lacks picks among the
        compiled programs): a warm run whose cached choices are all one engine
        builds nothing else; never the candidates out of ``reserve_margin``. Returns
        the stats ``warmup_compiled`` (those engines), ``warmup_skipped`` (the ones
        left out by ``reserve_margin``) and ``warmup_compile_seconds``."""
        t0 = time.perf_counter()
        done = []
        skipped = self._skipped.get(loss, [])
        wanted = self.cache.kinds(loss) if choice.basis == "cached" else set(self.candidates)
        wanted -= set(skipped)
        for kind in self.candidates:
            if kind == choice.kind or kind not in wanted:
                continue  # the pick is compiled when it runs
            prep = choice.prepared.get(kind)
            if prep is None:  # a reused or cached choice: only the pick prepared
                prep = self.engines[kind].prepare(batch, loss, weights=weights)
            key = (kind, prep.static, loss)
            if key in self.compiled:
                continue
            self.engines[kind].jit.lower(loss, prep.static, params, prep.args).compile()
            self.compiled.add(key)
            done.append(kind)
        self._warm_losses.append(loss)
        return dict(
            warmup_compiled=done,
            warmup_skipped=list(skipped),
            warmup_compile_seconds=time.perf_counter() - t0,
        )

    # ------------------------------------------------------------ calibration

    def calibrate(
        self, params, batches: Sequence[RolloutBatch], loss, *, repeats: int = 2
    ) -> CostModel:
        """Times every candidate on ``batches``, side by side per batch (after one
        warm-up call each, so compilation is excluded), and refits
        ``self.cost_model``; returns it."""
        samples = []
        for batch in batches:
            work, prepared = self.prepared_work(batch, loss)
            runs = {}
            for kind, p in prepared.items():
                fn = self.engines[kind].jit.get(loss, p.static)
                runs[kind] = lambda fn=fn, p=p: fn(params, *p.args)
            seconds = time_programs(runs, repeats=repeats)
            samples += [(kind, work[kind], seconds[kind]) for kind in prepared]
        self.cost_model = fit_cost_model(samples, self.cost_model)
        self.calibration_samples = samples
        return self.cost_model


__all__ = ["AutoEngine", "ChoiceCache", "Timing", "time_program", "time_programs"]
