"""The sections of ``TrainerConfig`` (``dtarl.rl.config``), each building its own objects.

    model, tokenizer = cfg.model.build()                # ModelSection
    mesh = cfg.mesh.build()                              # MeshSection: ('dp', 'tp') or None
    opt = cfg.optim.build(total=100)                     # OptimSection: AdamW + schedule
    sampler, eval_sampler = cfg.rollout.build(model, ...)  # dtarl.rl.rollout_sections
    engine = cfg.algo.build_engine(model, cfg.engine)    # AlgoSection (+ the engine: section)

Every section is a frozen keyword-only dataclass whose ``__post_init__`` names the
bad key and the accepted range. ``build`` methods import what they build lazily, so
that reading a config imports no model, engine or sampler.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import typing
from typing import Any

import jax

from dtarl.batch import LossNorm
from dtarl.engines.config import EngineConfig, EngineKind
from dtarl.errors import ConfigError
from dtarl.lora.adapters import LoraConfig
from dtarl.model.config import ModelConfig, Remat
from dtarl.parallel.mesh import FsdpGather
from dtarl.rl.schedule import Schedule
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


def _key(obj, name: str) -> str:
    """The key as a user writes it: ``rollout.top_p``; top-level fields bare (``steps``)."""
    return name if obj.SECTION == "trainer" else f"{obj.SECTION}.{name}"


def positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not v > 0:
            raise ConfigError(f"{_key(obj, n)}={v!r} must be > 0")


def nonneg(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not v >= 0:
            raise ConfigError(f"{_key(obj, n)}={v!r} must be >= 0")


def in_range(obj, name, lo, hi, *, lo_open=False, hi_open=False):
    """``lo <= v <= hi`` (``<`` on an open end); the error names key, value and range."""
    v = getattr(obj, name)
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"{_key(obj, name)}={v!r} must be in {rng}")


class TokenizerKind(enum.Enum):
    """``model.tokenizer``: ``auto`` reads the tokenizer.json of ``model.tokenizer_path``
    or ``model.hf_path`` (an HF folder without one is an error) and uses the byte
    tokenizer for presets; ``byte`` always uses the 256-id byte tokenizer."""

    AUTO = "auto"
    BYTE = "byte"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """The policy. ``hf_path`` (a local HF checkpoint) wins over ``preset``."""

    SECTION: typing.ClassVar[str] = "model"
    preset: str = "tiny"
    hf_path: str | None = None
    tokenizer_path: str | None = None  # a dir with tokenizer.json; default: hf_path
    tokenizer: TokenizerKind = TokenizerKind.AUTO
    seed: int = 0
    # What each decoder layer keeps for the backward pass: none (everything), full
    # (nothing: recomputed), dots_saveable (the weight products), offload (those in
    # pinned host memory on GPU/TPU, dots_saveable elsewhere).
    remat: Remat = Remat.NONE
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig fields
    # LoRA adapters on a frozen base (absent: full fine-tuning); docs/lora.md
    lora: LoraConfig | None = None

    def __post_init__(self):
        if self.hf_path is None and self.preset not in ModelConfig.PRESETS:
            raise ConfigError(
                f"model.preset={self.preset!r} is not known; accepted: {ModelConfig.PRESETS}"
            )
        nonneg(self, "seed")
        if self.tokenizer is TokenizerKind.BYTE and self.tokenizer_path is not None:
            raise ConfigError(
                f"model.tokenizer=byte with model.tokenizer_path={self.tokenizer_path!r}: the "
                "byte tokenizer reads no files; drop one of the two"
            )
        valid = {f.name for f in dataclasses.fields(ModelConfig)}
        bad = sorted(set(self.overrides) - valid)
        if bad:
            raise ConfigError(f"model.overrides: unknown keys {bad}; valid keys: {sorted(valid)}")
        if self.hf_path is None and self.overrides:
            try:  # the preset's ranges, checked before any weights exist
                ModelConfig.preset(self.preset).replace(**self.overrides)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"model.overrides={self.overrides!r}: {e}") from None

    def build(self):
        """(model, tokenizer): the HF checkpoint at ``hf_path`` or the preset (with
        ``overrides``, initialised from ``seed``), and the tokenizer.json of
        ``tokenizer_path`` / ``hf_path`` (the byte tokenizer when neither has one)."""
        from dtarl.model import init_model, load_hf
        from dtarl.model.tokenizer import ByteTokenizer, load_tokenizer

        if self.hf_path is not None and not os.path.isdir(self.hf_path):
            raise ConfigError(f"model.hf_path={self.hf_path!r} is not a directory")
        if self.tokenizer_path is not None and not os.path.exists(
            os.path.join(self.tokenizer_path, "tokenizer.json")
        ):
            raise ConfigError(f"model.tokenizer_path={self.tokenizer_path!r} has no tokenizer.json")
        settings = {"remat": self.remat, **self.overrides}
        if self.hf_path is not None:
            model = load_hf(self.hf_path, **settings)
        else:
            mc = ModelConfig.preset(self.preset).replace(**settings)
            model = init_model(mc, seed=self.seed)
        tok_dir = self.tokenizer_dir
        if tok_dir is None:
            tokenizer = ByteTokenizer()
        elif os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            tokenizer = load_tokenizer(tok_dir)
        else:
            raise ConfigError(
                f"model.hf_path={self.hf_path!r} has no tokenizer.json (a HF 'fast' tokenizer); "
                "set model.tokenizer_path to a directory with one, or model.tokenizer=byte for "
                "the 256-id byte tokenizer"
            )
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                f"{model.cfg.vocab_size}; set model.tokenizer_path to a matching tokenizer.json"
            )
        return model, tokenizer

    @property
    def tokenizer_dir(self) -> str | None:
        """Where the run's tokenizer files come from (None: the byte tokenizer's)."""
        if self.tokenizer is TokenizerKind.BYTE:
            return None
        return self.tokenizer_path or self.hf_path


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
            positive(self, "max_operand")
        if self.kind is TaskKind.ARITHMETIC and (not self.ops or set(self.ops) - set("+-*")):
            raise ConfigError(f"task.ops={self.ops!r} must be a non-empty subset of '+-*'")
        if self.kind is TaskKind.VERBOSE_ARITHMETIC:
            if not self.ops or set(self.ops) - set("+-"):
                raise ConfigError(
                    f"task.ops={self.ops!r} must be a non-empty subset of '+-' (verbose_arithmetic)"
                )
            positive(self, "max_verbosity")
            in_range(self, "short_fraction", 0, 1)
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
            in_range(self, "num_numbers", 2, 6)
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

    def build(self):
        """The task (``dtarl.rl.tasks.make_task``) with this section's options."""
        from dtarl.rl.tasks import make_task

        return make_task(self.kind, **self.options())


