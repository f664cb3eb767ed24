"""The RL loop: rollout -> reward -> advantages -> engine -> optax update -> metrics.

    trainer = Trainer(config)          # builds model, tokenizer, task, sampler, engine
    result = trainer.run()             # SFT warm-up, then RL steps; checkpoints; metrics

Every step is a deterministic function of (config, step, state): prompts come
from ``np.random.default_rng([seed, phase, step])``, sampling keys from
``fold_in(PRNGKey(seed), step)``. A checkpoint holds params, optimizer state(s),
the reference policy (with a KL term), the step and the data cursor, so a
resumed run reproduces the uninterrupted one bit for bit.

The host-side pieces are plain functions (``rollout``, ``reference_batch``,
``build_rl_batch``, ``make_optimizer``) usable on their own (see notebooks/).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dtarl.batch import LossNorm
from dtarl.engines import Capacity, RolloutBatch, make_engine
from dtarl.losses import ClippedSurrogateLoss, MaskedNLLLoss
from dtarl.model import ModelConfig, init_model, load_hf
from dtarl.model.decoder import token_logprobs
from dtarl.model.tokenizer import ByteTokenizer, load_tokenizer
from dtarl.rl import advantages as adv_fns
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import Algorithm, ConfigError, Schedule, TrainerConfig, to_dict
from dtarl.rl.metrics import MetricsLogger, length_stats, ratio_stats
from dtarl.rl.rewards import RewardErrorPolicy, RewardFn, compute_rewards
from dtarl.rl.tasks import Problem, Role, Task, make_task
from dtarl.rollout.sampler import FinishReason, Sampler, SamplingParams
from dtarl.tree.plan import bucket

_PHASE_SFT, _PHASE_RL, _PHASE_EVAL = 1, 2, 3
# optax >= 0.2.5 renamed tree_l2_norm to tree_norm (the old name warns).
_tree_norm = getattr(optax.tree_utils, "tree_norm", None) or optax.tree_utils.tree_l2_norm


# ------------------------------------------------------------ trajectories


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Trajectory:
    """One sample: prompt, then assistant turns and tool outputs, as tokens.

    ``loss_mask`` is 1 on assistant tokens only; ``old_logprobs`` holds the
    sampler's logprobs (temperature 1, the training policy) there, 0 elsewhere.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    prompt_len: int
    response_len: int  # assistant tokens
    completion: str  # decoded text after the prompt (assistant + tool)
    truncated: bool  # the last turn hit its length limit
    num_turns: int
    problem_index: int


def encode_prompt(tokenizer, text: str) -> np.ndarray:
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(text)
    return np.asarray(ids, np.int32)


def single_token(tokenizer, s: str, what: str) -> int:
    ids = tokenizer.encode(s)
    if len(ids) != 1:
        raise ConfigError(
            f"{what} {s!r} encodes to {len(ids)} tokens with this tokenizer; the sampler "
            "stops on single tokens"
        )
    return int(ids[0])


def tool_stop_ids(tokenizer, task: Task) -> tuple[int, ...]:
    return tuple(single_token(tokenizer, s, "task stop string") for s in task.stop_strings)


