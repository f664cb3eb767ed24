"""Workload generator: real PolyTrace length structure, dummy token ids.

``sample_workload`` turns a trace step (or the fitted production distributions)
into a ``RolloutBatch`` with the right prefix structure:

  * a GRPO group's sequences start with the *same* prompt array; distinct groups
    get independently drawn prompts;
  * ``trajectory`` mode: one sequence per trajectory, prompt then, per turn, the
    model tokens (loss 1) and tool-output tokens (loss 0) following the RLE;
  * ``per_turn`` mode: one sample per model turn; sample k is a prefix of sample
    k+1 of the same trajectory and is trained only on turn k's tokens.

Token ids are uniform in [1, vocab_size). Every length L becomes
``max(min_len, round(L * length_scale))``. Everything is deterministic per seed.

Letters: G = group size (n_sampling), R = runs of a response's loss-mask RLE.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from collections.abc import Sequence

import numpy as np

from dtarl.advantages import grpo_advantages
from dtarl.batch import RolloutBatch
from dtarl.traces.fitted import (
    MATH_MAX_LEN,
    FittedWorkload,
    load_fitted,
    sample_tool_session,
    tool_feature_dim,
)

# The samplers moved to dtarl.traces.latency; re-exported from here.
from dtarl.traces.latency import RewardTimeSampler as RewardTimeSampler
from dtarl.traces.latency import ToolLatencySampler as ToolLatencySampler
from dtarl.traces.loaders import (
    FITTED_RELPATH,
    FileKind,
    RunKind,
    RunTrace,
    default_polytrace_root,
    iter_jsonl,
    load_trace,
)
from dtarl.traces.records import PromptGroup, TraceFormatError, Trajectory


class WorkloadMode(enum.Enum):
    TRAJECTORY = "trajectory"
    PER_TURN = "per_turn"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """Length structure of one GRPO group (no tokens).

    Attributes:
      prompt_len: shared prompt tokens.
      responses: per sample, the response as RLE runs ((mask, length), ...);
        a single-turn response is ((1, L),).
      truncated: per sample, whether the response hit the length budget.
      record_index: index of the source group in the step (-1 for fitted sources).
      sample_index: per sample, index of the source response / trajectory in the group.
    """

    prompt_len: int
    responses: tuple[tuple[tuple[int, int], ...], ...]
    truncated: tuple[bool, ...]
    record_index: int = -1
    sample_index: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadInfo:
    """Per-sequence side data of a generated batch (all arrays [N]).

    group_ids: GRPO group (shared prompt) of each sequence.
    trajectory_ids: trajectory of each sequence (== row in trajectory mode).
    turn_index: model turn of a per-turn sample (-1 in trajectory mode).
    prompt_lens, response_lens: tokens before / after the prompt in the sequence.
    truncated: the source response hit its length budget.
    record_index, sample_index: source group index in the step and response index in it.
    dense_tokens / tree_tokens: tokens of the batch laid out densely / as a prefix tree
      (computed from the structure: shared prompts and per-turn prefixes counted once).
    """

    source: str
    step: int | None
    mode: WorkloadMode
    group_ids: np.ndarray
    trajectory_ids: np.ndarray
    turn_index: np.ndarray
    prompt_lens: np.ndarray
    response_lens: np.ndarray
    truncated: np.ndarray
    record_index: np.ndarray
    sample_index: np.ndarray
    dense_tokens: int
    tree_tokens: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    batch: RolloutBatch
    info: WorkloadInfo


# ----------------------------------------------------------------------------- length specs


@functools.lru_cache(maxsize=64)
def _run_max_output(step_files: tuple[tuple[int, str], ...]) -> int:
    """Largest response length over all steps of a run (the truncation budget proxy)."""
    best = 0
    for step, f in step_files:
        for rec in iter_jsonl(f, FileKind.PACKED_LENGTHS, expect_step=step):
            best = max(best, max(rec.output, default=0))
    return best


def run_max_output(run: RunTrace) -> int:
    """Largest single-turn response length over the run: responses equal to it were truncated."""
    return _run_max_output(tuple((s, str(p)) for s, p in sorted(run.step_files.items())))


def _pick(rng: np.random.Generator, available: int, want: int) -> np.ndarray:
    """``want`` indices of ``available``: without replacement if possible, else with."""
    if available <= 0:
        raise TraceFormatError("the selected step has no records to sample from")
    if want <= available:
        return rng.choice(available, size=want, replace=False)
    return rng.choice(available, size=want, replace=True)


def _specs_single_turn(
    recs: Sequence[PromptGroup], run_max: int, batch_size: int, n_sampling: int | None, rng
) -> list[GroupSpec]:
    out = []
    for gi in _pick(rng, len(recs), batch_size):
        rec = recs[int(gi)]
        g = rec.n_sampling if n_sampling is None else n_sampling
        si = np.arange(g) if g == rec.n_sampling else _pick(rng, rec.n_sampling, g)
        outs = [rec.output[int(i)] for i in si]
        out.append(
            GroupSpec(
                prompt_len=rec.input,
                responses=tuple(((1, o),) for o in outs),
                truncated=tuple(o >= run_max for o in outs),
                record_index=int(gi),
                sample_index=tuple(int(i) for i in si),
            )
        )
    return out


def group_trajectories(recs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by ``prompt_group_id`` (in order of first appearance)."""
    groups: dict[int, list[Trajectory]] = {}
    for r in recs:
        groups.setdefault(r.prompt_group_id, []).append(r)
    return list(groups.values())


