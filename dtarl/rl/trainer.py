"""The RL loop: a step function plus hooks.

    trainer = Trainer(config)          # builds model, tokenizer, task, samplers, engine
    trainer.add_hook(fn, every=10)     # fn(StepInfo) after every 10th global step
    result = trainer.run()             # SFT warm-up, then RL steps

A step reads top to bottom in three plain functions: ``rl_batch`` (rollout ->
rewards -> advantages -> ``RolloutBatch``, ``dtarl.rl.episodes``), ``update``
(engine gradient + optimiser step, ``dtarl.rl.optim``) and ``step_metrics``
(``dtarl.rl.metrics``). Evaluation, metrics logging and checkpoints are hooks the
trainer adds to itself, in this order:

    eval        every ``eval_every`` RL steps (not the last): ``eval_success_rate``
    log         every step: metrics.jsonl, console, TensorBoard; ``TrainResult.history``
    checkpoint  every ``checkpoint_every`` global steps

``run`` also evaluates before training, after the SFT warm-up and at the end (own
``phase="eval"`` records), and checkpoints at the end.

Every step is a deterministic function of (config, step, state): prompts come
from ``np.random.default_rng([seed, phase, step])``, sampling keys from
``fold_in(PRNGKey(seed), step)``. A checkpoint holds params, optimizer state(s),
the reference policy (with a KL term), the step and the data cursor, so a
resumed run reproduces the uninterrupted one bit for bit.

On a mesh (``mesh.dp x mesh.tp > 1``, ``dtarl.parallel``): the params, the
reference policy and the optimizer state live on a ('dp', 'tp') mesh over
``jax.devices()`` (every process's, under ``dtarl launch``), split over 'tp' by the
rule table and replicated over 'dp'; the training engines run through
``ShardedEngine`` (each batch cut over dp by the balanced partition, priced by the
running engine's own work counts, ``engine.partition_cost``, with the model's
``FlopCost`` as the fallback for an engine without them; auto picks one engine for
all ranks and the cut is priced by its pick) and the optimiser keeps
the params' shardings. One process: the rollout and evaluation samplers decode on
the same mesh (slots over dp, heads over tp). Several processes: each process
decodes only its contiguous share of the problems (whole groups, global sampling
keys) on a mesh of its own devices (``rollout_mesh``) from a host copy of the
params, and the trajectories are all-gathered, so that every process holds the
one-process run's batch (``process_rollout``; evaluation likewise). The KL
reference is not split: every process scores the whole batch on its first local
device (``_reference_params``), P times the reference forward of one process. Split
like the rollout, a process's share runs at another row count than the whole batch,
and XLA's CPU matmuls round differently there (measured: 4.8e-7 on the logprobs of
6 sequences of the 2-process test's config scored 3 + 3 in 4-row programs against 6
in one 8-row program); at policy == reference the KL gradient is that rounding, and
the 2-process test's grad norm then differed from the one-process run's by 1.1e-5
relative (over its 1e-5; the final parameters still agreed to 2 ulp). Replicated,
the grad norms agree to 1.5e-7 and 0 on its two steps. Checkpoints
hold the sharded arrays (every process writes its own shards) and restore onto
the run's mesh. Metric logs of process i > 0 go to ``out_dir/process_i``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.experimental.compilation_cache import compilation_cache

from dtarl import aot
from dtarl.batch import RolloutBatch
from dtarl.engines import Capacity, EngineConfig, make_engine, training_temperature
from dtarl.losses import MaskedNLLLoss
from dtarl.model import ModelConfig, init_model, load_hf
from dtarl.model.hf import check_export_dir, save_hf, tokenizer_files
from dtarl.model.tokenizer import ByteTokenizer, load_tokenizer
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.launch import report_progress
from dtarl.parallel.partition import FlopCost
from dtarl.parallel.sharded import ShardedEngine, to_host
from dtarl.rl import darts, runlock
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import (
    Algorithm,
    ConfigError,
    MeshSection,
    Schedule,
    StreamedModel,
    TrainerConfig,
    config_changes,
    to_dict,
)
from dtarl.rl.episodes import (
    Scorer,
    encode_prompt,
    process_rollout,
    reference_batch,
    rl_batch,
    rollout,
    success_rate,
    tool_stop_sequences,
)
from dtarl.rl.hooks import Hook, Phase, StepInfo, run_hooks
from dtarl.rl.metrics import MetricsLogger, step_metrics, truncate_metrics
from dtarl.rl.optim import (
    Optimizer,
    UpdateResult,
    engine_pass,
    group_splits,
    make_loss,
    make_optimizer,
    old_logprob_diff,
    on_policy,
    place_like,
    put,
    update,
    with_old_logprobs,
)
from dtarl.rl.rewards import RewardErrorPolicy, RewardFn, compute_rewards
from dtarl.rl.samplers import make_samplers
from dtarl.rl.tasks import Problem, Task, make_task
from dtarl.rl.value import ValueModel
from dtarl.rollout import pat as pat_lib
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.sampler import Sampler
from dtarl.rollout.stream import ScoreKind, Stream, StreamingScorers
from dtarl.timing import compile_seconds

# Seeds of the problem streams: np.random.default_rng([seed, stream, step]).
_SEED_SFT, _SEED_RL, _SEED_EVAL = 1, 2, 3


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TrainResult:
    history: list[dict[str, Any]]
    params: Any  # nnx.State of the final weights
    eval_start: float | None  # greedy success rate before training
    eval_rl_start: float | None  # ... after the SFT warm-up (None without one)
    eval_end: float | None
    seconds: float
    steps_done: int


def build_model(cfg: TrainerConfig):
    """(model, tokenizer) from the model section: a HF checkpoint or a preset."""
    m = cfg.model
    if m.hf_path is not None and not os.path.isdir(m.hf_path):
        raise ConfigError(f"model.hf_path={m.hf_path!r} is not a directory")
    if m.tokenizer_path is not None and not os.path.exists(
        os.path.join(m.tokenizer_path, "tokenizer.json")
    ):
        raise ConfigError(f"model.tokenizer_path={m.tokenizer_path!r} has no tokenizer.json")
    if m.hf_path is not None:
        model = load_hf(m.hf_path, **m.overrides)
    else:
        mc = ModelConfig.preset(m.preset).replace(**m.overrides)
        model = init_model(mc, seed=m.seed)
    tok_dir = m.tokenizer_path or m.hf_path
    if tok_dir is not None and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        tokenizer = load_tokenizer(tok_dir)
    else:
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.cfg.vocab_size}; set model.tokenizer_path to a matching tokenizer.json"
        )
    return model, tokenizer


def stop_sequences(tokenizer, strings) -> tuple[tuple[int, ...], ...]:
    """``rollout.stop`` strings as token id sequences of the run's tokenizer."""
    out = []
    for i, s in enumerate(strings):
        try:
            ids = tuple(int(t) for t in tokenizer.encode(s))
        except ValueError as e:
            raise ConfigError(f"rollout.stop[{i}]={s!r} cannot be encoded: {e}") from None
        if not ids:
            raise ConfigError(f"rollout.stop[{i}]={s!r} encodes to no tokens")
        out.append(ids)
    return tuple(out)


