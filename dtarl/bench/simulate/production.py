"""Validation against production timings: the traces' own latencies, not a CPU replay.

The search_r1 trace records, for every turn of every trajectory, the SGLang
engine latency of the turn (``engine_latency_s``, Qwen2.5-7B, 2048 trajectories
submitted together) with its token counts, and the latency of every tool call.
The rllm trace records the sandboxed reward time of each rank per step. This
module fits a latency model for that deployment on some steps and predicts the
others; fitting and testing never share a step (``split_steps`` refuses).

Rollout model (processor sharing). The engine serves every in-flight turn at
once; while n turns decode, each gains one token every

    tau(n) = max(floor_s, per_request_s * n)                                   (1)

seconds (throughput-bound at high n, latency-bound at low n). A turn with
``u`` uncached prompt tokens (``generation_prompt_len - cached_tokens``) and
``c`` completion tokens is admitted ``overhead_s + prefill_s * u`` seconds after
it is submitted, then decodes its c tokens under (1). Trajectories run
concurrently; within one, turn k+1 is submitted when turn k has finished and
its tool calls (the trace's recorded ``latency_s``, run one after another) have
returned, so tool calls sit on each trajectory's own timeline. ``simulate``
runs this event by event (a fluid model: arrivals and completions are the
events), so a held-out step is predicted from its token counts and tool
latencies alone, never from its engine latencies.

Fitting. On the fit steps the real timeline is known (turn k of a trajectory
starts at the sum of its earlier latencies and tool calls), so the number of
in-flight turns n(t) is known. A turn's latency is then approximately
``overhead_s + prefill_s u + c (per_request_s * nbar)`` with nbar the mean of
n(t) over its tokens (each instant weighted by the decode rate 1 / tau(n(t))),
which is linear in (per_request_s, prefill_s, overhead_s): fitted by
non-negative least squares weighted by 1 / latency (relative error), the token
weights refreshed from the fit a few times. The floor only matters in the tail
of a step, when few turns are left; it is chosen by bisection so the simulated
mean makespan of the fit steps equals the real one (makespan grows with it).

Reward model (rllm). ``reward_time_s = per_token_s * response_sum +
per_max_token_s * response_max + overhead_s`` per rank (non-negative least
squares, 1 / t weights); the step's reward stage is the slowest rank.

Accuracy is the paper's: 1 - mean relative error |pred - real| / real, per
step and over all held-out items.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dtarl.bench.report import save_figure
from dtarl.bench.simulate.skill import Skill, accuracy, skill, skill_table
from dtarl.engines.cost import nnls
from dtarl.traces.loaders import RunKind, RunTrace, default_polytrace_root, load_trace
from dtarl.traces.records import RewardTiming, Trajectory

SEARCH_R1_RELPATH = Path("search_r1/profile/multiturn_workload_log/0617_0223")
RLLM_RELPATH = Path("rllm/profile/packed_length_log/20260616_024512")

_FIT_ROUNDS = 4  # token-weight refreshes of the linear fit (converges in 2 on search_r1)
_FLOOR_BISECTIONS = 14


# ----------------------------------------------------------------------------- turn tables


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnTable:
    """One step's turns, flattened in trajectory order (turn k of a trajectory after k-1).

    Attributes:
      step: the trace step.
      traj: trajectory index of each turn (0..num_trajectories-1, non-decreasing).
      completion: completion tokens of each turn.
      prefill: uncached prompt tokens of each turn (generation_prompt_len - cached_tokens).
      tool_after: seconds of tool calls between this turn and the trajectory's next one.
      latency: the recorded engine latency of each turn (what is predicted).
    """

    step: int
    traj: np.ndarray
    completion: np.ndarray
    prefill: np.ndarray
    tool_after: np.ndarray
    latency: np.ndarray

    @classmethod
    def from_trajectories(cls, step: int, trajs: Sequence[Trajectory]) -> TurnTable:
        traj, comp, pref, tool, lat = [], [], [], [], []
        for i, tr in enumerate(trajs):
            if not tr.turns:
                raise ValueError(
                    f"step {step}: trajectory (group {tr.prompt_group_id}, sample "
                    f"{tr.sample_id}) has no turns; every trajectory needs at least one"
                )
            by_turn: dict[int, float] = {}
            for call in tr.tool_calls:
                by_turn[call.turn] = by_turn.get(call.turn, 0.0) + call.latency_s
            for t in tr.turns:
                traj.append(i)
                comp.append(t.completion_tokens)
                pref.append(max(t.generation_prompt_len - t.cached_tokens, 0))
                tool.append(by_turn.get(t.turn, 0.0))
                lat.append(t.engine_latency_s)
        if not traj:
            raise ValueError(f"step {step}: no trajectories")
        return cls(
            step=step,
            traj=np.asarray(traj, np.int64),
            completion=np.asarray(comp, np.float64),
            prefill=np.asarray(pref, np.float64),
            tool_after=np.asarray(tool, np.float64),
            latency=np.asarray(lat, np.float64),
        )

    @property
    def num_turns(self) -> int:
        return len(self.traj)

    @property
    def num_trajectories(self) -> int:
        return int(self.traj[-1]) + 1

    @property
    def first(self) -> np.ndarray:
        """True where a turn is its trajectory's first."""
        return np.r_[True, self.traj[1:] != self.traj[:-1]]

    def timeline(self, latency: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) of every turn when turns take ``latency`` and tools their recorded time."""
        dur = np.asarray(latency, np.float64) + self.tool_after
        cs = np.cumsum(dur)
        before = cs - dur  # sum of every earlier row's duration
        base = before[self.first][self.traj]  # ... minus the earlier trajectories'
        start = before - base
        return start, start + latency

    def trajectory_totals(self, latency: np.ndarray) -> np.ndarray:
        """Per-trajectory wall time: its turns' latencies plus its tool calls."""
        return np.bincount(self.traj, np.asarray(latency) + self.tool_after)

    def makespan(self, latency: np.ndarray) -> float:
        """The step's rollout time: the slowest trajectory's timeline (tools included)."""
        return float(self.trajectory_totals(latency).max())