def _specs_multi_turn(
    recs: Sequence[Trajectory], batch_size: int, n_sampling: int | None, rng
) -> list[GroupSpec]:
    groups = group_trajectories(recs)
    out = []
    for gi in _pick(rng, len(groups), batch_size):
        grp = groups[int(gi)]
        g = len(grp) if n_sampling is None else n_sampling
        si = np.arange(g) if g == len(grp) else _pick(rng, len(grp), g)
        trajs = [grp[int(i)] for i in si]
        out.append(
            GroupSpec(
                prompt_len=trajs[0].prompt_len,
                responses=tuple(t.loss_mask_rle for t in trajs),
                truncated=tuple(t.truncated for t in trajs),
                record_index=int(gi),
                sample_index=tuple(int(i) for i in si),
            )
        )
    return out


def _specs_fitted_math(fw: FittedWorkload, batch_size: int, n_sampling: int, rng) -> list:
    """One GMM component per group (outputs of one prompt are alike), n draws from it."""
    gmm = fw.math.joint
    out = []
    for _ in range(batch_size):
        c = int(rng.choice(len(gmm.weights), p=gmm.weights))
        one = dataclasses.replace(
            gmm,
            weights=np.ones(1),
            means=gmm.means[c : c + 1],
            covariances=gmm.covariances[c : c + 1],
        )
        x = np.rint(one.sample(rng, n_sampling))
        x = np.clip(x, 1, MATH_MAX_LEN).astype(np.int64)
        outs = [int(o) for o in x[:, 1]]
        out.append(
            GroupSpec(
                prompt_len=int(x[0, 0]),
                responses=tuple(((1, o),) for o in outs),
                truncated=tuple(o >= MATH_MAX_LEN for o in outs),
                sample_index=tuple(range(n_sampling)),
            )
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupCorrelation:
    """Within-group (same prompt) correlation of sampled tool-use trajectories.

    turns / lengths: the copula correlations of the latent normals behind the
    call count and the length features (``sample_tool_session``): each sample's
    latent is sqrt(rho) z_group + sqrt(1 - rho) z_own, so the marginals stay the
    fitted ones and same-prompt samples are alike. ``search_r1()`` holds the
    values that reproduce the intra-class correlation (ICC) of the search_r1
    trace (``measure_group_correlation``: turn counts 0.21 on step 0, 0.20 over
    steps 0-2; log model tokens per trajectory 0.32 / 0.30); the sampled ICCs are
    0.20 / 0.31 (800 groups of 8). ``independent()`` is the old behaviour.
    """

    turns: float
    lengths: float

    def __post_init__(self):
        for f in ("turns", "lengths"):
            v = getattr(self, f)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"GroupCorrelation.{f} = {v}: must be in [0, 1)")

    @classmethod
    def independent(cls) -> GroupCorrelation:
        return cls(turns=0.0, lengths=0.0)

    @classmethod
    def search_r1(cls) -> GroupCorrelation:
        return cls(turns=SEARCH_R1_LATENT_TURNS, lengths=SEARCH_R1_LATENT_LENGTHS)


