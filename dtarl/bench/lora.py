"""``dtarl bench lora``: what LoRA saves, and what it costs per step.

1. Memory (from the configs, nothing built): per-device bytes of the training state of
   each Qwen3 preset with full fine-tuning and with ``model.lora`` (weights, merged
   weights, the engine's fp32 gradient, adapters, AdamW moments, the KL reference),
   ``dtarl.lora.memory.state_bytes``. The compiled step's bytes, activations
   included, on a mesh: ``dtarl bench scale --lora 0 16`` (``dtarl.bench.scale_memory``).
2. Step time on this machine's CPU, tiny model, one GRPO batch: per engine, one
   update (engine value_and_grad + AdamW) of full fine-tuning vs LoRA (merge, the
   same engine on the merged params, the adapters' gradient (2), AdamW on the
   adapters), timed side by side (``dtarl.timing.interleaved_rounds``, medians).
"""

from __future__ import annotations

import time

import jax
import optax
from flax import nnx

from dtarl import timing
from dtarl.engines import DenseEngine, DFSEngine, PrefixReuseEngine
from dtarl.lora import LoraConfig, LoraEngine, init_adapters, merged
from dtarl.lora.memory import memory_table
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.testing import grpo_groups

GiB = 2**30
ENGINES = ("dense", "dfs", "prefix_reuse")


def _engine(kind: str, model):
    if kind == "dense":
        return DenseEngine(model, microbatch=8)
    if kind == "dfs":
        return DFSEngine(model, chunk_len=64)
    if kind == "prefix_reuse":
        return PrefixReuseEngine(model)
    raise ValueError(f"engine {kind!r}: accepted {list(ENGINES)}")


def step_times(
    lora: LoraConfig,
    *,
    engines=ENGINES,
    model_cfg: ModelConfig | None = None,
    groups: int = 4,
    group_size: int = 8,
    prompt: int = 64,
    response: int = 64,
    rounds: int = 5,
    cpu_clock: bool = True,
) -> list[dict]:
    """Median and minimum seconds of one update, full fine-tuning vs LoRA, per engine.
    ``cpu_clock``: this process's CPU seconds (``time.process_time``, all its threads:
    on a loaded machine the wall clock measures the neighbours), else the wall clock."""
    model = init_model(model_cfg or ModelConfig.tiny(), seed=0)
    _, params = nnx.split(model, nnx.Param)
    adapters = init_adapters(params, lora, jax.random.key(0))
    batch = grpo_groups(
        num_groups=groups,
        group_size=group_size,
        prompt_len=prompt,
        response_len=(response // 2, response),
        seed=0,
        with_old_logprobs=True,
    )
    loss = ClippedSurrogateLoss.grpo()
    tx = optax.adamw(1e-5)
    apply = jax.jit(lambda p, g, s: _apply(tx, p, g, s))
    rows = []
    for kind in engines:
        engine = _engine(kind, model)
        lora_engine = LoraEngine(engine, params, lora)
        full_state, lora_state = tx.init(params), tx.init(adapters)

        def full(engine=engine, state=full_state):
            _, g, _ = engine.value_and_grad(params, batch, loss)
            return apply(params, g, state)

        def low(engine=lora_engine, state=lora_state):
            _, g, _ = engine.value_and_grad(adapters, batch, loss)
            return apply(adapters, g, state)

        res = timing.interleaved_rounds(
            {"full": full, "lora": low},
            timing.Rounds(rounds=rounds, order=timing.alternating, warmup=True),
            block=jax.block_until_ready,
            clock=time.process_time if cpu_clock else None,
        )
        f, lo = res["full"].median, res["lora"].median
        rows.append(
            dict(
                engine=kind,
                full_s=f,
                lora_s=lo,
                lora_vs_full=lo / f,
                full_min_s=res["full"].min,
                lora_min_s=res["lora"].min,
                clock="process cpu" if cpu_clock else "wall",
            )
        )
    return rows


def merge_seconds(lora: LoraConfig, model_cfg: ModelConfig | None = None, rounds: int = 5):
    """Median CPU seconds (this process) of one merge (1) of every adapted weight: what
    a rollout with adapters pays once per step (the samplers decode merged weights)."""
    model = init_model(model_cfg or ModelConfig.tiny(), seed=0)
    _, params = nnx.split(model, nnx.Param)
    adapters = init_adapters(params, lora, jax.random.key(0))
    res = timing.interleaved_rounds(
        {"merge": lambda: merged(params, adapters, lora)},
        timing.Rounds(rounds=rounds, warmup=True),
        block=jax.block_until_ready,
        clock=time.process_time,
    )
    return res["merge"].median


def _apply(tx, p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s


def run(
    lora: LoraConfig,
    *,
    kl: bool = True,
    shards: int = 1,
    engines=ENGINES,
    rounds: int = 5,
    say=print,
):
    """Both tables, printed with ``say``; returns them."""
    mem = memory_table(lora, kl=kl, shards=shards)
    say(
        f"per-device training-state bytes, bf16 params, LoRA rank {lora.rank} on "
        f"{','.join(lora.targets)}, KL reference {'on' if kl else 'off'}, {shards} shard(s)"
    )
    say(
        f"{'preset':<12}{'params':>8}{'adapters':>10}{'full GiB':>10}{'lora GiB':>10}"
        f"{'saved GiB':>11}{'ref GiB':>9}"
    )
    for r in mem:
        say(
            f"{r['preset']:<12}{r['params'] / 1e9:>7.2f}B{r['adapter_params'] / 1e6:>9.1f}M"
            f"{r['full_bytes'] / GiB:>10.2f}{r['lora_bytes'] / GiB:>10.2f}"
            f"{r['saved_bytes'] / GiB:>11.2f}{r['reference_saved_bytes'] / GiB:>9.2f}"
        )
    say(
        "(the state only, from the configs; the compiled step with its activations, "
        f"per device on a mesh: dtarl bench scale --lora 0 {lora.rank})"
    )
    times = []
    if engines:
        say(
            "\nCPU step time (one update: engine value_and_grad + AdamW), tiny model, "
            "this process's CPU ms, median (min) of the rounds"
        )
        say(f"{'engine':<14}{'full ms':>16}{'lora ms':>16}{'lora/full':>10}")
        times = step_times(lora, engines=engines, rounds=rounds)
        for t in times:
            full = f"{t['full_s'] * 1e3:.1f} ({t['full_min_s'] * 1e3:.1f})"
            low = f"{t['lora_s'] * 1e3:.1f} ({t['lora_min_s'] * 1e3:.1f})"
            say(f"{t['engine']:<14}{full:>16}{low:>16}{t['lora_vs_full']:>10.2f}")
    merge_s = merge_seconds(lora)
    say(
        f"\nmerge W + (alpha/r) A@B of every adapted weight (tiny model): "
        f"{merge_s * 1e3:.2f} CPU ms"
    )
    return dict(memory=mem, step_times=times, merge_s=merge_s, machine=timing.machine_info())


__all__ = ["ENGINES", "run", "step_times"]
