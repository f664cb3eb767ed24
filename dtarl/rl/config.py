"""Trainer configuration: frozen keyword-only dataclasses, parsed from YAML overrides.

A YAML file (``configs/*.yaml``) holds only overrides of the defaults below,
nested by section; ``--set section.key=value`` applies more on top (the value is
parsed as YAML: ``--set rollout.group_size=8``, ``--set model.hf_path=/ckpt``,
``--set engine.dfs.chunk_len=64``). Numbers read as YAML 1.2 (``1e-3`` is 0.001,
in files and ``--set``). Unknown keys raise a ``ConfigError`` listing the valid
keys of that section; a bad value names its key and the accepted range, at load,
before any model is built.

``algo.engine`` picks the training engine (an ``EngineKind``); the ``engine:``
section holds every engine's settings (``dtarl.engines.EngineConfig``).

The sections (with the ``build`` methods that make the run's objects from them) live
in ``dtarl.rl.sections`` and ``dtarl.rl.rollout_sections``, the YAML/dict parsing in
``dtarl.rl.config_io``; every name is importable from here.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

from dtarl.data.config import DataSection
from dtarl.engines.config import EngineConfig
from dtarl.errors import ConfigError
from dtarl.rl.config_io import apply_override, check_finite, from_dict, read_yaml, to_dict
from dtarl.rl.rewards import RewardErrorPolicy
from dtarl.rl.rollout_sections import (
    PatSection,
    RolloutEngineKind,
    RolloutSection,
    StreamedModel,
    StreamingSection,
)
from dtarl.rl.schedule import Schedule
from dtarl.rl.sections import (
    Algorithm,
    AlgoSection,
    DartsSection,
    ExportSection,
    LambdaUnits,
    LossAggMode,
    MeshSection,
    ModelSection,
    OnCorrupt,
    OptimSection,
    ResumeSection,
    SFTSection,
    TaskSection,
    nonneg,
    positive,
)
from dtarl.rl.tasks import TaskKind

RESUME_FREE_KEYS = (
    "out_dir",
    "resume",
    "export",
    "console",
    "tensorboard",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_every",
    "eval_problems",
    "algo.engine",
    "algo.autotune_budget_seconds",
    "algo.autotune_cache",
    "compile_cache_dir",
    "engine",
    "mesh",
)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``["optim.lr: 0.001 -> 0.002", ...]``: the keys whose values differ between two
    ``to_dict`` configs, outside ``RESUME_FREE_KEYS``."""
    a, b = _flatten(saved), _flatten(current)
    out = []
    for k in sorted(set(a) | set(b)):
        if any(k == f or k.startswith(f + ".") for f in RESUME_FREE_KEYS):
            continue
        missing = "<absent>"
        if a.get(k, missing) != b.get(k, missing):
            out.append(f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}")
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """``dtarl train CONFIG``: SFT warm-up (``sft.steps``) then ``steps`` RL steps."""

    SECTION: typing.ClassVar[str] = "trainer"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    steps: int = 20
    seed: int = 0
    out_dir: str = "runs/default"
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 2
    resume: ResumeSection = dataclasses.field(default_factory=ResumeSection)
    export: ExportSection = dataclasses.field(default_factory=ExportSection)
    eval_problems: int = 64  # greedy success rate on a fixed set, before and after
    eval_every: int = 0  # also every N RL steps (0 = only before and after)
    tensorboard: bool = True  # when tensorboardX / torch.utils.tensorboard is importable
    console: bool = True
    reward_on_error: RewardErrorPolicy = RewardErrorPolicy.RAISE
    # JAX's persistent compilation cache for this process (None: off, or whatever
    # the process set up itself); a second run of the same config reads its programs
    # from there instead of compiling them. See ``Trainer`` / ``enable_compile_cache``.
    # It also turns on dtarl's program store in ``<dir>/dtarl-programs`` (``dtarl.aot``):
    # the engines', rollout engine's and scorer's programs are kept there as
    # ``jax.export`` programs, keyed by dtarl's source, the jax version, the devices,
    # the program's settings and its input shapes, so that a second run neither traces
    # nor lowers the model (the one store for the rest of the process).
    compile_cache_dir: str | None = None

    def __post_init__(self):
        check_finite(self)  # every float key, however the config was built
        nonneg(self, "steps", "seed", "checkpoint_every", "eval_problems", "eval_every")
        positive(self, "keep_checkpoints")
        if not self.out_dir:
            raise ConfigError("out_dir='' must name a directory")
        if self.compile_cache_dir is not None and not (
            isinstance(self.compile_cache_dir, str) and self.compile_cache_dir
        ):
            raise ConfigError(
                f"compile_cache_dir={self.compile_cache_dir!r} must be a directory path "
                "(or null: off)"
            )
        d = self.algo.darts
        if d.enabled and self.rollout.engine is not RolloutEngineKind.CONTINUOUS:
            raise ConfigError(
                "algo.darts.enabled=true needs rollout.engine=continuous (early stop and "
                f"per-prompt candidate counts), got rollout.engine={self.rollout.engine.value}"
            )
        self._check_streaming()
        self._check_data()
        r = self.rollout
        if r.pat.enabled and (r.engine is not RolloutEngineKind.CONTINUOUS or r.streaming.enabled):
            raise ConfigError(
                "rollout.pat.enabled=true switches the continuous engine's mesh: it needs "
                f"rollout.engine=continuous (got {self.rollout.engine.value}) and "
                f"rollout.streaming.enabled=false (got {self.rollout.streaming.enabled}; the "
                "streaming scorers are single-device)"
            )
        if self.algo.algorithm is not Algorithm.PPO and self.rollout.group_size < 2:
            raise ConfigError(
                f"rollout.group_size={self.rollout.group_size} with algo.algorithm="
                f"{self.algo.algorithm.value}: group-relative advantages of a group of one are all "
                "0 (nothing is learned); accepted: rollout.group_size >= 2, or algo.algorithm=ppo"
            )
        if d.enabled and d.short_k > self.rollout.group_size:
            raise ConfigError(
                f"algo.darts.short_k={d.short_k} must be <= rollout.group_size="
                f"{self.rollout.group_size} (0 = group_size - 1)"
            )
        if self.algo.overlong_buffer > self.rollout.max_new_tokens * self._turns():
            raise ConfigError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} must be <= the response "
                f"budget rollout.max_new_tokens x turns = "
                f"{self.rollout.max_new_tokens * self._turns()}"
            )

    def streamed_models(self) -> tuple[StreamedModel, ...]:
        """The models ``rollout.streaming`` scores while decoding (none when it is off):
        ``rollout.streaming.models``, or every forward-only model the algorithm has."""
        st = self.rollout.streaming
        if not st.enabled:
            return ()
        if st.models:
            return st.models
        has = [(StreamedModel.REF, self.algo.kl_coef > 0)]
        has.append((StreamedModel.CRITIC, self.algo.algorithm is Algorithm.PPO))
        return tuple(m for m, on in has if on)

    def _check_streaming(self) -> None:
        st, a = self.rollout.streaming, self.algo
        if not st.enabled:
            return
        if self.rollout.engine is not RolloutEngineKind.CONTINUOUS:
            raise ConfigError(
                "rollout.streaming.enabled=true needs rollout.engine=continuous (the engine's "
                f"token callbacks), got rollout.engine={self.rollout.engine.value}"
            )
        names = [m.value for m in st.models]
        if StreamedModel.REF in st.models and a.kl_coef <= 0:
            raise ConfigError(
                f"rollout.streaming.models={names} streams the reference policy ('ref'): it "
                f"needs algo.kl_coef > 0 (got {a.kl_coef}); drop 'ref' or set a KL coefficient"
            )
        if StreamedModel.CRITIC in st.models and a.algorithm is not Algorithm.PPO:
            raise ConfigError(
                f"rollout.streaming.models={names} streams the critic ('critic'): only "
                f"algo.algorithm=ppo has one (got {a.algorithm.value}); drop 'critic'"
            )
        if not self.streamed_models():
            raise ConfigError(
                "rollout.streaming.enabled=true has no forward-only model to stream: it needs "
                f"algo.kl_coef > 0 (the reference policy; got {a.kl_coef}) or "
                f"algo.algorithm=ppo (the critic; got {a.algorithm.value})"
            )

    def _check_data(self) -> None:
        data = self.data
        if data.enabled and self.sft.steps and data.response_key is None:
            raise ConfigError(
                f"sft.steps={self.sft.steps} with data.train_files: the SFT warm-up trains on "
                "reference responses; set data.response_key to their column, or sft.steps=0"
            )
        if data.enabled and self.task != TaskSection():
            raise ConfigError(
                "task: and data.train_files are both set: the prompts come from the dataset; "
                "remove the task: section (or data.train_files)"
            )

    def _turns(self) -> int:
        if self.data.enabled:
            return 1
        return self.task.max_turns if self.task.kind is TaskKind.CALCULATOR else 1

    @property
    def total_steps(self) -> int:
        return self.sft.steps + self.steps

    def replace(self, **changes) -> TrainerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def quickstart(cls) -> TrainerConfig:
        """The embedded default (configs/quickstart.yaml): tiny model, SFT then GRPO."""
        return load_config(os.path.join(_configs_dir(), "quickstart.yaml"))


def _configs_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs")


def load_config(path: str | os.PathLike | None, overrides=()) -> TrainerConfig:
    """Defaults <- YAML file (if any) <- ``overrides`` (``key=value`` strings)."""
    data: dict[str, Any] = read_yaml(path) if path is not None else {}
    for o in overrides:
        apply_override(data, o)
    return from_dict(TrainerConfig, data)


__all__ = [
    "AlgoSection",
    "Algorithm",
    "ConfigError",
    "DartsSection",
    "DataSection",
    "ExportSection",
    "LambdaUnits",
    "LossAggMode",
    "MeshSection",
    "ModelSection",
    "OnCorrupt",
    "OptimSection",
    "PatSection",
    "RESUME_FREE_KEYS",
    "ResumeSection",
    "RolloutEngineKind",
    "RolloutSection",
    "SFTSection",
    "StreamedModel",
    "StreamingSection",
    "Schedule",
    "TaskSection",
    "TrainerConfig",
    "apply_override",
    "config_changes",
    "from_dict",
    "load_config",
    "to_dict",
]