# Latent correlations whose sampled ICCs match search_r1's (see GroupCorrelation.search_r1;
# checked by tests/traces/test_traces_fidelity.py).
SEARCH_R1_LATENT_TURNS = 0.22
SEARCH_R1_LATENT_LENGTHS = 0.65


def intraclass_correlation(groups_GxK: np.ndarray) -> float:
    """One-way ANOVA ICC(1) of G groups of K values: (MSB - MSW) / (MSB + (K - 1) MSW)."""
    g = np.asarray(groups_GxK, np.float64)
    if g.ndim != 2 or g.shape[0] < 2 or g.shape[1] < 2:
        raise ValueError(f"intraclass_correlation: shape {g.shape}; need [G >= 2, K >= 2]")
    k = g.shape[1]
    msb = k * g.mean(1).var(ddof=1)
    msw = g.var(1, ddof=1).mean()
    den = msb + (k - 1) * msw
    return float((msb - msw) / den) if den > 0 else 0.0


def group_icc(turn_counts_GxK, model_tokens_GxK) -> tuple[float, float]:
    """(ICC of turn counts, ICC of log model tokens) of equal-size groups."""
    return (
        intraclass_correlation(turn_counts_GxK),
        intraclass_correlation(np.log(np.maximum(np.asarray(model_tokens_GxK, float), 1.0))),
    )


def measure_group_correlation(run: RunTrace, steps: Sequence[int] | None = None):
    """ICC of turn counts and of log model tokens per trajectory within prompt groups of a
    multi-turn run (groups of the most common size), pooled over ``steps``."""
    if run.kind is not RunKind.MULTI_TURN:
        raise ValueError(f"{run.path}: not a multi-turn run (need trajectories in groups)")
    turns, toks = [], []
    for st in run.steps if steps is None else steps:
        for grp in group_trajectories(list(run.iter_step(st))):
            turns.append([t.turn_count for t in grp])
            toks.append([sum(t.model_runs) for t in grp])
    sizes = [len(g) for g in turns]
    k = max(set(sizes), key=sizes.count)
    turns = [g for g in turns if len(g) == k]
    toks = [g for g in toks if len(g) == k]
    return group_icc(turns, toks)


def _specs_fitted_tool(
    fw: FittedWorkload, batch_size: int, n_sampling: int, rng, corr: GroupCorrelation
) -> list:
    """Sessions of one group share part of their latents (``GroupCorrelation``); the group's
    prompt is input_1 of its first sample."""
    d = tool_feature_dim(fw.tool)
    out = []
    for _ in range(batch_size):
        zc_g, zf_g = rng.standard_normal(), rng.standard_normal(d)
        responses, prompt = [], None
        for _ in range(n_sampling):
            zc = np.sqrt(corr.turns) * zc_g + np.sqrt(1 - corr.turns) * rng.standard_normal()
            zf = np.sqrt(corr.lengths) * zf_g + np.sqrt(1 - corr.lengths) * rng.standard_normal(d)
            ins, outs = sample_tool_session(fw.tool, rng, z_count=zc, z_features=zf)
            prompt = int(ins[0]) if prompt is None else prompt
            runs = []
            for j, o in enumerate(outs):
                if j > 0:
                    runs.append((0, int(ins[j])))
                runs.append((1, int(o)))
            responses.append(tuple(runs))
        out.append(
            GroupSpec(
                prompt_len=prompt,
                responses=tuple(responses),
                truncated=(False,) * n_sampling,
                sample_index=tuple(range(n_sampling)),
            )
        )
    return out


def scale_len(length: int, length_scale: float, min_len: int) -> int:
    """max(min_len, round(length * length_scale))."""
    return max(min_len, int(round(length * length_scale)))


def truncate_spec(spec: GroupSpec, max_response_len: int) -> GroupSpec:
    """Responses cut at ``max_response_len`` tokens (model and tool runs alike), as a run
    with that response budget would have cut them; a cut response is marked truncated."""
    if max_response_len < 1:
        raise ValueError(f"max_response_len={max_response_len}: must be >= 1")
    responses, truncated = [], []
    for resp, was in zip(spec.responses, spec.truncated, strict=True):
        out, left = [], max_response_len
        for m, n in resp:
            if left <= 0:
                break
            out.append((m, min(n, left)))
            left -= n
        responses.append(tuple(out) if out else ((1, max_response_len),))
        truncated.append(was or left < 0)
    return dataclasses.replace(spec, responses=tuple(responses), truncated=tuple(truncated))


