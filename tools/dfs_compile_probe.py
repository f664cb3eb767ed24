"""CPU seconds of ``jit.lower`` + ``compile`` of the dense and DFS programs alone.

    python tools/dfs_compile_probe.py [--remat MODE] LAYERS [DFS_KWARGS_JSON ...]

e.g. ``python tools/dfs_compile_probe.py 28 '{}' '{"chunk_len": 128, "leaf_rows": 2,
"bucket_bodies": true}'``: the qwen3_0p6b preset at LAYERS layers (random weights),
one GRPO group of 4 x (64 + 32) tokens (the group of ``dtarl bench scale
--compile``), the GRPO loss; one line per program (dense first, then a DFSEngine per
JSON object of ``DFSConfig`` fields, ``{}`` the default) with its compile CPU
seconds (``dtarl.bench.scale.program_compile_s``, as ``dtarl bench scale --compile``
measures compile), HLO size and the branch counts of its conditionals; unlike the bench
command it takes DFS config variants. ``--remat MODE`` sets ``model.remat`` (default
none; under full the DFS default keeps layer outputs).
"""

import json
import re
import sys

from flax import nnx

from dtarl.bench.scale import program_compile_s
from dtarl.engines import DenseEngine, DFSEngine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.model.config import Remat
from dtarl.testing import grpo_groups


def main(argv: list[str]) -> None:
    remat = "none"
    if argv[:1] == ["--remat"] and len(argv) > 1:
        remat, argv = argv[1], argv[2:]
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        sys.exit(__doc__)
    cfg = ModelConfig.preset("qwen3_0p6b").replace(num_layers=int(argv[0]), remat=Remat(remat))
    model = init_model(cfg, seed=0)
    params = nnx.split(model, nnx.Param)[1]
    batch = grpo_groups(
        num_groups=1, group_size=4, prompt_len=64, response_len=32, vocab_size=cfg.vocab_size
    )
    loss = ClippedSurrogateLoss.grpo()
    programs = [("dense", lambda: DenseEngine(model))]
    for spec in argv[1:]:
        kwargs = json.loads(spec)
        programs.append((spec, lambda kwargs=kwargs: DFSEngine(model, **kwargs)))
    for name, make in programs:
        engine = make()
        _, cpu = program_compile_s(engine, params, batch, loss)
        prepared = engine.prepare(batch, loss)
        hlo = engine.jit.lower(loss, prepared.static, params, prepared.args).as_text(dialect="hlo")
        branches = [len(b.split(",")) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo)]
        print(f"{name:<50} {cpu:6.1f} CPU s  HLO {len(hlo) / 1e6:.2f} MB  switches {branches}")


if __name__ == "__main__":
    main(sys.argv[1:])
