"""PAT's offline profile and its predictor (PAT, arXiv 2605.23945; the model is described in
``dtarl.rollout.pat``): ``Profile`` (the profiler's measurements, saved as JSON),
``Predictor`` (decode-step, prefill and recompute-call seconds from it) and the cost of
a switch (``switch_cost``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.rollout.config import recompute_calls
from dtarl.rollout.reshard import migrate_rows

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

    T_move is Eq. 1-2 over the rows the engine's migrate moves when ``live_lengths``
    is given (each resident prompt's ``length - 1`` rows once, each live request's
    response rows, each sum padded as ``dtarl.rollout.reshard.migrate_rows`` pads it);
    without an engine layout, over the full ``contexts`` (the paper's form).

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
    if live_lengths is not None:  # what the engine's migrate moves (valid rows, padded)
        prompt_rows = [int(x) - 1 for x in (() if resident is None else resident)]
        rows = migrate_rows(prompt_rows, live_lengths, prof.devices // tp_src, dp_dst)
        move_s = kv_rank_bytes(prof.model, rows, tp_src) / prof.kv_bytes_per_s
    else:
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


__all__ = [
    "CALL_KINDS",
    "FORMAT",
    "TP_DEGREES",
    "PatError",
    "Predictor",
    "Profile",
    "SwitchCost",
    "kv_rank_bytes",
    "leave_one_out",
    "switch_cost",
]
