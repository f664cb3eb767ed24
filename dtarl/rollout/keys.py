"""Per-request PRNG keys of the continuous engine: member j of a group submitted with
``seed`` draws position ``pos`` with ``fold_in(fold_in(key(seed), j), pos)``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dtarl.rollout.config import EngineError


@jax.jit
def _int_key(seed):
    return jax.random.key_data(jax.random.key(seed))


@functools.cache
def _member_keys_fn(n: int):
    """Jitted keys of members 0..n-1 of a group (one small program per n, not eager ops)."""
    return jax.jit(lambda base: jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n)))


def seed_key(seed) -> np.ndarray:
    """``seed`` (an int or a PRNG key) as a [2] uint32 key."""
    if isinstance(seed, int | np.integer):
        return np.asarray(_int_key(np.uint32(int(seed) & 0xFFFFFFFF)), np.uint32)
    arr = np.asarray(
        jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed
    )
    if arr.shape != (2,) or arr.dtype != np.uint32:
        raise EngineError(
            f"seed: need an int or a PRNG key ([2] uint32), got {arr.dtype}{arr.shape}"
        )
    return arr


def fold_seed(key: np.ndarray, i: int) -> np.ndarray:
    return np.asarray(jax.random.fold_in(jnp.asarray(key), i), np.uint32)


def member_keys(seed, n: int) -> np.ndarray:
    """[n, 2] uint32 keys of members 0..n-1 of a group submitted with ``seed``."""
    return np.asarray(_member_keys_fn(int(n))(seed_key(seed)), np.uint32)


__all__ = ["fold_seed", "member_keys", "seed_key"]
