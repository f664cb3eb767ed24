"""``dtarl bench scale`` (without ``--compile``): per-device memory of a GRPO step at a
real model's shape, from compiled programs, without running them.

    dtarl bench scale --model qwen3_8b --mesh dp=1,fsdp=8,tp=1 --group 8 \\
        --prompt 1024 --response 1024 [--engine dense dfs prefix_reuse] \\
        [--layers N] [--extrapolate L1 L2] [--lora 0 16] [--device-memory GiB] [--json PATH]

The parameters are ``jax.eval_shape``'s (nothing is initialised); the mesh is made of
simulated CPU devices (dp x fsdp x tp of them). One GRPO group (G sequences of one
prompt and responses of ``--response`` tokens) is cut over the dp x fsdp data ranks
by the balanced partition, as in training (``ShardedEngine``), with bf16 compute,
fp32 master weights and fp32 Adam moments; under FSDP the weights are gathered in
bf16 (``dtarl.parallel.fsdp``). Two programs are compiled, as the trainer runs them:
the sharded loss-and-gradient step and the AdamW update (``dtarl.rl.optim``). Per
device, from XLA's memory analysis and the shardings:

    param_bytes  the fp32 master weights' shards
    opt_bytes    Adam's two moments' shards (resident through the step)
    grad_bytes   the step's gradient output (split like the params)
    peak_bytes   max(step peak + opt_bytes, update peak); a program's peak is
                 arguments + outputs + temporaries - aliased (``bench.memory.peak_bytes``).
                 Not in it: the KL reference (``ref_bytes``), the rollout's weights and
                 KV cache (the rollout runs before the step; its weights are gathered
                 to its ('dp', 'tp') layout, ``dtarl.parallel.mesh.rollout_view``)
    ref_bytes    the KL reference policy (GRPO with ``algo.kl_coef > 0``): a second
                 copy of the params split like them (= param_bytes); resident through
                 the step, so the step's peak with a reference is peak + ref
    lora_rank    0 (full fine-tuning) or the LoRA rank of the row (``--lora``)
    compile_s    seconds to lower and compile the programs

``--lora R [R ...]``: a row per rank (0 = full fine-tuning, the rows above). A LoRA
row (rank r, alpha = 2r, all seven projections) compiles the step as the trainer runs
it (``LoraEngine`` around the ``ShardedEngine``, ``dtarl.lora``): the frozen base in
the model's dtype (fp32 here, or ``--lora-base-dtype bfloat16``; split like the
params), the adapters and their AdamW
moments in fp32 (replicated), four programs in turn: the merge W' = W + (alpha/r) A@B
of the adapted weights (placed like W), the sharded loss-and-gradient step on W' (the
same program as the full row's: W' has W's shapes and shardings), the adapters'
gradients (2) from dL/dW', and AdamW over the adapters. Its columns:

    param_bytes  the base's shards + the adapters
    opt_bytes    Adam's moments of the adapters (2 x adapter bytes + step counts)
    grad_bytes   dL/dW', the step's gradient output: fp32, every parameter, split like
                 the params (the engines differentiate the merged weights; (2) turns
                 it into the adapters' gradient afterwards)
    peak_bytes   max over the four programs of (the buffers held beside it + its
                 outputs and temporaries): base, adapters and moments throughout; the
                 adapted leaves of W' during the step; dL/dW' until (2) has run
                 (``measure_lora``; ``peak_phase`` names the program)
    ref_bytes    0: the reference is the base with the adapters off

and in ``LORA_KEYS`` (JSON too) ``adapter_bytes``, ``merged_bytes`` (the adapted
leaves of W'), the merge's and (2)'s program peaks, ``peak_phase``; with
``--lora-fused`` also ``fused_peak_bytes``: the peak if merge, step and (2) ran as one
program (``dtarl.lora.fused_step``, the same operations: W' and dL/dW' become
temporaries the compiler can overlap with the activations) followed by the update;
the trainer runs the four programs (``peak_bytes``). The table's ``lora`` column marks
LoRA rows (``-``: full fine-tuning). Prefer the model's depth to ``--extrapolate``:
under the layer scan the depth-1 and depth-2 programs are not on a line through the
deep one (qwen3_8b dense, fsdp=8: 181 GiB extrapolated, 144 compiled at 36 layers;
``docs/lora.md``).

``--layers N`` compiles at depth N instead of the model's (the layers run under one
scan, so a full-depth compile takes about as long); the row then says ``layers`` = N. With
``--extrapolate`` two depths are compiled and every byte count is fitted as
a + b x layers and evaluated at the model's depth: such rows carry ``"extrapolated":
true`` and the table marks them. ``--device-memory GiB`` is a budget: a row whose peak
exceeds it is an error (``ConfigError``) naming the mesh and the peak.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl.bench.memory import peak_bytes
from dtarl.errors import ConfigError
from dtarl.lora.adapters import (
    LoraConfig,
    adapter_grads,
    fused_step,
    init_adapters,
    merge_adapted,
    path_key,
)
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.sharded import ShardedEngine, Strategy
from dtarl.testing import grpo_groups

GiB = 2**30
MODELS = ("qwen3_0p6b", "qwen3_1p7b", "qwen3_4b", "qwen3_8b")
ENGINES = ("dense", "dfs", "prefix_reuse")
BASE_DTYPES = ("float32", "bfloat16")  # --lora-base-dtype
KEYS = (
    "model",
    "mesh",
    "engine",
    "layers",
    "param_bytes",
    "opt_bytes",
    "grad_bytes",
    "peak_bytes",
    "compile_s",
    "lora_rank",
    "ref_bytes",
    "fsdp_gather",
    "remat",
)

# A LoRA row's breakdown (in its JSON too): the adapters (fp32, replicated), the
# adapted leaves of W', the merge's and (2)'s program peaks, the phase that peaks (and with
# ``--lora-fused`` ``fused_peak_bytes``).
LORA_KEYS = (
    "base_dtype",
    "adapter_bytes",
    "merged_bytes",
    "merge_peak_bytes",
    "adapter_grads_peak_bytes",
    "peak_phase",
)

__all__ = [
    "ENGINES",
    "KEYS",
    "LORA_KEYS",
    "MODELS",
    "format_table",
    "measure",
    "measure_lora",
    "parse_mesh",
    "run",
]


def parse_mesh(text: str, num_devices: int | None = None) -> dict[str, int]:
    """``"dp=1,fsdp=8,tp=1"`` -> {"dp": 1, "fsdp": 8, "tp": 1} (missing axes: 1); with
    ``num_devices``, dp x fsdp x tp must equal it. Errors name the axis and the values
    accepted."""
    out = {"dp": 1, "fsdp": 1, "tp": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in out:
            raise ConfigError(f"--mesh: unknown axis {name!r} in {text!r}; accepted: dp, fsdp, tp")
        try:
            out[name] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh: {name}={value!r} must be an integer >= 1") from None
        if out[name] < 1:
            raise ConfigError(f"--mesh: {name}={out[name]} must be an integer >= 1")
    n = out["dp"] * out["fsdp"] * out["tp"]
    if num_devices is not None and n != num_devices:
        divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
        raise ConfigError(
            f"--mesh {text}: dp x fsdp x tp = {n}, but {num_devices} devices are simulated; "
            f"each axis in {divisors} with dp x fsdp x tp = {num_devices}"
        )
    return out


def model_config(name: str, layers: int | None = None, remat: str | None = None) -> ModelConfig:
    """The preset with bf16 compute on fp32 master weights, at depth ``layers``, with
    the layers' ``remat`` (None: the preset's)."""
    if name not in (*MODELS, "tiny"):  # tiny: the tests' model
        raise ConfigError(f"--model {name!r}: accepted {MODELS}")
    cfg = ModelConfig.preset(name)
    cfg = dataclasses.replace(cfg, param_dtype="float32", compute_dtype="bfloat16")
    if remat is not None:
        cfg = dataclasses.replace(cfg, remat=remat)
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers={layers}: must be >= 1")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    return cfg


def _engine(kind: str, model):
    from dtarl.engines import DenseEngine, DFSEngine
    from dtarl.engines.prefix_reuse import PrefixReuseEngine

    if kind not in ENGINES:
        raise ConfigError(f"--engine {kind!r}: accepted {ENGINES}")
    return {"dense": DenseEngine, "dfs": DFSEngine, "prefix_reuse": PrefixReuseEngine}[kind](model)


def _shard_bytes(x: jax.ShapeDtypeStruct, sharding: NamedSharding) -> int:
    shape = sharding.shard_shape(x.shape)
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _sharded_step(cfg, mesh_shape, engine, devices, strategy, gather_dtype, fsdp_gather):
    """(mesh, abstract params, ShardedEngine) for a row: the mesh over the first
    dp x fsdp x tp (simulated) devices, ``jax.eval_shape`` parameters of ``cfg``."""
    devs = list(jax.devices() if devices is None else devices)
    n = mesh_shape["dp"] * mesh_shape["fsdp"] * mesh_shape["tp"]
    if n > len(devs):
        raise ConfigError(f"--mesh needs {n} devices, {len(devs)} are simulated")
    if mesh_shape["fsdp"] > 1:
        mesh = mesh_lib.make_train_mesh(
            mesh_shape["dp"], mesh_shape["fsdp"], mesh_shape["tp"], devices=devs[:n]
        )
    else:
        mesh = mesh_lib.make_mesh(mesh_shape["dp"], mesh_shape["tp"], devices=devs[:n])
    model = nnx.eval_shape(lambda: init_model(cfg, seed=0))
    _, params = nnx.split(model, nnx.Param)
    sharded = ShardedEngine(
        _engine(engine, model),
        mesh,
        gather_dtype=gather_dtype,
        strategy=strategy,
        fsdp_gather=mesh_lib.FsdpGather.parse(fsdp_gather, "--fsdp-gather"),
    )
    return mesh, params, sharded


def measure(
    model_name: str,
    mesh_shape: dict[str, int],
    engine: str,
    *,
    group: int = 8,
    prompt: int = 1024,
    response: int = 1024,
    layers: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    strategy: Strategy = Strategy.SHARD_MAP,
    gather_dtype=jnp.bfloat16,
    fsdp_gather: mesh_lib.FsdpGather | str = mesh_lib.FsdpGather.LAYER,
    remat: str | None = None,
) -> dict:
    """One row (``KEYS``) for a model, mesh and engine, compiled at depth ``layers``."""
    cfg = model_config(model_name, layers, remat)
    mesh, params, sharded = _sharded_step(
        cfg, mesh_shape, engine, devices, strategy, gather_dtype, fsdp_gather
    )
    batch = grpo_groups(
        num_groups=1,
        group_size=group,
        prompt_len=prompt,
        response_len=response,
        vocab_size=min(cfg.vocab_size, 32000),
    )
    loss = ClippedSurrogateLoss.grpo()
    t0 = time.perf_counter()
    prepared = sharded.prepare(batch, loss)
    p_shard = sharded.param_shardings(params)
    p_abs = _abstract(params, p_shard)
    data = sharded.data_sharding()
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=data),
        prepared.args,
    )
    fn = sharded.get_fn(loss, prepared, params)
    t1 = time.perf_counter()
    step = fn.lower(p_abs, *args).compile()
    # The AdamW update as the trainer runs it (``Optimizer.apply`` on a mesh: outputs
    # pinned to the inputs' shardings, not donated).
    tx = optax.adamw(1e-6)
    opt_abs = jax.eval_shape(tx.init, p_abs)
    repl = NamedSharding(mesh, P())
    p_def = jax.tree.structure(params)
    s_leaves = jax.tree.leaves(p_shard)

    def like(sub):
        if jax.tree.structure(sub) == p_def:
            return jax.tree.unflatten(p_def, s_leaves)
        return jax.tree.map(lambda _: repl, sub)

    is_p = lambda x: x is not opt_abs and jax.tree.structure(x) == p_def  # noqa: E731
    opt_shard = jax.tree.map(like, opt_abs, is_leaf=is_p)
    opt_abs = _abstract(opt_abs, opt_shard)
    g_abs = p_abs

    def update(p, g, s):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    upd = jax.jit(update, out_shardings=(p_shard, opt_shard)).lower(p_abs, g_abs, opt_abs).compile()
    compile_s = time.perf_counter() - t1
    param_b = sum(_shard_bytes(x, x.sharding) for x in jax.tree.leaves(p_abs))
    opt_b = sum(_shard_bytes(x, x.sharding) for x in jax.tree.leaves(opt_abs))
    _, grads_out, _ = step.out_info  # (loss, grads, per-rank outputs)
    grad_b = sum(_shard_bytes(x, x.sharding) for x in jax.tree.leaves(grads_out))
    step_peak = peak_bytes(step.memory_analysis())
    upd_peak = peak_bytes(upd.memory_analysis())
    return dict(
        model=model_name,
        mesh=dict(mesh_shape),
        engine=engine,
        layers=cfg.num_layers,
        param_bytes=int(param_b),
        opt_bytes=int(opt_b),
        grad_bytes=int(grad_b),
        peak_bytes=int(max(step_peak + opt_b, upd_peak)),
        compile_s=round(compile_s, 2),
        step_peak_bytes=int(step_peak),
        update_peak_bytes=int(upd_peak),
        prepare_s=round(t1 - t0, 2),
        fsdp_gather=sharded.gather_used.get(prepared.static, "step"),  # what the step ran
        remat=cfg.remat.value,
        **full_extras(int(param_b)),
    )


def full_extras(param_b: int) -> dict:
    """A full fine-tuning row's LoRA columns: rank 0, no adapters, and the KL reference
    as a second copy of the params split like them (``ref_bytes`` = ``param_bytes``)."""
    return dict(lora_rank=0, adapter_bytes=0, ref_bytes=int(param_b))


def measure_lora(
    model_name: str,
    mesh_shape: dict[str, int],
    engine: str,
    rank: int,
    *,
    full: dict | None = None,
    fused: bool = False,
    base_dtype: str | None = None,
    group: int = 8,
    prompt: int = 1024,
    response: int = 1024,
    layers: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    strategy: Strategy = Strategy.SHARD_MAP,
    gather_dtype=jnp.bfloat16,
    fsdp_gather: mesh_lib.FsdpGather | str = mesh_lib.FsdpGather.LAYER,
    remat: str | None = None,
) -> dict:
    """One LoRA row (``KEYS``, ``lora_rank`` = ``rank``, alpha = 2 x rank, every target):
    the step as the trainer runs it (``dtarl.rl.build``: ``LoraEngine`` around the
    ``ShardedEngine``), four programs in turn, with the frozen base in the model's
    dtype split like the params, the adapters (fp32) and their AdamW state replicated:

        merge    W' = W + (alpha/r) A@B (``dtarl.lora.merge``), W' placed like W
        step     the sharded loss-and-gradient step on W' (dL/dW', split like W)
        grads    (2): dL/dA, dL/dB from dL/dW' (``dtarl.lora.adapter_grads``)
        update   AdamW over the adapters only

    ``full``: the rank-0 row of the same model, mesh, engine, shape and depth, whose
    step program is this one's (W' has W's shapes, dtypes and shardings): its numbers
    are reused instead of compiling it again. ``fused``: also compile the same step as
    one program (``dtarl.lora.fused_step``: merge, step and (2)) and report its peak,
    then the update's, as ``fused_peak_bytes``. ``base_dtype``: the frozen base's
    dtype (default the model config's, fp32); a bfloat16 base compiles its own step
    (the trainer with ``model.param_dtype: bfloat16``: W' in bf16; the step's dL/dW'
    is fp32 all the same)."""
    cfg = model_config(model_name, layers, remat)
    if base_dtype is not None:
        if base_dtype not in BASE_DTYPES:
            raise ConfigError(f"--lora-base-dtype {base_dtype!r}: accepted {BASE_DTYPES}")
        if full is not None and base_dtype != cfg.param_dtype:
            full = None  # another step program: the params are another dtype
        cfg = dataclasses.replace(cfg, param_dtype=base_dtype)
    lcfg = LoraConfig(rank=rank, alpha=2.0 * rank)
    mesh, base, sharded = _sharded_step(
        cfg, mesh_shape, engine, devices, strategy, gather_dtype, fsdp_gather
    )
    p_shard = sharded.param_shardings(base)
    b_abs = _abstract(base, p_shard)
    repl = NamedSharding(mesh, P())
    adapters = jax.eval_shape(lambda b: init_adapters(b, lcfg, jax.random.key(0)), base)
    a_abs = _abstract(adapters, jax.tree.map(lambda _: repl, adapters))
    t0 = time.perf_counter()
    batch = grpo_groups(
        num_groups=1,
        group_size=group,
        prompt_len=prompt,
        response_len=response,
        vocab_size=min(cfg.vocab_size, 32000),
    )
    loss = ClippedSurrogateLoss.grpo()
    prepared = sharded.prepare(batch, loss)
    data = sharded.data_sharding()
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=data),
        prepared.args,
    )
    prepare_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn = sharded.get_fn(loss, prepared, base)
    if full is None:
        step = fn.lower(b_abs, *args).compile()
        _, grads_out, _ = step.out_info
        step_peak = peak_bytes(step.memory_analysis())
    else:
        grads_out = b_abs  # dL/dW': the params' shapes, dtypes and shardings
        step_peak = full["step_peak_bytes"]
    one = fused_step(fn, lcfg).lower(b_abs, a_abs, *args).compile() if fused else None
    g_abs = _abstract(grads_out, jax.tree.map(lambda x: x.sharding, grads_out))
    flat = {path_key(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(b_abs)[0]}
    m_shard = {k: flat[k] for k in adapters}  # W' placed like W (``dtarl.lora.merged``)
    mrg = jax.jit(merge_adapted, static_argnums=2, out_shardings=m_shard)
    mrg = mrg.lower(b_abs, a_abs, lcfg).compile()
    grd = jax.jit(adapter_grads, static_argnums=2).lower(g_abs, a_abs, lcfg).compile()
    da_abs = _abstract(*_with_shardings(grd.out_info))
    tx = optax.adamw(1e-6)
    opt_abs = jax.eval_shape(tx.init, a_abs)
    opt_abs = _abstract(opt_abs, jax.tree.map(lambda _: repl, opt_abs))
    a_shard = jax.tree.map(lambda _: repl, adapters)
    o_shard = jax.tree.map(lambda _: repl, opt_abs)

    def update(p, g, s):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    upd = jax.jit(update, out_shardings=(a_shard, o_shard)).lower(a_abs, da_abs, opt_abs)
    upd = upd.compile()
    compile_s = time.perf_counter() - t0 + (full["compile_s"] if full else 0.0)
    nbytes = lambda tree: sum(_shard_bytes(x, x.sharding) for x in jax.tree.leaves(tree))  # noqa: E731
    base_b, adapter_b, opt_b = nbytes(b_abs), nbytes(a_abs), nbytes(opt_abs)
    grad_b = nbytes(g_abs)
    merged_b = _merged_bytes(b_abs, adapters)  # the adapted leaves of W'
    mems = dict(merge=mrg.memory_analysis(), grads=grd.memory_analysis())
    mems["update"] = upd.memory_analysis()
    merge_peak, grads_peak, upd_peak = (peak_bytes(mems[k]) for k in ("merge", "grads", "update"))
    # Each phase: the buffers the trainer holds while that program runs, plus the
    # program's outputs and temporaries (its peak less its arguments, which are
    # among the held buffers; jit drops unused arguments, e.g. the merge's
    # embeddings). Held throughout: the base, the adapters, their moments; the
    # adapted leaves of W' (its others are the base's arrays) during the step; dL/dW'
    # (every leaf, split like the params) from the step's end through (2); the
    # adapters' gradient through the update.
    held = base_b + adapter_b + opt_b

    def beside(k, extra):
        return held + extra + peak_bytes(mems[k]) - mems[k].argument_size_in_bytes

    # The fused program (``dtarl.lora.fused_step``: merge, step and (2) in one) holds
    # beside it the moments; the update then runs as above.
    extra = {}
    if one is not None:
        upd_phase = beside("update", nbytes(da_abs))
        extra["fused_peak_bytes"] = int(max(peak_bytes(one.memory_analysis()) + opt_b, upd_phase))
    phases = dict(
        merge=beside("merge", 0),
        step=step_peak + merged_b + adapter_b + opt_b,  # its arguments: W' and the batch
        grads=beside("grads", grad_b),
        update=beside("update", nbytes(da_abs)),
    )
    return dict(
        model=model_name,
        mesh=dict(mesh_shape),
        engine=engine,
        layers=cfg.num_layers,
        param_bytes=int(base_b + adapter_b),
        opt_bytes=int(opt_b),
        grad_bytes=int(grad_b),
        peak_bytes=int(max(phases.values())),
        compile_s=round(compile_s, 2),
        step_peak_bytes=int(step_peak),
        update_peak_bytes=int(upd_peak),
        merge_peak_bytes=int(merge_peak),
        adapter_grads_peak_bytes=int(grads_peak),
        merged_bytes=int(merged_b),
        peak_phase=max(phases, key=phases.get),
        prepare_s=round(prepare_s, 2),
        lora_rank=rank,
        adapter_bytes=int(adapter_b),
        ref_bytes=0,
        base_dtype=cfg.param_dtype,
        fsdp_gather=(full or {}).get("fsdp_gather")
        or sharded.gather_used.get(prepared.static, "step"),
        remat=cfg.remat.value,
        **extra,
    )


def _with_shardings(tree):
    return tree, jax.tree.map(lambda x: x.sharding, tree)


def _merged_bytes(b_abs, adapters) -> int:
    """Per-device bytes of the adapted leaves of W' (the merge's new arrays)."""
    keys = set(adapters)
    return sum(
        _shard_bytes(x, x.sharding)
        for path, x in jax.tree_util.tree_flatten_with_path(b_abs)[0]
        if path_key(path) in keys
    )


def extrapolate(a: dict, b: dict, layers: int) -> dict:
    """Row ``a`` with every byte count fitted linearly in depth through rows ``a`` and
    ``b`` (two depths) and evaluated at ``layers``; marked ``extrapolated``."""
    la, lb = a["layers"], b["layers"]
    out = dict(a, layers=layers, extrapolated=True, measured_layers=[la, lb])
    for k, v in a.items():
        if k.endswith("_bytes"):
            slope = (b[k] - v) / (lb - la)
            out[k] = int(round(v + slope * (layers - la)))
    out["compile_s"] = round(a["compile_s"] + b["compile_s"], 2)
    return out


def run(
    models: Sequence[str],
    meshes: Sequence[dict[str, int]],
    engines: Sequence[str] = ENGINES,
    *,
    group: int = 8,
    prompt: int = 1024,
    response: int = 1024,
    layers: int | None = None,
    extrapolate_from: tuple[int, int] | None = None,
    device_memory_gib: float | None = None,
    lora_ranks: Sequence[int] = (0,),
    lora_fused: bool = False,
    lora_base_dtype: str | None = None,
    say=print,
    fsdp_gather: mesh_lib.FsdpGather | str = mesh_lib.FsdpGather.LAYER,
    remat: str | None = None,
) -> list[dict]:
    """Rows for every (model, mesh, engine, LoRA rank: 0 = full fine-tuning); see the
    module docstring."""
    check_ranks(lora_ranks)
    rows = []
    for name in models:
        for mesh_shape in meshes:
            for engine in engines:
                kw = dict(group=group, prompt=prompt, response=response)
                kw.update(fsdp_gather=fsdp_gather, remat=remat)
                depths = [layers] if extrapolate_from is None else list(extrapolate_from)
                per_rank: dict[int, list[dict]] = {r: [] for r in lora_ranks}
                for depth in depths:
                    full = None
                    if 0 in per_rank or len(per_rank) > 1:  # LoRA reuses its step program
                        full = measure(name, mesh_shape, engine, layers=depth, **kw)
                    for rank in per_rank:
                        per_rank[rank].append(
                            full
                            if rank == 0
                            else measure_lora(
                                name,
                                mesh_shape,
                                engine,
                                rank,
                                full=full,
                                fused=lora_fused,
                                base_dtype=lora_base_dtype,
                                layers=depth,
                                **kw,
                            )
                        )
                for a, *b in per_rank.values():
                    row = (
                        extrapolate(a, b[0], model_config(name, None, remat).num_layers) if b else a
                    )
                    rows.append(row)
                    say(format_table([row], header=len(rows) == 1))
                    check_budget(row, device_memory_gib)
    return rows


def check_ranks(ranks: Sequence[int]) -> None:
    """``--lora``: distinct integers >= 0 (0: full fine-tuning)."""
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ConfigError(
            f"--lora {list(ranks)}: distinct LoRA ranks, each an integer >= 0 "
            "(0: full fine-tuning; e.g. --lora 0 16)"
        )


def check_budget(row: dict, device_memory_gib: float | None) -> None:
    """ConfigError when ``row``'s peak exceeds ``--device-memory``."""
    if device_memory_gib is None:
        return
    if row["peak_bytes"] > device_memory_gib * GiB:
        m = row["mesh"]
        need = int(np.ceil(row["peak_bytes"] / GiB))
        raise ConfigError(
            f"--device-memory {device_memory_gib:g} GiB: {row['model']} ({row['engine']}) on "
            f"mesh dp={m['dp']},fsdp={m['fsdp']},tp={m['tp']} peaks at "
            f"{row['peak_bytes'] / GiB:.2f} GiB per device; accepted: --device-memory >= "
            f"{need}, or a larger fsdp (or tp) on that mesh"
        )