def _token_weighted_concurrency(start, end, tau) -> np.ndarray:
    """Per turn: mean in-flight count n(t) over [start, end], weighted by 1 / tau(n(t))."""
    times = np.unique(np.concatenate([start, end]))
    cnt = np.searchsorted(np.sort(start), times, side="right") - np.searchsorted(
        np.sort(end), times, side="right"
    )
    dt = np.diff(times, append=times[-1])
    w = dt / np.maximum(tau(cnt), 1e-12)
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cwn = np.concatenate([[0.0], np.cumsum(w * cnt)])
    i0, i1 = np.searchsorted(times, start), np.searchsorted(times, end)
    tot, totn = cw[i1] - cw[i0], cwn[i1] - cwn[i0]
    at_start = cnt[np.minimum(i0, len(cnt) - 1)]
    return np.where(tot > 0, totn / np.where(tot > 0, tot, 1.0), at_start)


# ----------------------------------------------------------------------------- engine model


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLatencyModel:
    """Per-turn engine latency under processor sharing (module docstring, (1)); all >= 0."""

    floor_s: float
    per_request_s: float
    prefill_s: float
    overhead_s: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"EngineLatencyModel.{f.name} = {v}: must be finite and >= 0")
        if self.floor_s == 0 and self.per_request_s == 0:
            raise ValueError(
                "EngineLatencyModel: floor_s and per_request_s are both 0 (tokens would be free)"
            )

    def tau(self, n) -> np.ndarray:
        """Seconds per decoded token of each of n in-flight turns."""
        return np.maximum(self.floor_s, self.per_request_s * np.asarray(n, np.float64))

    def simulate(self, table: TurnTable) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) of every turn of a step, from tokens and tool latencies only."""
        n = table.num_turns
        nxt = np.full(n, -1)
        same = table.traj[1:] == table.traj[:-1]
        nxt[:-1][same] = np.nonzero(same)[0] + 1
        delay = self.overhead_s + self.prefill_s * table.prefill
        start, end = np.zeros(n), np.zeros(n)
        rem = table.completion.copy()
        active = np.zeros(n, bool)
        heap = [(float(delay[i]), int(i)) for i in np.nonzero(table.first)[0]]
        heapq.heapify(heap)
        t, done = 0.0, 0

        def finish(i: int, at: float) -> None:
            end[i] = at
            j = nxt[i]
            if j >= 0:
                start[j] = at + table.tool_after[i]
                heapq.heappush(heap, (float(start[j] + delay[j]), int(j)))

        while done < n:
            idx = np.nonzero(active)[0]
            t_arrive = heap[0][0] if heap else np.inf
            if len(idx):
                tau = float(self.tau(len(idx)))
                m = float(rem[idx].min())
                t_finish = t + m * tau
            else:
                t_finish = np.inf
            if t_arrive <= t_finish:
                if len(idx):
                    rem[idx] -= (t_arrive - t) / tau
                t = t_arrive
                while heap and heap[0][0] <= t:
                    _, i = heapq.heappop(heap)
                    if rem[i] <= 0:  # zero-token turn: done on admission
                        finish(i, t)
                        done += 1
                    else:
                        active[i] = True
            else:
                rem[idx] -= m
                t = t_finish
                for i in idx[rem[idx] <= 1e-9 * max(m, 1.0)]:
                    active[i] = False
                    finish(int(i), t)
                    done += 1
        return start, end

    def predict(self, table: TurnTable) -> np.ndarray:
        """Predicted engine latency of every turn."""
        start, end = self.simulate(table)
        return end - start

    @classmethod
    def fit(cls, tables: Sequence[TurnTable]) -> EngineLatencyModel:
        """Fits on the given steps' real timelines (module docstring, Fitting)."""
        if not tables:
            raise ValueError("EngineLatencyModel.fit: no fit steps")
        timelines = [t.timeline(t.latency) for t in tables]
        model = cls(floor_s=0.0, per_request_s=1.0, prefill_s=0.0, overhead_s=0.0)
        for rnd in range(_FIT_ROUNDS):
            xs, ys = [], []
            for tab, (s, e) in zip(tables, timelines, strict=True):
                if rnd == 0:  # time-weighted first (every instant alike)
                    nbar = _token_weighted_concurrency(s, e, lambda c: np.ones_like(c, float))
                else:
                    nbar = _token_weighted_concurrency(s, e, model.tau)
                xs.append(np.stack([tab.completion * nbar, tab.prefill, np.ones(tab.num_turns)], 1))
                ys.append(tab.latency)
            x, y = np.concatenate(xs), np.concatenate(ys)
            w = 1.0 / np.maximum(y, 1e-3)
            b, p, o = nnls(x * w[:, None], y * w)
            if b <= 0:
                raise ValueError(
                    "EngineLatencyModel.fit: latency does not grow with completion tokens x "
                    "concurrency on the fit steps; the trace cannot identify the model"
                )
            model = cls(
                floor_s=0.0, per_request_s=float(b), prefill_s=float(p), overhead_s=float(o)
            )
        real = np.mean([t.makespan(t.latency) for t in tables])

        def mean_makespan(floor: float) -> float:
            m = dataclasses.replace(model, floor_s=floor)
            return float(np.mean([t.makespan(m.predict(t)) for t in tables]))

        if mean_makespan(0.0) >= real:
            return model
        lo, hi = 0.0, model.per_request_s * max(t.num_trajectories for t in tables)
        while mean_makespan(hi) < real:
            hi *= 2
        for _ in range(_FLOOR_BISECTIONS):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if mean_makespan(mid) < real else (lo, mid)
        return dataclasses.replace(model, floor_s=0.5 * (lo + hi))


