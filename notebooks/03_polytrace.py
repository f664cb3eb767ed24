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
# # PolyTrace: real RL workload distributions
#
# On Colab or another fresh kernel: put a checkout of the dtarl repository on the
# machine (upload or clone it; dtarl is not on PyPI), open this notebook from its
# `notebooks/` folder (or set `DTARL_SRC=/path/to/dtarl`) and run the first cell:
# it installs that checkout with `pip install -e`.
#
# Loads a PolyTrace run (response lengths of every prompt group), plots its
# distributions, samples a training batch with the same prefix structure and
# writes the characterization report. The traces live outside the repository
# (`<repo>/../shared/polytrace` or `$DTARL_POLYTRACE`); without them this
# notebook says so and stops early.

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
import tempfile

import matplotlib.pyplot as plt
import numpy as np

from dtarl.traces import (
    PromptGroup,
    RunTrace,
    default_polytrace_root,
    find_traces,
    load_trace,
    sample_workload,
)
from dtarl.traces.report import write_report

FAST = os.environ.get("DTARL_NOTEBOOK_FAST") == "1"
root = default_polytrace_root()
runs = [t for t in find_traces(root) if isinstance(t, RunTrace)] if root.exists() else []
HAVE_TRACES = bool(runs)
print(f"PolyTrace root {root}: {len(runs)} runs" if HAVE_TRACES else f"no traces in {root}: skip")

# %% [markdown]
# ## Length distributions of one run

# %%
if HAVE_TRACES:
    run = load_trace(runs[0].path)
    steps = run.steps[:1] if FAST else run.steps[:5]
    groups = [r for r in run.iter_records(steps) if isinstance(r, PromptGroup)]
    prompt_len = np.array([g.input for g in groups])
    outputs = np.concatenate([g.output for g in groups])
    std_in_group = np.array([np.std(g.output) for g in groups])
    print(f"{run.name}: steps {steps}, {len(groups)} groups, G={groups[0].n_sampling}")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3))
    axes[0].hist(prompt_len, bins=40)
    axes[0].set_title("prompt length")
    axes[1].hist(outputs, bins=40)
    axes[1].set_title("response length")
    axes[2].hist(std_in_group, bins=40)
    axes[2].set_title("std of response length within a group")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## A training batch with the trace's prefix structure

# %%
if HAVE_TRACES:
    batch = sample_workload(run, batch_size=2 if FAST else 16, length_scale=0.01 if FAST else 0.1)
    print(
        f"{batch.num_sequences} sequences, {batch.num_tokens} tokens, "
        f"max length {batch.lengths.max()}"
    )

# %% [markdown]
# ## The characterization report

# %%
if HAVE_TRACES:
    out = tempfile.mkdtemp(prefix="polytrace_report_")
    report = write_report(run.path, out, steps=steps, html_output=False)
    print(report.markdown, f"({len(report.plots)} plots)")