def format_table(rows: Sequence[dict], *, header: bool = True) -> str:
    """Per device, GiB; ``*`` marks an extrapolated row, ``lora`` the LoRA rank (``-``:
    full fine-tuning); ``ref`` is the KL reference, not in ``peak``."""
    lines = []
    if header:
        lines.append(
            f"{'model':<11} {'mesh (dp,fsdp,tp)':<17} {'engine':<12} {'lora':>4} {'layers':>6} "
            f"{'param':>7} {'opt':>7} {'grad':>7} {'step':>7} {'update':>7} {'peak':>7} "
            f"{'ref':>7} {'compile s':>9}"
        )
    for r in rows:
        m = r["mesh"]
        g = lambda k, r=r: f"{r.get(k, 0) / GiB:7.2f}"  # noqa: E731
        star = "*" if r.get("extrapolated") else " "
        shape = f"{m['dp']},{m['fsdp']},{m['tp']}"
        lora = str(r["lora_rank"]) if r.get("lora_rank") else "-"
        lines.append(
            f"{r['model']:<11} {shape:<17} {r['engine']:<12} {lora:>4} "
            f"{r['layers']:>5}{star} {g('param_bytes')} {g('opt_bytes')} {g('grad_bytes')} "
            f"{g('step_peak_bytes')} {g('update_peak_bytes')} {g('peak_bytes')} "
            f"{g('ref_bytes')} {r['compile_s']:9.1f}"
        )
    return "\n".join(lines)


def json_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows with exactly ``KEYS`` (plus ``extrapolated`` on an extrapolated row, and
    on a LoRA row ``LORA_KEYS``)."""
    return [
        {k: r[k] for k in KEYS}
        | ({"extrapolated": True} if r.get("extrapolated") else {})
        | (
            {k: r[k] for k in (*LORA_KEYS, "fused_peak_bytes") if k in r}
            if r.get("lora_rank")
            else {}
        )
        for r in rows
    ]