# ----------------------------------------------------------------------------- reward model


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardTimeModel:
    """reward_time_s = per_token_s * response_sum + per_max_token_s * response_max + overhead_s."""

    per_token_s: float
    per_max_token_s: float
    overhead_s: float

    @staticmethod
    def _x(recs: Sequence[RewardTiming]) -> np.ndarray:
        return np.array([[r.response_sum, r.response_max, 1.0] for r in recs], np.float64)

    def predict(self, recs: Sequence[RewardTiming]) -> np.ndarray:
        return self._x(recs) @ np.array([self.per_token_s, self.per_max_token_s, self.overhead_s])

    @classmethod
    def fit(cls, recs: Sequence[RewardTiming]) -> RewardTimeModel:
        if not recs:
            raise ValueError("RewardTimeModel.fit: no reward timings on the fit steps")
        y = np.array([r.reward_time_s for r in recs])
        w = 1.0 / np.maximum(y, 1e-3)
        a, b, c = nnls(cls._x(recs) * w[:, None], y * w)
        return cls(per_token_s=float(a), per_max_token_s=float(b), overhead_s=float(c))


# ----------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutStepRow:
    step: int
    trajectories: int
    turns: int
    turn_accuracy: float
    trajectory_accuracy: float
    makespan_real_s: float
    makespan_pred_s: float

    @property
    def makespan_accuracy(self) -> float:
        return accuracy([self.makespan_pred_s], [self.makespan_real_s])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardStepRow:
    step: int
    ranks: int
    rank_accuracy: float
    stage_real_s: float  # slowest rank
    stage_pred_s: float

    @property
    def stage_accuracy(self) -> float:
        return accuracy([self.stage_pred_s], [self.stage_real_s])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProductionReport:
    """Held-out accuracy of the production latency models (``validate_production``)."""

    rollout_source: str
    fit_steps: tuple[int, ...]
    test_steps: tuple[int, ...]
    engine: EngineLatencyModel
    rollout_rows: tuple[RolloutStepRow, ...]
    turn_accuracy: float  # over every held-out turn
    trajectory_accuracy: float  # over every held-out trajectory
    makespan_accuracy: float  # over the held-out steps
    reward_source: str | None = None
    reward_fit_steps: tuple[int, ...] = ()
    reward_test_steps: tuple[int, ...] = ()
    reward: RewardTimeModel | None = None
    reward_rows: tuple[RewardStepRow, ...] = ()
    reward_rank_accuracy: float | None = None
    reward_stage_accuracy: float | None = None
    # held-out (real, predicted) pairs for the plot
    turn_pairs: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
    trajectory_pairs: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
    reward_pairs: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
    # every accuracy beside the fit-mean baseline's (``dtarl.bench.simulate.skill``)
    skill: tuple[Skill, ...] = ()

    def table(self) -> str:
        e = self.engine
        lines = [
            f"rollout: {self.rollout_source}",
            f"  fit steps {list(self.fit_steps)}, held-out steps {list(self.test_steps)}",
            f"  model: tau(n) = max({e.floor_s:.4g}, {e.per_request_s:.4g} n) s/token, "
            f"prefill {e.prefill_s:.3g} s/token, overhead {e.overhead_s:.3g} s",
            "  step  trajs  turns  turn acc  traj acc  makespan real  pred    acc",
        ]
        for r in self.rollout_rows:
            lines.append(
                f"  {r.step:>4}  {r.trajectories:>5}  {r.turns:>5}  {r.turn_accuracy:>8.1%}"
                f"  {r.trajectory_accuracy:>8.1%}  {r.makespan_real_s:>12.1f}s "
                f"{r.makespan_pred_s:>6.1f}s {r.makespan_accuracy:>6.1%}"
            )
        lines.append(
            f"  overall: per-turn {self.turn_accuracy:.1%}, per-trajectory "
            f"{self.trajectory_accuracy:.1%}, step makespan {self.makespan_accuracy:.1%}"
        )
        if self.reward is not None:
            m = self.reward
            lines += [
                f"reward: {self.reward_source}",
                f"  fit steps {list(self.reward_fit_steps)}, held-out steps "
                f"{list(self.reward_test_steps)}",
                f"  model: {m.per_token_s:.3g} s/token x response_sum + {m.per_max_token_s:.3g}"
                f" s/token x response_max + {m.overhead_s:.3g} s",
                "  step  ranks  rank acc  stage real   pred    acc",
            ]
            for r in self.reward_rows:
                lines.append(
                    f"  {r.step:>4}  {r.ranks:>5}  {r.rank_accuracy:>8.1%}  "
                    f"{r.stage_real_s:>9.1f}s {r.stage_pred_s:>6.1f}s {r.stage_accuracy:>6.1%}"
                )
            lines.append(
                f"  overall: per-rank {self.reward_rank_accuracy:.1%}, stage (slowest rank) "
                f"{self.reward_stage_accuracy:.1%}"
            )
        return "\n".join(lines + skill_table(self.skill))

    def to_dict(self) -> dict:
        d = {
            "rollout_source": self.rollout_source,
            "fit_steps": list(self.fit_steps),
            "test_steps": list(self.test_steps),
            "engine": dataclasses.asdict(self.engine),
            "rollout_rows": [
                dict(dataclasses.asdict(r), makespan_accuracy=r.makespan_accuracy)
                for r in self.rollout_rows
            ],
            "turn_accuracy": self.turn_accuracy,
            "trajectory_accuracy": self.trajectory_accuracy,
            "makespan_accuracy": self.makespan_accuracy,
            "skill": [k.to_dict() for k in self.skill],
        }
        if self.reward is not None:
            d.update(
                reward_source=self.reward_source,
                reward_fit_steps=list(self.reward_fit_steps),
                reward_test_steps=list(self.reward_test_steps),
                reward=dataclasses.asdict(self.reward),
                reward_rows=[
                    dict(dataclasses.asdict(r), stage_accuracy=r.stage_accuracy)
                    for r in self.reward_rows
                ],
                reward_rank_accuracy=self.reward_rank_accuracy,
                reward_stage_accuracy=self.reward_stage_accuracy,
            )
        return d

    def plot(self, path: str | os.PathLike) -> Path:
        """PNG of predicted vs real: per turn, per trajectory, per reward rank (held out)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [
            ("engine latency per turn", self.turn_pairs, self.turn_accuracy),
            ("trajectory total (turns + tools)", self.trajectory_pairs, self.trajectory_accuracy),
        ]
        if self.reward is not None:
            panels.append(("reward time per rank", self.reward_pairs, self.reward_rank_accuracy))
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6))
        for ax, (title, (real, pred), acc) in zip(np.atleast_1d(axes), panels, strict=True):
            ax.scatter(real, pred, s=3 if len(real) > 100 else 18, alpha=0.35)
            lo = max(min(real.min(), pred.min()), 1e-2)
            hi = max(real.max(), pred.max())
            ax.plot([lo, hi], [lo, hi], "k--", lw=1)
            if len(real) > 100:
                ax.set_xscale("log")
                ax.set_yscale("log")
            ax.set_xlabel("real (s)")
            ax.set_ylabel("predicted (s)")
            ax.set_title(f"{title}\naccuracy {acc:.1%} (held-out steps)", fontsize=10)
        return save_figure(fig, path, dpi=110)


# ----------------------------------------------------------------------------- validation


def split_steps(
    available: Sequence[int],
    fit_steps: Sequence[int] | None,
    test_steps: Sequence[int] | None,
    *,
    what: str,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Checks (or picks) disjoint fit / held-out steps among ``available``.

    Default: the first half (rounded up) of the available steps fit, the rest are held out.
    """
    avail = tuple(sorted(available))
    if len(avail) < 2:
        raise ValueError(f"{what}: {len(avail)} usable steps {list(avail)}; need >= 2")
    half = (len(avail) + 1) // 2
    fit = tuple(sorted(fit_steps)) if fit_steps is not None else avail[:half]
    if test_steps is not None:
        test = tuple(sorted(test_steps))
    else:
        test = tuple(s for s in avail if s not in fit)
    for name, steps in (("fit_steps", fit), ("test_steps", test)):
        if not steps:
            raise ValueError(f"{what}: {name} is empty; usable steps are {list(avail)}")
        bad = [s for s in steps if s not in avail]
        if bad:
            raise ValueError(f"{what}: {name} {bad} not among the usable steps {list(avail)}")
    shared = sorted(set(fit) & set(test))
    if shared:
        raise ValueError(
            f"{what}: steps {shared} are in both fit_steps and test_steps; fitting and "
            "testing must never share a step"
        )
    return fit, test


