"""``dtarl bench device --dry-run``: every program lowered for ``cuda`` and ``tpu`` on
this host, without compiling or running anything (``dtarl.bench.device``'s module
docstring says what is lowered)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

DRY_PARTS = ("kernels", "engines", "rollout")


def dry_run(
    log: Callable[[str], None],
    platforms: Sequence[str] = ("cuda", "tpu"),
    parts: Sequence[str] = DRY_PARTS,
) -> dict:
    """Lowers every program of ``parts`` for ``platforms`` on this host (module docstring)."""
    unknown = [p for p in parts if p not in DRY_PARTS]
    if unknown:
        raise ValueError(f"dry_run: unknown parts {unknown}; accepted: {list(DRY_PARTS)}")
    rows: list[dict] = []

    def check(name: str, platform: str, lower: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            text = lower().as_text()
            rows.append(dict(program=name, platform=platform, ok=True, chars=len(text)))
        except Exception as e:  # noqa: BLE001 - the report says which program fails where
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            rows.append(dict(program=name, platform=platform, ok=False, error=msg))
        rows[-1]["seconds"] = time.perf_counter() - t0
        r = rows[-1]
        log(f"  {name:28s} {platform:5s} {'ok' if r['ok'] else 'FAILED: ' + r['error']}")

    for part in parts:
        {"kernels": _dry_kernels, "engines": _dry_engines, "rollout": _dry_rollout}[part](
            check, platforms
        )
    failed = [r for r in rows if not r["ok"]]
    log(f"dry run: {len(rows) - len(failed)} of {len(rows)} lowerings ok")
    return dict(platforms=list(platforms), rows=rows, failed=len(failed))


def _dry_kernels(check, platforms) -> None:
    from pallas_kernels.chunk_attention import chunk_attention
    from pallas_kernels.chunk_attention_tpu import chunk_attention_tpu

    C, P, hq, hkv, d = 128, 512, 16, 8, 128
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    args = (
        spec(1, C, hq, d),
        spec(1, P + C, hkv, d),
        spec(1, P + C, hkv, d),
        spec(1, dt=jnp.int32),
        spec(1, dt=jnp.int32),
    )
    for platform in platforms:
        kernel = chunk_attention if platform in ("cuda", "rocm") else chunk_attention_tpu

        def fwd(q, k, v, s, n, kernel=kernel):
            return kernel(q, k, v, s, n, interpret=False)

        def loss(q, k, v, s, n, kernel=kernel):
            return jnp.sum(kernel(q, k, v, s, n, interpret=False).astype(jnp.float32))

        grad = jax.grad(loss, argnums=(0, 1, 2))
        for name, fn in (("chunk_attention fwd", fwd), ("chunk_attention bwd", grad)):

            def lower(fn=fn, p=platform):
                with _target_chip(p):
                    return jax.jit(fn).trace(*args).lower(lowering_platforms=(p,))

            check(name, platform, lower)


@contextlib.contextmanager
def _target_chip(platform: str, tpu_kind: str = "TPU v5 lite"):
    """For ``tpu`` off a TPU: an abstract mesh whose device is a TPU chip, which the
    Mosaic lowering reads its chip parameters from (jax has no public spelling yet;
    where this jax lacks it, the lowering fails and the report says why)."""
    if platform != "tpu" or jax.default_backend() == "tpu":
        yield
        return
    from jax._src import mesh as mesh_lib  # noqa: PLC0415 - private, used only here

    chip = mesh_lib.AbstractDevice(device_kind=tpu_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("chip",), abstract_device=chip)
    ):
        yield


def _dry_engines(check, platforms) -> None:
    from flax import nnx

    from dtarl.bench.train import workload_capacity
    from dtarl.engines import DFSConfig, EngineConfig, EngineKind, make_engine
    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.model import ModelConfig, init_model
    from dtarl.testing import grpo_groups

    model = init_model(ModelConfig.tiny(), seed=0)
    params = nnx.split(model, nnx.Param)[1]
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=24, response_len=(6, 12), seed=0)
    loss = ClippedSurrogateLoss.grpo()
    for kind in (EngineKind.DENSE, EngineKind.DFS, EngineKind.PREFIX_REUSE):
        engine = make_engine(kind, model, EngineConfig(dfs=DFSConfig(chunk_len=16)))
        engine.reserve(workload_capacity(batch))
        prepared = engine.prepare(batch, loss)
        fn = engine.jit.get(loss, prepared.static)
        for platform in platforms:
            check(
                f"engine {kind.value}",
                platform,
                lambda fn=fn, a=prepared.args, p=platform: fn.trace(params, *a).lower(
                    lowering_platforms=(p,)
                ),
            )


def _dry_rollout(check, platforms) -> None:
    from flax import nnx

    from dtarl.model import ModelConfig, init_model
    from dtarl.rollout.config import ContinuousConfig
    from dtarl.rollout.continuous import ContinuousSampler

    model = init_model(ModelConfig.tiny(), seed=0)
    weights = nnx.split(model, nnx.Param)[1]
    sampler = ContinuousSampler(
        model,
        ContinuousConfig(slots=4, group_size=2, prompt_len=16, response_len=16, steps_per_call=4),
        max_new_tokens=16,
    )
    programs = sampler.engine.programs
    built: list[tuple[Any, tuple]] = []
    compile_one = programs.compile

    def record(key, *args):  # the engine's warm-up names every program it can need
        built.append((key, args))
        compile_one(key, *args)

    programs.compile = record
    try:
        sampler.engine.warmup(weights, filtered=False, extend=True)
    finally:
        del programs.compile
    seen = set()
    for key, args in built:
        label = f"rollout {key.kind.value}"
        if label in seen:
            continue
        seen.add(label)
        fn = programs.get(key)
        for platform in platforms:
            check(
                label,
                platform,
                lambda fn=fn, a=args, p=platform: fn.trace(*a).lower(lowering_platforms=(p,)),
            )
