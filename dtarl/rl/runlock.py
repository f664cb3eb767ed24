"""One run per ``out_dir``: ``out_dir/.lock``, held with ``fcntl.flock`` for the run's life.

A second run on the same directory (same host, or another host on a filesystem
that honours ``flock``) fails at once with ``ConfigError`` naming the holder's pid
and host, which the lock file records. The kernel drops the lock when the holder
exits, however it exits (``kill -9`` included), so a stale file never blocks a run.
In a multi-process run only process 0 takes it (all processes share ``out_dir``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator

from dtarl.errors import ConfigError

LOCK_FILE = ".lock"


class RunLock:
    """``out_dir/.lock`` held until ``release`` (or the process ends)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = os.fspath(out_dir)
        self.path = os.path.join(self.out_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(
                f"out_dir={self.out_dir!r}: cannot be used as the run directory "
                f"({e.strerror or e}); choose a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd) or "an unknown process"
            os.close(fd)
            raise ConfigError(
                f"out_dir={self.out_dir!r} is in use by another run ({holder}, holding "
                f"{self.path}); wait for it to finish or choose another out_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 200).decode(errors="replace").strip()
    except OSError:
        return ""


@contextlib.contextmanager
def hold(out_dir: str | os.PathLike, *, enabled: bool = True) -> Iterator[RunLock | None]:
    """Holds ``out_dir``'s lock for the ``with`` block (nothing when not ``enabled``)."""
    if not enabled:
        yield None
        return
    with RunLock(out_dir) as lock:
        yield lock


__all__ = ["LOCK_FILE", "RunLock", "hold"]
