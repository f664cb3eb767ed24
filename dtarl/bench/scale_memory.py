"""``dtarl bench scale`` (without ``--compile``): per-device memory of a GRPO step at a
real model's shape, from compiled programs, without running them.

    dtarl bench scale --model qwen3_8b --mesh dp=1,fsdp=8,tp=1 --group 8 \\
        --prompt 1024 --response 1024 [--engine dense dfs prefix_reuse] \\
        [--layers N] [--device-memory GiB] [--json PATH]

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
                 arguments + outputs + temporaries - aliased (``bench.memory.peak_bytes``)
    compile_s    seconds to lower and compile both programs

Not counted: the KL reference policy (GRPO with ``algo.kl_coef > 0`` keeps another
param-sized copy, split like the params), the rollout's weights and KV cache (the
rollout runs before the step; its weights are gathered to its ('dp', 'tp') layout,
``dtarl.parallel.mesh.rollout_view``).

``--layers N`` compiles at depth N instead of the model's (CPU compile time grows with
depth while the decoder is unrolled); the row then says ``layers`` = N. With
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
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.parallel import mesh as mesh_lib
from dtarl.parallel.sharded import ShardedEngine, Strategy
from dtarl.testing import grpo_groups

GiB = 2**30
MODELS = ("qwen3_0p6b", "qwen3_1p7b", "qwen3_4b", "qwen3_8b")
ENGINES = ("dense", "dfs", "prefix_reuse")
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
)

__all__ = ["ENGINES", "KEYS", "MODELS", "format_table", "measure", "parse_mesh", "run"]


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
    batch = grpo_groups(
        num_groups=1,
        group_size=group,
        prompt_len=prompt,
        response_len=response,
        vocab_size=min(cfg.vocab_size, 32000),
    )
    loss = ClippedSurrogateLoss.grpo()
    sharded = ShardedEngine(
        _engine(engine, model),
        mesh,
        gather_dtype=gather_dtype,
        strategy=strategy,
        fsdp_gather=mesh_lib.FsdpGather.parse(fsdp_gather, "--fsdp-gather"),
    )
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
    say=print,
    fsdp_gather: mesh_lib.FsdpGather | str = mesh_lib.FsdpGather.LAYER,
    remat: str | None = None,
) -> list[dict]:
    """Rows for every (model, mesh, engine); see the module docstring."""
    rows = []
    for name in models:
        for mesh_shape in meshes:
            for engine in engines:
                kw = dict(group=group, prompt=prompt, response=response)
                kw.update(fsdp_gather=fsdp_gather, remat=remat)
                if extrapolate_from is not None:
                    lo, hi = extrapolate_from
                    a = measure(name, mesh_shape, engine, layers=lo, **kw)
                    b = measure(name, mesh_shape, engine, layers=hi, **kw)
                    row = extrapolate(a, b, model_config(name, None, remat).num_layers)
                else:
                    row = measure(name, mesh_shape, engine, layers=layers, **kw)
                rows.append(row)
                say(format_table([row], header=len(rows) == 1))
                check_budget(row, device_memory_gib)
    return rows


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
    """Per device, GiB; ``*`` marks an extrapolated row."""
    lines = []
    if header:
        lines.append(
            f"{'model':<11} {'mesh (dp,fsdp,tp)':<17} {'engine':<12} {'layers':>6} "
            f"{'param':>7} {'opt':>7} {'grad':>7} {'step':>7} {'update':>7} {'peak':>7} "
            f"{'compile s':>9}"
        )
    for r in rows:
        m = r["mesh"]
        g = lambda k, r=r: f"{r.get(k, 0) / GiB:7.2f}"  # noqa: E731
        star = "*" if r.get("extrapolated") else " "
        shape = f"{m['dp']},{m['fsdp']},{m['tp']}"
        lines.append(
            f"{r['model']:<11} {shape:<17} {r['engine']:<12} "
            f"{r['layers']:>5}{star} {g('param_bytes')} {g('opt_bytes')} {g('grad_bytes')} "
            f"{g('step_peak_bytes')} {g('update_peak_bytes')} {g('peak_bytes')} "
            f"{r['compile_s']:9.1f}"
        )
    return "\n".join(lines)


def json_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows with exactly ``KEYS`` (plus ``extrapolated`` on an extrapolated row)."""
    return [
        {k: r[k] for k in KEYS} | ({"extrapolated": True} if r.get("extrapolated") else {})
        for r in rows
    ]
