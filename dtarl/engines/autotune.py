"""What auto's autotuning keeps: its timed programs and its measured choices across runs.

    Timer        times named programs side by side: {name: fn} -> {name: seconds}
    Timing       one timed program: measured seconds and the cost model's prediction
    ChoiceCache  a JSON file of measured choices (engine per batch signature), reused
                 by the next run with the same model, engines and device

``dtarl.engines.auto`` makes the choices; these are what it measures and remembers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

from dtarl.engines import base

__all__ = ["ChoiceCache", "Timer", "Timing"]

Timer = Callable[[dict[str, Callable[[], object]]], dict[str, float]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """One timed program: ``measured`` seconds on the batch it was timed on, whose
    padded ``work`` the cost model then predicted at ``predicted`` seconds."""

    measured: float
    predicted: float
    work: base.WorkFeatures


class ChoiceCache:
    """Measured choices reused across runs: a JSON file mapping (scope, signature) to
    the engine a measured choice picked, and its measured seconds.

    ``scope`` says what a choice is valid for besides the batch's signature (the
    model's and engines' configs and the device kind: ``AutoEngine._cache_scope``);
    entries of other scopes in the same file are kept but never used. Every new
    choice is written at once, atomically (a temporary file in the same folder,
    then ``os.replace``), merged with what the file holds then. A file that is not
    one of these (unreadable, not JSON, another format or version) gives a warning
    and is ignored: nothing is read from it and it is never overwritten. ``path``
    None: no file, nothing kept.
    """

    VERSION = 1
    FORMAT = "dtarl.autotune-choices"

    def __init__(self, path: str | None, scope: str):
        self.path = path
        self.scope = scope
        self.entries: dict[str, dict[str, Any]] = {}
        self.writable = path is not None
        if path is not None and os.path.exists(path):
            data = self._read(path)
            if data is None:
                self.writable = False
            else:
                self.entries = data

    @staticmethod
    def key(scope: str, sig: tuple) -> str:
        return scope + "|" + repr(sig)

    def _read(self, path: str) -> dict[str, dict[str, Any]] | None:
        """The file's entries, or None (with a warning) when it is not a choice cache."""
        try:
            with open(path) as f:
                data = json.load(f)
            ok = (
                isinstance(data, dict)
                and data.get("format") == self.FORMAT
                and data.get("version") == self.VERSION
                and isinstance(data.get("entries"), dict)
                and all(
                    isinstance(v, dict) and isinstance(v.get("kind"), str)
                    for v in data["entries"].values()
                )
            )
            if not ok:
                raise ValueError(f"not a {self.FORMAT} file of version {self.VERSION}")
            return data["entries"]
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            warnings.warn(
                f"engine.auto.cache_path={path!r}: {e}; the file is ignored and will not "
                "be overwritten (delete it or choose another path to cache choices)",
                stacklevel=3,
            )
            return None

    def get(self, sig: tuple) -> dict[str, Any] | None:
        return self.entries.get(self.key(self.scope, sig))

    def kinds(self, loss) -> set[str]:
        """The engines this scope's cached choices for ``loss`` name (a signature's
        first element is its loss)."""
        head = f"{self.scope}|({loss!r}, "
        return {v["kind"] for k, v in self.entries.items() if k.startswith(head)}

    def put(self, sig: tuple, kind: str, seconds: float) -> None:
        if self.path is None:
            return
        key = self.key(self.scope, sig)
        entry = {"kind": kind, "measured_seconds": float(seconds)}
        if self.entries.get(key) == entry:
            return
        self.entries[key] = entry
        if not self.writable:
            return
        if os.path.exists(self.path):  # another run may have added choices meanwhile
            on_disk = self._read(self.path)
            if on_disk is None:
                self.writable = False
                return
            self.entries = {**on_disk, **self.entries}
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".autotune-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(
                    {"format": self.FORMAT, "version": self.VERSION, "entries": self.entries},
                    f,
                    indent=1,
                    sort_keys=True,
                )
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
