"""Streaming loaders for PolyTrace files, with format detection and validation.

``load_trace(path)`` accepts a single JSONL/JSON file or a run directory
(``.../packed_length_log/<run>`` or ``.../multiturn_workload_log/<run>``) and
returns a ``RunTrace`` (or a ``FittedWorkload`` for the fitted-distribution
JSON). Records are parsed lazily, one line at a time, so a multi-GB run never
has to fit in memory. Every validation error is a ``TraceFormatError`` naming
``file:line`` and the field.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from dtarl.traces.fitted import load_fitted
from dtarl.traces.records import (
    DapoFilterBatch,
    PromptGroup,
    RewardTiming,
    ToolCall,
    TraceFormatError,
    Trajectory,
    Turn,
)

ENV_VAR = "DTARL_POLYTRACE"
FITTED_RELPATH = Path("dataset/workloads/enhanced_task_distribution_parameters.json")


class FileKind(enum.Enum):
    """What one trace file holds (detected from its name)."""

    PACKED_LENGTHS = "packed_lengths"  # packed_lengths_step_<k>.jsonl
    MULTITURN = "multiturn"  # multiturn_workload_step_<k>.jsonl
    REWARD_TIMINGS = "reward_timings"  # reward_timings_step_<k>.jsonl
    DAPO_FILTER = "dapo_filter"  # dapo_filter_indices.jsonl
    FITTED = "fitted"  # *distribution_parameters*.json


_STEP_PATTERNS = (
    (re.compile(r"^packed_lengths_step_(\d+)\.jsonl$"), FileKind.PACKED_LENGTHS),
    (re.compile(r"^multiturn_workload_step_(\d+)\.jsonl$"), FileKind.MULTITURN),
    (re.compile(r"^reward_timings_step_(\d+)\.jsonl$"), FileKind.REWARD_TIMINGS),
)


def default_polytrace_root() -> Path:
    """``$DTARL_POLYTRACE`` or ``<repo>/../shared/polytrace`` (the traces live outside the repo)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "polytrace"


def detect_file(path: str | os.PathLike) -> tuple[FileKind, int | None]:
    """(kind, step) of a trace file from its name; step is None for per-run files."""
    p = Path(path)
    for pat, kind in _STEP_PATTERNS:
        m = pat.match(p.name)
        if m:
            return kind, int(m.group(1))
    if p.name == "dapo_filter_indices.jsonl":
        return FileKind.DAPO_FILTER, None
    if p.suffix == ".json" and "distribution" in p.name:
        return FileKind.FITTED, None
    raise TraceFormatError(
        f"{p}: unknown trace file name; expected packed_lengths_step_<k>.jsonl, "
        "multiturn_workload_step_<k>.jsonl, reward_timings_step_<k>.jsonl, "
        "dapo_filter_indices.jsonl or *distribution_parameters*.json"
    )


# ----------------------------------------------------------------------------- field parsing


def _get(obj: dict, key: str, where: str, prefix: str = ""):
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: field '{prefix.rstrip('.')}': expected an object")
    if key not in obj:
        raise TraceFormatError(f"{where}: missing field '{prefix}{key}'")
    return obj[key]


def _int(obj: dict, key: str, where: str, prefix: str = "", *, minimum: int | None = 0) -> int:
    v = _get(obj, key, where, prefix)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceFormatError(f"{where}: field '{prefix}{key}' = {v!r}: expected an integer")
    if minimum is not None and v < minimum:
        what = "negative length" if minimum == 0 else f"value below {minimum}"
        raise TraceFormatError(
            f"{where}: field '{prefix}{key}' = {v}: {what} (must be >= {minimum})"
        )
    return v


def _opt_int(obj: dict, key: str, where: str, default: int = -1) -> int:
    if key not in obj:
        return default
    return _int(obj, key, where, minimum=None)


