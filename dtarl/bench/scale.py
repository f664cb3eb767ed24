"""``dtarl bench scale --compile``: compile and step time against the model's depth.

For each depth in ``layers`` the preset (``model``, e.g. ``qwen3_0p6b``) is built with
that many layers (random weights, the preset's dtypes) and, on one GRPO group of
``group`` sequences of ``prompt`` + ``response`` tokens:

- every engine in ``engines`` lowers and compiles its program for the group (its
  *compile* seconds: that alone, ``program_compile_s``), then runs ``value_and_grad``
  once untimed and ``repeats`` more times (the median: its *step*). Before commit
  23fba97 compile was the first call's seconds minus the step's, which carried the
  step's noise (about ±1.5 s at 28 layers);
- the continuous rollout engine (``dtarl.rollout``; ``group`` slots, one prompt row of
  ``prompt`` tokens, ``response`` response rows) is built and ``warmup`` compiles its
  decode and prefill programs: the *rollout warm-up* seconds.

The table prints compile seconds per engine and depth, the ratio of the deepest to the
shallowest depth (the issue's goal: at most 1.3 for every engine, 1.5 for the rollout
warm-up), dfs compile over dense compile at each depth, and the step seconds with each
tree engine's speedup over dense and that speedup as a fraction of the group's
*token-ideal* (the batch's tokens over its prefix tree's tokens: G (p + r) / (p + G r)
for one GRPO group, 4.5 at G=8, p=512, r=64). Only ratios measured in one run mean anything on a
shared machine; compiles are single-threaded XLA work, steps use every core.

Uses only ``make_engine``, ``value_and_grad``, ``RolloutEngine.warmup`` and the model
presets, so the same module measures a checkout from before the layers were scanned
(``python -c 'from dtarl.bench import scale; ...'`` with that checkout first on the path).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from dtarl.model.config import ModelConfig

ENGINES = ("dense", "prefix_reuse", "dfs")


def _group(cfg: ModelConfig, group: int, prompt: int, response: int, seed: int):
    from dtarl.testing import grpo_groups

    return grpo_groups(
        num_groups=1,
        group_size=group,
        prompt_len=prompt,
        response_len=response,
        vocab_size=cfg.vocab_size,
        seed=seed,
    )


def program_compile_s(engine, params, batch, loss) -> tuple[float, float]:
    """Wall and CPU seconds of ``jit.lower`` + ``compile`` of ``engine``'s program for
    ``batch`` alone (host planning and the step not counted). JAX keeps the executable,
    so the engine's first call after it does not compile again."""
    prepared = engine.prepare(batch, loss)
    t0, c0 = time.perf_counter(), time.process_time()
    engine.jit.lower(loss, prepared.static, params, prepared.args).compile()
    return time.perf_counter() - t0, time.process_time() - c0


def _engine_times(model, params, batch, loss, kind: str, repeats: int) -> dict:
    import jax

    from dtarl.engines import make_engine

    engine = make_engine(kind, model)
    compile_s, compile_cpu_s = program_compile_s(engine, params, batch, loss)

    def call():
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine.value_and_grad(params, batch, loss)
        jax.block_until_ready(out[1])
        return out, time.perf_counter() - t0, time.process_time() - c0

    out, first, first_cpu = call()
    steps = [call() for _ in range(repeats)]
    step = statistics.median(s[1] for s in steps)
    step_cpu = statistics.median(s[2] for s in steps)
    return dict(
        first_s=first,
        step_s=step,
        step_cpu_s=step_cpu,
        compile_s=compile_s,
        compile_cpu_s=compile_cpu_s,
        loss=float(steps[-1][0][0]),
    )


def _rollout_warmup(model, params, group: int, prompt: int, response: int) -> float:
    from dtarl.rollout.config import ContinuousConfig
    from dtarl.rollout.engine import RolloutEngine

    t0, c0 = time.perf_counter(), time.process_time()
    engine = RolloutEngine(
        model,
        ContinuousConfig(
            slots=group, groups=1, group_size=group, prompt_len=prompt, response_len=response
        ),
    )
    engine.warmup(params)
    return time.perf_counter() - t0, time.process_time() - c0