def _scale_spec(spec: GroupSpec, length_scale: float, min_len: int) -> GroupSpec:
    return dataclasses.replace(
        spec,
        prompt_len=scale_len(spec.prompt_len, length_scale, min_len),
        responses=tuple(
            tuple((m, scale_len(n, length_scale, min_len)) for m, n in r) for r in spec.responses
        ),
    )


def _resolve_source(source):
    """(kind, object, label): kind in {'math', 'tool', 'run'}."""
    if isinstance(source, RunTrace):
        return "run", source, source.name
    if isinstance(source, str) and source.startswith("fitted:"):
        task = source.split(":", 1)[1]
        if task not in ("math", "tool"):
            raise ValueError(f"source={source!r}: expected 'fitted:math' or 'fitted:tool'")
        path = default_polytrace_root() / FITTED_RELPATH
        if not path.exists():
            raise FileNotFoundError(
                f"source={source!r}: fitted distributions not found at {path}; set "
                "$DTARL_POLYTRACE to the PolyTrace data folder"
            )
        return task, load_fitted(path), source
    tr = load_trace(os.fspath(source))
    if isinstance(tr, FittedWorkload):
        raise ValueError(
            f"source={source!r} is the fitted JSON; pass 'fitted:math' or 'fitted:tool' instead"
        )
    if not tr.step_files:
        raise TraceFormatError(f"{tr.path}: has no packed_lengths/multiturn step files to sample")
    return "run", tr, tr.name


def _dapo_kept(run: RunTrace, step: int, n_records: int) -> set[int]:
    kept: set[int] | None = None
    for b in run.iter_dapo_filter():
        if b.workload_step == step:
            if b.prompt_count != n_records:
                raise TraceFormatError(
                    f"{run.dapo_filter}: workload_step {step} has prompt_count {b.prompt_count} "
                    f"but the step has {n_records} groups"
                )
            kept = (kept or set()) | set(b.kept_prompt_indices)
    if kept is None:
        raise ValueError(
            f"dapo_filter=True: {run.name} has no DAPO filter record for step {step}"
            + ("" if run.dapo_filter else " (no dapo_filter_indices.jsonl in the run)")
        )
    return kept


def _step_records(run: RunTrace, steps: Sequence[int], dapo_filter: bool) -> list:
    """The records of ``steps`` pooled (DAPO: only the prompts dynamic sampling kept)."""
    recs = []
    for st in steps:
        if st not in run.step_files:
            raise TraceFormatError(f"{run.path}: no step {st}; available steps {run.steps}")
        step_recs = list(run.iter_step(st))
        if dapo_filter:
            if run.kind is not RunKind.SINGLE_TURN:
                raise ValueError("dapo_filter=True: only single-turn (packed-length) runs")
            kept = _dapo_kept(run, st, len(step_recs))
            step_recs = [r for i, r in enumerate(step_recs) if i in kept]
        recs += step_recs
    return recs