def rollout(
    sampler: Sampler,
    weights,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    group_size: int,
    key: jax.Array,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Samples ``group_size`` trajectories per problem, running tool turns (multi-turn tasks).

    Turn 0 prefills each prompt once for its whole group; later turns re-prefill
    each distinct history once (samples that made the same calls share it).
    """
    tool_ids = set(tool_stop_ids(tokenizer, task))
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    n = len(problems) * group_size
    owner = np.repeat(np.arange(len(problems)), group_size)
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    turn_text = [""] * n
    truncated = np.zeros(n, bool)
    turns = np.zeros(n, np.int64)
    active = list(range(n))
    gen_tokens, seconds = 0, 0.0
    for turn in range(task.max_turns):
        if not active:
            break
        histories = {}
        for row in active:
            h = np.concatenate([prompts[owner[row]]] + [p[0] for p in parts[row]])
            histories.setdefault(h.tobytes(), (h, []))[1].append(row)
        uniq = list(histories.values())
        rows = [r for _, rs in uniq for r in rs]
        res = sampler.generate(
            weights,
            [h for h, _ in uniq],
            num_samples=[len(rs) for _, rs in uniq],
            seed=jax.random.fold_in(key, turn),
        )
        gen_tokens += res.stats["generated_tokens"]
        seconds += res.stats["seconds"]
        nxt = []
        for j, row in enumerate(rows):
            tk = res.tokens[j].astype(np.int32)
            parts[row].append((tk, np.ones(tk.shape, np.float32), res.raw_logprobs[j]))
            turns[row] += 1
            text = tokenizer.decode(tk.tolist())
            finish = FinishReason(int(res.finish[j]))
            truncated[row] = finish is FinishReason.LENGTH
            if (
                finish is FinishReason.STOP
                and int(tk[-1]) in tool_ids
                and turn + 1 < task.max_turns
            ):
                out = task.tool(problems[owner[row]], turn_text[row] + text)
                if out is not None:
                    ids = np.asarray(tokenizer.encode(out), np.int32)
                    parts[row].append(
                        (ids, np.zeros(ids.shape, np.float32), np.zeros(ids.shape, np.float32))
                    )
                    turn_text[row] += text + out
                    nxt.append(row)
        active = nxt
    trajs = []
    for row in range(n):
        p = prompts[owner[row]]
        toks = np.concatenate([p] + [x[0] for x in parts[row]]).astype(np.int32)
        mask = np.concatenate([np.zeros(p.shape, np.float32)] + [x[1] for x in parts[row]])
        old = np.concatenate([np.zeros(p.shape, np.float32)] + [x[2] for x in parts[row]])
        trajs.append(
            Trajectory(
                tokens=toks,
                loss_mask=mask,
                old_logprobs=old.astype(np.float32),
                prompt_len=int(p.shape[0]),
                response_len=int(mask.sum()),
                completion=tokenizer.decode(toks[p.shape[0] :].tolist()),
                truncated=bool(truncated[row]),
                num_turns=int(turns[row]),
                problem_index=int(owner[row]),
            )
        )
    stats = dict(
        rollout_seconds=seconds,
        rollout_tokens=gen_tokens,
        rollout_tokens_per_s=gen_tokens / max(seconds, 1e-9),
    )
    return trajs, stats


def reference_batch(tokenizer, problems: Sequence[Problem]) -> RolloutBatch:
    """SFT batch: prompt + the reference trajectory + eos; loss on assistant tokens."""
    toks, masks = [], []
    for p in problems:
        seq = [encode_prompt(tokenizer, p.prompt)]
        mask = [np.zeros(seq[0].shape, np.float32)]
        for role, text in p.reference:
            ids = np.asarray(tokenizer.encode(text), np.int32)
            seq.append(ids)
            mask.append(np.full(ids.shape, 1.0 if role is Role.ASSISTANT else 0.0, np.float32))
        seq.append(np.asarray([tokenizer.eos_id], np.int32))
        mask.append(np.ones(1, np.float32))
        toks.append(np.concatenate(seq))
        masks.append(np.concatenate(mask))
    return RolloutBatch.create(tokens=toks, loss_mask=masks)


def success_rate(rewards: np.ndarray) -> float:
    """Fraction of samples with reward >= 1 (the built-in tasks score 0 or 1)."""
    r = np.asarray(rewards)
    return float(np.mean(r >= 1.0)) if r.size else 0.0


# ------------------------------------------------------------------ optax


def make_schedule(lr: float, warmup: int, total: int, kind: Schedule):
    decay = max(total - warmup, 1)
    if kind is Schedule.CONSTANT:
        main = optax.constant_schedule(lr)
    elif kind is Schedule.COSINE:
        main = optax.cosine_decay_schedule(lr, decay, alpha=0.1)
    else:
        main = optax.linear_schedule(lr, 0.0, decay)
    if warmup <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])


def make_optimizer(
    *, lr: float, warmup: int, total: int, schedule: Schedule, cfg
) -> tuple[optax.GradientTransformation, Any]:
    """AdamW behind global-norm clipping; returns (transformation, schedule)."""
    sched = make_schedule(lr, warmup, total, schedule)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )
    return tx, sched


# ------------------------------------------------------------ algorithms


def make_loss(cfg: TrainerConfig, max_response: int):
    a = cfg.algo
    if a.algorithm is Algorithm.DR_GRPO:
        return ClippedSurrogateLoss(
            eps_low=a.clip_eps,
            eps_high=a.eps_high,
            kl_coef=a.kl_coef,
            entropy_coef=a.entropy_coef,
            norm=LossNorm.CONSTANT,
            norm_constant=float(max_response),
        )
    if a.algorithm is Algorithm.PPO:
        # GAE advantages ride in the batch's token_advantages; KL is in the reward.
        return ClippedSurrogateLoss(
            eps_low=a.clip_eps,
            eps_high=a.eps_high,
            entropy_coef=a.entropy_coef,
            norm=LossNorm.TOKEN,
        )
    norm = LossNorm.TOKEN if a.algorithm is Algorithm.DAPO else LossNorm.SEQUENCE
    return ClippedSurrogateLoss(
        eps_low=a.clip_eps,
        eps_high=a.eps_high,
        kl_coef=a.kl_coef,
        entropy_coef=a.entropy_coef,
        norm=norm,
    )


def shaped_rewards(cfg: TrainerConfig, rewards: np.ndarray, trajs: Sequence[Trajectory]):
    """Task rewards plus DAPO's overlong shaping (when ``algo.overlong_buffer > 0``)."""
    r = np.asarray(rewards, np.float32)
    if cfg.algo.overlong_buffer > 0:
        max_len = cfg.rollout.max_new_tokens * cfg.task.max_turns
        lens = [t.response_len for t in trajs]
        r = r + adv_fns.overlong_penalty(
            lens, max_len=max_len, buffer=min(cfg.algo.overlong_buffer, max_len)
        )
    return r


def group_advantages(cfg: TrainerConfig, rewards: np.ndarray, group_ids: np.ndarray):
    scale = cfg.algo.algorithm is not Algorithm.DR_GRPO
    return adv_fns.grpo_advantages(rewards, group_ids, scale_std=scale)


# ---------------------------------------------------------------- scoring


class Scorer:
    """Jitted dense per-token logprobs of a batch under given weights (reference policy, values)."""

    def __init__(self, model):
        self.graphdef, _ = nnx.split(model, nnx.Param)
        self.cfg = model.cfg
        self._fn = jax.jit(self._score)
        self._min = dict(n=1, t=8)

    def _score(self, weights, tokens_NxT):
        model = nnx.merge(self.graphdef, weights)
        n, t = tokens_NxT.shape
        pos = jnp.broadcast_to(jnp.arange(t), (n, t))
        hidden, _ = model(tokens_NxT, pos, return_hidden=True)
        lp, _ = token_logprobs(
            model.lm_head_weight(), hidden[:, :-1], tokens_NxT[:, 1:], chunk=self.cfg.logits_chunk
        )
        return jnp.concatenate([jnp.zeros((n, 1), jnp.float32), lp], axis=1)

    def __call__(self, weights, tokens: Sequence[np.ndarray]) -> list[np.ndarray]:
        self._min["n"] = n = bucket(len(tokens), self._min["n"])
        self._min["t"] = t = bucket(max(len(x) for x in tokens), self._min["t"])
        arr = np.zeros((n, t), np.int32)
        for i, x in enumerate(tokens):
            arr[i, : len(x)] = x
        out = np.asarray(self._fn(weights, arr))
        return [out[i, : len(x)].copy() for i, x in enumerate(tokens)]


# ------------------------------------------------------------------ trainer


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
    if m.hf_path is not None:
        if not os.path.isdir(m.hf_path):
            raise ConfigError(f"model.hf_path={m.hf_path!r} is not a directory")
        model = load_hf(m.hf_path, **m.overrides)
    else:
        mc = ModelConfig.preset(m.preset).replace(**m.overrides)
        model = init_model(mc, seed=m.seed)
    tok_dir = m.tokenizer_path or m.hf_path
    if tok_dir is not None and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        tokenizer = load_tokenizer(tok_dir)
    elif m.tokenizer_path is not None:
        raise ConfigError(f"model.tokenizer_path={m.tokenizer_path!r} has no tokenizer.json")
    else:
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.cfg.vocab_size}; set model.tokenizer_path to a matching tokenizer.json"
        )
    return model, tokenizer