def complete_steps(run: RunTrace) -> tuple[int, ...]:
    """The run's steps minus partial ones (fewer trajectories than the fullest: the log of a
    run cut off mid-step keeps only the turns that had finished). Counts lines, parses nothing."""
    counts = {}
    for s, path in run.step_files.items():
        with open(path, encoding="utf-8") as f:
            counts[s] = sum(1 for line in f if line.strip())
    full = max(counts.values())
    return tuple(s for s in sorted(counts) if counts[s] == full)


def _run(path, default_rel: Path, what: str) -> RunTrace:
    p = Path(path) if path is not None else default_polytrace_root() / default_rel
    run = load_trace(p)
    if not isinstance(run, RunTrace):
        raise ValueError(f"{what}: {p} is not a run trace")
    return run


def validate_production(
    rollout_trace=None,
    *,
    fit_steps: Sequence[int] | None = None,
    test_steps: Sequence[int] | None = None,
    reward_trace=None,
    reward_fit_steps: Sequence[int] | None = None,
    reward_test_steps: Sequence[int] | None = None,
    reward: bool = True,
) -> ProductionReport:
    """Fits the production latency models on fit steps and scores them on held-out steps.

    ``rollout_trace``: a multi-turn run (default: the shared search_r1 run);
    ``reward_trace``: a run with reward timings (default: the shared rllm run;
    ``reward=False`` skips it). Partial steps are not usable (``complete_steps``).
    """
    run = _run(rollout_trace, SEARCH_R1_RELPATH, "rollout_trace")
    if not run.step_files or run.kind is not RunKind.MULTI_TURN:
        raise ValueError(f"rollout_trace: {run.path} has no multi-turn steps (search_r1 format)")
    fit, test = split_steps(complete_steps(run), fit_steps, test_steps, what="rollout")
    tables = {s: TurnTable.from_trajectories(s, list(run.iter_step(s))) for s in (*fit, *test)}
    engine = EngineLatencyModel.fit([tables[s] for s in fit])
    rows, tr, tp, jr, jp, mr, mp = [], [], [], [], [], [], []
    for s in test:
        tab = tables[s]
        pred = engine.predict(tab)
        real_tot, pred_tot = tab.trajectory_totals(tab.latency), tab.trajectory_totals(pred)
        rows.append(
            RolloutStepRow(
                step=s,
                trajectories=tab.num_trajectories,
                turns=tab.num_turns,
                turn_accuracy=accuracy(pred, tab.latency),
                trajectory_accuracy=accuracy(pred_tot, real_tot),
                makespan_real_s=float(real_tot.max()),
                makespan_pred_s=float(pred_tot.max()),
            )
        )
        tr.append(tab.latency)
        tp.append(pred)
        jr.append(real_tot)
        jp.append(pred_tot)
        mr.append(real_tot.max())
        mp.append(pred_tot.max())
    kw, reward_skill = {}, ()
    if reward:
        rrun = _run(reward_trace, RLLM_RELPATH, "reward_trace")
        if not rrun.reward_files:
            raise ValueError(f"reward_trace: {rrun.path} has no reward_timings_step_<k>.jsonl")
        recs: dict[int, list[RewardTiming]] = {}
        for r in rrun.iter_reward_timings():
            if not r.validate and r.reward_time_s > 0:
                recs.setdefault(r.step, []).append(r)
        rfit, rtest = split_steps(recs, reward_fit_steps, reward_test_steps, what="reward")
        model = RewardTimeModel.fit([r for s in rfit for r in recs[s]])
        rrows, rr, rp = [], [], []
        for s in rtest:
            real = np.array([r.reward_time_s for r in recs[s]])
            pred = model.predict(recs[s])
            rrows.append(
                RewardStepRow(
                    step=s,
                    ranks=len(real),
                    rank_accuracy=accuracy(pred, real),
                    stage_real_s=float(real.max()),
                    stage_pred_s=float(pred.max()),
                )
            )
            rr.append(real)
            rp.append(pred)
        rr_all, rp_all = np.concatenate(rr), np.concatenate(rp)
        fit_ranks = [[r.reward_time_s for r in recs[s]] for s in rfit]
        stage_real = [r.stage_real_s for r in rrows]
        stage_acc = accuracy([r.stage_pred_s for r in rrows], stage_real)
        kw = dict(
            reward_source=str(rrun.name),
            reward_fit_steps=rfit,
            reward_test_steps=rtest,
            reward=model,
            reward_rows=tuple(rrows),
            reward_rank_accuracy=accuracy(rp_all, rr_all),
            reward_stage_accuracy=stage_acc,
            reward_pairs=(rr_all, rp_all),
        )
        reward_skill = (
            skill("reward per rank", kw["reward_rank_accuracy"], np.concatenate(fit_ranks), rr_all),
            skill("reward stage", stage_acc, [max(v) for v in fit_ranks], stage_real),
        )
    turn_real, turn_pred = np.concatenate(tr), np.concatenate(tp)
    traj_real, traj_pred = np.concatenate(jr), np.concatenate(jp)
    fit_totals = [tables[s].trajectory_totals(tables[s].latency) for s in fit]
    acc = dict(
        turn=accuracy(turn_pred, turn_real),
        traj=accuracy(traj_pred, traj_real),
        span=accuracy(mp, mr),
    )
    fit_turns = np.concatenate([tables[s].latency for s in fit])
    rollout_skill = (
        skill("engine latency per turn", acc["turn"], fit_turns, turn_real),
        skill("trajectory total", acc["traj"], np.concatenate(fit_totals), traj_real),
        skill("step makespan", acc["span"], [t.max() for t in fit_totals], mr),
    )
    return ProductionReport(
        rollout_source=run.name,
        fit_steps=fit,
        test_steps=test,
        engine=engine,
        rollout_rows=tuple(rows),
        turn_accuracy=acc["turn"],
        trajectory_accuracy=acc["traj"],
        makespan_accuracy=acc["span"],
        turn_pairs=(turn_real, turn_pred),
        trajectory_pairs=(traj_real, traj_pred),
        skill=rollout_skill + reward_skill,
        **kw,
    )
