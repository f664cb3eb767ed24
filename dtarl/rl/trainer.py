"""The RL loop: a step function plus hooks.

    trainer = Trainer(config)          # builds the run's parts (dtarl.rl.build)
    trainer.add_hook(fn, every=10)     # fn(StepInfo) after every 10th global step
    result = trainer.run()             # SFT warm-up, then RL steps

The run's arrays are one ``TrainState`` (``dtarl.rl.state``) in ``trainer.state``; its
objects (model, samplers, engines, losses, optimisers, scorers) are ``trainer.parts``
(``dtarl.rl.build.RunParts``, each built by its config section). A step reads top to
bottom in three functions: ``rl_batch`` (``dtarl.rl.step``), ``run_updates``
(``dtarl.rl.update``) and ``step_metrics`` (``dtarl.rl.metrics``). Evaluation, logging,
checkpoints and the export are hooks (``dtarl.rl.hooks.trainer_hooks``).

Every step is a deterministic function of (config, step, state). A checkpoint is the
``TrainState`` plus the ``HostRecord`` (data cursor, skipped count, DARTS, config) in
one Orbax step (``CheckpointManager.save_state``), so a resumed run reproduces the
uninterrupted one bit for bit. Logs of process i > 0: ``out_dir/process_i``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dtarl.errors import ConfigError
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.launch import report_progress
from dtarl.rewards import RewardFn
from dtarl.rl import darts, runlock
from dtarl.rl.build import (
    RunParts,
    build_parts,
    build_pat,
    export_policy,
    local_copy,
    part_attribute,
    partition_cost,
    place_state,
    rollout_params,
    stop_sequences,
)
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import StreamedModel, TrainerConfig, to_dict
from dtarl.rl.datatask import DatasetTask
from dtarl.rl.episodes import reference_batch, rl_batch
from dtarl.rl.evaluate import evaluate_policy
from dtarl.rl.hooks import Hook, Phase, StepInfo, run_final_hooks, run_hooks, trainer_hooks
from dtarl.rl.metrics import (
    CompileTotals,
    MetricsLogger,
    mesh_metrics,
    pat_metrics,
    step_metrics,
    truncate_metrics,
)
from dtarl.rl.optim import Optimizer
from dtarl.rl.state import HostRecord, TrainState, check_resume, state_attribute
from dtarl.rl.tasks import Problem, Task
from dtarl.rl.update import run_updates
from dtarl.rollout.stream import Stream

# Seeds of the problem streams: np.random.default_rng([seed, stream, step]).
_SEED_SFT, _SEED_RL, _SEED_EVAL = 1, 2, 3
# pass@k sampling keys: fold_in(PRNGKey(seed), _SEED_EVAL_KEY + global step).
_SEED_EVAL_KEY = 3 << 20


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TrainResult:
    history: list[dict[str, Any]]
    params: Any  # nnx.State of the final weights
    eval_start: float | None  # greedy success rate before training
    eval_rl_start: float | None  # ... after the SFT warm-up (None without one)
    eval_end: float | None
    seconds: float
    steps_done: int


class Trainer:
    """Runs a ``TrainerConfig``. ``reward_fn`` (sync or async) replaces the task's verifier."""

    def __init__(
        self, cfg: TrainerConfig, *, reward_fn: RewardFn | None = None, task: Task | None = None
    ):
        self.cfg = cfg
        self.parts, params = build_parts(cfg, reward_fn=reward_fn, task=task)
        # The phase's optimiser state comes with ``run`` (or a resume).
        self.state = TrainState.create(params=params, seed=cfg.seed, value=self.parts.value)
        ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
        self.ckpt = CheckpointManager(
            ckpt_dir, keep=cfg.keep_checkpoints, on_corrupt=cfg.resume.on_corrupt.value
        )
        self.darts = cfg.algo.darts.build()  # checkpointed (the host record)
        self.data_cursor = 0  # problems consumed
        self.skipped = 0
        self.compile_totals = CompileTotals()  # seconds, this process's steps
        self.eval_rl_start: float | None = None  # greedy success rate after the warm-up
        self.eval_end: float | None = None
        eval_rng = np.random.default_rng([cfg.seed, _SEED_EVAL])
        if isinstance(self.task, DatasetTask):  # data.val_files (or a sample of the train rows)
            self.eval_problems = self.task.held_out(cfg.eval.num_problems, eval_rng)
        else:
            self.eval_problems = self.task.generate(eval_rng, cfg.eval.num_problems)
        self._warmed: set[int] = set()  # samplers whose ``warmup`` ran
        self._ref_local = None  # multi-process: a process-local copy of ref_params
        self.logger: MetricsLogger | None = None  # open during ``run``
        self.history: list[dict[str, Any]] = []  # the logged records of the current run
        self.hooks: list[Hook] = trainer_hooks(self)  # eval, log, checkpoint, export

    params, opt_state = state_attribute("params"), state_attribute("opt_state")

    @property
    def ref_params(self):
        """The KL reference: the TrainState's copy, or with ``model.lora`` the frozen base
        itself (adapters off: no second copy)."""
        if self.lora is not None and self.cfg.algo.kl_coef > 0:
            return self.lora.params
        return self.state.ref_params

    @property
    def policy_params(self):
        """The policy's weights: the params, or with ``model.lora`` the base with the
        adapters merged (what the samplers decode with and the export writes)."""
        return self.params if self.lora is None else self.lora.merged(self.params)

    @ref_params.setter
    def ref_params(self, value):
        self.state = self.state.replace(ref_params=value)
        self._ref_local = None

    @property
    def step(self) -> int:
        """Completed global steps (SFT + RL)."""
        return self.state.global_step

    @property
    def multiprocess(self) -> bool:
        return jax.process_count() > 1

    def add_hook(
        self, fn: Callable[[StepInfo], None], *, every=1, phase: Phase | None = None, final=False
    ) -> Hook:
        """Calls ``fn(info)`` after each step where ``every`` divides the global step
        count (or, with ``phase``, that phase's step count), after the hooks added
        before; ``final``: once instead, when the run reaches its last step."""
        hook = Hook(fn=fn, every=every, phase=phase, final=final)
        self.hooks.append(hook)
        return hook

    # ---------------------------------------------------------------- steps

    def _draw(self, rng_seed: list[int], n: int) -> list[Problem]:
        """``n`` problems: a dataset's next ``n`` rows (at ``data_cursor``), or the
        procedural task's from ``np.random.default_rng(rng_seed)``."""
        if isinstance(self.task, DatasetTask):
            problems = self.task.take(self.data_cursor, n)
        else:
            problems = self.task.generate(np.random.default_rng(rng_seed), n)
        self.data_cursor += len(problems)
        return problems

    def _problems(self, stream: int, step: int, n: int) -> list[Problem]:
        return self._draw([self.cfg.seed, stream, step], n)

    def _refill_problems(self, step: int, k: int) -> list[Problem]:
        """Generation batch ``k`` >= 1 of RL step ``step`` (dynamic sampling's refill)."""
        return self._draw([self.cfg.seed, _SEED_RL, step, k], self.cfg.rollout.prompts_per_step)

    def _update(self, batch, loss, optimizer: Optimizer, times: int, *, engine=None, **kw):
        """``run_updates`` from the current state; keeps the state after it. Returns the
        updates, the sub-batch of the last one and its ``recompute_old`` metrics."""
        out = run_updates(
            self.params,
            self.opt_state,
            batch,
            engine=self.engine if engine is None else engine,
            loss=loss,
            optimizer=optimizer,
            times=times,
            **kw,
        )
        self.state = self.state.replace(params=out.params, opt_state=out.opt_state)
        return out.updates, out.last, out.info

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
        """One RL step: ``rl_batch``, ``algo.updates_per_batch`` passes of updates (the
        value model's too, with PPO), ``step_metrics``."""
        cfg, a = self.cfg, self.cfg.algo
        reference = None
        if self.ref_params is not None and self.scorer is not None:
            if self._ref_local is None:  # every process scores the whole batch
                self._ref_local = local_copy(self.ref_params, self.mesh)
            reference = functools.partial(self.scorer, self._ref_local)
        params = rollout_params(self.policy_params, self.mesh, self.rollout_mesh)
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
            key=jax.random.fold_in(self.state.rng, cfg.sft.steps + step),
            reference=reference,
            value=self.value,
            more_problems=functools.partial(self._refill_problems, step),
            darts_state=self.darts,
            stream=self._streams(),
            shard_processes=self.multiprocess,
            on_call=self.pat,
        )
        m = dict(phase="rl", step=step, global_step=cfg.sft.steps + step + 1)
        if isinstance(self.task, DatasetTask):
            m.update(self.task.metrics(self.data_cursor))
        m["lr"] = self.rl_opt.lr(self.opt_state)  # this step's first update's
        m.update(episode_metrics)
        if self.pat is not None:
            m.update(pat_metrics(self.pat.timeline, int(self.rollout_mesh.shape[mesh_lib.TP])))
        if self.multiprocess:  # the devices this process decoded its share on
            m["rollout_devices"] = 1 if self.rollout_mesh is None else self.rollout_mesh.size
        if batch is None:
            self.skipped += 1
            return m
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
            v = self.value.state()
            self.state = self.state.replace(
                value_params=v["params"], value_opt_state=v["opt_state"]
            )
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

    def _make_pat(self):
        """A new ``rollout.pat`` controller over this run's sampler (``build_pat``)."""
        return build_pat(self.cfg, self.sampler, self.rollout_mesh, self.model)

    def _warm(self, sampler, params) -> None:
        """``rollout.warmup``: the first use of a sampler compiles all its programs
        (``Rollout.warmup``), so that nothing compiles later in the run."""
        if self.cfg.rollout.warmup and id(sampler) not in self._warmed:
            sampler.warmup(params, extend=self.task.max_turns > 1)
            self._warmed.add(id(sampler))

    def train_step(self) -> StepInfo:
        """The next global step: SFT, or RL (entering the RL phase after the warm-up)."""
        g, sft = self.step, self.cfg.sft.steps
        compile_s0 = self.compile_totals.start()
        if g < sft:
            t0 = time.perf_counter()
            m = self.sft_step(g)
        else:
            if g == sft and sft > 0:
                self._enter_rl()
            t0 = time.perf_counter()  # after the warm-up's own evaluation
            m = self.rl_step(g - sft)
        m["step_seconds"] = time.perf_counter() - t0  # the step alone: no hooks, no eval
        self.state = self.state.replace(step=g + 1)
        m["skipped_total"] = self.skipped
        self.compile_totals.add(m, compile_s0)
        report_progress()  # dtarl launch's watchdog: this rank finished a step
        return self._info(m)

    def _info(self, metrics: dict[str, Any]) -> StepInfo:
        """The ``StepInfo`` after the current step."""
        g, sft = self.step, self.cfg.sft.steps
        phase = Phase.SFT if 0 < g <= sft else Phase.RL
        return StepInfo(
            step=g, phase=phase, phase_step=g if phase is Phase.SFT else g - sft, metrics=metrics
        )

    def _start_rl(self):
        """A fresh optimizer for the RL phase; the reference policy = current weights."""
        if self.cfg.algo.kl_coef > 0 and self.lora is None:  # LoRA: the base is the reference
            self.ref_params = jax.tree.map(lambda x: x, self.params)
        self.opt_state = self.rl_opt.init(self.params)

    def _enter_rl(self):
        """After the SFT warm-up: ``_start_rl``, and evaluate the RL phase's starting point."""
        self._start_rl()
        if self.cfg.eval.num_problems:
            self.eval_rl_start = self.eval_record(self.step, after="sft")

    def evaluate(self) -> dict[str, float]:
        """``evaluate_policy`` on the fixed held-out problems with the run's reward:
        ``val/pass@1`` (greedy; also as ``eval_success_rate``), ``val/reward_mean``,
        ``val/response_length/mean`` and, with ``eval.num_samples`` = k > 1,
        ``val/pass@k`` at the rollout temperature. Empty without problems."""
        cfg = self.cfg
        params = rollout_params(self.policy_params, self.mesh, self.rollout_mesh)
        if not self.eval_problems:
            return {}
        self._warm(self.eval_sampler, params)
        k = cfg.eval.num_samples
        if k > 1:
            self._warm(self.sampler, params)
        res = evaluate_policy(
            self.eval_sampler,
            params,
            self.tokenizer,
            self.task,
            self.eval_problems,
            reward_fn=self.reward_fn,
            processes=self.multiprocess,
            sampler=self.sampler,
            k=k,
            chunk=cfg.rollout.prompts_per_step,
            key=jax.random.fold_in(jax.random.PRNGKey(cfg.seed), _SEED_EVAL_KEY + self.step),
        )
        return {"eval_success_rate": res.pass_at_1, **res.metrics()}

    # ---------------------------------------------------------------- hooks

    def log(self, metrics: dict[str, Any], *, advance: bool = True) -> None:
        """Logs a record (metrics.jsonl, console, TensorBoard) and adds it to ``history``."""
        self.logger.log(metrics, advance=advance)
        self.history.append(metrics)

    def eval_record(self, step: int, **extra) -> float:
        """Evaluates and logs a ``phase="eval"`` record (no progress-bar step); returns
        the greedy pass@1 (NaN without problems)."""
        m = self.evaluate()
        rec = dict(phase="eval", step=step, global_step=step, **m, **extra)
        self.log(rec, advance=False)
        return m.get("val/pass@1", float("nan"))

    # ---------------------------------------------------------- checkpoints

    def phase_optimizer(self, step: int) -> Optimizer:
        """The optimiser of global step ``step`` (0-based): SFT's during the warm-up, RL's after."""
        return self.sft_opt if step < self.cfg.sft.steps else self.rl_opt

    def host_record(self) -> HostRecord:
        return HostRecord(
            phase=(Phase.SFT if self.step < self.cfg.sft.steps else Phase.RL).value,
            data_cursor=self.data_cursor,
            skipped=self.skipped,
            seed=self.cfg.seed,
            config=to_dict(self.cfg),
            darts=None if self.darts is None else self.darts.state_dict(),
            has_ref=self.state.ref_params is not None,
            has_value=self.state.value_params is not None,
            data=self.task.train.fingerprint() if isinstance(self.task, DatasetTask) else None,
            lora_base=None if self.lora is None else self.lora.record(),
        )

    def save_checkpoint(self) -> str:
        """Starts writing the state after the current step (``CheckpointManager.save_state``)."""
        return self.ckpt.save_state(self.state, self.host_record().to_dict())

    def restore_target(self, step: int, host: HostRecord) -> TrainState:
        """The ``TrainState`` checkpoint ``step`` restores into (``TrainState.target``): the
        optimiser state is that of step - 1's phase (the one saved after global step ``step``)."""
        opt_state = self.phase_optimizer(step - 1).init(self.params)
        return self.state.target(
            opt_state=opt_state, has_ref=host.has_ref, has_value=host.has_value
        )

    def export_hf(self, path: str) -> str:
        """Writes the current policy to ``path`` as a HF checkpoint with the run's tokenizer
        files (``dtarl.rl.build.export_policy``: atomic; process 0 writes)."""
        tok = self.cfg.model.tokenizer_dir
        return export_policy(self.graphdef, self.policy_params, path, tokenizer_dir=tok)

    def try_resume(self) -> bool:
        """Restores the latest checkpoint in out_dir (False when there is none)."""
        self.ckpt.wait()  # a save of this trainer still in flight is committed first
        step = self.ckpt.latest_step()
        if step is None:
            return False
        host = HostRecord.from_dict(self.ckpt.read_host(step), where=self.ckpt.path(step))
        check_resume(host, self.cfg, where=self.ckpt.path(step))
        data = self.host_record().data
        if host.data != data and not self.cfg.resume.allow_changes:
            raise ConfigError(
                f"cannot resume from {self.ckpt.path(step)}: the training rows changed "
                f"(fingerprint {host.data} -> {data}); its data position counts rows of the "
                "old data. Restore the files, use another out_dir, or --set "
                "resume.allow_changes=true"
            )
        if self.lora is not None:  # adapters resume only onto the base they were trained on
            self.lora.check(host.lora_base, where=self.ckpt.path(step))
        state, _ = self.ckpt.restore_state(step, self.restore_target(step, host))
        self.state, self._ref_local = place_state(state, self.mesh), None
        if self.value is not None and state.value_params is not None:
            self.value.load_state(
                {"params": state.value_params, "opt_state": state.value_opt_state}
            )
        self.data_cursor, self.skipped = int(host.data_cursor), int(host.skipped)
        if self.darts is not None and host.darts:
            self.darts = darts.DartsState.from_state_dict(host.darts)
        return True

    # ------------------------------------------------------------------ run

    def run(self, *, max_steps: int | None = None) -> TrainResult:
        """Trains to ``cfg.total_steps`` (or stops after ``max_steps`` global steps, e.g.
        to simulate an interruption), resuming from out_dir's checkpoint when asked.
        Holds ``out_dir/.lock`` meanwhile (``dtarl.rl.runlock``: one run per out_dir)."""
        with runlock.hold(self.cfg.out_dir, enabled=jax.process_index() == 0):
            return self._run(max_steps)

    def _run(self, max_steps: int | None) -> TrainResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        resumed = cfg.resume.enabled and self.try_resume()
        if resumed:
            truncate_metrics(os.path.join(self.cfg.out_dir, "metrics.jsonl"), self.step)
        else:
            self.opt_state = (self.sft_opt if cfg.sft.steps else self.rl_opt).init(self.params)
            if cfg.sft.steps == 0:
                self._start_rl()
        self.logger = MetricsLogger.for_process(
            cfg.out_dir,
            total_steps=cfg.total_steps,
            console=cfg.console,
            logging=cfg.logging,
            config=to_dict(cfg),
        )
        self.history = []
        if isinstance(self.task, DatasetTask):
            self.logger.print(self.task.summary())
        eval_start = self.eval_rl_start = self.eval_end = None
        try:
            if resumed:
                self.logger.print(f"resumed from step {self.step} ({self.ckpt.path(self.step)})")
                self.logger.skip_to(self.step)
            elif cfg.eval.num_problems:
                eval_start = self.eval_record(0)
            end = cfg.total_steps if max_steps is None else min(cfg.total_steps, max_steps)
            info = self._info({})
            while self.step < end:
                info = self.train_step()
                run_hooks(self.hooks, info)
            if self.step >= cfg.total_steps:
                run_final_hooks(self.hooks, info)
            self.ckpt.wait()  # checkpoints are written asynchronously
        finally:
            self.logger.close()
            self.logger = None
        return TrainResult(
            history=self.history,
            params=self.policy_params,
            eval_start=eval_start,
            eval_rl_start=self.eval_rl_start,
            eval_end=self.eval_end,
            seconds=time.perf_counter() - t_start,
            steps_done=self.step,
        )


for _name in (f.name for f in dataclasses.fields(RunParts)):
    setattr(Trainer, _name, part_attribute(_name))  # trainer.engine is trainer.parts.engine, ...


def train(cfg: TrainerConfig, **kwargs) -> TrainResult:
    """``Trainer(cfg, **kwargs).run()``."""
    return Trainer(cfg, **kwargs).run()


__all__ = ["TrainResult", "Trainer", "mesh_metrics", "partition_cost", "stop_sequences", "train"]