def _engine_metrics(stats: dict) -> dict:
    """What a step's engine stats add to its metrics: the engine auto ran (``chosen_engine``),
    the compiled programs so far (``trace_count``: it grows only when a batch needs a new
    shape bucket) and auto's tuning time for the step (``autotune_seconds``; 0 for a fixed
    engine in RL steps)."""
    out = {}
    if "chosen_engine" in stats:
        out["chosen_engine"] = stats["chosen_engine"]
    for key in ("trace_count", "autotune_seconds"):
        if key in stats:
            out[key] = stats[key]
    return out


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
        self.model, self.tokenizer = build_model(cfg)
        self.graphdef, params = nnx.split(self.model, nnx.Param)
        self.params = params
        self.task = task if task is not None else make_task(cfg.task.kind, **cfg.task.options())
        self.reward_fn = reward_fn if reward_fn is not None else self.task.reward
        r = cfg.rollout
        stops = (self.tokenizer.eos_id,) + tool_stop_ids(self.tokenizer, self.task)
        self.sampler = Sampler(
            self.model,
            SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens,
                stop_tokens=stops,
            ),
            pad_id=self.tokenizer.pad_id,
        )
        self.eval_sampler = Sampler(
            self.model,
            SamplingParams.greedy(max_new_tokens=r.max_new_tokens, stop_tokens=stops),
            pad_id=self.tokenizer.pad_id,
        )
        self.max_response = r.max_new_tokens * self.task.max_turns
        self.engine = self._make_engine()
        self.loss = make_loss(cfg, self.max_response)
        self.sft_loss = MaskedNLLLoss()
        self.scorer = Scorer(self.model) if cfg.algo.kl_coef > 0 else None
        self.ref_params = None
        self.value = None
        if cfg.algo.algorithm is Algorithm.PPO:
            from dtarl.rl.value import ValueModel

            self.value = ValueModel(self.model, lr=cfg.algo.value_lr, seed=cfg.model.seed)
        self.sft_tx, self.sft_sched = make_optimizer(
            lr=cfg.sft.lr,
            warmup=cfg.sft.warmup_steps,
            total=cfg.sft.steps,
            schedule=Schedule.CONSTANT,
            cfg=cfg.optim,
        )
        self.rl_tx, self.rl_sched = make_optimizer(
            lr=cfg.optim.lr,
            warmup=cfg.optim.warmup_steps,
            total=cfg.steps * cfg.algo.updates_per_batch,
            schedule=cfg.optim.schedule,
            cfg=cfg.optim,
        )
        self.opt_state = None
        self._updates = {}
        self._gnorm = jax.jit(_tree_norm)
        self.base_key = jax.random.PRNGKey(cfg.seed)
        self.ckpt = CheckpointManager(
            os.path.join(cfg.out_dir, "checkpoints"), keep=cfg.keep_checkpoints
        )
        self.step = 0  # completed global steps (SFT + RL)
        self.data_cursor = 0  # problems consumed
        self.skipped = 0
        self.eval_problems = self.task.generate(
            np.random.default_rng([cfg.seed, _PHASE_EVAL]), cfg.eval_problems
        )
        self._reserve()

    # ------------------------------------------------------------ building

    def _make_engine(self):
        a = self.cfg.algo
        try:
            return make_engine(a.engine, self.model)
        except ValueError:
            return make_engine(a.fallback_engine, self.model)

    def _reserve(self):
        """Pre-sizes sampler and engine buckets to the run's largest batch, so that
        the sampler, dense and dfs never recompile after their first step (auto's
        candidates are sized as if each ran alone). prefix_reuse's group buckets
        (groups, prefix and suffix lengths, rows) are left to grow: their bound is
        the longest sequence, and padding every group to it would cost more than
        the few compiles early in a run."""
        cfg, r = self.cfg, self.cfg.rollout
        probe = self.task.generate(np.random.default_rng(0), 64)
        plen = max(len(encode_prompt(self.tokenizer, p.prompt)) for p in probe)
        tool = 16 * (self.task.max_turns - 1)
        max_len = plen + self.max_response + tool
        rows = r.prompts_per_step * r.group_size
        self.sampler.reserve(
            prompts=rows if self.task.max_turns > 1 else r.prompts_per_step,
            rows=rows,
            prompt_len=max_len,
            response=r.max_new_tokens,
        )
        self.eval_sampler.reserve(
            prompts=max(1, cfg.eval_problems), rows=max(1, cfg.eval_problems), prompt_len=max_len
        )
        n = max(rows, cfg.sft.batch_size if cfg.sft.steps else 1)
        self.engine.reserve(
            Capacity(
                sequences=n,
                length=max_len,
                group_size=r.group_size,
                groups=r.prompts_per_step,
            )
        )

    def _update_fn(self, tx):
        if id(tx) not in self._updates:

            def update(params, grads, opt_state):
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            self._updates[id(tx)] = jax.jit(update)
        return self._updates[id(tx)]

    # ---------------------------------------------------------- checkpoints

    def _phase_tx(self, step: int):
        return self.sft_tx if step < self.cfg.sft.steps else self.rl_tx

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
        )
        return self.ckpt.save(self.step, self.state_tree(), meta)

    def try_resume(self) -> bool:
        """Restores the latest checkpoint in out_dir (False when there is none)."""
        step = self.ckpt.latest_step()
        if step is None:
            return False
        meta = self.ckpt.read_meta(step)
        # The optimizer state saved after global step s belongs to the phase of step s - 1.
        self.opt_state = self._phase_tx(step - 1).init(self.params)
        self.ref_params = self.params if meta.get("has_ref") else None
        tree, meta = self.ckpt.restore(step, self.state_tree())
        self.params = tree["params"]
        self.opt_state = tree["opt_state"]
        self.ref_params = tree.get("ref_params")
        if self.value is not None and "value" in tree:
            self.value.load_state(tree["value"])
        self.step = step
        self.data_cursor = int(meta["data_cursor"])
        self.skipped = int(meta.get("skipped", 0))
        return True

    def _start_rl(self):
        """Enters the RL phase: a fresh optimizer; the reference policy = current weights."""
        if self.cfg.algo.kl_coef > 0:
            self.ref_params = jax.tree.map(lambda x: x, self.params)
        self.opt_state = self.rl_tx.init(self.params)

    # --------------------------------------------------------------- steps

    def _apply(self, tx, grads, loss_value) -> tuple[bool, float, str]:
        gnorm = float(self._gnorm(grads))
        if not (np.isfinite(float(loss_value)) and np.isfinite(gnorm)):
            return False, gnorm, "non-finite loss or gradient"
        self.params, self.opt_state = self._update_fn(tx)(self.params, grads, self.opt_state)
        return True, gnorm, ""

    def sft_step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, _PHASE_SFT, step])
        problems = self.task.generate(rng, cfg.sft.batch_size)
        self.data_cursor += len(problems)
        batch = reference_batch(self.tokenizer, problems)
        t0 = time.perf_counter()
        loss, grads, aux = self.engine.value_and_grad(self.params, batch, self.sft_loss)
        applied, gnorm, why = self._apply(self.sft_tx, grads, loss)
        secs = time.perf_counter() - t0
        m = dict(
            phase="sft",
            step=step,
            global_step=step + 1,
            loss=float(loss),
            grad_norm=gnorm,
            lr=float(self.sft_sched(step)),
            train_tokens_per_s=batch.num_tokens / max(secs, 1e-9),
            train_seconds=secs,
            skipped=int(not applied),
            engine=aux.stats.get("engine", getattr(self.engine, "name", "?")),
            **_engine_metrics(aux.stats),
        )
        if not applied:
            self.skipped += 1
            m["skip_reason"] = why
        return m

    def rl_step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        r = cfg.rollout
        rng = np.random.default_rng([cfg.seed, _PHASE_RL, step])
        problems = self.task.generate(rng, r.prompts_per_step)
        self.data_cursor += len(problems)
        key = jax.random.fold_in(self.base_key, cfg.sft.steps + step)
        trajs, rstats = rollout(
            self.sampler,
            self.params,
            self.tokenizer,
            self.task,
            problems,
            group_size=r.group_size,
            key=key,
        )
        t_reward = time.perf_counter()
        res = compute_rewards(
            self.reward_fn,
            [problems[t.problem_index] for t in trajs],
            [t.completion for t in trajs],
            on_error=cfg.reward_on_error,
        )
        reward_s = time.perf_counter() - t_reward
        raw = res.rewards
        rewards = shaped_rewards(cfg, raw, trajs)
        gids = np.array([t.problem_index for t in trajs], np.int32)
        m: dict[str, Any] = dict(
            phase="rl",
            step=step,
            global_step=cfg.sft.steps + step + 1,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()),
            success_rate=success_rate(raw),
            truncated_fraction=float(np.mean([t.truncated for t in trajs])),
            turns_mean=float(np.mean([t.num_turns for t in trajs])),
            reward_errors=len(res.errors),
            reward_seconds=reward_s,
            lr=float(self.rl_sched(step * cfg.algo.updates_per_batch)),
            **rstats,
            **length_stats([t.response_len for t in trajs]),
        )
        keep = np.ones(len(trajs), bool)
        if cfg.algo.use_dynamic_sampling:
            keep = adv_fns.dynamic_sampling_mask(rewards, gids)
        m["kept_fraction"] = float(keep.mean())
        if not keep.any():
            m.update(skipped=1, skip_reason="every group has equal rewards (no signal)")
            self.skipped += 1
            return m
        idx = np.flatnonzero(keep)
        trajs = [trajs[i] for i in idx]
        rewards, gids = rewards[idx], gids[idx]
        toks = [t.tokens for t in trajs]
        masks = [t.loss_mask for t in trajs]
        olds = [t.old_logprobs for t in trajs]
        ref = None
        if self.ref_params is not None and self.scorer is not None:
            ref = self.scorer(self.ref_params, toks)
        if self.value is not None:
            advs = np.zeros(len(trajs), np.float32)
            token_adv, vstats = self.value.advantages(
                toks,
                masks,
                olds,
                rewards,
                ref,
                kl_coef=cfg.algo.kl_coef,
                gamma=cfg.algo.gamma,
                lam=cfg.algo.lam,
            )
            m.update(vstats)
        else:
            advs = group_advantages(cfg, rewards, gids)
            token_adv = None
        batch = RolloutBatch.create(
            tokens=toks,
            loss_mask=masks,
            advantages=advs,
            old_logprobs=olds,
            ref_logprobs=ref,
            token_advantages=token_adv,
            group_ids=gids,
            rewards=rewards,
        )
        m["advantage_abs_mean"] = float(np.abs(advs).mean())
        tree = batch.prefix_tree()  # built once: the engine reuses it
        m["tree_token_ratio"] = tree.stats.ideal_token_ratio
        m["num_tokens"] = batch.num_tokens
        m["tree_tokens"] = tree.stats.tree_tokens
        train_s, tune_s, applied_all, why = 0.0, 0.0, True, ""
        for _ in range(cfg.algo.updates_per_batch):
            t0 = time.perf_counter()
            loss, grads, aux = self.engine.value_and_grad(self.params, batch, self.loss)
            applied, gnorm, why = self._apply(self.rl_tx, grads, loss)
            train_s += time.perf_counter() - t0
            tune_s += float(aux.stats.get("autotune_seconds", 0.0))
            applied_all &= applied
            if not applied:
                break
        if self.value is not None and applied_all:
            m.update(self.value.train(toks, masks))
        m.update(
            loss=float(loss),
            grad_norm=gnorm,
            engine=aux.stats.get("engine", getattr(self.engine, "name", "?")),
            **_engine_metrics(aux.stats | {"autotune_seconds": tune_s}),
            train_seconds=train_s,
            train_tokens_per_s=batch.num_tokens * cfg.algo.updates_per_batch / max(train_s, 1e-9),
            skipped=int(not applied_all),
        )
        if not applied_all:
            m["skip_reason"] = why
            self.skipped += 1
        eps_high = cfg.algo.eps_high
        m.update(
            ratio_stats(
                aux.logprobs,
                olds,
                masks,
                advs if self.value is None else np.zeros(len(trajs)),
                eps_low=cfg.algo.clip_eps,
                eps_high=eps_high,
            )
        )
        if ref is not None:
            against = ref
        else:  # approximate KL(old || new) on the sampled tokens
            against = olds
        m["kl"] = float(
            np.mean(
                [
                    adv_fns.token_kl(lp, rf, mk)
                    for lp, rf, mk in zip(aux.logprobs, against, masks, strict=True)
                ]
            )
        )
        return m

    def evaluate(self) -> float:
        """Greedy success rate on the fixed evaluation problems."""
        if not self.eval_problems:
            return float("nan")
        trajs, _ = rollout(
            self.eval_sampler,
            self.params,
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

    # ----------------------------------------------------------------- run

    def run(self, *, max_steps: int | None = None) -> TrainResult:
        """Trains to ``cfg.total_steps`` (or stops after ``max_steps`` global steps, e.g.
        to simulate an interruption), resuming from out_dir's checkpoint when asked."""
        cfg = self.cfg
        t_start = time.perf_counter()
        resumed = cfg.resume and self.try_resume()
        if not resumed:
            self.opt_state = (self.sft_tx if cfg.sft.steps else self.rl_tx).init(self.params)
            if cfg.sft.steps == 0:
                self._start_rl()
        logger = MetricsLogger(
            cfg.out_dir,
            total_steps=cfg.total_steps,
            console=cfg.console,
            tensorboard=cfg.tensorboard,
        )
        history: list[dict[str, Any]] = []
        eval_start = eval_end = eval_rl_start = None
        try:
            if resumed:
                logger.print(f"resumed from step {self.step} ({self.ckpt.path(self.step)})")
                logger.skip_to(self.step)
            elif cfg.eval_problems:
                eval_start = self.evaluate()
                rec = dict(phase="eval", step=0, global_step=0, eval_success_rate=eval_start)
                logger.log(rec, advance=False)
                history.append(rec)
            end = cfg.total_steps if max_steps is None else min(cfg.total_steps, max_steps)
            while self.step < end:
                g = self.step
                if g < cfg.sft.steps:
                    m = self.sft_step(g)
                else:
                    if g == cfg.sft.steps and cfg.sft.steps > 0:
                        self._start_rl()
                        if cfg.eval_problems:  # the RL phase's starting point
                            eval_rl_start = self.evaluate()
                            rec = dict(
                                phase="eval",
                                step=g,
                                global_step=g,
                                eval_success_rate=eval_rl_start,
                                after="sft",
                            )
                            logger.log(rec, advance=False)
                            history.append(rec)
                    m = self.rl_step(g - cfg.sft.steps)
                self.step = g + 1
                m["skipped_total"] = self.skipped
                rl_done = self.step - cfg.sft.steps
                if (
                    cfg.eval_every
                    and cfg.eval_problems
                    and rl_done > 0
                    and rl_done % cfg.eval_every == 0
                    and self.step < cfg.total_steps
                ):
                    m["eval_success_rate"] = self.evaluate()
                logger.log(m)
                history.append(m)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
            if self.step >= cfg.total_steps:
                if not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                    self.save_checkpoint()
                if cfg.eval_problems:
                    eval_end = self.evaluate()
                    rec = dict(
                        phase="eval",
                        step=self.step,
                        global_step=self.step,
                        eval_success_rate=eval_end,
                    )
                    logger.log(rec, advance=False)
                    history.append(rec)
        finally:
            logger.close()
        return TrainResult(
            history=history,
            params=self.params,
            eval_start=eval_start,
            eval_rl_start=eval_rl_start,
            eval_end=eval_end,
            seconds=time.perf_counter() - t_start,
            steps_done=self.step,
        )


def train(cfg: TrainerConfig, **kwargs) -> TrainResult:
    """``Trainer(cfg, **kwargs).run()``."""
    return Trainer(cfg, **kwargs).run()


__all__ = [
    "Scorer",
    "TrainResult",
    "Trainer",
    "Trajectory",
    "build_model",
    "encode_prompt",
    "make_loss",
    "make_optimizer",
    "reference_batch",
    "rollout",
    "success_rate",
    "train",
]
