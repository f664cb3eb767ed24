"""Fault injection helpers: small checkpoints, byte flips, subprocesses with a path."""

import glob
import os

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def subprocess_env(**extra) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def small_tree(scale: float = 1.0):
    import jax.numpy as jnp

    return {
        "params": {"w": jnp.arange(4096, dtype=jnp.float32) * scale, "b": jnp.ones(8)},
        "opt_state": {"mu": jnp.zeros(16)},
    }


def data_files(step_dir) -> list[str]:
    """The OCDBT data files of a step, largest first."""
    files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    return sorted((f for f in files if os.path.isfile(f)), key=os.path.getsize, reverse=True)


def flip(fp: str, n: int, offset: int = 0) -> None:
    data = bytearray(open(fp, "rb").read())
    for i in range(offset, min(offset + n, len(data))):
        data[i] ^= 0xFF
    with open(fp, "wb") as f:
        f.write(bytes(data))


def restored_w(mgr, step) -> np.ndarray:
    tree, _ = mgr.restore(step, small_tree())
    return np.asarray(tree["params"]["w"])


# The tiniest trainer (as tests/rl/test_rl_trainer.py's TINY): 1 layer, 2 prompts x 2.
TINY_TRAINER = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=1",
    "sft.batch_size=4",
    "steps=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "eval_problems=0",
    "console=false",
    "tensorboard=false",
    "keep_checkpoints=5",
    "mesh.dp=1",
]
