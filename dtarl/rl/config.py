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
"""

from __future__ import annotations

import dataclasses
import enum
import keyword
import math
import os
import types
import typing
from typing import Any

import yaml

from dtarl import yamlconf
from dtarl.batch import LossNorm
from dtarl.engines.config import EngineConfig, EngineKind
from dtarl.errors import ConfigError
from dtarl.model.config import ModelConfig
from dtarl.rl.rewards import RewardErrorPolicy
from dtarl.rl.tasks import TaskKind


class Algorithm(enum.Enum):
    GRPO = "grpo"  # group-normalised advantages, per-sequence mean, symmetric clip
    DR_GRPO = "dr_grpo"  # no std scaling, constant normaliser
    DAPO = "dapo"  # clip-higher, token-level loss, dynamic sampling, overlong shaping
    PPO = "ppo"  # value model + GAE, per-token advantages, KL in the reward


class LossAggMode(enum.Enum):
    """How the per-token policy losses l_it (mask m_it, N sequences, c = the maximum
    response length) become the batch loss (verl's ``loss_agg_mode`` names):

        token-mean               L = sum_i sum_t m_it l_it / sum_i sum_t m_it   (DAPO, PPO)
        seq-mean-token-mean      L = 1/N sum_i (sum_t m_it l_it / sum_t m_it)   (GRPO)
        seq-mean-token-sum       L = 1/N sum_i sum_t m_it l_it
        seq-mean-token-sum-norm  L = 1/(N c) sum_i sum_t m_it l_it              (Dr.GRPO)

    ``algo.loss_agg_mode`` left unset takes the algorithm's (in brackets).
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"

    @property
    def norm(self) -> LossNorm:
        return {
            LossAggMode.TOKEN_MEAN: LossNorm.TOKEN,
            LossAggMode.SEQ_MEAN_TOKEN_MEAN: LossNorm.SEQUENCE,
            LossAggMode.SEQ_MEAN_TOKEN_SUM: LossNorm.SEQUENCE_SUM,
            LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM: LossNorm.CONSTANT,
        }[self]


class RolloutEngineKind(enum.Enum):
    CONTINUOUS = "continuous"  # dtarl.rollout.engine: continuous batching, prompt-shared K/V
    STATIC = "static"  # dtarl.rollout.sampler: one static batch per call (the reference)


class StreamedModel(enum.Enum):
    """A forward-only model of an RL step that ``rollout.streaming`` can score while
    decoding goes on (verl's role names)."""

    REF = "ref"  # the reference policy's logprobs (the KL term; algo.kl_coef > 0)
    CRITIC = "critic"  # the PPO value model's values (GAE; algo.algorithm=ppo)


class Schedule(enum.Enum):
    CONSTANT = "constant"  # linear warm-up then constant
    COSINE = "cosine"  # linear warm-up then cosine decay to 0.1 x lr
    LINEAR = "linear"  # linear warm-up then linear decay to 0


def _key(obj, name: str) -> str:
    """The key as a user writes it: ``rollout.top_p``; top-level fields bare (``steps``)."""
    return name if obj.SECTION == "trainer" else f"{obj.SECTION}.{name}"


def _positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not v > 0:
            raise ConfigError(f"{_key(obj, n)}={v!r} must be > 0")


def _nonneg(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not v >= 0:
            raise ConfigError(f"{_key(obj, n)}={v!r} must be >= 0")


def _in_range(obj, name, lo, hi, *, lo_open=False, hi_open=False):
    """``lo <= v <= hi`` (``<`` on an open end); the error names key, value and range."""
    v = getattr(obj, name)
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"{_key(obj, name)}={v!r} must be in {rng}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """The policy. ``hf_path`` (a local HF checkpoint) wins over ``preset``."""

    SECTION: typing.ClassVar[str] = "model"
    preset: str = "tiny"
    hf_path: str | None = None
    tokenizer_path: str | None = None  # a dir with tokenizer.json; default: hf_path if it has one
    seed: int = 0
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig fields

    def __post_init__(self):
        if self.hf_path is None and self.preset not in ModelConfig.PRESETS:
            raise ConfigError(
                f"model.preset={self.preset!r} is not known; accepted: {ModelConfig.PRESETS}"
            )
        _nonneg(self, "seed")
        valid = {f.name for f in dataclasses.fields(ModelConfig)}
        bad = sorted(set(self.overrides) - valid)
        if bad:
            raise ConfigError(f"model.overrides: unknown keys {bad}; valid keys: {sorted(valid)}")
        if self.hf_path is None and self.overrides:
            try:  # the preset's ranges, checked before any weights exist
                ModelConfig.preset(self.preset).replace(**self.overrides)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"model.overrides={self.overrides!r}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSection:
    SECTION: typing.ClassVar[str] = "task"
    kind: TaskKind = TaskKind.ARITHMETIC
    max_operand: int = 20  # arithmetic, calculator, verbose_arithmetic
    ops: str = "+-"  # arithmetic, verbose_arithmetic (a subset of "+-")
    num_numbers: int = 3  # countdown
    max_number: int = 9  # countdown
    allow_unused: bool = False  # countdown: accept answers that leave given numbers out
    max_turns: int = 2  # calculator
    # verbose_arithmetic: the SFT references' scratchpad (see VerboseArithmeticTask)
    max_verbosity: int = 8  # most scratchpad steps
    short_fraction: float = 0.4  # references with no scratchpad ...
    wrong_fraction: float = 0.15  # ... of which this fraction (of all) answer wrongly

    _VERBOSE_KEYS: typing.ClassVar[tuple[str, ...]] = (
        "max_verbosity",
        "short_fraction",
        "wrong_fraction",
    )

    def __post_init__(self):
        if self.kind in (TaskKind.ARITHMETIC, TaskKind.CALCULATOR, TaskKind.VERBOSE_ARITHMETIC):
            _positive(self, "max_operand")
        if self.kind is TaskKind.ARITHMETIC and (not self.ops or set(self.ops) - set("+-*")):
            raise ConfigError(f"task.ops={self.ops!r} must be a non-empty subset of '+-*'")
        if self.kind is TaskKind.VERBOSE_ARITHMETIC:
            if not self.ops or set(self.ops) - set("+-"):
                raise ConfigError(
                    f"task.ops={self.ops!r} must be a non-empty subset of '+-' (verbose_arithmetic)"
                )
            _positive(self, "max_verbosity")
            _in_range(self, "short_fraction", 0, 1)
            if not 0 <= self.wrong_fraction <= self.short_fraction:
                raise ConfigError(
                    f"task.wrong_fraction={self.wrong_fraction!r} must be in [0, "
                    f"task.short_fraction={self.short_fraction!r}] (the wrong references "
                    "are short ones)"
                )
        else:
            for name in self._VERBOSE_KEYS:
                if getattr(self, name) != getattr(TaskSection, name):
                    raise ConfigError(
                        f"task.{name}={getattr(self, name)!r}: only task.kind="
                        f"verbose_arithmetic has a scratchpad (task.kind={self.kind.value!r}); "
                        "remove the key"
                    )
        if self.kind is TaskKind.COUNTDOWN:
            _in_range(self, "num_numbers", 2, 6)
            if not self.max_number >= 2:
                raise ConfigError(f"task.max_number={self.max_number!r} must be >= 2")
        if self.kind is TaskKind.CALCULATOR:
            if not self.max_turns >= 2:
                raise ConfigError(f"task.max_turns={self.max_turns!r} must be >= 2 (calculator)")
        elif self.max_turns != TaskSection.max_turns:
            raise ConfigError(
                f"task.max_turns={self.max_turns!r}: only the calculator task has turns "
                f"(task.kind={self.kind.value!r} is single-turn); remove the key"
            )

    def options(self) -> dict[str, Any]:
        if self.kind is TaskKind.ARITHMETIC:
            return dict(max_operand=self.max_operand, ops=self.ops)
        if self.kind is TaskKind.VERBOSE_ARITHMETIC:
            return dict(
                max_operand=self.max_operand,
                ops=self.ops,
                max_verbosity=self.max_verbosity,
                short_fraction=self.short_fraction,
                wrong_fraction=self.wrong_fraction,
            )
        if self.kind is TaskKind.COUNTDOWN:
            return dict(
                num_numbers=self.num_numbers,
                max_number=self.max_number,
                allow_unused=self.allow_unused,
            )
        return dict(max_operand=self.max_operand, max_turns=self.max_turns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingSection:
    """``rollout.streaming``: score generated tokens with the step's forward-only models
    every ``chunk`` tokens while decoding goes on (papers/002 §4.3; dtarl.rollout.stream),
    instead of one forward over the finished batch. ``models``: which ones, from
    ``ref`` (needs ``algo.kl_coef > 0``) and ``critic`` (needs ``algo.algorithm: ppo``);
    empty = every one the algorithm has. Needs ``rollout.engine: continuous``. The
    policy's old logprobs are not streamed (``dtarl.rollout.stream``: the sampler's
    own logprobs already are the policy's at the rollout weights). ``device``: index
    (in ``jax.devices()``) of a device the scorers run on, beside the rollout's
    decode (-1: the rollout's own device); single-device runs only (no mesh)."""

    SECTION: typing.ClassVar[str] = "rollout.streaming"
    enabled: bool = False
    chunk: int = 16
    models: tuple[StreamedModel, ...] = ()
    device: int = -1

    def __post_init__(self):
        _positive(self, "chunk")
        if self.device < -1:
            raise ConfigError(
                f"rollout.streaming.device={self.device} must be -1 (the rollout's device) "
                "or a device index >= 0"
            )
        if len(set(self.models)) != len(self.models):
            raise ConfigError(
                f"rollout.streaming.models={[m.value for m in self.models]} names a model twice"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatSection:
    """``rollout.pat``: adaptive tensor parallelism during generation (papers/003;
    dtarl.rollout.pat). The rollout engine starts on the run's mesh and, every
    ``check_every`` decode calls once no request waits, switches to the TP of
    ``tp_candidates`` (with the live requests merged into fewer slots) whose predicted
    remaining time + switch cost is the lowest, if lower than staying. ``profile``:
    the offline profile JSON (``dtarl bench rollout --profile OUT.json`` on the
    training machine with the run's model); required when enabled, since profiling
    at startup would take minutes. Needs ``rollout.engine: continuous``, a mesh of
    several devices and one process."""

    SECTION: typing.ClassVar[str] = "rollout.pat"
    enabled: bool = False
    tp_candidates: tuple[int, ...] = (1, 2, 4, 8)
    check_every: int = 4
    profile: str = ""

    def __post_init__(self):
        _positive(self, "check_every")
        if not self.tp_candidates:
            raise ConfigError("rollout.pat.tp_candidates=[] must list TP degrees of [1, 2, 4, 8]")
        for i, tp in enumerate(self.tp_candidates):
            if tp not in (1, 2, 4, 8):
                raise ConfigError(
                    f"rollout.pat.tp_candidates[{i}]={tp!r} must be one of [1, 2, 4, 8]"
                )
        if self.enabled and not self.profile:
            raise ConfigError(
                "rollout.pat.profile='' must name a profile JSON when rollout.pat.enabled=true "
                "(make one with `dtarl bench rollout --profile OUT.json --model ...`)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSection:
    SECTION: typing.ClassVar[str] = "rollout"
    prompts_per_step: int = 16
    group_size: int = 8
    # Sampling temperature T (0 = greedy). The trainer's logprobs are those of
    # logits / T too (no top-k/top-p), so the first update is on-policy; greedy
    # rollouts train at T = 1.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8  # per turn
    stop: tuple[str, ...] = ()  # strings that end a sample (any length in tokens), besides eos
    engine: RolloutEngineKind = RolloutEngineKind.CONTINUOUS
    # continuous engine: decode slots (0 = prompts_per_step x group_size: a step at once)
    slots: int = 0
    steps_per_call: int = 16  # continuous engine: decode steps per device call
    # continuous engine: compile every rollout program (each decode window, prefill and,
    # with tool turns, extend bucket) when a sampler is first used, so that a response
    # growing past a window later in the run does not compile mid-step
    warmup: bool = True
    streaming: StreamingSection = dataclasses.field(default_factory=StreamingSection)
    pat: PatSection = dataclasses.field(default_factory=PatSection)

    def __post_init__(self):
        for i, s in enumerate(self.stop):
            if not s:
                raise ConfigError(f"rollout.stop[{i}]='' must be a non-empty string")
        _positive(self, "prompts_per_step", "group_size", "max_new_tokens", "steps_per_call")
        if self.prompts_per_step * self.group_size > MAX_ROLLOUTS_PER_STEP:
            raise ConfigError(
                f"rollout.prompts_per_step x rollout.group_size = {self.prompts_per_step} x "
                f"{self.group_size} rollouts per step; accepted: at most {MAX_ROLLOUTS_PER_STEP}"
            )
        _nonneg(self, "slots")
        _in_range(self, "top_p", 0, 1, lo_open=True)
        _nonneg(self, "temperature", "top_k")
        if not math.isfinite(self.temperature):
            raise ConfigError(f"rollout.temperature={self.temperature!r} must be finite")


MAX_ROLLOUTS_PER_STEP = 1 << 20  # prompts_per_step x group_size: host arrays stay bounded


class LambdaUnits(enum.Enum):
    """Units of ``algo.darts.lambda`` (see ``dtarl.rl.darts``)."""

    RELATIVE = "relative"  # per base batch's per-sample cost: M* = rho M N / lambda
    PER_SECOND = "per_second"  # the paper's: M* = rho / (lambda k), k in s per sample


@dataclasses.dataclass(frozen=True, kw_only=True)
class DartsSection:
    """``algo.darts``: distribution-aware rollout shaping (papers/002; dtarl.rl.darts).

    enabled: needs ``rollout.engine: continuous``. short_k: K shortest candidates per
    group (0 = group_size - 1, i.e. L = 1 longest). up_factor: M_up = up_factor x M
    candidates at most per prompt. lambda: the budget's cost trade-off (Eq. 8), in
    ``lambda_units``: ``relative`` (M_total = clip(rho M N / lambda, M N, 2 M N), the
    same on any model or machine; 0.6 gives the paper's 1.5 M N at a length spread
    rho = 0.9) or ``per_second`` (the paper's rho / (lambda k), k the fitted cost of a
    sample in seconds). ema: smoothing of the length statistics.
    """

    SECTION: typing.ClassVar[str] = "algo.darts"
    enabled: bool = False
    short_k: int = 0
    up_factor: float = 2.0
    lambda_: float = 0.6
    lambda_units: LambdaUnits = LambdaUnits.RELATIVE
    ema: float = 0.9

    def __post_init__(self):
        _nonneg(self, "short_k")
        _in_range(self, "up_factor", 1, 8)
        _positive(self, "lambda_")
        _in_range(self, "ema", 0, 1, hi_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgoSection:
    SECTION: typing.ClassVar[str] = "algo"
    algorithm: Algorithm = Algorithm.GRPO
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # default: clip_eps (0.28 for DAPO)
    kl_coef: float = 0.0  # > 0: KL to the frozen reference policy (the post-SFT weights)
    entropy_coef: float = 0.0  # > 0: entropy bonus in the policy loss (per token, same norm)
    loss_agg_mode: LossAggMode | None = None  # default: the algorithm's (see LossAggMode)
    dynamic_sampling: bool | None = None  # default: True for DAPO only
    # Dynamic sampling re-samples up to this many prompt batches per step to fill it.
    max_generation_batches: int = 3
    std_ddof: int = 0  # GRPO's group std: 0 = population (default), 1 = unbiased (n - 1)
    overlong_buffer: int = 0  # DAPO soft overlong punishment window (0 = off)
    updates_per_batch: int = 1  # passes over each rollout batch (ratio != 1 after the 1st)
    minibatches: int = 1  # optimizer steps per pass: the batch split into whole groups
    grad_accum: int = 1  # > 1: each step's gradient summed in fp32 over this many parts
    # True: the ratio's old-policy logprobs are the training engine's at the params
    # before the step's first update (no gradient through them), not the sampler's;
    # needed when the two differ (bf16, another sampler's kernels). See ``Trainer._update``.
    recompute_old_logprobs: bool = False
    engine: EngineKind = EngineKind.AUTO  # its settings: the ``engine:`` section
    darts: DartsSection = dataclasses.field(default_factory=DartsSection)
    # auto: seconds of engine tuning in all (None: unbounded); then the cost model picks
    autotune_budget_seconds: float | None = None
    # auto: JSON file of measured engine choices reused across runs (None: off)
    autotune_cache: str | None = None
    gamma: float = 1.0  # PPO GAE
    lam: float = 0.95  # PPO GAE
    value_lr: float = 1e-3  # PPO value model

    def __post_init__(self):
        _in_range(self, "clip_eps", 0, 1, hi_open=True)
        if self.clip_eps_high is not None:
            _nonneg(self, "clip_eps_high")
        _nonneg(self, "kl_coef", "entropy_coef", "overlong_buffer")
        _positive(
            self,
            "updates_per_batch",
            "value_lr",
            "max_generation_batches",
            "minibatches",
            "grad_accum",
        )
        _in_range(self, "gamma", 0, 1)
        _in_range(self, "lam", 0, 1)
        if self.std_ddof not in (0, 1):
            raise ConfigError(f"algo.std_ddof={self.std_ddof} must be 0 or 1")
        if self.autotune_budget_seconds is not None:
            _nonneg(self, "autotune_budget_seconds")
        if self.autotune_cache is not None and not (
            isinstance(self.autotune_cache, str) and self.autotune_cache
        ):
            raise ConfigError(
                f"algo.autotune_cache={self.autotune_cache!r} must be a file path (or null: off)"
            )

    @property
    def eps_high(self) -> float:
        if self.clip_eps_high is not None:
            return self.clip_eps_high
        return 0.28 if self.algorithm is Algorithm.DAPO else self.clip_eps

    @property
    def agg_mode(self) -> LossAggMode:
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return {
            Algorithm.GRPO: LossAggMode.SEQ_MEAN_TOKEN_MEAN,
            Algorithm.DR_GRPO: LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM,
            Algorithm.DAPO: LossAggMode.TOKEN_MEAN,
            Algorithm.PPO: LossAggMode.TOKEN_MEAN,
        }[self.algorithm]

    @property
    def use_dynamic_sampling(self) -> bool:
        if self.dynamic_sampling is not None:
            return self.dynamic_sampling
        return self.algorithm is Algorithm.DAPO


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSection:
    """AdamW with global-norm gradient clipping and a warm-up schedule."""

    SECTION: typing.ClassVar[str] = "optim"
    lr: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    schedule: Schedule = Schedule.CONSTANT
    # AdamW's epsilon: update = lr m / (sqrt(v) + eps). Elements with |g| near eps turn
    # fp32 rounding of g into O(lr) changes; a large eps makes the update ~linear in g.
    eps: float = 1e-8

    def __post_init__(self):
        _positive(self, "lr", "max_grad_norm", "eps")
        _nonneg(self, "weight_decay", "warmup_steps")
        _in_range(self, "b1", 0, 1, hi_open=True)
        _in_range(self, "b2", 0, 1, hi_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSection:
    """Optional warm-up on the task's reference solutions (0 steps = off)."""

    SECTION: typing.ClassVar[str] = "sft"
    steps: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 0

    def __post_init__(self):
        _nonneg(self, "steps", "warmup_steps")
        _positive(self, "batch_size", "lr")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
    """The device mesh of a run: ``dp`` data-parallel ranks x ``tp`` tensor-parallel
    ways (``dtarl.parallel``). ``dp`` unset: every device of every process not used
    by tp. One process may use fewer devices than it has (the first ``dp x tp``);
    a multi-process run (``dtarl launch``) must use every device. ``dp x tp = 1``
    is the single-device trainer (no mesh)."""

    SECTION: typing.ClassVar[str] = "mesh"
    dp: int | None = None
    tp: int = 1

    def __post_init__(self):
        if self.dp is not None:
            _positive(self, "dp")
        _positive(self, "tp")

    def resolve(self, num_devices: int, num_processes: int = 1) -> tuple[int, int]:
        """(dp, tp) on ``num_devices`` devices (every process's) or a ConfigError naming
        the field and the accepted values."""
        tp, n = self.tp, num_devices
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        if self.dp is None:
            if n % tp:
                raise ConfigError(
                    f"mesh.tp={tp} does not divide the {n} devices (mesh.dp unset uses all "
                    f"of them); accepted: mesh.tp in {divisors}, or set mesh.dp"
                )
            return n // tp, tp
        dp = self.dp
        if num_processes > 1 and dp * tp != n:
            raise ConfigError(
                f"mesh.dp={dp} x mesh.tp={tp} = {dp * tp} devices, but this {num_processes}-"
                f"process run has {n}; a multi-process run must use every device: "
                f"mesh.dp x mesh.tp = {n} (or leave mesh.dp unset)"
            )
        if dp * tp > n:
            raise ConfigError(
                f"mesh.dp={dp} x mesh.tp={tp} = {dp * tp} devices, but only {n} are "
                f"available; accepted: mesh.dp x mesh.tp <= {n}"
            )
        return dp, tp


class OnCorrupt(enum.Enum):
    """``resume.on_corrupt``: what a resume does with a step that fails verification."""

    PREVIOUS = "previous"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeSection:
    """Continue from the latest checkpoint in ``out_dir/checkpoints``. The saved run's
    config must match this one (except ``RESUME_FREE_KEYS``), or the resume is refused
    with the differing keys; ``allow_changes: true`` resumes anyway. ``resume: false``
    is short for ``resume: {enabled: false}``."""

    SECTION: typing.ClassVar[str] = "resume"
    enabled: bool = True
    allow_changes: bool = False
    # A step whose files do not match its manifest (``dtarl.rl.integrity``): skip it
    # with one line and resume from the newest intact step, or stop with the error.
    on_corrupt: OnCorrupt = OnCorrupt.PREVIOUS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportSection:
    """``hf_dir``: at the end of the run the trained policy is written there as a HF
    checkpoint (``config.json`` + safetensors, plus the tokenizer files when the
    run's tokenizer came from a HF directory), atomically. None/empty = no export."""

    SECTION: typing.ClassVar[str] = "export"
    hf_dir: str | None = None


# Keys that change how a run is observed or laid out, not what it computes: a resume
# may change them freely (dotted; a section name covers the whole section).
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
        _check_finite(self, "")  # every float key, however the config was built
        _nonneg(self, "steps", "seed", "checkpoint_every", "eval_problems", "eval_every")
        _positive(self, "keep_checkpoints")
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

    def _turns(self) -> int:
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


def _check_finite(obj, prefix: str) -> None:
    """Raises ``ConfigError`` naming the first float key (dotted) holding inf or nan."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{_yaml_key(f.name)}"
        if dataclasses.is_dataclass(v):
            _check_finite(v, key + ".")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}={v!r} must be a finite number")


def _configs_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs")


# ------------------------------------------------------------------ parsing


def _yaml_load(stream):
    return yamlconf.load(stream)  # YAML 1.2 floats; a duplicate key is an error


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A one-line description of a YAML error (PyYAML's own spans several lines)."""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    text = ", ".join(p for p in parts if p) or str(e)
    return " ".join(text.split())


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, bool) and "enabled" in {f.name for f in dataclasses.fields(tp)}:
            value = {"enabled": value}  # ``resume: false`` = ``resume: {enabled: false}``
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(
                f"{where}={value!r} is not valid; accepted: {[e.value for e in tp]}"
            ) from None
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}={value!r} must be a list")
        (item, *rest) = typing.get_args(tp) or (Any,)
        if rest and rest != [Ellipsis]:
            raise ConfigError(f"{where}: fixed-length tuples are not supported")
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}={value!r} must be a number")
        if not math.isfinite(value):  # .inf, 1e400, .nan
            raise ConfigError(f"{where}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    return value


def _field_name(key: str, fields) -> str:
    """A YAML key that is a Python keyword (``lambda``) names the field ``lambda_``."""
    return key + "_" if keyword.iskeyword(key) and key + "_" in fields else key


def _yaml_key(name: str) -> str:
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def from_dict(cls, data: dict[str, Any], where: str = ""):
    """Builds dataclass ``cls`` from nested dicts; unknown keys list the valid ones."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = {_field_name(k, fields): v for k, v in data.items()}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        section = where or "config"
        raise ConfigError(f"{section}: unknown keys {unknown}; valid keys: {sorted(fields)}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(hints[k], v, f"{where}.{k}" if where else k)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        # The engine configs' own errors already start with their key.
        msg = str(e)
        raise ConfigError(
            msg if where and msg.startswith(where) else f"{where or 'config'}: {msg}"
        ) from None


def to_dict(obj) -> dict[str, Any]:
    """Plain YAML/JSON-able dict of a config (enums as their values, tuples as lists);
    ``from_dict(type(obj), to_dict(obj)) == obj``."""
    return {_yaml_key(f.name): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(v):
    if dataclasses.is_dataclass(v):
        return to_dict(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    return v


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Applies ``a.b.c=value`` (value parsed as YAML) to nested dict ``data`` in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. rollout.group_size=8")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: malformed key {key!r}")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {assignment!r}: value is not valid YAML ({_yaml_problem(e)}); "
            "quote it, e.g. --set \"task.ops='+-*'\""
        ) from None
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if isinstance(child, bool):  # ``resume: false`` then ``--set resume.allow_changes=..``
            child = node[p] = {"enabled": child}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | os.PathLike | None, overrides=()) -> TrainerConfig:
    """Defaults <- YAML file (if any) <- ``overrides`` (``key=value`` strings)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = os.fspath(path)
        try:
            with open(p) as f:
                loaded = _yaml_load(f)
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such config file") from None
        except IsADirectoryError:
            raise ConfigError(f"{p}: is a directory, not a YAML config file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{p}: not a text file (byte {e.start} is not UTF-8); expected a YAML config"
            ) from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read the config file ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{p}{line}: malformed YAML ({_yaml_problem(e)})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded or {}
    for o in overrides:
        apply_override(data, o)
    return from_dict(TrainerConfig, data)


__all__ = [
    "AlgoSection",
    "Algorithm",
    "ConfigError",
    "DartsSection",
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
