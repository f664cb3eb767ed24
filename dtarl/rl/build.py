"""A run's objects, built from its config: ``build_parts(cfg)`` -> ``(RunParts, params)``.

Each section builds its own (``dtarl.rl.sections``): the mesh (``MeshSection.build``),
model and tokenizer (``ModelSection``), task, samplers (``RolloutSection``), PAT's
controller (``PatSection``), the engines, loss and value model (``AlgoSection``),
the streaming scorers (``StreamingSection``), the optimisers (``OptimSection``,
``SFTSection``) and DARTS' statistics (``DartsSection``). This module wires them
together and reserves every bucket the run will need (``reserve``).

On a mesh (``mesh.dp x mesh.fsdp x mesh.tp > 1``, ``dtarl.parallel``): the params, the
reference policy and the optimizer state live on a ('dp', 'tp') mesh, or ('dp', 'fsdp',
'tp') with ``mesh.fsdp > 1``, over ``jax.devices()`` (every process's, under ``dtarl
launch``), split over 'tp' (and 'fsdp') by the rule table and replicated over 'dp';
the rollout decodes on the ('dp', 'tp') view of the same devices; the training engines run through
``ShardedEngine`` (each batch cut over dp by the balanced partition, priced by the
running engine's own work counts, ``engine.partition_cost``, with the model's
``FlopCost`` as the fallback for an engine without them; auto picks one engine for
all ranks and the cut is priced by its pick) and the optimiser keeps the params'
shardings. One process: the rollout and evaluation samplers decode on the same mesh
(slots over dp, heads over tp). Several processes: each process decodes only its
contiguous share of the problems (whole groups, global sampling keys) on a mesh of
its own devices (``rollout_mesh``) from a host copy of the params, and the
trajectories are all-gathered, so that every process holds the one-process run's
batch (``process_rollout``; evaluation likewise). The KL reference is not split:
every process scores the whole batch on its first local device (``local_copy``), P
times the reference forward of one process. Split like the rollout, a process's
share runs at another row count than the whole batch, and XLA's CPU matmuls round
differently there (measured: 4.8e-7 on the logprobs of 6 sequences of the 2-process
test's config scored 3 + 3 in 4-row programs against 6 in one 8-row program); at
policy == reference the KL gradient is that rounding, and the 2-process test's grad
norm then differed from the one-process run's by 1.1e-5 relative (over its 1e-5; the
final parameters still agreed to 2 ulp). Replicated, the grad norms agree to 1.5e-7
and 0 on its two steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl import aot
from dtarl.engines import training_temperature
from dtarl.errors import ConfigError
from dtarl.lora import LoraBase, LoraEngine, checksum, init_adapters
from dtarl.lora.adapters import file_checksum
from dtarl.losses import MaskedNLLLoss
from dtarl.model.hf import save_hf, tokenizer_files
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.partition import FlopCost
from dtarl.parallel.sharded import ShardedEngine, to_host
from dtarl.rewards import RewardFn
from dtarl.rl.capacity import capacity, response_budget
from dtarl.rl.config import Algorithm, TrainerConfig
from dtarl.rl.datatask import DatasetTask
from dtarl.rl.episodes import Scorer, problem_ids, tool_stop_sequences
from dtarl.rl.optim import Optimizer, place_like, put
from dtarl.rl.state import TrainState
from dtarl.rl.tasks import Task


@dataclasses.dataclass(kw_only=True, eq=False)
class RunParts:
    """The objects a run is made of (no state: that is ``TrainState``). A caller may
    swap one (a test's engine double, a reward function) before the next step."""

    model: Any  # the policy's nnx module (its params live in the TrainState)
    graphdef: Any
    tokenizer: Any
    task: Task | DatasetTask
    reward_fn: RewardFn
    mesh: jax.sharding.Mesh | None  # the training mesh (None: one device)
    rollout_mesh: jax.sharding.Mesh | None  # the samplers' (``rollout_mesh``)
    sampler: Any  # a ``dtarl.rollout.protocol.Rollout``
    eval_sampler: Any  # greedy, for ``Trainer.evaluate``
    pat: Any  # rollout.pat's controller, or None
    temperature: float  # the engines' logprobs are those of logits / temperature
    engine: Any  # the RL engine (``ShardedEngine`` on a mesh)
    sft_engine: Any  # SFT's (T = 1): the RL engine unless the temperature differs
    loss: Any
    sft_loss: Any
    scorer: Scorer | None  # the KL reference's scorer (algo.kl_coef > 0)
    streamers: dict  # rollout.streaming's scorers by ``StreamedModel``
    value: Any  # PPO's ValueModel, or None
    lora: Any  # model.lora: the frozen base (``dtarl.lora.LoraBase``); params = adapters
    sft_opt: Optimizer
    rl_opt: Optimizer
    max_response: int  # max_new_tokens per turn x turns
    prompt_len: int  # the longest of 64 probe prompts


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


def rollout_mesh(mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
    """The rollout samplers' mesh: the run's own in one process; in a multi-process run
    (where each process decodes its share of the problems, ``process_rollout``) a mesh
    of this process's devices, with the run's tp when it divides them (else tp = 1),
    or None when the process has one device. On a ('dp', 'fsdp', 'tp') mesh the
    rollout decodes on its ('dp', 'tp') view (``mesh_lib.rollout_view``: dp x fsdp
    slot groups over the same devices), its weights gathered there once per step."""
    if mesh is None or jax.process_count() == 1:
        return None if mesh is None else mesh_lib.rollout_view(mesh)
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


def check_mesh(cfg: TrainerConfig, mesh: jax.sharding.Mesh) -> None:
    """Refuses what does not run on ``mesh``, naming the combination."""
    dp = mesh_lib.data_ranks(mesh)
    fsdp = mesh_lib.mesh_size(mesh, mesh_lib.FSDP)
    where = f"mesh.dp={dp // fsdp}, mesh.tp={int(mesh.shape[mesh_lib.TP])}"
    where = where if fsdp == 1 else where.replace(", ", f", mesh.fsdp={fsdp}, ")
    if cfg.rollout.streaming.enabled:
        raise ConfigError(
            f"rollout.streaming.enabled=true is not supported on a mesh ({where}): the "
            "streaming scorers (reference policy, critic) run on one device, beside a "
            "single-device rollout (rollout.streaming.device), not beside a mesh; disable "
            "streaming or use mesh.dp=1, mesh.tp=1"
        )
    a, r = cfg.algo, cfg.rollout
    if jax.process_count() > 1 and a.algorithm is Algorithm.PPO:
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


def build_parts(
    cfg: TrainerConfig, *, reward_fn: RewardFn | None = None, task: Task | None = None
) -> tuple[RunParts, Any]:
    """(the run's objects, the initial params: on the mesh when there is one). ``task``
    replaces ``cfg.task``'s; ``reward_fn`` (sync or async) the task's verifier, else
    ``reward.function`` does when set."""
    # compile_cache_dir: before anything compiles (the model's initialisation does)
    if cfg.compile_cache_dir is not None:
        cache_dir = enable_compile_cache(cfg.compile_cache_dir)
        aot.enable_program_store(os.path.join(cache_dir, aot.STORE_SUBDIR))
    mesh = cfg.mesh.build()  # before the model: a bad mesh fails at once
    if task is None and cfg.data.enabled:
        cfg.data.check_files()  # ... and so do missing data files
    if reward_fn is None:  # reward.function (loaded before the model: a bad one fails at once)
        # data_source of problems that carry none: the procedural task's kind
        source = task if task is not None else (None if cfg.data.enabled else cfg.task)
        reward_fn = cfg.reward.build(
            data_source=getattr(getattr(source, "kind", None), "value", "")
        )
    model, tokenizer = cfg.model.build()
    graphdef, params = nnx.split(model, nnx.Param)
    if mesh is not None:
        check_mesh(cfg, mesh)
        params = mesh_lib.shard_params(params, mesh)
    if task is None:
        task = build_task(cfg, tokenizer)
    r = cfg.rollout
    # Tool-call markers of one token are stop tokens; longer ones stop sequences.
    tool = tool_stop_sequences(tokenizer, task)
    stops = (tokenizer.eos_id,) + tuple(sq[0] for sq in tool if len(sq) == 1)
    stop_seqs = stop_sequences(tokenizer, r.stop) + tuple(sq for sq in tool if len(sq) > 1)
    if isinstance(task, DatasetTask):  # every row is tokenised: the longest is known
        prompt_len = task.longest_prompt
    else:
        probe = task.generate(np.random.default_rng(0), 64)
        prompt_len = max(len(problem_ids(tokenizer, p)) for p in probe)
    samplers_mesh = rollout_mesh(mesh)
    sampler, eval_sampler = r.build(
        model,
        pad_id=tokenizer.pad_id,
        stop_ids=stops,
        stop_sequences=stop_seqs,
        prompt_len=prompt_len,
        response_len=response_budget(r.max_new_tokens, task.max_turns),
        group_size=cfg.algo.darts.candidates(r.group_size),
        eval_problems=cfg.eval.num_problems,
        mesh=samplers_mesh,
    )
    pat = build_pat(cfg, sampler, samplers_mesh, model)
    # The engine's logprobs are those of logits / T, the sampler's (greedy: T = 1).
    temperature = training_temperature(r.temperature)
    engine = cfg.algo.build_engine(model, cfg.engine, temperature=temperature)
    # SFT trains the model itself (T = 1): its own engine when the rollout's differs.
    sft_engine = engine
    if cfg.sft.steps and temperature != 1.0:
        sft_engine = cfg.algo.build_engine(model, cfg.engine)
    if mesh is not None:
        cost = partition_cost(model)
        gather = cfg.mesh.fsdp_gather
        sharded = ShardedEngine(engine, mesh, fallback_cost=cost, fsdp_gather=gather)
        if sft_engine is not engine:
            sft_engine = ShardedEngine(sft_engine, mesh, fallback_cost=cost, fsdp_gather=gather)
        else:
            sft_engine = sharded
        engine = sharded
    lora = None
    if cfg.model.lora is not None:  # the TrainState's params are the adapters
        lora, params = lora_parts(cfg, params, mesh)
        wrapped = LoraEngine(engine, lora.params, lora.cfg)
        sft_engine = (
            wrapped if sft_engine is engine else LoraEngine(sft_engine, lora.params, lora.cfg)
        )
        engine = wrapped
    max_response = r.max_new_tokens * task.max_turns
    a = cfg.algo
    parts = RunParts(
        model=model,
        graphdef=graphdef,
        tokenizer=tokenizer,
        task=task,
        reward_fn=reward_fn if reward_fn is not None else task.reward,
        mesh=mesh,
        rollout_mesh=samplers_mesh,
        sampler=sampler,
        eval_sampler=eval_sampler,
        pat=pat,
        temperature=temperature,
        engine=engine,
        sft_engine=sft_engine,
        loss=a.build_loss(max_response),
        sft_loss=MaskedNLLLoss(),
        scorer=Scorer(model, temperature=temperature) if a.kl_coef > 0 else None,
        streamers=r.streaming.build(
            model,
            cfg.streamed_models(),
            temperature=temperature,
            pad_id=tokenizer.pad_id,
            warmup=r.warmup,
        ),
        value=a.build_value(model, seed=cfg.model.seed),
        lora=lora,
        sft_opt=cfg.sft.build_optimizer(cfg.optim),
        rl_opt=cfg.optim.build(total=cfg.steps * a.updates_per_batch * a.minibatches),
        max_response=max_response,
        prompt_len=prompt_len,
    )
    cfg.export.check(cfg.out_dir)  # refused now, not after training
    reserve(cfg, parts)
    return parts, params


def build_task(cfg: TrainerConfig, tokenizer) -> Task | DatasetTask:
    """``data:``'s dataset (rows read, rendered with the chat template and tokenised)
    when ``data.train_files`` is set, else ``task:``'s procedural task."""
    if not cfg.data.enabled:
        return cfg.task.build()
    train, val = cfg.data.build(tokenizer, tokenizer_dir=cfg.model.tokenizer_dir, seed=cfg.seed)
    return DatasetTask(train=train, val=val)


def lora_parts(cfg: TrainerConfig, base, mesh) -> tuple[LoraBase, Any]:
    """(the frozen base, fresh adapters from ``model.seed``: replicated on the mesh). The
    base's checksum: of its HF files (``model.hf_path``), else of its weights (a preset's
    initialisation), else, where a process cannot read them all, of the preset's
    config and seed (what its deterministic initialisation is a function of)."""
    lc, m = cfg.model.lora, cfg.model
    if m.hf_path is not None:
        digest = file_checksum(m.hf_path)
    elif all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(base)):
        digest = checksum(base)
    else:
        ident = repr((m.preset, sorted(m.overrides.items()), m.seed)).encode()
        digest = hashlib.sha256(ident).hexdigest()
    lora = LoraBase(cfg=lc, params=base, path=m.hf_path, checksum=digest)
    adapters = init_adapters(base, lc, jax.random.fold_in(jax.random.key(cfg.model.seed), 7))
    if mesh is not None:
        adapters = jax.tree.map(lambda x: put(x, NamedSharding(mesh, P())), adapters)
    return lora, adapters


def build_pat(cfg: TrainerConfig, sampler, mesh, model):
    """``rollout.pat``'s controller over ``sampler`` on ``mesh`` (None when disabled)."""
    r = cfg.rollout
    return r.pat.build(
        sampler,
        mesh=mesh,
        num_kv_heads=model.cfg.num_kv_heads,
        steps_per_call=r.steps_per_call,
        compile_reuse=max(cfg.steps, 1),  # the RL steps reuse a compiled target
    )


def reserve(cfg: TrainerConfig, parts: RunParts) -> None:
    """Pre-sizes sampler and engine buckets to the run's largest batch (prompt length,
    responses of ``max_new_tokens`` per turn plus tool output, group size, prompts per
    step, turns; ``dtarl.rl.capacity``), so that no engine compiles after the first
    step of each phase."""
    r, turns = cfg.rollout, parts.task.max_turns
    plen = parts.prompt_len
    max_len = plen + response_budget(r.max_new_tokens, turns)
    rows = r.prompts_per_step * r.group_size
    parts.sampler.reserve(
        prompts=rows if turns > 1 else r.prompts_per_step,
        rows=rows,
        prompt_len=max_len,
        response=r.max_new_tokens,
    )
    n_eval = max(1, cfg.eval.num_problems)
    parts.eval_sampler.reserve(
        prompts=n_eval, rows=n_eval, prompt_len=max_len, response=r.max_new_tokens
    )
    sft = cfg.sft.batch_size if cfg.sft.steps else 1
    cap = capacity(
        sequences=max(rows, sft),
        groups=max(r.prompts_per_step, sft),
        length=max_len,
        group_size=r.group_size,
        prompt_len=plen,
        response_len=max_len - plen,
        turns=turns,
        dp=1 if parts.mesh is None else mesh_lib.data_ranks(parts.mesh),
    )
    parts.engine.reserve(cap)
    if parts.scorer is not None:  # the KL reference: every sequence of a step, unsplit
        parts.scorer.reserve(sequences=rows, length=max_len)
    if parts.sft_engine is not parts.engine:
        parts.sft_engine.reserve(cap)


def local_copy(tree, mesh: jax.sharding.Mesh | None):
    """A process-local copy of a mesh tree in a multi-process run (on the first local
    device; as is in one process or without a mesh)."""
    if jax.process_count() == 1 or mesh is None:
        return tree
    return jax.device_put(to_host(tree), jax.local_devices()[0])


def rollout_params(params, mesh, samplers_mesh):
    """The params the samplers decode with: the mesh's own in one process; a
    process-local copy (gathered from the mesh, as host arrays that the sampler
    places on its local mesh, ``rollout_mesh``) in a multi-process run, where each
    process decodes its share of the problems (``process_rollout``)."""
    if jax.process_count() == 1 or mesh is None:
        return params
    host = to_host(params)
    return host if samplers_mesh is not None else jax.device_put(host, jax.local_devices()[0])


def place_state(state: TrainState, mesh: jax.sharding.Mesh | None) -> TrainState:
    """A restored ``TrainState`` on the mesh: params and reference policy by the rule
    table, the optimiser state like the params (as is without a mesh)."""
    if mesh is None:
        return state
    # LoRA adapters (not an nnx.State) restore replicated, like the target they came into.
    params = place(state.params, mesh) if isinstance(state.params, nnx.State) else state.params
    return state.replace(
        params=params,
        opt_state=place_like(state.opt_state, params),
        ref_params=place(state.ref_params, mesh),
    )


def export_policy(graphdef, params, path: str, *, tokenizer_dir: str | None) -> str:
    """Writes the policy ``params`` to ``path`` as a HF checkpoint (``save_hf``: atomic,
    in ``param_dtype``) with the tokenizer files of ``tokenizer_dir`` (none: the byte
    tokenizer's). Process 0 writes, after gathering the parameters."""
    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return path
    return save_hf(nnx.merge(graphdef, params), path, extra_files=tokenizer_files(tokenizer_dir))


def part_attribute(name: str) -> property:
    """A property ``owner.<name>`` for ``owner.parts.<name>`` (settable: a caller may swap
    a part, e.g. an engine double, before the next step)."""

    def get(owner):
        return getattr(owner.parts, name)

    def set_(owner, value):
        setattr(owner.parts, name, value)

    return property(get, set_, doc=f"``parts.{name}`` (``RunParts``)")


def place(tree, mesh: jax.sharding.Mesh | None):
    """A restored params-shaped tree on the mesh (as is without one)."""
    if mesh is None or tree is None:
        return tree
    return jax.tree.map(put, tree, mesh_lib.param_shardings(tree, mesh))


__all__ = [
    "RunParts",
    "build_parts",
    "build_pat",
    "build_task",
    "check_mesh",
    "enable_compile_cache",
    "export_policy",
    "local_copy",
    "part_attribute",
    "partition_cost",
    "place",
    "place_state",
    "reserve",
    "rollout_mesh",
    "rollout_params",
    "stop_sequences",
]
