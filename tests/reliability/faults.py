"""Fault injection helpers: small checkpoints, byte flips, subprocesses with a path."""

import glob
import os

import numpy as np

from tests.rl.test_rl_trainer import TINY

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


# The tiniest trainer: tests/rl/test_rl_trainer.py's, checkpoints only when asked.
TINY_TRAINER = [o for o in TINY if not o.startswith("checkpoint_every=")]
