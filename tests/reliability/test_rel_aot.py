"""Issue #40 item 4: a planted ``.program`` file ran a shell command (the store unpickled
it before checking its key). Now nothing in a file is executed: a pickle, a file of
another key or a tampered module is ignored with a warning and the plain jit runs."""

import json
import os
import pickle

import numpy as np
import pytest

from dtarl import aot, aotfile


def axpy(a, x):
    return a * x + 1.0


ARGS = (np.float32(2.0), np.arange(4, dtype=np.float32))


class Payload:
    """Unpickling this runs ``os.system`` (what the planted file did)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _the_file(store) -> str:
    (name,) = [p for p in os.listdir(store.path) if p.endswith(".program")]
    return os.path.join(store.path, name)


def _run_again():
    with pytest.warns(RuntimeWarning, match="'axpy' runs on the normal jit path"):
        got = aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    np.testing.assert_array_equal(np.asarray(got), 2.0 * ARGS[1] + 1.0)


@pytest.mark.parametrize("magic", [b"dtarl-program-v1\n", aotfile.MAGIC, b""])
def test_planted_pickle_is_never_executed(store, tmp_path, magic):
    aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    path = _the_file(store)
    marker = tmp_path / "pwned"
    with open(path, "wb") as f:
        f.write(magic + pickle.dumps(("key", Payload(marker))))
    _run_again()
    assert not marker.exists()
    assert store.stats.loaded == 0


def test_other_key_or_tampered_module_is_ignored(store):
    aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    path = _the_file(store)
    data = open(path, "rb").read()
    with open(path, "wb") as f:  # one flipped byte in the StableHLO module
        f.write(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    with pytest.warns(RuntimeWarning, match="does not match its checksum"):
        aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    with pytest.raises(aotfile.StoreError, match="key mismatch"):
        aotfile.decode(data, "another key", path)
    assert store.stats.loaded == 0


def test_file_holds_json_and_the_module(store):
    aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    data = open(_the_file(store), "rb").read()
    start = len(aotfile.MAGIC) + 8
    n = int.from_bytes(data[len(aotfile.MAGIC) : start], "big")
    header = json.loads(data[start : start + n])
    assert set(header) == {"key", "module_sha256", "module_size", "exported"}
    assert len(data) == start + n + header["module_size"]  # JSON, then the module: no pickle
