"""Step seconds of dense and of DFS config variants side by side, in one process.

    python tools/dfs_step_probe.py [--remat MODE] [--rounds N] [--no-dense] LAYERS
        [DFS_KWARGS_JSON ...]

e.g. ``python tools/dfs_step_probe.py --remat full 28 '{}' '{"keep_layer_outputs":
false}'``: the qwen3_0p6b preset at LAYERS layers (random weights, logits chunk 32),
one GRPO group of 8 x (512 + 64) tokens (the issue's tree-speed shape), the GRPO loss;
dense, then one DFSEngine per JSON object of ``DFSConfig`` fields (``{}``: the
default). Each program is called once untimed (compile), then timed ``--rounds``
times interleaved with the others; it prints each program's median CPU and wall
seconds, its speedup over dense and the fraction of the token-ideal speedup
(dense tokens / tree tokens). CPU seconds (``time.process_time``) are the steadier
figure on a shared machine. ``--no-dense`` skips dense (its minutes at 28 layers)
and prints the times alone.
"""

import json
import statistics
import sys
import time

import jax
from flax import nnx

from dtarl.engines import DFSEngine, make_engine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.model.config import Remat
from dtarl.testing import grpo_groups


def main(argv: list[str]) -> None:
    remat, rounds, dense = "none", 1, True
    while argv[:1] and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--no-dense":
            dense = False
        elif flag in ("--remat", "--rounds") and argv:
            value = argv.pop(0)
            remat, rounds = (value, rounds) if flag == "--remat" else (remat, int(value))
        else:
            sys.exit(__doc__)
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        sys.exit(__doc__)
    cfg = ModelConfig.preset("qwen3_0p6b").replace(
        num_layers=int(argv[0]), logits_chunk=32, remat=Remat(remat)
    )
    model = init_model(cfg, seed=0)
    params = nnx.split(model, nnx.Param)[1]
    batch = grpo_groups(
        num_groups=1, group_size=8, prompt_len=512, response_len=64, vocab_size=cfg.vocab_size
    )
    loss = ClippedSurrogateLoss.grpo()
    engines = {"dense": make_engine("dense", model)} if dense else {}
    for spec in argv[1:]:
        engines[f"dfs {spec}"] = DFSEngine(model, **json.loads(spec))

    def call(engine) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(engine.value_and_grad(params, batch, loss)[1])
        return time.process_time() - c0, time.perf_counter() - t0

    for engine in engines.values():
        call(engine)  # compile
    times = {name: [] for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            times[name].append(call(engine))
            print(f"round {r} {name}: {times[name][-1][0]:.1f} CPU s", flush=True)
    tree = batch.prefix_tree().stats
    ideal = tree.num_tokens / tree.tree_tokens
    base = statistics.median(c for c, _ in times["dense"]) if dense else None
    print(f"token-ideal speedup {ideal:.2f}")
    for name, got in times.items():
        cpu, wall = (statistics.median(x[i] for x in got) for i in (0, 1))
        line = f"{name:<40} CPU {cpu:8.2f} s  wall {wall:8.2f} s"
        if base:
            line += f"  x dense {base / cpu:5.2f}  of ideal {base / cpu / ideal:5.2f}"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