def sample_group_specs(
    source,
    *,
    batch_size: int,
    n_sampling: int | None = None,
    step: int | Sequence[int] | None = None,
    seed: int = 0,
    group_correlation: GroupCorrelation | None = None,
    dapo_filter: bool = False,
) -> tuple[list[GroupSpec], str, int | tuple[int, ...] | None]:
    """Unscaled length structure of ``batch_size`` groups: (specs, source label, step used).

    Trace sources: groups of ``step`` (default: the first step; a sequence of
    steps pools their groups, e.g. ``range(0, 5)``) drawn without replacement
    (with replacement when ``batch_size`` exceeds the groups); ``n_sampling``
    None keeps each group's own size, otherwise responses are subsampled (or
    resampled). ``dapo_filter``: only the prompts DAPO's dynamic sampling kept
    (runs with ``dapo_filter_indices.jsonl``). With several steps or the filter,
    ``GroupSpec.record_index`` indexes the pooled, filtered groups. Fitted
    sources need ``n_sampling`` (default 8); tool sessions of a group are
    correlated by ``group_correlation`` (default ``GroupCorrelation.search_r1()``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if n_sampling is not None and n_sampling < 1:
        raise ValueError(f"n_sampling={n_sampling}: must be >= 1 (or None for the trace's)")
    rng = np.random.default_rng([seed, 0])
    kind, obj, label = _resolve_source(source)
    if kind == "math":
        return _specs_fitted_math(obj, batch_size, n_sampling or 8, rng), label, None
    if kind == "tool":
        corr = GroupCorrelation.search_r1() if group_correlation is None else group_correlation
        return _specs_fitted_tool(obj, batch_size, n_sampling or 8, rng, corr), label, None
    run: RunTrace = obj
    if step is None:
        step = run.steps[0]
    steps = (int(step),) if isinstance(step, int | np.integer) else tuple(int(s) for s in step)
    if not steps:
        raise ValueError("step: an empty sequence of steps; give at least one")
    recs = _step_records(run, steps, dapo_filter)
    if run.kind is RunKind.SINGLE_TURN:
        specs = _specs_single_turn(recs, run_max_output(run), batch_size, n_sampling, rng)
    else:
        specs = _specs_multi_turn(recs, batch_size, n_sampling, rng)
    return specs, label, steps[0] if len(steps) == 1 else steps


# ----------------------------------------------------------------------------- tokens


def build_workload(
    specs: Sequence[GroupSpec],
    *,
    mode: WorkloadMode | str = WorkloadMode.TRAJECTORY,
    seed: int = 0,
    vocab_size: int = 256,
    source: str = "specs",
    step: int | None = None,
) -> Workload:
    """Materialises length specs into a ``RolloutBatch`` of dummy tokens (see module doc)."""
    mode = WorkloadMode(mode)
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 2 (ids are drawn from [1, vocab))")
    rng = np.random.default_rng([seed, 1])
    tokens, masks, rows = [], [], []
    rewards_T, traj_groups_T = [], []
    dense = tree = 0
    traj = 0
    for g, spec in enumerate(specs):
        if spec.prompt_len < 1:
            raise ValueError(f"specs[{g}].prompt_len={spec.prompt_len}: must be >= 1")
        prompt = rng.integers(1, vocab_size, size=spec.prompt_len, dtype=np.int64)
        tree += spec.prompt_len
        for s, runs in enumerate(spec.responses):
            resp_len = sum(n for _, n in runs)
            resp = rng.integers(1, vocab_size, size=resp_len, dtype=np.int64)
            seq = np.concatenate([prompt, resp])
            mask = np.zeros(seq.shape[0], np.float32)
            ends, pos = [], spec.prompt_len
            for m, n in runs:
                if m == 1:
                    mask[pos : pos + n] = 1.0
                    ends.append((pos, pos + n))
                pos += n
            reward = float(rng.integers(0, 2))
            rewards_T.append(reward)
            traj_groups_T.append(g)
            common = dict(
                group=g,
                traj=traj,
                truncated=spec.truncated[s],
                record=spec.record_index,
                sample=spec.sample_index[s] if spec.sample_index else s,
            )
            if mode is WorkloadMode.TRAJECTORY:
                tokens.append(seq)
                masks.append(mask)
                rows.append(dict(common, turn=-1, prompt=spec.prompt_len, resp=resp_len))
                dense += seq.shape[0]
                tree += resp_len
            else:
                for k, (start, end) in enumerate(ends):
                    m = np.zeros(end, np.float32)
                    m[start:end] = 1.0
                    tokens.append(seq[:end])
                    masks.append(m)
                    rows.append(
                        dict(common, turn=k, prompt=spec.prompt_len, resp=end - spec.prompt_len)
                    )
                    dense += end
                tree += (ends[-1][1] - spec.prompt_len) if ends else 0
            traj += 1
    if not tokens:
        raise ValueError("the workload has no sequences (per_turn mode needs model turns)")
    adv_T = grpo_advantages(
        np.asarray(rewards_T, np.float32),
        np.asarray(traj_groups_T),
        compute_dtype=np.float32,
    )
    trajs = np.array([r["traj"] for r in rows], np.int32)
    batch = RolloutBatch.create(
        tokens=tokens,
        loss_mask=masks,
        advantages=adv_T[trajs],
        group_ids=np.array([r["group"] for r in rows], np.int32),
        rewards=np.asarray(rewards_T, np.float32)[trajs],
    )
    info = WorkloadInfo(
        source=source,
        step=step,
        mode=mode,
        group_ids=batch.group_ids,
        trajectory_ids=trajs,
        turn_index=np.array([r["turn"] for r in rows], np.int32),
        prompt_lens=np.array([r["prompt"] for r in rows], np.int64),
        response_lens=np.array([r["resp"] for r in rows], np.int64),
        truncated=np.array([r["truncated"] for r in rows], bool),
        record_index=np.array([r["record"] for r in rows], np.int64),
        sample_index=np.array([r["sample"] for r in rows], np.int64),
        dense_tokens=int(dense),
        tree_tokens=int(tree),
    )
    return Workload(batch=batch, info=info)


def generate_workload(
    source,
    *,
    batch_size: int,
    n_sampling: int | None = None,
    step: int | Sequence[int] | None = None,
    seed: int = 0,
    length_scale: float = 1.0,
    mode: WorkloadMode | str = "trajectory",
    vocab_size: int = 256,
    min_len: int = 1,
    group_correlation: GroupCorrelation | None = None,
    dapo_filter: bool = False,
    max_response_len: int | None = None,
) -> Workload:
    """``sample_workload`` plus the side structure (``WorkloadInfo``)."""
    if not length_scale > 0:
        raise ValueError(f"length_scale={length_scale}: must be > 0")
    if min_len < 1:
        raise ValueError(f"min_len={min_len}: must be >= 1 (a sequence needs a prompt token)")
    specs, label, used_step = sample_group_specs(
        source,
        batch_size=batch_size,
        n_sampling=n_sampling,
        step=step,
        seed=seed,
        group_correlation=group_correlation,
        dapo_filter=dapo_filter,
    )
    if max_response_len is not None:
        specs = [truncate_spec(s, max_response_len) for s in specs]
    specs = [_scale_spec(s, length_scale, min_len) for s in specs]
    return build_workload(
        specs, mode=mode, seed=seed, vocab_size=vocab_size, source=label, step=used_step
    )


def sample_workload(
    source,
    *,
    batch_size: int,
    n_sampling: int | None = None,
    step: int | Sequence[int] | None = None,
    seed: int = 0,
    length_scale: float = 1.0,
    mode: WorkloadMode | str = "trajectory",
    vocab_size: int = 256,
    min_len: int = 1,
    group_correlation: GroupCorrelation | None = None,
    dapo_filter: bool = False,
) -> RolloutBatch:
    """A training batch with a real trace's (or the fitted distributions') length structure.

    Args:
      source: a trace path (run directory or step file), a ``RunTrace``, or
        ``"fitted:math"`` / ``"fitted:tool"`` (production fits; any batch size).
      batch_size: number of prompt groups.
      n_sampling: sequences (trajectories) per group; None = the trace's own G (8 for fitted).
      step: trace step to sample (default: the run's first step), or a sequence of
        steps whose groups are pooled; ignored for fitted.
      seed: makes the batch deterministic (lengths, tokens, rewards).
      length_scale: every length L -> max(min_len, round(L * length_scale)).
      mode: "trajectory" (one sequence per trajectory) or "per_turn" (one per model turn).
      vocab_size: token ids are uniform in [1, vocab_size).
      min_len: smallest length after scaling (>= 1).
      group_correlation: same-prompt correlation of fitted tool sessions
        (``GroupCorrelation``; default: the search_r1 trace's).
      dapo_filter: sample only the prompts DAPO's dynamic sampling kept.

    Returns a ``RolloutBatch`` with group ids = prompt groups and GRPO advantages
    from seeded Bernoulli rewards. Use ``generate_workload`` for the side info.
    """
    return generate_workload(
        source,
        batch_size=batch_size,
        n_sampling=n_sampling,
        step=step,
        seed=seed,
        length_scale=length_scale,
        mode=mode,
        vocab_size=vocab_size,
        min_len=min_len,
        group_correlation=group_correlation,
        dapo_filter=dapo_filter,
    ).batch
