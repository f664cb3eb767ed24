# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Tree training: one forward/backward per prefix-tree node
#
# On Colab or another fresh kernel: put a checkout of the dtarl repository on the
# machine (upload or clone it; dtarl is not on PyPI), open this notebook from its
# `notebooks/` folder (or set `DTARL_SRC=/path/to/dtarl`) and run the first cell:
# it installs that checkout with `pip install -e`.
#
# We sample G responses per prompt with the KV-cache sampler (the prompt is
# prefilled once per group), build the prefix tree of the rollouts, check that
# the tree engines' gradients equal the dense baseline's, and time them.

# %%
import importlib.util
import os
import subprocess
import sys

if "google.colab" in sys.modules and importlib.util.find_spec("dtarl") is None:
    # Colab only: install dtarl from a local checkout ($DTARL_SRC, the folder above
    # this notebook, or ./dtarl, e.g. after `git clone <your dtarl repository URL>`).
    found = [
        d
        for d in (os.environ.get("DTARL_SRC", ""), "..", "dtarl")
        if d and os.path.exists(os.path.join(d, "pyproject.toml"))
    ]
    if not found:
        raise RuntimeError(
            "dtarl is not installed and no checkout was found: upload or clone the "
            "repository, set os.environ['DTARL_SRC'] = '/path/to/dtarl' and rerun this cell"
        )
    src = os.path.abspath(found[0])
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", src], check=True)
    sys.path.insert(0, src)

# %%
import os
import time

import jax
import numpy as np
from flax import nnx

from dtarl.advantages import grpo_advantages
from dtarl.engines import EngineKind, RolloutBatch, make_engine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rl.episodes import encode_prompt
from dtarl.rl.tasks import ArithmeticTask
from dtarl.rollout.sampler import Sampler, SamplingParams
from dtarl.tree import build_tree

FAST = os.environ.get("DTARL_NOTEBOOK_FAST") == "1"
NUM_PROMPTS, GROUP, MAX_NEW = (2, 3, 6) if FAST else (8, 8, 24)

model = init_model(ModelConfig.tiny(), seed=0)
weights = nnx.split(model, nnx.Param)[1]
tok = ByteTokenizer()

# %% [markdown]
# ## Rollouts

# %%
problems = ArithmeticTask(max_operand=99).generate(np.random.default_rng(0), NUM_PROMPTS)
prompts = [encode_prompt(tok, p.prompt) for p in problems]
sampler = Sampler(model, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, stop_tokens=(2,)))
res = sampler.generate(weights, prompts, num_samples=GROUP, seed=0)
print(res.stats)
pairs = zip(res.prompt_index, res.tokens, strict=True)
tokens = [np.concatenate([prompts[i], t]) for i, t in pairs]
rewards = np.random.default_rng(0).random(len(res.tokens)).astype(np.float32)  # toy rewards
batch = RolloutBatch.create(
    tokens=tokens,
    prompt_lens=[len(prompts[i]) for i in res.prompt_index],
    advantages=grpo_advantages(rewards, res.prompt_index),
    old_logprobs=[
        np.concatenate([np.zeros(len(prompts[i])), lp])
        for i, lp in zip(res.prompt_index, res.raw_logprobs, strict=True)
    ],
    group_ids=res.prompt_index,
)

# %% [markdown]
# ## The prefix tree

# %%
tree = build_tree(list(batch.tokens))
s = tree.stats
print(
    f"{s.num_sequences} sequences, dense tokens {s.num_tokens}, tree tokens {s.tree_tokens}, "
    f"ideal saving {s.ideal_token_ratio:.2f}x, depth {s.depth}, forks {s.num_forks}"
)

# %% [markdown]
# ## Gradients: every engine against dense, and timings

# %%
loss = ClippedSurrogateLoss.grpo()
kinds = [k.value for k in EngineKind]
if FAST:  # the smoke run checks the baseline, the DFS engine and the default
    kinds = [k for k in kinds if k in ("dense", "dfs", "auto")]
results = {}
for kind in kinds:
    engine = make_engine(kind, model)
    value, grads, aux = engine.value_and_grad(weights, batch, loss)  # compiles
    t0 = time.perf_counter()
    value, grads, aux = engine.value_and_grad(weights, batch, loss)
    jax.block_until_ready(grads)
    results[kind] = (float(value), grads, time.perf_counter() - t0)

ref_val, ref_grads, _ = results["dense"]
for kind, (val, grads, secs) in results.items():
    err = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / (np.max(np.abs(b)) + 1e-12))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )
    gnorm = float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads))))
    print(
        f"{kind:>13}: loss {val:+.6f}  |grad| {gnorm:.4f}  max rel diff vs dense {err:.1e}  "
        f"{secs * 1e3:7.1f} ms"
    )
    assert err < 1e-3, kind
assert list(results) == kinds, f"engines that did not run: {set(kinds) - set(results)}"
