"""Atomic, resumable training checkpoints (Orbax for arrays, JSON for metadata).

Layout under ``directory``::

    step_00000010/         a complete checkpoint (the name appears only when complete)
      state/               Orbax StandardCheckpointHandler: {"leaves": {"0": ..., "1": ...}}
      meta.json            step, data cursor, config, tree structure fingerprint, user data
    .tmp-step_00000012-*/  an interrupted write (ignored, removed by the next save)

A save writes everything into a fresh ``.tmp-*`` directory, fsyncs it and then
``os.rename``s it to ``step_N`` — atomic on POSIX — so a crash, a full disk or
an exception mid-write leaves the previous checkpoints untouched and valid.
Restores take the target pytree (for its structure: nnx.State, optax states)
and check that the saved leaves match it in number, shape and dtype.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or restored; the message names the path."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fingerprint(tree) -> list[list]:
    leaves = jax.tree.leaves(tree)
    return [[list(np.shape(x)), str(_dtype(x))] for x in leaves]


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


class CheckpointManager:
    """Saves and restores ``(pytree, meta)`` pairs by step; keeps the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep
        self._ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())

    # -------------------------------------------------------------- listing

    def steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            m = _STEP_RE.match(name)
            if m and os.path.isfile(os.path.join(self.directory, name, "meta.json")):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    # ---------------------------------------------------------------- write

    def _write(self, tmp: str, tree, meta: dict[str, Any]) -> None:
        """Writes the payload into ``tmp`` (separate so tests can inject failures)."""
        leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
        payload = {"leaves": {str(i): x for i, x in enumerate(leaves)}}
        self._ckptr.save(os.path.join(tmp, "state"), args=ocp.args.StandardSave(payload))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    def save(self, step: int, tree, meta: dict[str, Any] | None = None) -> str:
        """Atomically writes checkpoint ``step``; returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        self.cleanup_partial()
        final = self.path(step)
        tmp = os.path.join(self.directory, f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        full_meta = dict(meta or {})
        full_meta.update(step=int(step), fingerprint=_fingerprint(tree))
        try:
            self._write(tmp, tree, full_meta)
            _fsync_dir(tmp)
            if os.path.exists(final):  # re-saving a step: replace it
                old = final + f".old-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise CheckpointError(
                    f"{final}: checkpoint write failed ({e}); the previous checkpoint "
                    f"(step {self.latest_step()}) is still valid"
                ) from e
            raise
        for s in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(s), ignore_errors=True)
        return final

    def cleanup_partial(self) -> None:
        """Removes leftovers of interrupted writes."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-step_") or ".old-" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # ----------------------------------------------------------------- read

    def read_meta(self, step: int) -> dict[str, Any]:
        fp = os.path.join(self.path(step), "meta.json")
        try:
            with open(fp) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{fp}: cannot read checkpoint metadata ({e})") from None

    def restore(self, step: int, target) -> tuple[Any, dict[str, Any]]:
        """Returns (tree with ``target``'s structure, meta) of checkpoint ``step``."""
        meta = self.read_meta(step)
        want = _fingerprint(target)
        if meta.get("fingerprint") != want:
            raise CheckpointError(
                f"{self.path(step)}: saved state does not match the model/optimizer built from "
                f"the config ({len(meta.get('fingerprint', []))} saved leaves vs {len(want)} "
                "expected, or different shapes/dtypes); use a fresh out_dir or the same config"
            )
        leaves, treedef = jax.tree.flatten(target)
        abstract = {
            "leaves": {
                str(i): jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for i, x in enumerate(leaves)
            }
        }
        try:
            payload = self._ckptr.restore(
                os.path.join(self.path(step), "state"), args=ocp.args.StandardRestore(abstract)
            )
        except Exception as e:
            raise CheckpointError(f"{self.path(step)}: cannot restore ({e})") from e
        restored = [payload["leaves"][str(i)] for i in range(len(leaves))]
        return jax.tree.unflatten(treedef, restored), meta


__all__ = ["CheckpointError", "CheckpointManager"]
