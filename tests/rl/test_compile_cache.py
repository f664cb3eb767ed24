"""``compile_cache_dir``: a second run of the same config reads its programs from JAX's
persistent compilation cache instead of compiling them.

The runs happen in a subprocess: the cache is process-wide JAX state, and the suite's
own cache (tests/conftest.py) must stay in place for the other tests. Structural, not
timed: JAX's cache events are counted (a miss is an executable compiled and written,
a hit one read back), and the run's programs are the same in both runs."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

from dtarl.rl.config import ConfigError, load_config
from dtarl.rl.optim import Optimizer

_SCRIPT = r"""
import json, sys
import jax
from dtarl import aot
from dtarl.rl.config import load_config
from dtarl.rl.trainer import Trainer

counts = {}
def on_event(event, **kwargs):
    counts[event] = counts.get(event, 0) + 1
jax.monitoring.register_event_listener(on_event)

cache, out = sys.argv[1], sys.argv[2]
over = [
    "model.overrides={num_layers: 1}", "task.max_operand=5", "sft.steps=1",
    "sft.batch_size=2", "steps=1", "rollout.prompts_per_step=1", "rollout.group_size=2",
    "rollout.max_new_tokens=3", "eval.num_problems=0", "console=false",
    "mesh.dp=1", "algo.engine=dense", f"compile_cache_dir={cache}",
]
report = []
for run in range(2):
    counts.clear()
    jax.clear_caches()  # the second run finds nothing in memory: only the disk cache
    t = Trainer(load_config(None, over + [f"out_dir={out}/{run}"]))
    t.run()
    report.append(dict(
        hits=counts.get("/jax/compilation_cache/cache_hits", 0),
        misses=counts.get("/jax/compilation_cache/cache_misses", 0),
        requests=counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
        cache_dir=jax.config.jax_compilation_cache_dir,
        programs=dict(vars(aot.program_store().stats)),  # cumulative over both runs
    ))
print("REPORT " + json.dumps(report))
"""


def test_second_run_reads_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(cache), str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    cold, warm = json.loads(line[len("REPORT ") :])
    assert cold["cache_dir"] == warm["cache_dir"] == str(cache)
    # The first run compiles its programs (model init, rollout, engine, optimiser) and
    # writes each; the second asks for the same programs and reads every one back.
    assert cold["misses"] >= 5 and cold["hits"] == 0, cold
    assert warm["requests"] == cold["requests"], (cold, warm)
    assert warm["misses"] == 0 and warm["hits"] == warm["requests"], warm
    assert len(os.listdir(cache)) >= cold["misses"]
    # The program store (dtarl.aot, in the same directory): the first run exports the
    # engine's, rollout's and scorer's programs (a program built twice is read back the
    # second time), the second run reads every one it builds back and exports none.
    built = cold["programs"]["exported"] + cold["programs"]["loaded"]
    assert cold["programs"]["exported"] >= 3 and cold["programs"]["failed"] == 0, cold
    assert warm["programs"]["exported"] == cold["programs"]["exported"], (cold, warm)
    assert warm["programs"]["loaded"] - cold["programs"]["loaded"] == built, (cold, warm)
    assert warm["programs"]["failed"] == 0, warm


def test_compile_cache_dir_is_checked(tmp_path):
    assert load_config(None, ["console=false"]).compile_cache_dir is None  # default: off
    cfg = load_config(None, [f"compile_cache_dir={tmp_path}", "console=false"])
    assert cfg.compile_cache_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="compile_cache_dir=''"):
        load_config(None, ["compile_cache_dir=''"])


def test_optimizer_runs_one_executable_for_committed_and_uncommitted_inputs():
    """A program read back from the AOT store returns committed gradients while the first
    step's params are uncommitted; jit keys executables on that, so the update commits
    its inputs and every step runs the first step's executable."""
    opt = Optimizer(optax.adamw(1e-2), optax.constant_schedule(1e-2))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}  # uncommitted
    state = opt.init(params)
    dev = jax.devices()[0]
    grads = jax.device_put({"w": jnp.full((3, 2), 0.5), "b": jnp.ones(2)}, dev)  # committed
    assert not params["w"].committed and grads["w"].committed
    for _ in range(3):
        params, state = opt.apply(params, grads, state)
    assert opt._fn._cache_size() == 1
