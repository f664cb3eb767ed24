"""PAT: adaptive tensor parallelism during generation (papers/003 §4.2-4.3).

The rollout engine (``dtarl.rollout.engine``) decodes on a ('dp', 'tp') mesh of D
devices; ``RolloutEngine.reshard`` changes the mesh shape (and compacts the live
requests into fewer slots) between two decode calls. This module decides *when*
and *to what*:

* **Profile** (``dtarl.bench.pat_profile.profile_engine``; ``dtarl bench rollout
  --profile OUT.json``; the JSON format and its checks are ``Profile`` here): the
  engine's own decode programs for one engine config, for each TP in {1, 2, 4, 8}
  that divides the kv heads and D: B = slots per DP group on the levels the
  engine's slot merge reaches, L = the response window of the call (R/4, R/2, R);
  per point one prefill then R forced decode steps on dummy tokens, the fastest
  per-step seconds over the full calls that compiled nothing (background load only
  adds time; their median and coefficient of variation, ``cv``, are kept) and one
  factor for all points, ``decode_scale``: the median over every timed step of its
  seconds over its point's fastest (how much slower a typical call runs); the
  prefill's seconds; one call of each of the engine's prefill and extend programs per
  length bucket (``kv_calls``: what a recompute switch runs); the weight-reshard and
  K/V-move bandwidths (``jax.device_put`` between the shardings of two meshes); the
  seconds of one point's compiles. The JSON records the model, the engine config,
  the device kind, the jax version and the mesh axes (``Profile.save`` /
  ``Profile.load``).
* **Predictor** (``Predictor``): per-step latency ``l(B, T; tp)`` with T the
  aggregate context tokens *per DP group*: piecewise linear in T for every
  profiled B (below the smallest profiled T its value; above the largest T the last
  segment's slope when positive, else flat), interpolated linearly between the two
  nearest profiled B (below the smallest B: the smallest B's curve; above the
  largest: extended with the two largest B's slope when positive, else flat). Each
  neighbour's curve is read at the same context *per request* (T B' / B for a
  neighbour B'), not at the same T: a B' level was profiled over the T range its
  own requests reach, so at a larger B's T a smaller level would be read far past
  its last point, on its last segment's noise (an 82% held-out error on one CPU
  profile; 5.5% against 7.4% mean over seven profiles). Latency is taken never to
  fall with more tokens or a larger batch outside the grid, so a noisy negative
  slope is not extrapolated. The curves are the fastest
  steps times ``decode_scale``: per point the fastest is the least noisy statistic
  (a point's median moved 7-20% between profiles on the 2-core CPU), and the one
  pooled factor turns it into a typical call's seconds (the fastest alone
  under-predicted every static run, by 6-19%). ``est_rem_time`` sums it
  over the remaining steps as the context grows (Alg. 1's ``est_rem_time``).
  ``leave_one_out`` reports the error on held-out points inside the grid (between
  windows of one B; between B levels).
* **Switch cost** (``switch_cost``): weight bytes / reshard bandwidth +
  min(T_move, T_recomp) + a compile when the target program is not cached.
  T_move is Eq. 1-2 (valid K/V bytes per source rank / per-rank bandwidth).
  T_recomp is what the engine's recompute runs (``Predictor.recompute_seconds``):
  the prefill calls over the resident prompts and the extend calls over every
  request holding a slot, chunked and padded as the engine does
  (``dtarl.rollout.engine.recompute_calls``, the one list the engine runs too), each
  priced at its bucket from the profile's ``kv_calls``, plus the recompute's fixed
  part (old pool freed, empty one created). A profile made before those
  were timed (no ``kv_calls``) falls back to the paper's Eq. 3-4 (one profiled
  prefill of ceil(n / dp) prompts at the RMS context length). A switch that keeps
  the TP (compaction into fewer slots) has no weight term.
* **Controller** (``PatController``; Alg. 1): every ``check_every`` decode calls,
  when no request waits, it compares the predicted remaining time now with the
  remaining time + switch cost of every candidate TP (the live requests merged
  into the fewest slots the target DP spreads evenly; the current TP counts too,
  compacted into fewer slots without moving the weights) and switches to the best
  one when it is lower. It can switch several times per generation, records a
  timeline, and plugs in as the engine's ``on_call`` hook.

*What B and T mean on this engine.* A decode program computes every slot and
reads padded K/V: the prompt part of the cascade (Q prompt rows x M members x P
rows) and every slot's response rows up to the call's window. So its cost depends
on the program's shape, not on how many slots are still active: the controller
predicts with B = slots / dp and T = (Q M P + slots x window) / dp, the rows one DP
group's program reads per step, and the profile times exactly these programs (T
of a profiled point is defined the same way), so a generation's call lands on a
profiled (B, T) point or between two. Profile the engine config the run uses: a
profile of other shapes is interpolated and extrapolated from programs the run
never executes. The *paper's* B and T (active requests and their summed contexts,
``stats()['active_per_step']`` / ``['context_per_step']``) are what ``replay``
feeds a saved profile, to predict the gain on an engine whose step cost follows
the active batch (e.g. a GPU server); that is a prediction and is labelled so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.rollout.engine import decode_windows, merged_slots, recompute_calls

FORMAT = "dtarl.pat.profile/1"
TP_DEGREES = (1, 2, 4, 8)
CALL_KINDS = ("prefill", "extend", "pool")
# The engine config fields the recompute's call list needs (``kv_calls``).
_CALL_CONFIG = ("prefill_batch", "extend_batch", "prompt_len", "response_len")


class PatError(ValueError):
    """Bad PAT input (profile, candidates, state); the message names the field."""


# ----------------------------------------------------------------------------- profile


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """An offline profile (module docstring). ``decode``/``prefill``: rows
    ``{"tp", "b", "l", "t", "seconds"}`` (decode: seconds per step; prefill: seconds
    of the first scheduling round's prefill; b per DP group; t = the tokens one DP
    group reads per step). ``kv_calls`` (optional; empty in profiles made before it):
    rows ``{"kind", "tp", "l", "seconds"}``, the seconds of ONE of the engine's
    prefill or extend calls (``kind``) padded to ``l`` rows on the mesh of that TP, as
    a recompute switch runs them (``dtarl.rollout.engine.recompute_calls``), and
    (optional) ``kind="pool"``: a recompute's fixed part onto ``l`` slots (the old
    pool freed, the empty one created); it needs ``engine`` to hold prefill_batch,
    extend_batch, prompt_len and response_len."""

    model: dict[str, Any]
    device_kind: str
    platform: str
    jax_version: str
    devices: int
    mesh_axes: tuple[str, ...]
    token_cap: int
    window: int
    decode: tuple[dict[str, float], ...]
    prefill: tuple[dict[str, float], ...]
    weight_bytes: int
    weights_bytes_per_s: float
    kv_bytes_per_s: float
    compile_s: float
    steps_per_call: int = 0  # decode steps per call of the profiled programs (0: unknown)
    # The engine config whose programs were profiled (ContinuousConfig's fields; empty:
    # not recorded). Decode rows may carry ``median``, ``cv`` (coefficient of variation)
    # and ``n`` (how many) of the timed steps whose fastest is ``seconds``.
    engine: dict[str, int] = dataclasses.field(default_factory=dict)
    kv_calls: tuple[dict[str, Any], ...] = ()
    # Typical over fastest: the median, over every timed decode step of the profile, of
    # its seconds over the fastest of its point. A decode row's ``seconds`` is its
    # fastest step (the least noisy statistic of a point), which a typical call runs
    # slower than; the predictor multiplies decode seconds by this one factor, pooled
    # over all points, so it predicts typical calls without each point's median noise.
    # 1.0: predict the fastest steps (profiles made before it).
    decode_scale: float = 1.0
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mesh_axes"] = list(self.mesh_axes)
        d["decode"] = [dict(r) for r in self.decode]
        d["prefill"] = [dict(r) for r in self.prefill]
        d["kv_calls"] = [dict(r) for r in self.kv_calls]
        d["engine"] = dict(self.engine)
        return {"format": FORMAT, **d}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise PatError(
                f"PAT profile {path}: no such file (make one with "
                "`dtarl bench rollout --profile OUT.json`)"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PatError(f"PAT profile {path}: not JSON ({e})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> Profile:
        """Validates every field; errors name ``source`` and the field."""

        def fail(field: str, why: str):
            raise PatError(f"PAT profile {source}: {field} {why}")

        if not isinstance(data, dict):
            fail("top level", f"must be an object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            fail("format", f"must be {FORMAT!r}, got {data.get('format')!r}")
        for name in ("device_kind", "platform", "jax_version"):
            if not isinstance(data.get(name), str):
                fail(name, f"must be a string, got {data.get(name)!r}")
        if not isinstance(data.get("model"), dict):
            fail("model", f"must be an object (the model config), got {data.get('model')!r}")
        for name in ("devices", "token_cap", "window", "weight_bytes"):
            v = data.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(name, f"must be an int >= 1, got {v!r}")
        for name in ("weights_bytes_per_s", "kv_bytes_per_s"):
            v = data.get(name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                fail(name, f"must be a finite number > 0, got {v!r}")
        v = data.get("compile_s")
        if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            fail("compile_s", f"must be a finite number >= 0, got {v!r}")
        axes = data.get("mesh_axes")
        if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
            fail("mesh_axes", f"must be a list of axis names, got {axes!r}")

        def row(where: str, r, ints, numbers, optional) -> dict[str, Any]:
            """One table row, checked: ``ints`` ints >= 1 (``tp`` a TP dividing the
            devices), ``numbers`` finite >= 0, ``optional`` numbers kept when present."""
            if not isinstance(r, dict):
                fail(where, f"must be an object, got {r!r}")
            for k in ints:
                x = r.get(k)
                if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                    fail(f"{where}.{k}", f"must be an int >= 1, got {x!r}")
            for k in (*numbers, *(k for k in optional if k in r)):
                x = r.get(k)
                if (
                    not isinstance(x, int | float)
                    or isinstance(x, bool)
                    or not math.isfinite(x)
                    or x < 0
                ):
                    fail(f"{where}.{k}", f"must be a finite number >= 0, got {x!r}")
            if r["tp"] not in TP_DEGREES or data["devices"] % r["tp"]:
                fail(
                    f"{where}.tp",
                    f"must be one of {TP_DEGREES} dividing devices={data['devices']}, "
                    f"got {r['tp']}",
                )
            return {k: r[k] for k in (*ints, *numbers, *optional) if k in r}

        tables = {}
        for table in ("decode", "prefill"):
            rows = data.get(table)
            if not isinstance(rows, list) or not rows:
                fail(table, f"must be a non-empty list of points, got {rows!r}")
            tables[table] = tuple(
                row(f"{table}[{i}]", r, ("tp", "b", "l"), ("t", "seconds"), ("median", "cv", "n"))
                for i, r in enumerate(rows)
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: data[k] for k in fields if k in data}
        spc = data.get("steps_per_call", 0)
        if not isinstance(spc, int) or isinstance(spc, bool) or spc < 0:
            fail("steps_per_call", f"must be an int >= 0, got {spc!r}")
        eng = data.get("engine", {})
        if not isinstance(eng, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in eng.values()
        ):
            fail("engine", f"must be an object of ints >= 0 (the engine config), got {eng!r}")
        calls = data.get("kv_calls", [])
        if not isinstance(calls, list):
            fail("kv_calls", f"must be a list of points, got {calls!r}")
        kv_calls = []
        for i, r in enumerate(calls):
            if isinstance(r, dict) and r.get("kind") not in CALL_KINDS:
                fail(f"kv_calls[{i}].kind", f"must be one of {CALL_KINDS}, got {r.get('kind')!r}")
            checked = row(f"kv_calls[{i}]", r, ("tp", "l"), ("seconds",), ("median", "n"))
            kv_calls.append({"kind": r["kind"], **checked})
        if kv_calls:
            missing = [k for k in _CALL_CONFIG if k not in eng or eng[k] < 1]
            if missing:
                fail(
                    "engine",
                    f"must hold {missing} (ints >= 1) when kv_calls is given: the recompute's "
                    "calls follow them",
                )
            for tp in sorted({r["tp"] for r in tables["decode"]}):
                for kind in ("prefill", "extend"):
                    if not any(r["tp"] == tp and r["kind"] == kind for r in kv_calls):
                        fail("kv_calls", f"has no {kind!r} row for tp={tp} (a decode TP)")
        scale = data.get("decode_scale", 1.0)
        if (
            not isinstance(scale, int | float)
            or isinstance(scale, bool)
            or not math.isfinite(scale)
            or scale <= 0
        ):
            fail("decode_scale", f"must be a finite number > 0, got {scale!r}")
        known.update(
            tables,
            decode_scale=float(scale),
            mesh_axes=tuple(axes),
            engine=dict(eng),
            kv_calls=tuple(kv_calls),
            notes=str(data.get("notes", "")),
        )
        return cls(**known)


# ----------------------------------------------------------------------------- predictor


def _pwl(x, xs: np.ndarray, ys: np.ndarray, *, through_zero: bool = False) -> np.ndarray:
    """Piecewise linear through (xs, ys) (sorted, distinct). Below the first point: its
    value; above the last: the last segment's slope if positive, else flat (latency
    never falls with more tokens, so a noisy negative slope is not extended). A single
    point is a constant, or with ``through_zero`` proportional above it (the prefill
    of an engine profile, timed at the engine's one prompt length: its seconds grow
    with the tokens)."""
    x = np.asarray(x, np.float64)
    if xs.size == 1:
        if through_zero:
            return ys[0] * np.maximum(x, xs[0]) / xs[0]
        return np.full(x.shape, ys[0])
    y = np.interp(x, xs, ys)  # constant outside [xs[0], xs[-1]]
    s1 = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return np.where(x > xs[-1], ys[-1] + s1 * (x - xs[-1]), y)


def _curves(rows, key: str) -> dict[int, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """{tp: {b: (x sorted, seconds)}} with x = row[key]; repeated x are averaged."""
    acc: dict[int, dict[int, dict[float, list[float]]]] = {}
    for r in rows:
        acc.setdefault(int(r["tp"]), {}).setdefault(int(r["b"]), {}).setdefault(
            float(r[key]), []
        ).append(float(r["seconds"]))
    out = {}
    for tp, per_b in acc.items():
        out[tp] = {}
        for b, pts in per_b.items():
            xs = np.asarray(sorted(pts), np.float64)
            out[tp][b] = (xs, np.asarray([np.mean(pts[x]) for x in xs], np.float64))
    return out


def _in_b(
    curves: dict[int, tuple[np.ndarray, np.ndarray]],
    b: float,
    x,
    *,
    through_zero: bool = False,
    aggregate: bool = False,
) -> np.ndarray:
    """Interpolates the per-B curves at batch ``b`` (module docstring: the smallest B's
    curve below it, linear between neighbours, above the largest B the two largest
    B's slope if positive, else the largest B's curve). ``aggregate``: ``x`` sums over
    the batch (decode's T), so a neighbour B' is read at ``x B' / b``, the same
    amount per request."""
    bs = sorted(curves)
    if len(bs) == 1 or b <= bs[0]:
        return _pwl(x, *curves[bs[0]], through_zero=through_zero)
    if b in curves:
        return _pwl(x, *curves[int(b)], through_zero=through_zero)
    i = int(np.searchsorted(bs, b))
    lo, hi = (bs[-2], bs[-1]) if i >= len(bs) else (bs[i - 1], bs[i])
    x = np.asarray(x, np.float64)
    xlo, xhi = (x * lo / b, x * hi / b) if aggregate else (x, x)
    ylo = _pwl(xlo, *curves[lo], through_zero=through_zero)
    yhi = _pwl(xhi, *curves[hi], through_zero=through_zero)
    if b > hi:
        return yhi + np.maximum(yhi - ylo, 0.0) * (b - hi) / (hi - lo)
    return ylo + (yhi - ylo) * (b - lo) / (hi - lo)


class Predictor:
    """Latency predictions from a ``Profile`` (module docstring)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._decode = _curves(profile.decode, "t")
        self._prefill = _curves(profile.prefill, "l")
        # {(kind, tp): (l sorted, seconds per call)} of the engine's prefill/extend calls
        acc: dict[tuple[str, int], dict[float, list[float]]] = {}
        for r in profile.kv_calls:
            acc.setdefault((r["kind"], int(r["tp"])), {}).setdefault(float(r["l"]), []).append(
                float(r["seconds"])
            )
        self._calls = {
            key: (
                np.asarray(sorted(pts), np.float64),
                np.asarray([np.mean(pts[x]) for x in sorted(pts)], np.float64),
            )
            for key, pts in acc.items()
        }

    @property
    def tps(self) -> tuple[int, ...]:
        return tuple(sorted(self._decode))

    def _check(self, table, tp: int, what: str):
        if tp not in table:
            raise PatError(f"{what}: tp={tp} is not in the profile (profiled: {sorted(table)})")

    def step_seconds(self, tp: int, b: float, t) -> np.ndarray:
        """Seconds of one decode step at B = ``b`` per DP group, T = ``t`` tokens per DP
        group (a typical step: the profile's fastest times its ``decode_scale``)."""
        self._check(self._decode, tp, "step_seconds")
        return _in_b(self._decode[tp], float(b), t, aggregate=True) * self.profile.decode_scale

    def prefill_seconds(self, tp: int, b: float, length) -> np.ndarray:
        """Seconds of a prefill of ``b`` prompts of ``length`` tokens per DP group (a B
        profiled at one length only: proportional to ``length`` above it)."""
        self._check(self._prefill, tp, "prefill_seconds")
        return _in_b(self._prefill[tp], float(b), length, through_zero=True)

    @property
    def has_kv_calls(self) -> bool:
        """The profile times the engine's prefill and extend calls (``kv_calls``)."""
        return bool(self._calls)

    def call_seconds(self, kind: str, tp: int, length) -> np.ndarray:
        """Seconds of one engine ``kind`` call ("prefill" or "extend") padded to
        ``length`` rows at ``tp`` (or "pool": a recompute's fixed part onto ``length``
        slots): piecewise linear over the profiled points (below the smallest its value;
        above the largest the last slope when positive, else flat)."""
        if (kind, tp) not in self._calls:
            raise PatError(
                f"call_seconds: no {kind!r} call at tp={tp} in the profile's kv_calls "
                f"(profiled: {sorted(self._calls)})"
            )
        return _pwl(length, *self._calls[kind, tp])

    def recompute_calls(
        self, prompt_tokens: Sequence[int], lengths: Sequence[int]
    ) -> list[tuple[str, int, int, int]]:
        """The calls the engine's recompute makes (``dtarl.rollout.engine.recompute_calls``
        with the profile's engine config)."""
        e = self.profile.engine
        return recompute_calls(prompt_tokens, lengths, **{k: int(e[k]) for k in _CALL_CONFIG})

    def recompute_seconds(
        self, tp: int, prompt_tokens: Sequence[int], lengths: Sequence[int]
    ) -> float:
        """Seconds of ``reshard(..., mode="recompute")`` onto ``tp`` rebuilding resident
        prompts of ``prompt_tokens`` tokens (row order) and the response rows
        ``lengths`` of every request holding a slot (slot order, held ones included):
        the sum over the engine's calls (``recompute_calls``) of one call's profiled
        seconds at its bucket, plus the fixed part (the "pool" row: the pool freed and
        re-created; 0 when the profile has none). Needs ``kv_calls``
        (``has_kv_calls``)."""
        if not self._calls:
            raise PatError(
                "recompute_seconds: the profile has no kv_calls (made before they were "
                "profiled: re-profile, or use switch_cost's Eq. 3-4 fallback)"
            )
        calls = self.recompute_calls(prompt_tokens, lengths)
        fixed = self._calls.get(("pool", tp))
        return float(fixed[1].min() if fixed else 0.0) + float(
            sum(float(self.call_seconds(kind, tp, t)) for kind, t, *_ in calls)
        )

    def est_rem_time(
        self,
        tp: int,
        batch_per_dp_group: float,
        l_max: int,
        l_gen: int,
        *,
        context: float | None = None,
    ) -> float:
        """Alg. 1's remaining decode time: steps ``l_gen .. l_max - 1``, each at
        ``l(B, T_k; tp)`` with ``T_k = context + B k`` (every request grows by one token a
        step; ``context`` defaults to ``B * l_gen``, the paper's T without prompts)."""
        b = float(batch_per_dp_group)
        n = int(l_max) - int(l_gen)
        if n <= 0 or b <= 0:
            return 0.0
        c = b * l_gen if context is None else float(context)
        t = c + b * np.arange(n, dtype=np.float64)
        return float(np.sum(self.step_seconds(tp, b, t)))


def leave_one_out(profile: Profile) -> list[dict[str, Any]]:
    """Held-out error of the decode predictions, on points *inside* the grid (a point
    outside it would test the extrapolation rule, not the fit):

    * ``kind="t"``: each point whose T lies strictly between two other points of its
      (tp, B) curve, predicted from the profile without it (piecewise linear in T);
    * ``kind="b"``: each point of a B level strictly between two other levels of its
      TP, predicted from the profile without that whole level (interpolated between
      the two nearest profiled B).

    Rows ``{tp, b, l, t, seconds, predicted, rel_error, kind}``, both on the rows' scale
    (the fastest step; ``decode_scale`` cancels)."""
    out = []
    rows = list(profile.decode)
    scale = profile.decode_scale
    for i, r in enumerate(rows):
        ts = [x["t"] for x in rows if (x["tp"], x["b"]) == (r["tp"], r["b"]) and x is not r]
        if not ts or not min(ts) < r["t"] < max(ts):
            continue
        p = Predictor(dataclasses.replace(profile, decode=tuple(rows[:i] + rows[i + 1 :])))
        pred = float(p.step_seconds(r["tp"], r["b"], r["t"])) / scale
        rel = abs(pred - r["seconds"]) / max(r["seconds"], 1e-12)
        out.append(dict(r, predicted=pred, rel_error=rel, kind="t"))
    for tp in sorted({x["tp"] for x in rows}):
        levels = sorted({x["b"] for x in rows if x["tp"] == tp})
        for b in levels[1:-1]:
            rest = tuple(x for x in rows if (x["tp"], x["b"]) != (tp, b))
            p = Predictor(dataclasses.replace(profile, decode=rest))
            for r in rows:
                if (r["tp"], r["b"]) != (tp, b):
                    continue
                pred = float(p.step_seconds(tp, b, r["t"])) / scale
                rel = abs(pred - r["seconds"]) / max(r["seconds"], 1e-12)
                out.append(dict(r, predicted=pred, rel_error=rel, kind="b"))
    return out


# ----------------------------------------------------------------------------- switch cost


@dataclasses.dataclass(frozen=True)
class SwitchCost:
    """Predicted seconds of one switch; ``mode`` is the cheaper K/V handling."""

    weights_s: float
    move_s: float
    recompute_s: float
    compile_s: float

    @property
    def mode(self) -> str:
        return "migrate" if self.move_s <= self.recompute_s else "recompute"

    @property
    def kv_s(self) -> float:
        return min(self.move_s, self.recompute_s)

    @property
    def total(self) -> float:
        return self.weights_s + self.kv_s + self.compile_s


def kv_rank_bytes(model: dict[str, Any], contexts: Sequence[int], tp_src: int) -> int:
    """Eq. 1: K/V bytes a source rank sends, ``sum_i 2 M L_i (K Dh / tp_src) s``."""
    item = np.dtype(model.get("compute_dtype", "float32")).itemsize
    width = int(model["num_kv_heads"]) * int(model["head_dim"])
    per_token = 2 * int(model["num_layers"]) * width * item
    return int(sum(int(x) for x in contexts) * per_token // tp_src)


def switch_cost(
    predictor: Predictor,
    *,
    tp_src: int,
    tp_dst: int,
    contexts: Sequence[int],
    cached: bool,
    resident: Sequence[int] | None = None,
    live_lengths: Sequence[int] | None = None,
) -> SwitchCost:
    """Cost of switching ``tp_src -> tp_dst`` with unfinished requests of full context
    lengths ``contexts`` (prompt + generated): weights + min(T_move, T_recomp) +
    compile (when the target program is not ``cached``).

    T_recomp is what the engine's recompute runs when the profile has ``kv_calls`` and
    ``live_lengths`` is given (the response rows of every request holding a slot, slot
    order; ``resident``: the resident prompts' lengths): ``Predictor.recompute_seconds``
    onto ``tp_dst``. Otherwise (a profile made before ``kv_calls``, or no engine
    layout) it is the paper's Eq. 3-4: one profiled prefill of ceil(n / dp) prompts at
    the RMS context length."""
    prof = predictor.profile
    dp_dst = prof.devices // tp_dst
    # The same TP (compaction into fewer slots) keeps the weights where they are.
    weights_s = 0.0 if tp_dst == tp_src else prof.weight_bytes / prof.weights_bytes_per_s
    ctx = np.asarray(contexts, np.float64)
    if ctx.size == 0:
        return SwitchCost(weights_s, 0.0, 0.0, 0.0 if cached else prof.compile_s)
    move_s = kv_rank_bytes(prof.model, ctx.astype(np.int64), tp_src) / prof.kv_bytes_per_s
    if predictor.has_kv_calls and live_lengths is not None:
        recompute_s = predictor.recompute_seconds(
            tp_dst, () if resident is None else resident, live_lengths
        )
    else:
        b = math.ceil(ctx.size / dp_dst)
        l_rms = float(np.sqrt(np.mean(ctx**2)))
        recompute_s = float(predictor.prefill_seconds(tp_dst, b, l_rms))
    return SwitchCost(weights_s, move_s, recompute_s, 0.0 if cached else prof.compile_s)


# ----------------------------------------------------------------------------- engine model


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineState:
    """What the controller reads from the engine between two decode calls.

    lengths / remaining: response rows held and tokens still to generate of each
    live (running) request; tp, dp, slots: the current program; cells: prompt
    rows x members (Q M); prompt_len, response_len, steps_per_call, max_slots:
    the engine's config; waiting: a request waits in the queue; cached(dp, tp,
    slots): the target program is compiled. resident / live_lengths (None: unknown,
    the recompute cost falls back to Eq. 3-4): what a recompute switch rebuilds, the
    resident prompt rows' prompt lengths and the response rows of every request
    holding a slot (running and held, slot order)."""

    tp: int
    dp: int
    slots: int
    lengths: np.ndarray
    prompts: np.ndarray
    remaining: np.ndarray
    waiting: bool
    cells: int
    prompt_len: int
    response_len: int
    steps_per_call: int
    max_slots: int
    live: int = -1  # requests holding a slot (running + held); -1: len(lengths)
    cached: Callable[[int, int, int], bool] = lambda dp, tp, slots: True
    resident: np.ndarray | None = None
    live_lengths: np.ndarray | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.tp


def program_tokens(state: EngineState, slots: int, dp: int, window) -> np.ndarray:
    """T of the engine's decode program per DP group (module docstring)."""
    w = np.asarray(window, np.float64)
    return (state.cells * state.prompt_len + slots * w) / dp


def engine_rem_time(predictor: Predictor, state: EngineState, tp: int, slots: int) -> float:
    """Predicted seconds of the decode steps left when the live requests run on a program
    of ``slots`` slots at ``tp`` (B = slots / dp; the window follows the longest active
    request as the engine picks it, per call)."""
    if state.lengths.size == 0:
        return 0.0
    dp = state.devices // tp
    n = int(state.remaining.max())
    k = np.arange(n)
    active = state.remaining[None, :] > k[:, None]
    longest = np.max(np.where(active, state.lengths[None, :] + k[:, None], 0), axis=1)
    s = state.steps_per_call
    # The engine picks a window per call, from the longest length at the call's start.
    start = (k // s) * s
    longest_at_call = longest[start]
    need = longest_at_call + s + 1
    ws = np.asarray(decode_windows(state.response_len))
    idx = np.minimum(np.searchsorted(ws, need), ws.size - 1)
    t = program_tokens(state, slots, dp, ws[idx])
    return float(np.sum(predictor.step_seconds(tp, slots / dp, t)))


# ----------------------------------------------------------------------------- controller


@dataclasses.dataclass(frozen=True)
class Decision:
    """Alg. 1's outcome at one check: ``tp`` (and ``slots``) to run next."""

    tp: int
    slots: int
    mode: str
    now_s: float  # predicted remaining time without a switch
    best_s: float  # remaining time + switch cost of the chosen target
    cost: SwitchCost | None
    candidates: dict[int, float]  # tp -> remaining + cost

    @property
    def switch(self) -> bool:
        return self.cost is not None


def decide(
    predictor: Predictor,
    state: EngineState,
    candidates: Sequence[int],
    *,
    compile_reuse: int = 1,
) -> Decision:
    """Algorithm 1 on one engine state: the candidate with the least remaining time +
    switch cost; a switch only when that beats the remaining time now. An uncached
    target's compile seconds count ``1 / compile_reuse`` (the generations expected to
    reuse its programs: the engine keeps them, PAT's communication-group cache)."""
    now = engine_rem_time(predictor, state, state.tp, state.slots)
    best = Decision(state.tp, state.slots, "none", now, now, None, {state.tp: now})
    live = int(state.lengths.size if state.live < 0 else state.live)
    if state.waiting or state.lengths.size == 0:
        return best
    contexts = state.prompts + state.lengths
    # The current TP is a candidate too, with the live requests compacted into fewer
    # slots (no weight move).
    for tp in sorted(set(candidates) | {state.tp}):
        dp = state.devices // tp
        slots = merged_slots(live, dp, state.max_slots)
        if tp == state.tp and slots >= state.slots:
            continue
        rem = engine_rem_time(predictor, state, tp, slots)
        cost = switch_cost(
            predictor,
            tp_src=state.tp,
            tp_dst=tp,
            contexts=contexts,
            cached=state.cached(dp, tp, slots),
            resident=state.resident,
            live_lengths=state.live_lengths,
        )
        if compile_reuse > 1:
            cost = dataclasses.replace(cost, compile_s=cost.compile_s / compile_reuse)
        total = rem + cost.total
        best.candidates[tp] = min(total, best.candidates.get(tp, total))
        if total < best.best_s:
            best = Decision(tp, slots, cost.mode, now, total, cost, best.candidates)
    return best


def engine_state(engine, cached: Callable[[int, int, int], bool]) -> EngineState:
    """The controller's ``EngineState`` from ``engine.view()`` and ``engine.config``."""
    v, c = engine.view(), engine.config
    return EngineState(
        tp=int(v.tp),
        dp=int(v.dp),
        slots=int(v.slots),
        lengths=np.asarray(v.response_tokens, np.int64),
        prompts=np.asarray(v.prompt_tokens, np.int64),
        remaining=np.asarray(v.remaining, np.int64),
        waiting=bool(v.waiting),
        cells=c.prompt_slots * c.group_size,
        prompt_len=c.prompt_len,
        response_len=c.response_len,
        steps_per_call=c.steps_per_call,
        max_slots=c.slots,
        live=int(v.live),
        cached=cached,
        resident=np.asarray(v.resident_prompt_tokens, np.int64),
        live_lengths=np.asarray(v.live_response_tokens, np.int64),
    )


class PatController:
    """Algorithm 1 as the engine's ``on_call`` hook (``RolloutEngine.run(weights,
    on_call=controller)``; ``ContinuousSampler.generate(..., on_call=controller)``).

    Every ``check_every`` decode calls it reads the engine (``engine_state``), runs
    ``decide`` over ``candidates`` and, when a switch pays, calls
    ``engine.reshard((dp, tp), weights, slots=..., mode=...)`` with the cheaper K/V
    mode and returns the re-placed weights. ``timeline`` lists this generation's
    switches (``begin`` starts a new one; ``history`` keeps every generation's):
    call index, seconds since ``begin``, from/to (dp, tp, slots), predicted
    remaining time without and with the switch (cost included), the predicted cost,
    the switch's measured seconds and the engine's ``info``.

    Compiled programs: a target (dp, tp, slots) counts as cached once this
    controller has switched into it (the engine keeps its programs) or it is the
    shape the engine started in; otherwise the profile's compile seconds, divided
    by ``compile_reuse`` (the generations expected to reuse the compiled programs,
    e.g. the RL steps of a run), are added to its cost. Keep one controller per
    engine across iterations for that memory.
    """

    def __init__(
        self,
        predictor: Predictor,
        *,
        candidates: Sequence[int] = TP_DEGREES,
        check_every: int = 4,
        compile_reuse: int = 1,
    ):
        if not isinstance(check_every, int) or check_every < 1:
            raise PatError(f"check_every={check_every!r} must be an int >= 1")
        if not isinstance(compile_reuse, int) or compile_reuse < 1:
            raise PatError(f"compile_reuse={compile_reuse!r} must be an int >= 1")
        self.compile_reuse = compile_reuse
        self.predictor = predictor
        missing = [tp for tp in candidates if tp not in predictor.tps]
        if missing:
            raise PatError(
                f"tp_candidates: {missing} not in the profile (profiled: {list(predictor.tps)})"
            )
        self.candidates = tuple(candidates)
        self.check_every = check_every
        self.timeline: list[dict[str, Any]] = []
        self.history: list[list[dict[str, Any]]] = []
        self.checks = 0
        self._calls = 0
        self._t0 = time.perf_counter()
        self._cached: set[tuple[int, int, int]] = set()
        self._engine = None  # the engine whose compiled programs ``_cached`` describes

    def begin(self) -> None:
        """Starts a generation: call count and clock from zero, a new timeline."""
        self._calls = 0
        self._t0 = time.perf_counter()
        self.timeline = []
        self.history.append(self.timeline)

    def adopt(self, engine, compiled: Sequence[tuple[int, int, int]] = ()) -> None:
        """Starts tracking ``engine`` whose programs for the (dp, tp, slots) shapes in
        ``compiled`` exist already (e.g. the profile was taken on it:
        ``dtarl.bench.pat_profile.profile_engine(..., engine=engine)``), so switching
        into them is not charged a compile."""
        self._engine = engine
        self._cached = {(int(a), int(b), int(c)) for a, b, c in compiled}

    def cached(self, dp: int, tp: int, slots: int) -> bool:
        return (dp, tp, slots) in self._cached

    def __call__(self, engine, weights):
        self._calls += 1
        if engine is not self._engine:  # e.g. a sampler rebuilt its engine: nothing compiled
            self._engine, self._cached = engine, set()
        if self._calls % self.check_every:
            return None
        state = engine_state(engine, self.cached)
        self._cached.add((state.dp, state.tp, state.slots))
        self.checks += 1
        d = decide(self.predictor, state, self.candidates, compile_reuse=self.compile_reuse)
        if not d.switch:
            return None
        dp = state.devices // d.tp
        t0 = time.perf_counter()
        new, info = engine.reshard((dp, d.tp), weights, slots=d.slots, mode=d.mode)
        seconds = time.perf_counter() - t0
        self._cached.add((dp, d.tp, d.slots))
        self.timeline.append(
            dict(
                call=self._calls,
                time_s=t0 - self._t0,
                src=(state.dp, state.tp, state.slots),
                dst=(dp, d.tp, d.slots),
                live=int(state.live),
                predicted_now_s=d.now_s,
                predicted_after_s=d.best_s,
                predicted_cost_s=d.cost.total,
                predicted_gain_s=d.now_s - d.best_s,
                mode=d.mode,
                seconds=seconds,
                info={k: v for k, v in info.items() if isinstance(v, int | float | str)},
            )
        )
        return new


def _trajectory_seconds(predictor: Predictor, tp: int, active, context) -> np.ndarray:
    """Per-step predicted seconds of a (B, T) trajectory (global) run at ``tp``."""
    dp = predictor.profile.devices // tp
    b = np.ceil(np.asarray(active, np.float64) / dp)
    t = np.asarray(context, np.float64) / dp
    out = np.zeros(b.shape)
    for bb in np.unique(b):
        sel = b == bb
        out[sel] = predictor.step_seconds(tp, bb, t[sel]) if bb > 0 else 0.0
    return out


def replay(
    predictor: Predictor,
    active: Sequence[int],
    context: Sequence[int],
    *,
    candidates: Sequence[int] | None = None,
    check_every_steps: int = 16,
) -> dict[str, Any]:
    """PREDICTED latency of a generation's decode trajectory (``active`` requests and
    their summed ``context`` tokens per step, e.g. ``stats()['active_per_step']`` and
    ``['context_per_step']``) on the profiled machine, with the paper's step cost
    ``l(B / dp, T / dp; tp)``: per static TP, and with Algorithm 1 run every
    ``check_every_steps`` steps from the best static TP (remaining time estimated with
    every active request running to the trajectory's end, as Alg. 1's L_max; switch
    cost from the profile, programs assumed compiled, K/V of the active requests at
    their mean context). Returns ``static`` {tp: s}, ``pat`` s, ``start_tp``,
    ``switches`` [(step, from, to, cost_s)], ``label`` = "PREDICTION"."""
    a = np.asarray(active, np.int64)
    c = np.asarray(context, np.float64)
    if a.shape != c.shape or a.ndim != 1 or a.size == 0:
        raise PatError(
            f"replay: active {a.shape} and context {c.shape} must be equal non-empty 1-D arrays"
        )
    tps = tuple(candidates or predictor.tps)
    per_step = {tp: _trajectory_seconds(predictor, tp, a, c) for tp in tps}
    static = {tp: float(v.sum()) for tp, v in per_step.items()}
    tp = min(static, key=static.get)
    start, total, switches = tp, 0.0, []
    n, d = a.size, predictor.profile.devices
    for k in range(n):
        if k and k % check_every_steps == 0 and a[k] > 0:

            def rem(t, k=k):
                dp = d // t
                b = math.ceil(a[k] / dp)
                return predictor.est_rem_time(t, b, n, k, context=c[k] / dp)

            now_s, best, best_s, best_cost = rem(tp), tp, None, None
            for t in tps:
                if t == tp:
                    continue
                ctx = np.full(int(a[k]), c[k] / a[k])
                cost = switch_cost(predictor, tp_src=tp, tp_dst=t, contexts=ctx, cached=True)
                total_s = rem(t) + cost.total
                if total_s < now_s and (best_s is None or total_s < best_s):
                    best, best_s, best_cost = t, total_s, cost.total
            if best != tp:
                switches.append((k, tp, best, best_cost))
                total += best_cost
                tp = best
        total += float(per_step[tp][k])
    return dict(label="PREDICTION", static=static, pat=total, start_tp=start, switches=switches)


def check_candidates(candidates: Sequence[int], *, devices: int, kv_heads: int) -> tuple[int, ...]:
    """The TP candidates, validated: each in (1, 2, 4, 8), dividing the devices and the kv
    heads."""
    out = []
    for tp in candidates:
        if tp not in TP_DEGREES or devices % tp or kv_heads % tp:
            raise PatError(
                f"tp_candidates: {tp} must be one of {TP_DEGREES} dividing the devices "
                f"({devices}) and the kv heads ({kv_heads})"
            )
        out.append(int(tp))
    if not out:
        raise PatError("tp_candidates: empty (need at least one TP degree)")
    return tuple(sorted(set(out)))


__all__ = [
    "FORMAT",
    "TP_DEGREES",
    "Decision",
    "EngineState",
    "PatController",
    "CALL_KINDS",
    "PatError",
    "Predictor",
    "Profile",
    "SwitchCost",
    "check_candidates",
    "decide",
    "decode_windows",
    "engine_state",
    "engine_rem_time",
    "kv_rank_bytes",
    "leave_one_out",
    "merged_slots",
    "program_tokens",
    "recompute_calls",
    "replay",
    "switch_cost",
]
