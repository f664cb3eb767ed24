"""The ``rollout:`` section of ``TrainerConfig`` (with ``rollout.streaming`` and
``rollout.pat``), each building its own objects: the samplers (``RolloutSection.build``),
the streaming scorers (``StreamingSection.build``) and PAT's switch controller
(``PatSection.build``). The other sections: ``dtarl.rl.sections``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
import warnings
from collections.abc import Sequence

import jax

from dtarl.errors import ConfigError
from dtarl.rl.sections import in_range, nonneg, positive


class RolloutEngineKind(enum.Enum):
    CONTINUOUS = "continuous"  # dtarl.rollout.engine: continuous batching, prompt-shared K/V
    STATIC = "static"  # dtarl.rollout.sampler: one static batch per call (the reference)


class StreamedModel(enum.Enum):
    """A forward-only model of an RL step that ``rollout.streaming`` can score while
    decoding goes on (verl's role names)."""

    REF = "ref"  # the reference policy's logprobs (the KL term; algo.kl_coef > 0)
    CRITIC = "critic"  # the PPO value model's values (GAE; algo.algorithm=ppo)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingSection:
    """``rollout.streaming``: score generated tokens with the step's forward-only models
    every ``chunk`` tokens while decoding goes on (DARTS §4.3; dtarl.rollout.stream),
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
        positive(self, "chunk")
        if self.device < -1:
            raise ConfigError(
                f"rollout.streaming.device={self.device} must be -1 (the rollout's device) "
                "or a device index >= 0"
            )
        if len(set(self.models)) != len(self.models):
            raise ConfigError(
                f"rollout.streaming.models={[m.value for m in self.models]} names a model twice"
            )

    def build(
        self,
        model,
        models: Sequence[StreamedModel],
        *,
        temperature: float,
        pad_id: int,
        warmup: bool,
    ) -> dict:
        """{model kind: ``StreamingScorers``} for ``models`` (``TrainerConfig.streamed_models``),
        on ``device`` (-1: the rollout's)."""
        from dtarl.rollout.stream import ScoreKind, StreamingScorers

        device = None
        if self.enabled and self.device >= 0:
            n = jax.device_count()
            if self.device >= n:
                raise ConfigError(
                    f"rollout.streaming.device={self.device} is not a device index: this run "
                    f"has {n} devices (0..{n - 1}); -1 runs the scorers on the rollout's device"
                )
            device = jax.devices()[self.device]
        return {
            m: StreamingScorers(
                model,
                chunk=self.chunk,
                temperature=temperature,
                pad_id=pad_id,
                kind=ScoreKind.VALUES if m is StreamedModel.CRITIC else ScoreKind.LOGPROBS,
                warmup=warmup,
                device=device,
            )
            for m in models
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatSection:
    """``rollout.pat``: adaptive tensor parallelism during generation (PAT, arXiv 2605.23945;
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
        positive(self, "check_every")
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

    def build(self, sampler, *, mesh, num_kv_heads: int, steps_per_call: int, compile_reuse: int):
        """PAT's switch controller over ``sampler`` (None when disabled), from the saved
        profile; refuses what cannot switch (several processes, no mesh, a sampler without
        ``Feature.SWITCH``, a profile of another device count or without the candidates)."""
        from dtarl.rollout import pat as pat_lib
        from dtarl.rollout.protocol import Feature

        if not self.enabled:
            return None
        if jax.process_count() > 1:
            raise ConfigError(
                f"rollout.pat.enabled=true is not supported in a {jax.process_count()}-process "
                "run (each process decodes its own share on its own devices); run PAT in one "
                "process"
            )
        if mesh is None or Feature.SWITCH not in sampler.features:
            raise ConfigError(
                "rollout.pat.enabled=true needs rollout.engine=continuous on a mesh of several "
                "devices (mesh.dp x mesh.tp > 1) to switch between"
            )
        try:
            profile = pat_lib.Profile.load(self.profile)
            tps = pat_lib.check_candidates(
                self.tp_candidates, devices=mesh.size, kv_heads=num_kv_heads
            )
        except pat_lib.PatError as e:
            raise ConfigError(f"rollout.pat: {e}") from None
        if profile.devices != mesh.size:
            raise ConfigError(
                f"rollout.pat.profile={self.profile!r} was taken on {profile.devices} devices; "
                f"the rollout mesh has {mesh.size}"
            )
        spc = steps_per_call
        if profile.steps_per_call and profile.steps_per_call != spc:
            warnings.warn(
                f"rollout.pat.profile={self.profile!r} timed {profile.steps_per_call} decode "
                f"steps per call, the engine runs rollout.steps_per_call={spc}: the per-call "
                "cost is spread differently, so predictions are biased (profile again with "
                f"`dtarl bench rollout --profile OUT.json --steps-per-call {spc}`)",
                RuntimeWarning,
                stacklevel=3,
            )
        ours = {k: int(v) for k, v in dataclasses.asdict(sampler.engine.config).items()}
        differ = {
            k: (profile.engine[k], v) for k, v in ours.items() if profile.engine.get(k, v) != v
        }
        if profile.engine and differ:
            warnings.warn(
                f"rollout.pat.profile={self.profile!r} timed another engine shape than this "
                "run's ("
                + ", ".join(f"{k}: profiled {a}, here {b}" for k, (a, b) in differ.items())
                + "): its calls are predicted by interpolating programs the run never "
                "executes (profile this run's engine with `dtarl bench rollout --profile "
                "OUT.json` with --slots, --prompts, --group-size, --prompt-len, "
                "--max-new-tokens and --steps-per-call to match)",
                RuntimeWarning,
                stacklevel=3,
            )
        try:
            return pat_lib.PatController(
                pat_lib.Predictor(profile),
                candidates=tps,
                check_every=self.check_every,
                compile_reuse=compile_reuse,
            )
        except pat_lib.PatError as e:
            raise ConfigError(f"rollout.pat ({self.profile}): {e}") from None


MAX_ROLLOUTS_PER_STEP = 1 << 20  # prompts_per_step x group_size: host arrays stay bounded


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
        positive(self, "prompts_per_step", "group_size", "max_new_tokens", "steps_per_call")
        if self.prompts_per_step * self.group_size > MAX_ROLLOUTS_PER_STEP:
            raise ConfigError(
                f"rollout.prompts_per_step x rollout.group_size = {self.prompts_per_step} x "
                f"{self.group_size} rollouts per step; accepted: at most {MAX_ROLLOUTS_PER_STEP}"
            )
        nonneg(self, "slots")
        in_range(self, "top_p", 0, 1, lo_open=True)
        nonneg(self, "temperature", "top_k")
        if not math.isfinite(self.temperature):
            raise ConfigError(f"rollout.temperature={self.temperature!r} must be finite")

    def build(
        self,
        model,
        *,
        pad_id: int,
        stop_ids: Sequence[int],
        stop_sequences: Sequence[Sequence[int]],
        prompt_len: int,
        response_len: int,
        group_size: int,
        eval_problems: int,
        mesh: jax.sharding.Mesh | None = None,
    ):
        """(rollout sampler, greedy evaluation sampler) of ``engine``.

        ``continuous`` (the default): every prompt of a step is resident at once (one
        prompt row each) and ``slots`` samples decode together (0: the whole step);
        ``group_size`` is the most samples of one prompt (DARTS: its M_up candidates).
        ``response_len`` rows hold every turn of a sample plus its tool tokens; a
        longer tool output ends that sample as truncated. A prompt longer than
        ``prompt_len`` rebuilds the engine once (see ``ContinuousSampler``). ``mesh``:
        the rollout engine's (decode slots and prompt rows over 'dp', weights and K/V
        heads over 'tp'). ``static``: the reference sampler, one static batch per call.
        """
        from dtarl.rollout.continuous import ContinuousSampler
        from dtarl.rollout.engine import ContinuousConfig
        from dtarl.rollout.sampler import Sampler, SamplingParams
        from dtarl.tree.plan import bucket

        greedy_kw = dict(max_new_tokens=self.max_new_tokens, stop_tokens=tuple(stop_ids))
        if self.engine is RolloutEngineKind.STATIC:
            if mesh is not None:
                raise ConfigError(
                    "rollout.engine=static has no mesh support; with mesh.dp x mesh.tp > 1 "
                    "use rollout.engine=continuous (or mesh.dp=1, mesh.tp=1)"
                )
            params = SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                stop_sequences=stop_sequences,
                **greedy_kw,
            )
            greedy = SamplingParams.greedy(stop_sequences=stop_sequences, **greedy_kw)
            return Sampler(model, params, pad_id=pad_id), Sampler(model, greedy, pad_id=pad_id)
        shape = dict(
            prompt_len=bucket(prompt_len),
            response_len=response_len,
            steps_per_call=self.steps_per_call,
        )
        train = ContinuousConfig(
            slots=self.slots or self.prompts_per_step * group_size,
            groups=self.prompts_per_step,
            group_size=group_size,
            stream_chunk=self.streaming.chunk if self.streaming.enabled else 0,
            **shape,
        )
        n_eval = max(1, eval_problems)
        evals = ContinuousConfig(slots=n_eval, groups=n_eval, group_size=1, **shape)
        common = dict(
            stop_ids=stop_ids,
            stop_sequences=stop_sequences,
            max_new_tokens=self.max_new_tokens,
            pad_id=pad_id,
        )
        rollout = ContinuousSampler(
            model,
            train,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            mesh=mesh,
            **common,
        )
        return rollout, ContinuousSampler(model, evals, temperature=0.0, mesh=mesh, **common)


__all__ = [
    "PatSection",
    "RolloutEngineKind",
    "RolloutSection",
    "StreamedModel",
    "StreamingSection",
]
