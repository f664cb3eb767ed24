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
# # dtarl quickstart: GRPO on a tiny model
#
# On Colab or another fresh kernel: put a checkout of the dtarl repository on the
# machine (upload or clone it; dtarl is not on PyPI), open this notebook from its
# `notebooks/` folder (or set `DTARL_SRC=/path/to/dtarl`) and run the first cell:
# it installs that checkout with `pip install -e`.
#
# A tiny random decoder (2 layers, hidden 64, byte tokenizer) learns integer
# arithmetic: a short SFT warm-up on reference solutions, then GRPO with a
# rule-based verifier. Same as `dtarl train configs/quickstart.yaml`.
# Set `DTARL_NOTEBOOK_FAST=1` for a seconds-long smoke run.

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
import dataclasses
import os
import tempfile

import matplotlib.pyplot as plt
import numpy as np

from dtarl.rl.config import MeshSection, ResumeSection, TrainerConfig
from dtarl.rl.trainer import Trainer

FAST = os.environ.get("DTARL_NOTEBOOK_FAST") == "1"
out_dir = tempfile.mkdtemp(prefix="dtarl_quickstart_")
cfg = TrainerConfig.quickstart()
cfg = cfg.replace(out_dir=out_dir, console=not FAST, resume=ResumeSection(enabled=False))
if FAST:
    cfg = cfg.replace(
        steps=2,
        eval=cfg.eval.__class__(num_problems=4),
        sft=cfg.sft.__class__(steps=2, batch_size=4),
        rollout=cfg.rollout.__class__(prompts_per_step=2, group_size=2, max_new_tokens=4),
        mesh=MeshSection(dp=1),  # one device, however many the machine has
        # auto times and compiles only its best-estimated engine per loss
        engine=dataclasses.replace(
            cfg.engine,
            auto=dataclasses.replace(cfg.engine.auto, tune_all_below=0.0, reserve_margin=1.0),
        ),
    )
print(cfg.algo.algorithm, cfg.task.kind, f"{cfg.sft.steps} SFT + {cfg.steps} RL steps")

# %% [markdown]
# ## Train
# Every step logs to the console, `metrics.jsonl` and the `logging.backends` (TensorBoard, W&B).

# %%
result = Trainer(cfg).run()
print(
    f"greedy success rate: {result.eval_start:.3f} -> {result.eval_end:.3f} "
    f"({result.seconds:.0f} s)"
)

# %% [markdown]
# ## Reward during GRPO

# %%
rl = [h for h in result.history if h["phase"] == "rl"]
steps = np.array([h["step"] for h in rl])
reward = np.array([h["reward_mean"] for h in rl])
window = min(10, len(reward))
smooth = np.convolve(reward, np.ones(window) / window, mode="valid")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(steps, reward, alpha=0.3, label="reward (per step)")
ax.plot(steps[window - 1 :], smooth, label=f"{window}-step mean")
ax.set_xlabel("GRPO step")
ax.set_ylabel("mean reward")
ax.legend()
plt.show()