def run_compile(
    *,
    model: str = "qwen3_0p6b",
    layers: Sequence[int] = (7, 28),
    engines: Sequence[str] = ENGINES,
    group: int = 4,
    prompt: int = 64,
    response: int = 32,
    repeats: int = 2,
    rollout: bool = True,
    logits_chunk: int | None = None,
    remat: str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Measures every depth (module docstring); returns the rows the table prints.

    ``logits_chunk``: the model's ``logits_chunk`` (None: the preset's). At a large
    vocab (Qwen3: 151,936) the unchunked [rows, T, V] fp32 logits of dense's 8 rows
    of 640 tokens alone take 3.1 GB, their cotangent as much again. ``remat``: the
    model's ``remat`` policy (``Remat`` value; None: the preset's, none) for every engine;
    at 28 layers dense's saved activations need a 34.5 GB buffer without it."""
    from flax import nnx

    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.model import init_model

    if not layers or any(int(n) < 1 for n in layers):
        raise ValueError(f"--layers {list(layers)}: need depths >= 1")
    if repeats < 1:
        raise ValueError(f"--repeats {repeats} must be >= 1")
    base = ModelConfig.preset(model)
    if logits_chunk is not None:
        base = base.replace(logits_chunk=int(logits_chunk))
    if remat is not None:
        from dtarl.model.config import Remat

        base = base.replace(remat=Remat(remat))
    loss = ClippedSurrogateLoss.grpo()
    stats = _group(base, group, prompt, response, seed).prefix_tree().stats
    ideal = stats.num_tokens / stats.tree_tokens  # the token-ideal tree speedup
    rows = []
    for depth in layers:
        cfg = base.replace(num_layers=int(depth))
        t0 = time.perf_counter()
        m = init_model(cfg, seed=seed)
        params = nnx.split(m, nnx.Param)[1]
        log(f"[{model} x {depth} layers] built in {time.perf_counter() - t0:.1f} s")
        batch = _group(cfg, group, prompt, response, seed)
        row = {"layers": int(depth), "engines": {}}
        for kind in engines:
            r = _engine_times(m, params, batch, loss, kind, repeats)
            row["engines"][kind] = r
            dense = row["engines"].get("dense")
            vs = ""
            if dense is not None and kind != "dense":
                x = dense["step_s"] / r["step_s"]
                vs = f"   {x:.2f}x dense ({x / ideal:.2f} of ideal {ideal:.2f})"
            log(
                f"  {kind:<13} compile {r['compile_s']:7.1f} s ({r['compile_cpu_s']:.1f} CPU s)"
                f"   step {r['step_s']:7.2f} s   loss {r['loss']:+.6f}{vs}"
            )
        if rollout:
            wall, cpu = _rollout_warmup(m, params, group, prompt, response)
            row["rollout_warmup_s"], row["rollout_warmup_cpu_s"] = wall, cpu
            log(f"  rollout       warm-up {wall:7.1f} s   ({cpu:.1f} CPU s)")
        rows.append(row)
        del m, params
    result = dict(
        model=model,
        group=group,
        prompt=prompt,
        response=response,
        repeats=repeats,
        logits_chunk=base.logits_chunk,
        remat=base.remat.value,
        num_tokens=int(stats.num_tokens),
        tree_tokens=int(stats.tree_tokens),
        ideal=ideal,
        rows=rows,
    )
    log(format_table(result))
    return result


def format_table(result: dict) -> str:
    """Compile seconds (wall, then this process's CPU seconds: compiling is one thread,
    so CPU seconds barely move with other load on the machine), their deepest /
    shallowest ratio, dfs over dense, then the step seconds, the speedups over dense
    and those speedups as a fraction of the token-ideal (``result["ideal"]``), in wall
    seconds and in this process's CPU seconds (the steps' work: on a machine shared
    with other jobs they move less with the load than wall seconds do)."""
    rows = result["rows"]
    names = list(rows[0]["engines"])
    if "rollout_warmup_s" in rows[0]:
        names.append("rollout")
    lines = [
        f"\n{result['model']}: one group of {result['group']} x ({result['prompt']} + "
        f"{result['response']}) tokens"
        + (f", token-ideal speedup {result['ideal']:.2f}" if "ideal" in result else "")
        + (f", remat {result['remat']}" if result.get("remat", "none") != "none" else "")
    ]
    for title, suffix in (("compile s", "_s"), ("compile CPU s", "_cpu_s")):

        def sec(row, name, suffix=suffix):
            if name == "rollout":
                return row["rollout_warmup" + suffix]
            return row["engines"][name]["compile" + suffix]

        lines.append(f"{title:<16}" + "".join(f"{n:>14}" for n in names))
        for row in rows:
            label = f"{row['layers']} layers"
            lines.append(f"{label:<16}" + "".join(f"{sec(row, n):>14.1f}" for n in names))
        if len(rows) > 1:
            lo, hi = rows[0], rows[-1]
            ratio = "".join(f"{sec(hi, n) / max(sec(lo, n), 1e-9):>14.2f}" for n in names)
            label = f"{hi['layers']}/{lo['layers']} layers"
            lines.append(f"{label:<16}" + ratio)
        if "dfs" in names and "dense" in names:
            lines.append(
                "dfs / dense: "
                + ", ".join(
                    f"{r['layers']} layers {sec(r, 'dfs') / max(sec(r, 'dense'), 1e-9):.2f}"
                    for r in rows
                )
            )
    eng = list(rows[0]["engines"])
    for title, key in (("step s", "step_s"), ("step CPU s", "step_cpu_s")):
        if key not in rows[0]["engines"][eng[0]]:
            continue  # a result from before CPU seconds were recorded
        lines.append(f"{title:<16}" + "".join(f"{n:>14}" for n in eng))
        for row in rows:
            sec = {n: row["engines"][n][key] for n in eng}
            lines.append(
                f"{str(row['layers']) + ' layers':<16}" + "".join(f"{sec[n]:>14.2f}" for n in eng)
            )
            if "dense" not in eng:
                continue
            x = {n: sec["dense"] / max(sec[n], 1e-9) for n in eng}
            lines.append(f"{'  x dense':<16}" + "".join(f"{x[n]:>14.2f}" for n in eng))
            if "ideal" in result:
                lines.append(
                    f"{'  of ideal':<16}"
                    + "".join(
                        f"{'':>14}" if n == "dense" else f"{x[n] / result['ideal']:>14.2f}"
                        for n in eng
                    )
                )
    return "\n".join(lines)


__all__ = ["ENGINES", "format_table", "run_compile"]
