"""The replay suite: workload specs (what regenerates one replayed batch), the
default real-trace suite with its length scales, and JSON helpers."""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path
from typing import Any

import numpy as np

from dtarl.model.config import AttentionBackend, ModelConfig, ModelFamily, RopeScaling
from dtarl.traces.loaders import default_polytrace_root
from dtarl.traces.workload import Workload, WorkloadMode, generate_workload, sample_group_specs

SEARCH_R1_RELPATH = Path("search_r1/profile/multiturn_workload_log/0617_0223")
RLLM_RELPATH = Path("rllm/profile/packed_length_log/20260616_024512")

#: The default replay suite: (name, trace folder below the PolyTrace root, step, mode,
#: batch size, n_sampling, max_len). Lengths are scaled by ``auto_length_scale`` so the
#: longest sequence has ``max_len`` tokens (a CPU with the tiny model).
DEFAULT_SUITE = (
    ("math_verl", "verl/profile/packed_length_log/20260610_092349", 1, "trajectory", 4, None, 256),
    (
        "video_verl",
        "verl-video/profile/packed_length_log/20260609_033329",
        2,
        "trajectory",
        4,
        None,
        256,
    ),
    (
        "search_r1",
        "search_r1/profile/multiturn_workload_log/0617_0223",
        1,
        "per_turn",
        2,
        4,
        250,
    ),
    (
        "coding_rllm",
        "rllm/profile/packed_length_log/20260616_024512",
        1,
        "trajectory",
        3,
        None,
        256,
    ),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Everything that regenerates one replayed batch deterministically.

    ``source`` is a trace path or ``fitted:math`` / ``fitted:tool`` (see
    ``generate_workload``); the other fields are its arguments.
    """

    name: str
    source: str
    batch_size: int
    n_sampling: int | None = None
    step: int | None = None
    seed: int = 0
    length_scale: float = 1.0
    mode: str = "trajectory"
    min_len: int = 1
    max_response_len: int | None = None  # trace tokens, before length_scale (a sweep axis)

    def __post_init__(self):
        if self.max_response_len is not None and self.max_response_len < 1:
            raise ValueError(
                f"WorkloadSpec.max_response_len={self.max_response_len}: must be >= 1 or None"
            )
        if self.batch_size < 1:
            raise ValueError(f"WorkloadSpec.batch_size={self.batch_size}: must be >= 1")
        if not self.length_scale > 0:
            raise ValueError(f"WorkloadSpec.length_scale={self.length_scale}: must be > 0")
        try:
            WorkloadMode(self.mode)
        except ValueError:
            raise ValueError(
                f"WorkloadSpec.mode={self.mode!r}; accepted: {[m.value for m in WorkloadMode]}"
            ) from None

    def build(self, *, vocab_size: int = 256) -> Workload:
        return generate_workload(
            self.source,
            batch_size=self.batch_size,
            n_sampling=self.n_sampling,
            step=self.step,
            seed=self.seed,
            length_scale=self.length_scale,
            mode=self.mode,
            vocab_size=vocab_size,
            min_len=self.min_len,
            max_response_len=self.max_response_len,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def auto_length_scale(
    source,
    *,
    batch_size: int,
    max_len: int,
    n_sampling: int | None = None,
    step: int | None = None,
    seed: int = 0,
) -> float:
    """The ``length_scale`` that maps the sampled batch's longest sequence to ``max_len``.

    Longest sequence = prompt + whole response (RLE runs) of the unscaled specs;
    the scale is capped at 1 (never stretch a trace).
    """
    if max_len < 2:
        raise ValueError(f"max_len={max_len}: must be >= 2")
    specs, _, _ = sample_group_specs(
        source, batch_size=batch_size, n_sampling=n_sampling, step=step, seed=seed
    )
    longest = max(s.prompt_len + sum(n for _, n in r) for s in specs for r in s.responses)
    return min(1.0, max_len / max(longest, 1))


def default_suite(
    root: str | os.PathLike | None = None, *, max_len: int | None = None, seed: int = 0
) -> list[WorkloadSpec]:
    """The real-trace replay suite (``DEFAULT_SUITE``) found under ``root``, auto-scaled.

    ``max_len`` overrides every entry's longest-sequence target. Traces missing
    under ``root`` are skipped; an empty list means no PolyTrace data.
    """
    root = default_polytrace_root() if root is None else Path(root)
    out = []
    for name, rel, step, mode, bs, ns, entry_max in DEFAULT_SUITE:
        target = entry_max if max_len is None else max_len
        path = root / rel
        if not path.exists():
            continue
        scale = auto_length_scale(
            str(path), batch_size=bs, max_len=target, n_sampling=ns, step=step, seed=seed
        )
        out.append(
            WorkloadSpec(
                name=name,
                source=str(path),
                batch_size=bs,
                n_sampling=ns,
                step=step,
                seed=seed,
                length_scale=round(scale, 6),
                mode=mode,
            )
        )
    return out


def jsonable(x):
    """``x`` with enums, numpy scalars and arrays turned into JSON values (else repr)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, bool | int | float | str) or x is None:
        return x
    return repr(x)


def model_config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return jsonable(dataclasses.asdict(cfg))


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    d["family"] = ModelFamily(d["family"])
    d["attention_backend"] = AttentionBackend(d.get("attention_backend", "xla"))
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})