def train_mesh(section: MeshSection) -> jax.sharding.Mesh | None:
    """The run's ('dp', 'tp') mesh over ``jax.devices()`` (the first dp x tp of them),
    or None for one device (``mesh.dp x mesh.tp = 1``)."""
    devices = jax.devices()
    dp, tp = section.resolve(len(devices), jax.process_count())
    if dp * tp == 1:
        return None
    return mesh_lib.make_mesh(dp, tp, devices=devices[: dp * tp])


def rollout_mesh(mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
    """The rollout samplers' mesh: the run's own in one process; in a multi-process run
    (where each process decodes its share of the problems, ``process_rollout``) a mesh
    of this process's devices, with the run's tp when it divides them (else tp = 1),
    or None when the process has one device."""
    if mesh is None or jax.process_count() == 1:
        return mesh
    local = jax.local_devices()
    tp = int(mesh.shape[mesh_lib.TP])
    tp = tp if len(local) % tp == 0 else 1
    if len(local) == 1:
        return None
    return mesh_lib.make_mesh(len(local) // tp, tp, devices=local)


def partition_cost(model) -> FlopCost:
    """The dp partition's fallback cost model, used only for an engine without its own
    ``partition_cost`` (the built-in engines all have one; metric
    ``partition_cost_model`` = "fallback:FlopCost" says when it is used): the policy's
    training FLOPs per tree token (``FlopCost.from_transformer``: matmuls + attention)."""
    c = model.cfg
    return FlopCost.from_transformer(
        num_params=c.num_params(), num_layers=c.num_layers, hidden=c.hidden_size
    )


def engine_config(cfg: TrainerConfig) -> EngineConfig:
    """The ``engine:`` section with ``algo.autotune_budget_seconds`` and
    ``algo.autotune_cache`` (where set) in auto's settings."""
    a, auto = cfg.algo, cfg.engine.auto
    if a.autotune_budget_seconds is not None:
        auto = dataclasses.replace(auto, budget_seconds=a.autotune_budget_seconds)
    if a.autotune_cache is not None:
        auto = dataclasses.replace(auto, cache_path=a.autotune_cache)
    return dataclasses.replace(cfg.engine, auto=auto)


def enable_compile_cache(path: str) -> str:
    """Points JAX's persistent compilation cache at ``path`` (created if missing; ``~``
    expanded) for the rest of the process, and caches every program, however short its
    compile (JAX's defaults skip the ones under 1 s: most of a small model's on a CPU).
    The next process that compiles the same program (same JAX/XLA versions, device
    kind, options) reads the executable from there instead of compiling it; tracing
    and lowering still run. A cache JAX was already using elsewhere is switched over
    (JAX reads its directory once: the cache is reset). Returns the absolute path.

    The cache is trusted code: anyone who can write to ``path`` can make this process
    run arbitrary code (JAX's warning), so keep it private to the user."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"compile_cache_dir={path!r} cannot be created: {e}") from e
    if not os.access(path, os.W_OK):
        raise ConfigError(f"compile_cache_dir={path!r} is not writable")
    current = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if current is None or os.path.abspath(current) != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # JAX opens its directory once per process
    return path


class Trainer:
    """Runs a ``TrainerConfig``. ``reward_fn`` (sync or async) replaces the task's verifier."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        reward_fn: RewardFn | None = None,
        task: Task | None = None,
    ):
        self.cfg = cfg
        # compile_cache_dir: before anything compiles (the model's initialisation does)
        if cfg.compile_cache_dir is not None:
            cache_dir = enable_compile_cache(cfg.compile_cache_dir)
            aot.enable_program_store(os.path.join(cache_dir, aot.STORE_SUBDIR))
        self.mesh = train_mesh(cfg.mesh)  # before the model: a bad mesh fails at once
        self.model, self.tokenizer = build_model(cfg)
        self.graphdef, self.params = nnx.split(self.model, nnx.Param)
        self.multiprocess = jax.process_count() > 1
        if self.mesh is not None:
            self._check_mesh()
            self.params = mesh_lib.shard_params(self.params, self.mesh)
        self._ref_local = None  # multi-process: a process-local copy of ref_params
        self.task = task if task is not None else make_task(cfg.task.kind, **cfg.task.options())
        self.reward_fn = reward_fn if reward_fn is not None else self.task.reward
        r = cfg.rollout
        # Tool-call markers of one token are stop tokens; longer ones stop sequences.
        tool = tool_stop_sequences(self.tokenizer, self.task)
        stops = (self.tokenizer.eos_id,) + tuple(sq[0] for sq in tool if len(sq) == 1)
        stop_seqs = stop_sequences(self.tokenizer, r.stop) + tuple(sq for sq in tool if len(sq) > 1)
        self.max_response = r.max_new_tokens * self.task.max_turns
        self.rollout_mesh = rollout_mesh(self.mesh)
        self.sampler, self.eval_sampler = make_samplers(
            cfg,
            self.model,
            pad_id=self.tokenizer.pad_id,
            stop_ids=stops,
            stop_sequences=stop_seqs,
            prompt_len=self._prompt_len(),
            response_len=self.max_response + 16 * (self.task.max_turns - 1),
            mesh=self.rollout_mesh,
        )
        self.pat = self._make_pat()  # rollout.pat: the switch controller (or None)
        # The engine's logprobs are those of logits / T, the sampler's (greedy: T = 1).
        self.temperature = training_temperature(r.temperature)
        self.engine = make_engine(
            cfg.algo.engine, self.model, engine_config(cfg), temperature=self.temperature
        )
        # SFT trains the model itself (T = 1): its own engine when the rollout's differs.
        self.sft_engine = self.engine
        if cfg.sft.steps and self.temperature != 1.0:
            self.sft_engine = make_engine(cfg.algo.engine, self.model, engine_config(cfg))
        if self.mesh is not None:
            cost = partition_cost(self.model)
            sharded = ShardedEngine(self.engine, self.mesh, fallback_cost=cost)
            if self.sft_engine is not self.engine:
                self.sft_engine = ShardedEngine(self.sft_engine, self.mesh, fallback_cost=cost)
            else:
                self.sft_engine = sharded
            self.engine = sharded
        self.loss = make_loss(cfg, self.max_response)
        self.sft_loss = MaskedNLLLoss()
        self.scorer = (
            Scorer(self.model, temperature=self.temperature) if cfg.algo.kl_coef > 0 else None
        )
        # rollout.streaming: the reference policy / critic scored while decoding
        device = None
        if r.streaming.enabled and r.streaming.device >= 0:
            if r.streaming.device >= jax.device_count():
                raise ConfigError(
                    f"rollout.streaming.device={r.streaming.device} is not a device index: "
                    f"this run has {jax.device_count()} devices (0..{jax.device_count() - 1}); "
                    "-1 runs the scorers on the rollout's device"
                )
            device = jax.devices()[r.streaming.device]
        self.streamers = {
            m: StreamingScorers(
                self.model,
                chunk=r.streaming.chunk,
                temperature=self.temperature,
                pad_id=self.tokenizer.pad_id,
                kind=ScoreKind.VALUES if m is StreamedModel.CRITIC else ScoreKind.LOGPROBS,
                warmup=r.warmup,
                device=device,
            )
            for m in cfg.streamed_models()
        }
        self.ref_params = None
        self.value = None
        if cfg.algo.algorithm is Algorithm.PPO:
            self.value = ValueModel(self.model, lr=cfg.algo.value_lr, seed=cfg.model.seed)
        self.sft_opt: Optimizer = make_optimizer(
            lr=cfg.sft.lr,
            warmup=cfg.sft.warmup_steps,
            total=cfg.sft.steps,
            schedule=Schedule.CONSTANT,
            cfg=cfg.optim,
        )
        self.rl_opt: Optimizer = make_optimizer(
            lr=cfg.optim.lr,
            warmup=cfg.optim.warmup_steps,
            total=cfg.steps * cfg.algo.updates_per_batch * cfg.algo.minibatches,
            schedule=cfg.optim.schedule,
            cfg=cfg.optim,
        )
        self.opt_state = None
        self.base_key = jax.random.PRNGKey(cfg.seed)
        self.ckpt = CheckpointManager(
            os.path.join(cfg.out_dir, "checkpoints"),
            keep=cfg.keep_checkpoints,
            on_corrupt=cfg.resume.on_corrupt.value,
        )
        if cfg.export.hf_dir:  # refused now, not after training
            check_export_dir(
                cfg.export.hf_dir, what="export.hf_dir", protect=[("out_dir", cfg.out_dir)]
            )
        d = cfg.algo.darts
        self.darts = darts.DartsState(ema=d.ema) if d.enabled else None  # checkpointed
        self.step = 0  # completed global steps (SFT + RL)
        self.data_cursor = 0  # problems consumed
        self.skipped = 0
        self.compile_total = self.autotune_total = 0.0  # seconds, this process's steps
        compile_seconds()  # starts JAX's compile-time events
        self.eval_rl_start: float | None = None  # greedy success rate after the warm-up
        self.eval_problems = self.task.generate(
            np.random.default_rng([cfg.seed, _SEED_EVAL]), cfg.eval_problems
        )
        self._warm_engines: set[int] = set()  # rollout engines compiled by ``_warm``
        self._reserve()
        self.logger: MetricsLogger | None = None  # open during ``run``
        self.history: list[dict[str, Any]] = []  # the logged records of the current run
        self.hooks: list[Hook] = []
        if cfg.eval_every and cfg.eval_problems:
            self.add_hook(self._eval_hook, every=cfg.eval_every, phase=Phase.RL)
        self.add_hook(self._log_hook)
        if cfg.checkpoint_every:
            self.add_hook(lambda info: self.save_checkpoint(), every=cfg.checkpoint_every)

    def _make_pat(self) -> pat_lib.PatController | None:
        """``rollout.pat``: PAT's controller over the rollout engine, from the saved profile;
        refuses what cannot switch (no mesh, several processes, a static sampler, a
        profile of another device count or without the candidates)."""
        p = self.cfg.rollout.pat
        if not p.enabled:
            return None
        mesh = self.rollout_mesh
        if self.multiprocess:
            raise ConfigError(
                f"rollout.pat.enabled=true is not supported in a {jax.process_count()}-process "
                "run (each process decodes its own share on its own devices); run PAT in one "
                "process"
            )
        if mesh is None or not isinstance(self.sampler, ContinuousSampler):
            raise ConfigError(
                "rollout.pat.enabled=true needs rollout.engine=continuous on a mesh of several "
                "devices (mesh.dp x mesh.tp > 1) to switch between"
            )
        try:
            profile = pat_lib.Profile.load(p.profile)
            tps = pat_lib.check_candidates(
                p.tp_candidates, devices=mesh.size, kv_heads=self.model.cfg.num_kv_heads
            )
        except pat_lib.PatError as e:
            raise ConfigError(f"rollout.pat: {e}") from None
        if profile.devices != mesh.size:
            raise ConfigError(
                f"rollout.pat.profile={p.profile!r} was taken on {profile.devices} devices; "
                f"the rollout mesh has {mesh.size}"
            )
        spc = self.cfg.rollout.steps_per_call
        if profile.steps_per_call and profile.steps_per_call != spc:
            warnings.warn(
                f"rollout.pat.profile={p.profile!r} timed {profile.steps_per_call} decode steps "
                f"per call, the engine runs rollout.steps_per_call={spc}: the per-call cost "
                "is spread differently, so predictions are biased (profile again with "
                f"`dtarl bench rollout --profile OUT.json --steps-per-call {spc}`)",
                RuntimeWarning,
                stacklevel=2,
            )
        ours = {k: int(v) for k, v in dataclasses.asdict(self.sampler.engine.config).items()}
        differ = {
            k: (profile.engine[k], v) for k, v in ours.items() if profile.engine.get(k, v) != v
        }
        if profile.engine and differ:
            warnings.warn(
                f"rollout.pat.profile={p.profile!r} timed another engine shape than this run's "
                "("
                + ", ".join(f"{k}: profiled {a}, here {b}" for k, (a, b) in differ.items())
                + "): its calls are predicted by interpolating programs the run never "
                "executes (profile this run's engine with `dtarl bench rollout --profile "
                "OUT.json` with --slots, --prompts, --group-size, --prompt-len, "
                "--max-new-tokens and --steps-per-call to match)",
                RuntimeWarning,
                stacklevel=2,
            )
        try:
            return pat_lib.PatController(
                pat_lib.Predictor(profile),
                candidates=tps,
                check_every=p.check_every,
                compile_reuse=max(self.cfg.steps, 1),  # the RL steps reuse a compiled target
            )
        except pat_lib.PatError as e:
            raise ConfigError(f"rollout.pat ({p.profile}): {e}") from None

    def _pat_metrics(self) -> dict[str, float]:
        """``pat_switches``, ``pat_switch_seconds`` and ``pat_final_tp`` of this step."""
        tl = self.pat.timeline
        start = int(self.rollout_mesh.shape[mesh_lib.TP])
        return dict(
            pat_switches=len(tl),
            pat_switch_seconds=float(sum(e["seconds"] for e in tl)),
            pat_final_tp=tl[-1]["dst"][1] if tl else start,
        )

    def _check_mesh(self) -> None:
        """Refuses what does not run on the mesh, naming the combination."""
        cfg, dp = self.cfg, int(self.mesh.shape[mesh_lib.DP])
        where = f"mesh.dp={dp}, mesh.tp={int(self.mesh.shape[mesh_lib.TP])}"
        if cfg.rollout.streaming.enabled:
            raise ConfigError(
                f"rollout.streaming.enabled=true is not supported on a mesh ({where}): the "
                "streaming scorers (reference policy, critic) run on one device, beside a "
                "single-device rollout (rollout.streaming.device), not beside a mesh; disable "
                "streaming or use mesh.dp=1, mesh.tp=1"
            )
        a, r = cfg.algo, cfg.rollout
        if self.multiprocess and a.algorithm is Algorithm.PPO:
            raise ConfigError(
                f"algo.algorithm=ppo is not supported in a {jax.process_count()}-process run "
                f"({where}): the value model is a single-device model outside the mesh and "
                "its checkpoint would be written by every process; run PPO in one process"
            )
        parts = a.minibatches * a.grad_accum
        per_call = (r.prompts_per_step // parts) * r.group_size
        if per_call < dp:
            raise ConfigError(
                f"rollout.prompts_per_step={r.prompts_per_step} x rollout.group_size="
                f"{r.group_size} split into algo.minibatches x algo.grad_accum = {parts} "
                f"parts gives {per_call} sequences per engine call, fewer than the {dp} dp "
                f"ranks ({where}); every rank needs at least one sequence"
            )
        if cfg.sft.steps and cfg.sft.batch_size < dp:
            raise ConfigError(
                f"sft.batch_size={cfg.sft.batch_size} is smaller than the {dp} dp ranks "
                f"({where}); every rank needs at least one sequence"
            )

    def _rollout_params(self):
        """The params the samplers decode with: the mesh's own in one process; a
        process-local copy (gathered from the mesh, as host arrays that the sampler
        places on its local mesh, ``rollout_mesh``) in a multi-process run, where each
        process decodes its share of the problems (``process_rollout``)."""
        if not self.multiprocess or self.mesh is None:
            return self.params
        host = to_host(self.params)
        return (
            host if self.rollout_mesh is not None else jax.device_put(host, jax.local_devices()[0])
        )

    def _warm(self, sampler, params) -> None:
        """``rollout.warmup``: the first use of a continuous sampler compiles all its
        programs (every decode window, prefill and, with tool turns, extend bucket), so
        that a response or tool output outgrowing the ones seen so far compiles nothing
        later in the run."""
        if not self.cfg.rollout.warmup or not isinstance(sampler, ContinuousSampler):
            return
        if id(sampler.engine) not in self._warm_engines:
            sampler.warmup(params, extend=self.task.max_turns > 1)
            self._warm_engines.add(id(sampler.engine))

    def _reference_params(self):
        """``ref_params`` as the KL scorer takes them (process-local in a multi-process run)."""
        if not self.multiprocess or self.mesh is None:
            return self.ref_params
        if self._ref_local is None:
            self._ref_local = jax.device_put(to_host(self.ref_params), jax.local_devices()[0])
        return self._ref_local

    def _place(self, tree):
        """A restored params-shaped tree on the mesh (as is without one)."""
        if self.mesh is None or tree is None:
            return tree
        return jax.tree.map(put, tree, mesh_lib.param_shardings(tree, self.mesh))

    def _prompt_len(self) -> int:
        """The longest prompt of 64 probe problems (the engines' and sampler's sizing)."""
        probe = self.task.generate(np.random.default_rng(0), 64)
        return max(len(encode_prompt(self.tokenizer, p.prompt)) for p in probe)

    def _reserve(self):
        """Pre-sizes sampler and engine buckets to the run's largest batch (prompt
        length, responses of ``max_new_tokens`` per turn plus tool output, group size,
        prompts per step, turns), so that no engine compiles after the first step of
        each phase, whatever the depth, leaf counts and lengths of its trees (auto's
        candidates are sized as if each ran alone, and its choice signature counts
        every depth from 1 + 2 * turns up as one)."""
        cfg, r = self.cfg, self.cfg.rollout
        plen = self._prompt_len()
        tool = 16 * (self.task.max_turns - 1)
        max_len = plen + self.max_response + tool
        rows = r.prompts_per_step * r.group_size
        if isinstance(self.sampler, Sampler):
            self.sampler.reserve(
                prompts=rows if self.task.max_turns > 1 else r.prompts_per_step,
                rows=rows,
                prompt_len=max_len,
                response=r.max_new_tokens,
            )
            n_eval = max(1, cfg.eval_problems)
            self.eval_sampler.reserve(prompts=n_eval, rows=n_eval, prompt_len=max_len)
        n = max(rows, cfg.sft.batch_size if cfg.sft.steps else 1)
        groups = max(r.prompts_per_step, cfg.sft.batch_size if cfg.sft.steps else 1)
        if self.mesh is not None:  # each dp rank gets about 1/dp of a batch; buckets grow
            dp = int(self.mesh.shape[mesh_lib.DP])
            n, groups = -(-n // dp), -(-groups // dp)
        capacity = Capacity(
            sequences=n,
            length=max_len,
            group_size=r.group_size,
            groups=groups,
            prompt_len=plen,
            response_len=max_len - plen,
            turns=self.task.max_turns,
        )
        self.engine.reserve(capacity)
        if self.scorer is not None:  # the KL reference: every sequence of a step, unsplit
            self.scorer.reserve(sequences=rows, length=max_len)
        if self.sft_engine is not self.engine:
            self.sft_engine.reserve(capacity)

    def add_hook(
        self, fn: Callable[[StepInfo], None], *, every: int = 1, phase: Phase | None = None
    ) -> Hook:
        """Calls ``fn(info)`` after each step where ``every`` divides the global step
        count (or, with ``phase``, that phase's step count); after the hooks added before."""
        hook = Hook(fn=fn, every=every, phase=phase)
        self.hooks.append(hook)
        return hook

    # ---------------------------------------------------------------- steps

    def _problems(self, stream: int, step: int, n: int) -> list[Problem]:
        problems = self.task.generate(np.random.default_rng([self.cfg.seed, stream, step]), n)
        self.data_cursor += len(problems)
        return problems

    def _refill_problems(self, step: int, k: int) -> list[Problem]:
        """Generation batch ``k`` >= 1 of RL step ``step`` (dynamic sampling's refill)."""
        rng = np.random.default_rng([self.cfg.seed, _SEED_RL, step, k])
        problems = self.task.generate(rng, self.cfg.rollout.prompts_per_step)
        self.data_cursor += len(problems)
        return problems

    def _update(
        self,
        batch: RolloutBatch,
        loss,
        optimizer: Optimizer,
        times: int,
        *,
        engine=None,
        minibatches: int = 1,
        grad_accum: int = 1,
        recompute_old: bool = False,
    ) -> tuple[list[UpdateResult], RolloutBatch, dict[str, Any]]:
        """``times`` passes over ``batch``, each ``minibatches`` updates on sub-batches of
        whole groups (each normalised on its own), each gradient accumulated over
        ``grad_accum`` parts; stops after a skipped update. Returns the updates, the
        sub-batch of the last one, and ``recompute_old``'s metrics.

        ``recompute_old`` (``algo.recompute_old_logprobs``): the old-policy logprobs
        are the engine's at the params before the first update, with no gradient
        through them, instead of the sampler's. The first update runs on-policy (old
        = stop_gradient(logp): the same forward, so its ratio is exactly 1 and no
        extra pass is needed) and its logprobs become the old ones of the later
        passes; every other minibatch gets its own from one engine pass at those
        params before the first update (its gradient discarded).
        """
        engine = self.engine if engine is None else engine
        updates: list[UpdateResult] = []
        parts = (
            [batch]
            if minibatches == 1
            else [batch.select(ix) for ix in group_splits(batch, minibatches)]
        )
        sampled = [p.old_logprobs for p in parts]
        info: dict[str, Any] = {}
        if recompute_old:
            t0 = time.perf_counter()
            for k in range(1, len(parts)):
                _, _, aux = engine_pass(engine, self.params, on_policy(parts[k]), loss, grad_accum)
                parts[k] = with_old_logprobs(parts[k], aux.logprobs)
            info["recompute_seconds"] = time.perf_counter() - t0
            parts[0] = on_policy(parts[0])
        last = parts[-1]
        for i in range(times):
            for k, part in enumerate(parts):
                u = update(
                    self.params,
                    self.opt_state,
                    part,
                    engine=engine,
                    loss=loss,
                    optimizer=optimizer,
                    grad_accum=grad_accum,
                )
                if recompute_old and i == 0 and k == 0:
                    parts[0] = part = with_old_logprobs(part, u.aux.logprobs)
                self.params, self.opt_state = u.params, u.opt_state
                updates.append(u)
                last = part
                if not u.applied:
                    break
            else:
                continue
            break
        if recompute_old:
            info.update(recompute_old_logprobs=1, **old_logprob_diff(parts, sampled))
        return updates, last, info

    def sft_step(self, step: int) -> dict[str, Any]:
        """One supervised step on the task's reference solutions."""
        batch = reference_batch(
            self.tokenizer, self._problems(_SEED_SFT, step, self.cfg.sft.batch_size)
        )
        lr = self.sft_opt.lr(self.opt_state)
        updates, _, _ = self._update(batch, self.sft_loss, self.sft_opt, 1, engine=self.sft_engine)
        m = dict(phase="sft", step=step, global_step=step + 1, lr=lr)
        m.update(step_metrics(batch, updates))
        m.update(mesh_metrics(updates[-1].aux.stats))
        self.skipped += m["skipped"]
        return m

    def rl_step(self, step: int) -> dict[str, Any]:
        """One RL step: ``rl_batch``, ``algo.updates_per_batch`` ``update``s (the value
        model's too, with PPO), ``step_metrics``."""
        cfg = self.cfg
        reference = None
        if self.ref_params is not None and self.scorer is not None:
            # Every process scores the whole batch (see ``_reference_params``).
            reference = functools.partial(self.scorer, self._reference_params())
        params = self._rollout_params()
        self._warm(self.sampler, params)
        if self.pat is not None:
            self.pat.begin()
        batch, episode_metrics = rl_batch(
            cfg,
            self._problems(_SEED_RL, step, cfg.rollout.prompts_per_step),
            sampler=self.sampler,
            params=params,
            tokenizer=self.tokenizer,
            task=self.task,
            reward_fn=self.reward_fn,
            key=jax.random.fold_in(self.base_key, cfg.sft.steps + step),
            reference=reference,
            value=self.value,
            more_problems=functools.partial(self._refill_problems, step),
            darts_state=self.darts,
            stream=self._streams(),
            shard_processes=self.multiprocess,
            on_call=self.pat,
        )
        m = dict(phase="rl", step=step, global_step=cfg.sft.steps + step + 1)
        m["lr"] = self.rl_opt.lr(self.opt_state)  # this step's first update's
        m.update(episode_metrics)
        if self.pat is not None:
            m.update(self._pat_metrics())
        if self.multiprocess:  # the devices this process decoded its share on
            m["rollout_devices"] = 1 if self.rollout_mesh is None else self.rollout_mesh.size
        if batch is None:
            self.skipped += 1
            return m
        a = cfg.algo
        updates, last, recompute = self._update(
            batch,
            self.loss,
            self.rl_opt,
            a.updates_per_batch,
            minibatches=a.minibatches,
            grad_accum=a.grad_accum,
            recompute_old=a.recompute_old_logprobs,
        )
        m.update(recompute)
        if self.value is not None and updates[-1].applied:
            m.update(self.value.train(batch.tokens, batch.loss_mask))
        m.update(step_metrics(batch, updates, cfg.algo, last_batch=last))
        m.update(mesh_metrics(updates[-1].aux.stats))
        self.skipped += m["skipped"]
        return m

    def _streams(self) -> list[Stream]:
        """This step's ``rollout.streaming`` models with the weights they score with."""
        weights = {
            StreamedModel.REF: lambda: self.ref_params,
            StreamedModel.CRITIC: lambda: self.value.params,
        }
        return [Stream(sc, weights[m]()) for m, sc in self.streamers.items()]

    def train_step(self) -> StepInfo:
        """The next global step: SFT, or RL (entering the RL phase after the warm-up)."""
        g, sft = self.step, self.cfg.sft.steps
        compile_s0 = compile_seconds()
        if g < sft:
            t0 = time.perf_counter()
            phase, m = Phase.SFT, self.sft_step(g)
        else:
            if g == sft and sft > 0:
                self._enter_rl()
            t0 = time.perf_counter()  # after the warm-up's own evaluation
            phase, m = Phase.RL, self.rl_step(g - sft)
        m["step_seconds"] = time.perf_counter() - t0  # the step alone: no hooks, no eval
        self.step = g + 1
        m["skipped_total"] = self.skipped
        self._time_totals(m, compile_s0)
        done_in_phase = self.step if phase is Phase.SFT else self.step - sft
        report_progress()  # dtarl launch's watchdog: this rank finished a step
        return StepInfo(step=self.step, phase=phase, phase_step=done_in_phase, metrics=m)

    def _time_totals(self, m: dict[str, Any], compile_s0: float) -> None:
        """``compile_seconds``: what JAX spent tracing, lowering and compiling during the
        step (every program: rollout, scoring, engine, optimiser; ``compile_seconds``
        of ``dtarl.timing``); ``autotune_seconds``: auto's tuning in the step (its
        timed calls include compiling the candidates, so the two overlap); and both
        summed over the steps of this process (``*_total``)."""
        m["compile_seconds"] = compile_seconds() - compile_s0
        m.setdefault("autotune_seconds", 0.0)
        self.compile_total += m["compile_seconds"]
        self.autotune_total += m["autotune_seconds"]
        m["compile_seconds_total"] = self.compile_total
        m["autotune_seconds_total"] = self.autotune_total

    def _start_rl(self):
        """A fresh optimizer for the RL phase; the reference policy = current weights."""
        if self.cfg.algo.kl_coef > 0:
            self.ref_params = jax.tree.map(lambda x: x, self.params)
            self._ref_local = None
        self.opt_state = self.rl_opt.init(self.params)

    def _enter_rl(self):
        """After the SFT warm-up: ``_start_rl``, and evaluate the RL phase's starting point."""
        self._start_rl()
        if self.cfg.eval_problems:
            self.eval_rl_start = self._eval_record(self.step, after="sft")

    def evaluate(self) -> float:
        """Greedy success rate on the fixed evaluation problems."""
        if not self.eval_problems:
            return float("nan")
        params = self._rollout_params()
        self._warm(self.eval_sampler, params)
        trajs, _ = (process_rollout if self.multiprocess else rollout)(
            self.eval_sampler,
            params,
            self.tokenizer,
            self.task,
            self.eval_problems,
            group_size=1,
            key=jax.random.PRNGKey(0),
        )
        res = compute_rewards(
            self.task.reward,
            self.eval_problems,
            [t.completion for t in trajs],
            on_error=RewardErrorPolicy.ZERO,
        )
        return success_rate(res.rewards)

    # ---------------------------------------------------------------- hooks

    def _eval_hook(self, info: StepInfo) -> None:
        if info.step < self.cfg.total_steps:  # the last step's eval is run's own record
            info.metrics["eval_success_rate"] = self.evaluate()

    def _log_hook(self, info: StepInfo) -> None:
        self.logger.log(info.metrics)
        self.history.append(info.metrics)

    def _eval_record(self, step: int, **extra) -> float:
        """Evaluates and logs a ``phase="eval"`` record (no progress-bar step)."""
        rate = self.evaluate()
        rec = dict(phase="eval", step=step, global_step=step, eval_success_rate=rate, **extra)
        self.logger.log(rec, advance=False)
        self.history.append(rec)
        return rate

    # ---------------------------------------------------------- checkpoints

    def _phase_opt(self, step: int) -> Optimizer:
        return self.sft_opt if step < self.cfg.sft.steps else self.rl_opt

    def state_tree(self) -> dict[str, Any]:
        tree = {"params": self.params, "opt_state": self.opt_state}
        if self.ref_params is not None:
            tree["ref_params"] = self.ref_params
        if self.value is not None:
            tree["value"] = self.value.state()
        return tree

    def save_checkpoint(self) -> str:
        meta = dict(
            data_cursor=self.data_cursor,
            skipped=self.skipped,
            seed=self.cfg.seed,
            rng_key=np.asarray(jax.random.key_data(self.base_key)).tolist()
            if jnp.issubdtype(self.base_key.dtype, jax.dtypes.prng_key)
            else np.asarray(self.base_key).tolist(),
            config=to_dict(self.cfg),
            has_ref=self.ref_params is not None,
            darts=None if self.darts is None else self.darts.state_dict(),
        )
        return self.ckpt.save(self.step, self.state_tree(), meta)

    def export_hf(self, path: str) -> str:
        """Writes the current policy to ``path`` as a HF checkpoint (``save_hf``: atomic,
        in ``param_dtype``) with the run's tokenizer files when its tokenizer came from a
        HF directory (``model.tokenizer_path`` / ``model.hf_path``); the byte tokenizer
        has none. Process 0 writes (after gathering the parameters)."""
        params = self.params
        if jax.process_count() > 1:
            params = multihost_utils.process_allgather(params, tiled=True)
            if jax.process_index() != 0:
                return path
        tok_dir = self.cfg.model.tokenizer_path or self.cfg.model.hf_path
        model = nnx.merge(self.graphdef, params)
        return save_hf(model, path, extra_files=tokenizer_files(tok_dir))

    def try_resume(self) -> bool:
        """Restores the latest checkpoint in out_dir (False when there is none)."""
        self.ckpt.wait()  # a save of this trainer still in flight is committed first
        step = self.ckpt.latest_step()
        if step is None:
            return False
        meta = self.ckpt.read_meta(step)
        self._check_resume(step, meta)
        # The optimizer state saved after global step s belongs to the phase of step s - 1.
        self.opt_state = self._phase_opt(step - 1).init(self.params)
        self.ref_params = self.params if meta.get("has_ref") else None
        tree, meta = self.ckpt.restore(step, self.state_tree())
        self.params = self._place(tree["params"])
        self.opt_state = tree["opt_state"]
        if self.mesh is not None:
            self.opt_state = place_like(self.opt_state, self.params)
        self.ref_params = self._place(tree.get("ref_params"))
        self._ref_local = None
        if self.value is not None and "value" in tree:
            self.value.load_state(tree["value"])
        self.step = step
        self.data_cursor = int(meta["data_cursor"])
        self.skipped = int(meta.get("skipped", 0))
        if self.darts is not None and meta.get("darts"):
            self.darts = darts.DartsState.from_state_dict(meta["darts"])
        return True

    def _check_resume(self, step: int, meta: dict[str, Any]) -> None:
        """Refuses to continue a checkpoint written by a different config or seed
        (``resume.allow_changes`` overrides); keys in ``RESUME_FREE_KEYS`` may change."""
        if self.cfg.resume.allow_changes:
            return
        diffs = []
        if "seed" in meta and meta["seed"] != self.cfg.seed:
            diffs.append(f"seed: {meta['seed']!r} -> {self.cfg.seed!r}")
        if "config" in meta:
            diffs += [
                d for d in config_changes(meta["config"], to_dict(self.cfg)) if d not in diffs
            ]
        if diffs:
            raise ConfigError(
                f"cannot resume from {self.ckpt.path(step)}: the config changed "
                f"({'; '.join(diffs)}); restore those values, use another out_dir, or "
                "--set resume.allow_changes=true"
            )

    # ------------------------------------------------------------------ run

    def run(self, *, max_steps: int | None = None) -> TrainResult:
        """Trains to ``cfg.total_steps`` (or stops after ``max_steps`` global steps, e.g.
        to simulate an interruption), resuming from out_dir's checkpoint when asked.
        Holds ``out_dir/.lock`` meanwhile (``dtarl.rl.runlock``: one run per out_dir)."""
        with runlock.hold(self.cfg.out_dir, enabled=jax.process_index() == 0):
            return self._run(max_steps=max_steps)

    def _run(self, *, max_steps: int | None) -> TrainResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        resumed = cfg.resume.enabled and self.try_resume()
        if resumed:
            truncate_metrics(os.path.join(self.cfg.out_dir, "metrics.jsonl"), self.step)
        if not resumed:
            self.opt_state = (self.sft_opt if cfg.sft.steps else self.rl_opt).init(self.params)
            if cfg.sft.steps == 0:
                self._start_rl()
        me = jax.process_index()
        self.logger = MetricsLogger(  # process i > 0: its own directory, no console
            cfg.out_dir if me == 0 else os.path.join(cfg.out_dir, f"process_{me}"),
            total_steps=cfg.total_steps,
            console=cfg.console and me == 0,
            tensorboard=cfg.tensorboard and me == 0,
        )
        self.history = []
        eval_start = eval_end = self.eval_rl_start = None
        try:
            if resumed:
                self.logger.print(f"resumed from step {self.step} ({self.ckpt.path(self.step)})")
                self.logger.skip_to(self.step)
            elif cfg.eval_problems:
                eval_start = self._eval_record(0)
            end = cfg.total_steps if max_steps is None else min(cfg.total_steps, max_steps)
            while self.step < end:
                run_hooks(self.hooks, self.train_step())
            if self.step >= cfg.total_steps:
                if not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                    self.save_checkpoint()
                if cfg.export.hf_dir:
                    self.logger.print(f"exported the policy to {self.export_hf(cfg.export.hf_dir)}")
                if cfg.eval_problems:
                    eval_end = self._eval_record(self.step)
            self.ckpt.wait()  # checkpoints are written asynchronously
        finally:
            self.logger.close()
            self.logger = None
        return TrainResult(
            history=self.history,
            params=self.params,
            eval_start=eval_start,
            eval_rl_start=self.eval_rl_start,
            eval_end=eval_end,
            seconds=time.perf_counter() - t_start,
            steps_done=self.step,
        )


def mesh_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """A sharded update's layout (``ShardedEngine`` stats): ``dp``, ``tp``, the
    partition method, the candidate that won (``partition_winner``: the balanced cut's
    order or the baseline with the lower makespan), the cost model it was priced with
    (``partition_cost_model``: the running engine's kind, or "fallback:FlopCost"), and
    the rank loads under that cost model (FLOPs, not measured time): ``rank_load_max``
    (the makespan), ``rank_load_mean`` and ``load_balance`` = max / mean.
    ``work_balance``: max / mean of the ranks' padded work as the engine counts it
    (``features``), when this process prepared every rank. Empty for a single-device
    update."""
    if "rank_loads" not in stats:
        return {}
    loads = np.asarray(stats["rank_loads"], np.float64)
    out = dict(
        dp=int(stats["dp"]),
        tp=int(stats["tp"]),
        partition_method=stats["partition_method"],
        partition_winner=stats.get("partition_winner", ""),
        partition_cost_model=stats.get("partition_cost_model", ""),
        rank_load_max=float(loads.max()),
        rank_load_mean=float(loads.mean()),
        load_balance=float(stats["load_balance"]),
    )
    work = np.asarray(stats.get("rank_work_flops", []), np.float64)
    if work.size == int(stats["dp"]) and work.mean() > 0:
        out["work_balance"] = float(work.max() / work.mean())
    return out


def train(cfg: TrainerConfig, **kwargs) -> TrainResult:
    """``Trainer(cfg, **kwargs).run()``."""
    return Trainer(cfg, **kwargs).run()


__all__ = [
    "TrainResult",
    "Trainer",
    "build_model",
    "engine_config",
    "mesh_metrics",
    "partition_cost",
    "stop_sequences",
    "train",
    "train_mesh",
]
