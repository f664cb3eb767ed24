"""Checkpoint integrity: a manifest of per-file checksums for every saved step.

``write_manifest(step_dir, step=..., config=...)`` runs once a step is committed:
it lists every file under ``step_dir`` with its size and SHA-256, plus the step,
a hash of the run's config and the dtarl version, and writes ``MANIFEST``
atomically (a temporary file, fsynced, renamed, the directory fsynced), so a
step either has a complete manifest or none. ``verify(step_dir)`` re-reads every
file and returns None when all match, else a one-line reason (no manifest, a
missing, extra, resized or changed file). Nothing of a step is read by a restore
before it verifies.

``nonfinite_leaf(names, leaves)`` names the first floating-point leaf holding a
NaN or an infinity: such parameters are never saved or exported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MANIFEST = "dtarl-manifest.json"
FORMAT = "dtarl-manifest-1"
_CHUNK = 1 << 20


def dtarl_version() -> str:
    try:
        return importlib.metadata.version("dtarl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def config_hash(config: Any) -> str:
    """SHA-256 of the config as canonical JSON (sorted keys)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256(fp: str) -> str:
    h = hashlib.sha256()
    with open(fp, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    """Every regular file under ``step_dir`` but the manifest, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(step_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), step_dir)
            if rel != MANIFEST and not n.startswith(f".{MANIFEST}."):
                out.append(rel)
    return sorted(out)


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: str | os.PathLike, *, step: int, config: Any = None) -> str:
    """Writes ``step_dir/MANIFEST`` (atomically) over the files now in ``step_dir``;
    returns its path."""
    step_dir = os.fspath(step_dir)
    files = {
        rel: {"size": os.path.getsize(os.path.join(step_dir, rel)), "sha256": _sha256(fp)}
        for rel in _files(step_dir)
        for fp in [os.path.join(step_dir, rel)]
    }
    doc = {
        "format": FORMAT,
        "step": int(step),
        "config_sha256": config_hash(config),
        "dtarl_version": dtarl_version(),
        "files": files,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=step_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(step_dir, MANIFEST))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(step_dir)
    return os.path.join(step_dir, MANIFEST)


def has_manifest(step_dir: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(step_dir), MANIFEST))


def read_manifest(step_dir: str | os.PathLike) -> dict[str, Any]:
    fp = os.path.join(os.fspath(step_dir), MANIFEST)
    with open(fp) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} manifest")
    if not isinstance(doc.get("files"), dict):
        raise ValueError("no 'files' mapping")
    return doc


def verify(step_dir: str | os.PathLike) -> str | None:
    """None when every file of ``step_dir`` matches its manifest; else why not (one line)."""
    step_dir = os.fspath(step_dir)
    if not os.path.isdir(step_dir):
        return "not a directory"
    if not has_manifest(step_dir):
        return (
            f"no {MANIFEST} (the save did not finish, or it was written by a dtarl without "
            "checkpoint manifests)"
        )
    try:
        doc = read_manifest(step_dir)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({' '.join(str(e).split())})"
    files = doc["files"]
    have = _files(step_dir)
    for rel in sorted(files):
        entry = files[rel]
        fp = os.path.join(step_dir, rel)
        if not os.path.isfile(fp):
            return f"{rel} is missing"
        try:
            size = os.path.getsize(fp)
            if size != entry.get("size"):
                return f"{rel} has {size} bytes, the manifest says {entry.get('size')}"
            if _sha256(fp) != entry.get("sha256"):
                return f"{rel} does not match its checksum (the data changed after the save)"
        except OSError as e:
            return f"{rel} cannot be read ({e.strerror or e})"
    extra = [rel for rel in have if rel not in files]
    if extra:
        more = f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"{extra[0]}{more} is not in the manifest"
    return None


def nonfinite_leaf(names: Sequence[str], leaves: Sequence[Any]) -> str | None:
    """The name of the first floating-point leaf holding a NaN or an infinity, or None."""
    for name, x in zip(names, leaves, strict=True):
        if isinstance(x, jax.ShapeDtypeStruct) or x is None:
            continue
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            dtype = np.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.inexact):
            continue
        if isinstance(x, jax.Array):
            ok = bool(np.asarray(jnp.isfinite(x).all()))
        else:
            ok = bool(np.isfinite(np.asarray(x)).all())
        if not ok:
            return name
    return None


# ------------------------------------------------- CheckpointManager's side


class StepVerifier:
    """The ``CheckpointManager``'s view of integrity: which steps verify (cached per
    manifest version, so a resume hashes a step once), the newest intact one, and
    the manifest written once a save commits.

    ``on_corrupt``: ``"previous"`` skips a step that fails verification with one
    logged line naming it and why; ``"error"`` raises ``CheckpointError`` instead.
    """

    def __init__(self, on_corrupt: str = "previous"):
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt={on_corrupt!r}: accepted: {list(ON_CORRUPT)}")
        self.on_corrupt = on_corrupt
        self._cache: dict[str, tuple[Any, str | None]] = {}
        self.pending: tuple[str, int, Any] | None = None  # (step_dir, step, config) in flight

    def reason(self, step_dir: str) -> str | None:
        try:  # every file's identity, size and mtime: a rewritten file misses the cache
            key: Any = tuple(
                (rel, st.st_ino, st.st_size, st.st_mtime_ns)
                for rel in [MANIFEST, *_files(step_dir)]
                for st in [os.stat(os.path.join(step_dir, rel))]
            )
        except OSError:
            key = None
        hit = self._cache.get(step_dir)
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        why = verify(step_dir)
        self._cache[step_dir] = (key, why)
        return why

    def check(self, step_dir: str) -> None:
        """Raises ``CheckpointError`` when ``step_dir`` does not verify."""
        from dtarl.errors import CheckpointError

        why = self.reason(step_dir)
        if why is not None:
            raise CheckpointError(f"{step_dir}: corrupt checkpoint, not used: {why}")

    def latest(self, steps: Sequence[int], path) -> int | None:
        """The newest of ``steps`` that verifies (``path(step)`` is its directory)."""
        from dtarl.errors import CheckpointError

        for step in sorted(steps, reverse=True):
            why = self.reason(path(step))
            if why is None:
                return step
            if self.on_corrupt == "error":
                raise CheckpointError(
                    f"{path(step)}: corrupt checkpoint: {why} (resume.on_corrupt=error; "
                    "set resume.on_corrupt=previous to resume from the newest intact step)"
                )
            _log.warning("dtarl: skipping checkpoint %s: %s", path(step), why)
        if steps:
            raise CheckpointError(
                f"{os.path.dirname(path(steps[0]))}: none of the saved steps {sorted(steps)} "
                "is intact (see the lines above); move the directory away, or set "
                "resume.enabled=false with a new out_dir"
            )
        return None

    def watch(self, wait_fn) -> None:
        """Single process: a thread waits for the async save in flight (``wait_fn``, Orbax's
        ``wait_until_finished``) and writes its manifest at once, so a step is verifiable
        as soon as it is committed. A multi-process run writes it in ``committed``, where
        all processes meet."""
        if jax.process_count() > 1:
            return

        def run():
            try:
                wait_fn()
                self.committed()
            except BaseException as e:  # re-raised by ``join`` in the caller's thread
                self._error = e

        self._error: BaseException | None = None
        self._thread = threading.Thread(target=run, name="dtarl-manifest", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Waits for ``watch``'s thread; raises what it raised."""
        thread, self._thread = getattr(self, "_thread", None), None
        if thread is not None:
            thread.join()
            if self._error is not None:
                err, self._error = self._error, None
                raise err

    def committed(self) -> None:
        """Writes the manifest of the committed save in flight (``CheckpointManager.wait``;
        a no-op when ``on_commit`` did it). Process 0 writes it; in a multi-process run
        every process makes this call and they all wait until it is written."""
        if self.pending is None:
            return
        step_dir, step, config = self.pending
        if not os.path.isdir(step_dir):  # not committed: ``CheckpointManager.wait`` says so
            return
        if jax.process_index() == 0 and not has_manifest(step_dir):
            write_manifest(step_dir, step=step, config=config)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"dtarl-manifest-{step}")
        self._cache.pop(step_dir, None)
        self.pending = None


ON_CORRUPT = ("previous", "error")
_log = logging.getLogger("dtarl.checkpoint")


__all__ = [
    "MANIFEST",
    "ON_CORRUPT",
    "StepVerifier",
    "config_hash",
    "has_manifest",
    "nonfinite_leaf",
    "read_manifest",
    "verify",
    "write_manifest",
]