def _float(obj: dict, key: str, where: str, prefix: str = "", *, nonneg: bool = True) -> float:
    v = _get(obj, key, where, prefix)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TraceFormatError(f"{where}: field '{prefix}{key}' = {v!r}: expected a number")
    if nonneg and not v >= 0:
        raise TraceFormatError(f"{where}: field '{prefix}{key}' = {v}: must be >= 0")
    return float(v)


def _str(obj: dict, key: str, where: str, prefix: str = "") -> str:
    v = _get(obj, key, where, prefix)
    if not isinstance(v, str):
        raise TraceFormatError(f"{where}: field '{prefix}{key}' = {v!r}: expected a string")
    return v


def _list(obj: dict, key: str, where: str, prefix: str = "") -> list:
    v = _get(obj, key, where, prefix)
    if not isinstance(v, list):
        raise TraceFormatError(f"{where}: field '{prefix}{key}': expected a list, got {v!r:.60}")
    return v


def _int_list(obj: dict, key: str, where: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(_list(obj, key, where)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TraceFormatError(f"{where}: field '{key}[{i}]' = {v!r}: expected an integer")
        if v < 0:
            raise TraceFormatError(f"{where}: field '{key}[{i}]' = {v}: negative length")
        out.append(v)
    return tuple(out)


def _bool(obj: dict, key: str, where: str) -> bool:
    v = obj.get(key, False)
    if not isinstance(v, bool):
        raise TraceFormatError(f"{where}: field '{key}' = {v!r}: expected true/false")
    return v


# ----------------------------------------------------------------------------- record parsers


def parse_prompt_group(obj: dict, where: str) -> PromptGroup:
    """Validates one packed-length line: lengths >= 0 and len(output) == n_sampling."""
    n = _int(obj, "n_sampling", where, minimum=1)
    output = _int_list(obj, "output", where)
    if len(output) != n:
        raise TraceFormatError(
            f"{where}: field 'output' has {len(output)} responses but n_sampling = {n}"
        )
    return PromptGroup(
        step=_int(obj, "step", where),
        input=_int(obj, "input", where),
        output=output,
        n_sampling=n,
        rank=_opt_int(obj, "rank", where),
        dp_rank=_opt_int(obj, "dp_rank", where),
        tp_rank=_opt_int(obj, "tp_rank", where),
        local_index=_opt_int(obj, "local_index", where),
        validate=_bool(obj, "validate", where),
    )


def parse_dapo_filter(obj: dict, where: str) -> DapoFilterBatch:
    """Validates one DAPO filter line: counts match index lists, used ⊆ kept ⊆ [0, prompts)."""
    prompt_count = _int(obj, "prompt_count", where)
    kept = _int_list(obj, "kept_prompt_indices", where)
    used = _int_list(obj, "used_prompt_indices", where)
    for name, idx in (("kept_prompt_indices", kept), ("used_prompt_indices", used)):
        count_key = name.replace("_indices", "_count")
        if count_key in obj and _int(obj, count_key, where) != len(idx):
            raise TraceFormatError(
                f"{where}: field '{count_key}' = {obj[count_key]} but '{name}' has {len(idx)} "
                "entries"
            )
        bad = [i for i in idx if i >= prompt_count]
        if bad:
            raise TraceFormatError(
                f"{where}: field '{name}' has index {bad[0]} >= prompt_count {prompt_count}"
            )
    if not set(used) <= set(kept):
        raise TraceFormatError(
            f"{where}: field 'used_prompt_indices' has prompts not in 'kept_prompt_indices'"
        )
    return DapoFilterBatch(
        workload_step=_int(obj, "workload_step", where),
        trainer_step=_int(obj, "trainer_step", where),
        gen_batch_index=_int(obj, "gen_batch_index", where),
        prompt_count=prompt_count,
        n_sampling=_int(obj, "n_sampling", where, minimum=1),
        train_batch_size=_int(obj, "train_batch_size", where),
        num_prompt_in_batch_before=_int(obj, "num_prompt_in_batch_before", where),
        kept_prompt_indices=kept,
        used_prompt_indices=used,
    )


def parse_reward_timing(obj: dict, where: str) -> RewardTiming:
    """Validates one reward-timing line (times and lengths >= 0)."""
    return RewardTiming(
        step=_int(obj, "step", where),
        rank=_int(obj, "rank", where),
        dp_rank=_int(obj, "dp_rank", where),
        tp_rank=_int(obj, "tp_rank", where),
        batch_size=_int(obj, "batch_size", where),
        reward_time_s=_float(obj, "reward_time_s", where),
        response_sum=_int(obj, "response_sum", where),
        response_mean=_float(obj, "response_mean", where),
        response_max=_int(obj, "response_max", where),
        validate=_bool(obj, "validate", where),
    )


def _parse_turn(obj, where: str, i: int) -> Turn:
    p = f"turns[{i}]."
    return Turn(
        turn=_int(obj, "turn", where, p),
        generation_prompt_len=_int(obj, "generation_prompt_len", where, p),
        cached_tokens=_int(obj, "cached_tokens", where, p),
        completion_tokens=_int(obj, "completion_tokens", where, p),
        assistant_append_len=_int(obj, "assistant_append_len", where, p),
        assistant_loss_len=_int(obj, "assistant_loss_len", where, p),
        finish_reason=_str(obj, "finish_reason", where, p),
        tool_call_count=_int(obj, "tool_call_count", where, p),
        engine_latency_s=_float(obj, "engine_latency_s", where, p),
        generated_text_token_len=(
            _int(obj, "generated_text_token_len", where, p)
            if "generated_text_token_len" in obj
            else None
        ),
    )


def _parse_tool_call(obj, where: str, i: int) -> ToolCall:
    p = f"tool_calls[{i}]."
    return ToolCall(
        turn=_int(obj, "turn", where, p),
        tool_name=_str(obj, "tool_name", where, p),
        latency_s=_float(obj, "latency_s", where, p),
        response_token_len=_int(obj, "response_token_len", where, p),
        append_len=_int(obj, "append_len", where, p),
        status=_str(obj, "status", where, p),
    )


def _parse_rle(obj: dict, where: str) -> tuple[tuple[int, int], ...]:
    key = "response_loss_mask_rle"
    runs = []
    for i, run in enumerate(_list(obj, key, where)):
        if (
            not isinstance(run, list)
            or len(run) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in run)
        ):
            raise TraceFormatError(
                f"{where}: field '{key}[{i}]' = {run!r}: expected a [mask, length] integer pair"
            )
        mask, length = run
        if mask not in (0, 1):
            raise TraceFormatError(f"{where}: field '{key}[{i}]' mask = {mask}: must be 0 or 1")
        if length < 0:
            raise TraceFormatError(
                f"{where}: field '{key}[{i}]' length = {length}: negative length"
            )
        runs.append((mask, length))
    return tuple(runs)


def parse_trajectory(obj: dict, where: str) -> Trajectory:
    """Validates one multi-turn line: RLE sums to final_response_len, counts match lists."""
    turns = tuple(_parse_turn(t, where, i) for i, t in enumerate(_list(obj, "turns", where)))
    calls = tuple(
        _parse_tool_call(t, where, i) for i, t in enumerate(_list(obj, "tool_calls", where))
    )
    rle = _parse_rle(obj, where)
    prompt_len = _int(obj, "prompt_len", where)
    resp = _int(obj, "final_response_len", where)
    total = _int(obj, "final_total_len", where)
    rle_sum = sum(n for _, n in rle)
    if rle_sum != resp:
        raise TraceFormatError(
            f"{where}: field 'response_loss_mask_rle' runs sum to {rle_sum} tokens but "
            f"final_response_len = {resp}"
        )
    if total < prompt_len + resp:
        raise TraceFormatError(
            f"{where}: field 'final_total_len' = {total} < prompt_len + final_response_len = "
            f"{prompt_len + resp}"
        )
    for key, items in (("turn_count", turns), ("tool_call_count", calls)):
        if key in obj and _int(obj, key, where) != len(items):
            raise TraceFormatError(
                f"{where}: field '{key}' = {obj[key]} but the record lists {len(items)}"
            )
    finish = obj.get("finish_reason", turns[-1].finish_reason if turns else "stop")
    if not isinstance(finish, str):
        raise TraceFormatError(f"{where}: field 'finish_reason' = {finish!r}: expected a string")
    return Trajectory(
        step=_int(obj, "step", where),
        prompt_group_id=_int(obj, "prompt_group_id", where),
        sample_id=_int(obj, "sample_id", where),
        prompt_len=prompt_len,
        max_response_len=_int(obj, "max_response_len", where),
        turns=turns,
        tool_calls=calls,
        final_total_len=total,
        final_response_len=resp,
        loss_mask_rle=rle,
        finish_reason=finish,
        validate=_bool(obj, "validate", where),
    )


_PARSERS = {
    FileKind.PACKED_LENGTHS: parse_prompt_group,
    FileKind.MULTITURN: parse_trajectory,
    FileKind.REWARD_TIMINGS: parse_reward_timing,
    FileKind.DAPO_FILTER: parse_dapo_filter,
}


def iter_jsonl(path: str | os.PathLike, kind: FileKind | None = None, *, expect_step=None):
    """Lazily parses a JSONL trace file, one validated record per non-blank line.

    ``expect_step``: when given, each record's ``step`` field must equal it
    (the step in the file name).
    """
    p = Path(path)
    if kind is None:
        kind, expect_step = detect_file(p)
    if kind is FileKind.FITTED:
        raise TraceFormatError(f"{p}: the fitted-distribution JSON is not JSONL; use load_fitted")
    parse = _PARSERS[kind]
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(
                    f"{where}: malformed JSON ({e.msg} at column {e.colno})"
                ) from e
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            rec = parse(obj, where)
            step = getattr(rec, "step", None)
            if expect_step is not None and step is not None and step != expect_step:
                raise TraceFormatError(
                    f"{where}: field 'step' = {step} but the file name says step {expect_step}"
                )
            yield rec


# ----------------------------------------------------------------------------- runs


class RunKind(enum.Enum):
    SINGLE_TURN = "single_turn"  # packed-length logs: PromptGroup records
    MULTI_TURN = "multi_turn"  # multiturn workload logs: Trajectory records


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunTrace:
    """One training run's trace files (no records are read until asked for).

    Attributes:
      path: the run directory, or the single file that was loaded.
      task: task name from the path (the folder above ``profile/``: verl, rllm, ...).
      kind: single-turn or multi-turn.
      step_files: {step: path} of the main per-step records.
      reward_files: {step: path} of rllm reward timings (may be empty).
      dapo_filter: path of ``dapo_filter_indices.jsonl`` or None.
    """

    path: Path
    task: str
    kind: RunKind
    step_files: dict[int, Path]
    reward_files: dict[int, Path] = dataclasses.field(default_factory=dict)
    dapo_filter: Path | None = None

    @property
    def name(self) -> str:
        run = self.path.name if self.path.is_dir() else self.path.parent.name
        return f"{self.task}/{run}"

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(sorted(self.step_files))

    def iter_step(self, step: int) -> Iterator[PromptGroup | Trajectory]:
        """Lazily yields the records of one step."""
        if step not in self.step_files:
            raise TraceFormatError(f"{self.path}: no step {step}; available steps {self.steps}")
        kind = FileKind.PACKED_LENGTHS if self.kind is RunKind.SINGLE_TURN else FileKind.MULTITURN
        return iter_jsonl(self.step_files[step], kind, expect_step=step)

    def iter_records(self, steps=None) -> Iterator[PromptGroup | Trajectory]:
        """Lazily yields the records of the given steps (all by default), step by step."""
        for s in self.steps if steps is None else steps:
            yield from self.iter_step(s)

    def iter_reward_timings(self, steps=None) -> Iterator[RewardTiming]:
        for s in sorted(self.reward_files) if steps is None else steps:
            if s in self.reward_files:
                yield from iter_jsonl(self.reward_files[s], FileKind.REWARD_TIMINGS, expect_step=s)

    def iter_dapo_filter(self) -> Iterator[DapoFilterBatch]:
        if self.dapo_filter is not None:
            yield from iter_jsonl(self.dapo_filter, FileKind.DAPO_FILTER)


def _task_name(path: Path) -> str:
    parts = path.resolve().parts
    if "profile" in parts:
        i = parts.index("profile")
        if i > 0:
            return parts[i - 1]
    return path.name


def _run_from_dir(d: Path) -> RunTrace | None:
    main: dict[FileKind, dict[int, Path]] = {}
    dapo = None
    for f in sorted(d.iterdir()):
        if not f.is_file():
            continue
        try:
            kind, step = detect_file(f)
        except TraceFormatError:
            continue
        if kind is FileKind.DAPO_FILTER:
            dapo = f
        elif step is not None:
            main.setdefault(kind, {})[step] = f
    packed = main.get(FileKind.PACKED_LENGTHS, {})
    multi = main.get(FileKind.MULTITURN, {})
    rewards = main.get(FileKind.REWARD_TIMINGS, {})
    if packed and multi:
        raise TraceFormatError(
            f"{d}: holds both packed_lengths and multiturn_workload step files; keep one "
            "run per directory"
        )
    if not (packed or multi or rewards or dapo):
        return None
    kind = RunKind.MULTI_TURN if multi else RunKind.SINGLE_TURN
    return RunTrace(
        path=d,
        task=_task_name(d),
        kind=kind,
        step_files=multi or packed,
        reward_files=rewards,
        dapo_filter=dapo,
    )


def load_trace(path: str | os.PathLike):
    """Opens a trace: a run directory, one trace file, or the fitted-distribution JSON.

    Returns a ``RunTrace`` (records are streamed on demand) or, for the fitted
    JSON, a ``FittedWorkload``. Raises ``TraceFormatError`` if nothing is recognised.
    """

    p = Path(path)
    if not p.exists():
        raise TraceFormatError(
            f"{p}: no such file or directory (set ${ENV_VAR} or pass the PolyTrace path)"
        )
    if p.is_dir():
        run = _run_from_dir(p)
        if run is None:
            found = find_traces(p)
            hint = f"; it contains {len(found)} traces below, use find_traces()" if found else ""
            raise TraceFormatError(f"{p}: no trace files directly in this directory{hint}")
        return run
    kind, step = detect_file(p)
    if kind is FileKind.FITTED:
        return load_fitted(p)
    task = _task_name(p.parent)
    if kind is FileKind.DAPO_FILTER:
        return RunTrace(path=p, task=task, kind=RunKind.SINGLE_TURN, step_files={}, dapo_filter=p)
    if kind is FileKind.REWARD_TIMINGS:
        return RunTrace(
            path=p, task=task, kind=RunKind.SINGLE_TURN, step_files={}, reward_files={step: p}
        )
    rk = RunKind.MULTI_TURN if kind is FileKind.MULTITURN else RunKind.SINGLE_TURN
    return RunTrace(path=p, task=task, kind=rk, step_files={step: p})


def find_traces(root: str | os.PathLike) -> list:
    """Every run directory and fitted JSON below ``root`` (sorted by path), unopened records."""

    root = Path(root)
    if root.is_file():
        return [load_trace(root)]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        d = Path(dirpath)
        run = _run_from_dir(d)
        if run is not None:
            out.append(run)
        for fn in sorted(filenames):
            if fn.endswith(".json") and "distribution" in fn:
                out.append(load_fitted(d / fn))
    return out