class LambdaUnits(enum.Enum):
    """Units of ``algo.darts.lambda`` (see ``dtarl.rl.darts``)."""

    RELATIVE = "relative"  # per base batch's per-sample cost: M* = rho M N / lambda
    PER_SECOND = "per_second"  # the paper's: M* = rho / (lambda k), k in s per sample


@dataclasses.dataclass(frozen=True, kw_only=True)
class DartsSection:
    """``algo.darts``: distribution-aware rollout shaping (DARTS, arXiv 2605.30859; dtarl.rl.darts).

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
        nonneg(self, "short_k")
        in_range(self, "up_factor", 1, 8)
        positive(self, "lambda_")
        in_range(self, "ema", 0, 1, hi_open=True)

    def candidates(self, group_size: int) -> int:
        """The most samples of one prompt: M_up = ``up_factor`` x M when enabled."""
        return max(group_size, int(self.up_factor * group_size)) if self.enabled else group_size

    def build(self):
        """The run's (checkpointed) DARTS statistics, or None when disabled."""
        from dtarl.rl.darts import DartsState

        return DartsState(ema=self.ema) if self.enabled else None


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
    # needed when the two differ (bf16, another sampler's kernels). See
    # ``dtarl.rl.update.run_updates``.
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
        in_range(self, "clip_eps", 0, 1, hi_open=True)
        if self.clip_eps_high is not None:
            nonneg(self, "clip_eps_high")
        nonneg(self, "kl_coef", "entropy_coef", "overlong_buffer")
        positive(
            self,
            "updates_per_batch",
            "value_lr",
            "max_generation_batches",
            "minibatches",
            "grad_accum",
        )
        in_range(self, "gamma", 0, 1)
        in_range(self, "lam", 0, 1)
        if self.std_ddof not in (0, 1):
            raise ConfigError(f"algo.std_ddof={self.std_ddof} must be 0 or 1")
        if self.autotune_budget_seconds is not None:
            nonneg(self, "autotune_budget_seconds")
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

    def build_loss(self, max_response: int):
        """The policy loss of ``algorithm``, aggregated by ``agg_mode``.

        GRPO: per-sequence mean; DAPO: token-level mean; Dr.GRPO: the token sum over
        N * ``max_response`` (also the constant of ``seq-mean-token-sum-norm`` under
        any algorithm); PPO: token-level, GAE advantages in the batch's
        ``token_advantages`` and the KL in the reward instead of the loss.
        """
        from dtarl.losses import ClippedSurrogateLoss

        norm = self.agg_mode.norm
        return ClippedSurrogateLoss(
            eps_low=self.clip_eps,
            eps_high=self.eps_high,
            kl_coef=0.0 if self.algorithm is Algorithm.PPO else self.kl_coef,
            entropy_coef=self.entropy_coef,
            norm=norm,
            norm_constant=float(max_response) if norm is LossNorm.CONSTANT else None,
        )

    def engine_config(self, engine: EngineConfig) -> EngineConfig:
        """The ``engine:`` section with ``autotune_budget_seconds`` and ``autotune_cache``
        (where set) in auto's settings."""
        auto = engine.auto
        if self.autotune_budget_seconds is not None:
            auto = dataclasses.replace(auto, budget_seconds=self.autotune_budget_seconds)
        if self.autotune_cache is not None:
            auto = dataclasses.replace(auto, cache_path=self.autotune_cache)
        return dataclasses.replace(engine, auto=auto)

    def build_engine(self, model, engine: EngineConfig, *, temperature: float = 1.0):
        """The training engine ``self.engine`` with the ``engine:`` section's settings;
        its logprobs are those of logits / ``temperature``."""
        from dtarl.engines import make_engine

        return make_engine(self.engine, model, self.engine_config(engine), temperature=temperature)

    def build_value(self, model, *, seed: int):
        """PPO's value model (a head on a copy of ``model``), None for the other algorithms."""
        from dtarl.rl.value import ValueModel

        if self.algorithm is not Algorithm.PPO:
            return None
        return ValueModel(model, lr=self.value_lr, seed=seed)


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
        positive(self, "lr", "max_grad_norm", "eps")
        nonneg(self, "weight_decay", "warmup_steps")
        in_range(self, "b1", 0, 1, hi_open=True)
        in_range(self, "b2", 0, 1, hi_open=True)

    def build(
        self,
        *,
        total: int,
        lr: float | None = None,
        warmup: int | None = None,
        schedule: Schedule | None = None,
    ):
        """The optimiser (``dtarl.rl.optim.Optimizer``: AdamW behind global-norm clipping)
        over ``total`` updates; ``lr``, ``warmup`` and ``schedule`` default to this
        section's."""
        from dtarl.rl.optim import make_optimizer

        return make_optimizer(
            lr=self.lr if lr is None else lr,
            warmup=self.warmup_steps if warmup is None else warmup,
            total=total,
            schedule=self.schedule if schedule is None else schedule,
            cfg=self,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSection:
    """Optional warm-up on the task's reference solutions (0 steps = off)."""

    SECTION: typing.ClassVar[str] = "sft"
    steps: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 0

    def __post_init__(self):
        nonneg(self, "steps", "warmup_steps")
        positive(self, "batch_size", "lr")

    def build_optimizer(self, optim: OptimSection):
        """The warm-up's optimiser: ``optim``'s AdamW at ``lr``, constant after
        ``warmup_steps``, over ``steps`` updates."""
        return optim.build(
            lr=self.lr, warmup=self.warmup_steps, total=self.steps, schedule=Schedule.CONSTANT
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
    """The device mesh of a run: ``dp`` data-parallel ranks x ``fsdp`` data-parallel
    ranks that also split the parameters, gradients and optimiser moments (ZeRO-3)
    x ``tp`` tensor-parallel ways (``dtarl.parallel``). ``dp`` unset: every device of
    every process not used by fsdp x tp. One process may use fewer devices than it
    has (the first ``dp x fsdp x tp``); a multi-process run (``dtarl launch``) must
    use every device. ``dp x fsdp x tp = 1`` is the single-device trainer (no
    mesh). ``fsdp > 1`` builds a ('dp', 'fsdp', 'tp') mesh, else ('dp', 'tp')."""

    SECTION: typing.ClassVar[str] = "mesh"
    dp: int | None = None
    fsdp: int = 1  # data-parallel ranks that also split params, grads and Adam moments (ZeRO-3)
    tp: int = 1
    # Where fsdp all-gathers the weights: per decoder layer inside the layer scan
    # (layer), or the whole model before the step (step); dtarl.parallel.fsdp.
    fsdp_gather: FsdpGather = FsdpGather.LAYER

    def __post_init__(self):
        if self.dp is not None:
            positive(self, "dp")
        positive(self, "fsdp")
        positive(self, "tp")

    def resolve(self, num_devices: int, num_processes: int = 1) -> tuple[int, int]:
        """(dp, tp) on ``num_devices`` devices (every process's) or a ConfigError naming
        the field and the accepted values (``resolve3`` with fsdp)."""
        dp, _, tp = self.resolve3(num_devices, num_processes)
        return dp, tp

    def resolve3(self, num_devices: int, num_processes: int = 1) -> tuple[int, int, int]:
        """(dp, fsdp, tp) on ``num_devices`` devices, or a ConfigError naming the axis
        and the accepted values."""
        fsdp, tp, n = self.fsdp, self.tp, num_devices
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        inner = fsdp * tp
        names = "mesh.tp" if fsdp == 1 else "mesh.fsdp x mesh.tp"
        shown = f"mesh.tp={tp}" if fsdp == 1 else f"mesh.fsdp={fsdp} x mesh.tp={tp} = {inner}"
        if self.dp is None:
            if n % inner:
                raise ConfigError(
                    f"{shown} does not divide the {n} devices (mesh.dp unset uses all "
                    f"of them); accepted: {names} in {divisors}, or set mesh.dp"
                )
            return n // inner, fsdp, tp
        dp = self.dp
        used = dp * inner
        what = f"mesh.dp={dp} x {shown.replace(f' = {inner}', '')} = {used} devices"
        if num_processes > 1 and used != n:
            raise ConfigError(
                f"{what}, but this {num_processes}-process run has {n}; a multi-process "
                f"run must use every device: mesh.dp x {names} = {n} (or leave mesh.dp unset)"
            )
        if used > n:
            raise ConfigError(
                f"{what}, but only {n} are available; accepted: mesh.dp x {names} <= {n}"
            )
        return dp, fsdp, tp

    def build(self) -> jax.sharding.Mesh | None:
        """The run's mesh over ``jax.devices()`` (the first dp x fsdp x tp of them):
        ('dp', 'fsdp', 'tp') when fsdp > 1, else ('dp', 'tp'); None for one device."""
        from dtarl.parallel import mesh as mesh_lib

        devices = jax.devices()
        dp, fsdp, tp = self.resolve3(len(devices), jax.process_count())
        if dp * fsdp * tp == 1:
            return None
        if fsdp > 1:
            return mesh_lib.make_train_mesh(dp, fsdp, tp, devices=devices[: dp * fsdp * tp])
        return mesh_lib.make_mesh(dp, tp, devices=devices[: dp * tp])


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

    def check(self, out_dir: str) -> None:
        """Refuses ``hf_dir`` now, not after training (``check_export_dir``)."""
        from dtarl.model.hf import check_export_dir

        if self.hf_dir:
            check_export_dir(self.hf_dir, what="export.hf_dir", protect=[("out_dir", out_dir)])


__all__ = [
    "AlgoSection",
    "Algorithm",
    "DartsSection",
    "ExportSection",
    "LambdaUnits",
    "LossAggMode",
    "MeshSection",
    "ModelSection",
    "OnCorrupt",
    "OptimSection",
    "ResumeSection",
    "SFTSection",
    "TaskSection",
    "in_range",
    "nonneg",
    "positive",
]
