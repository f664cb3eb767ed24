"""An ahead-of-time program store: warm runs skip tracing and lowering.

JAX's persistent compilation cache (``compile_cache_dir``) saves XLA's compile, but a
new process still traces every program's Python (the model) to a jaxpr and lowers it
to StableHLO before it can look the executable up. The program store saves those two
as well: with it enabled (``enable_program_store(dir)``; the trainer enables it in
``<compile_cache_dir>/dtarl-programs``), ``aot.jit(fun, name=..., static=...)`` builds
each program (one per abstract input signature) with ``jax.export``, keeps the
``Exported`` in a file, and runs it as ``jax.jit(exported.call)``. A later process
with the same key reads the file instead of tracing ``fun``; tracing that small
wrapper does not run the model, and XLA's compile of it hits the persistent cache
(the cold run compiled the very same wrapper). Without the store, ``aot.jit`` is
``jax.jit``: nothing changes.

The key makes a stale program impossible to load: a hash of
  * the dtarl and pallas_kernels packages' source (every ``.py`` under them, hashed
    once per process: ``source_fingerprint``), so any code change misses;
  * the jax and jaxlib versions, the backend, device kind and count, process count,
    and the jax settings that change a trace (x64, default matmul precision);
  * the program's name and ``static`` (its static configuration: the loss's and
    the engine's reprs, static shapes), which must determine ``fun`` given the
    source: callers pass every setting their function closes over;
  * the abstract inputs: tree structure, and every leaf's shape, dtype, weak type
    and sharding (its mesh shape, axis names, partition spec, memory kind).
The full key text is stored in the file and compared on load (a hash collision
cannot load a wrong program).

Files are ``<dir>/<name>-<hash>.program``, written atomically (a temporary file in
the same folder, then ``os.replace``), in the format of ``dtarl.aotfile``: JSON
metadata and the serialized StableHLO module as it is, never pickle (jax's own
``Exported.serialize`` needs the optional ``flatbuffers`` package, which dtarl does
not depend on; the jax version is part of the key, so a file is only read by the jax
that wrote it). The stored key and the module's checksum are compared before
anything else in the file is decoded; a file that does not match is ignored with a
warning and its program is never run. A planted file can at most hold a StableHLO
program under the right key: keep the store private to the user, like JAX's
compilation cache.

Failures never give a wrong result: a program whose export fails (a host callback,
an effect, a custom call jax will not export, a leaf that is not an array), or whose
file cannot be read, runs on the normal ``jax.jit`` path, with one warning naming
the program. Donation (``donate_argnums``) and ``out_shardings`` are kept: the
wrapper ``jax.jit(exported.call, ...)`` takes them like the plain one.

Committed arrays: jax commits the results of an ``Exported`` call to their devices
(a plain jit leaves them uncommitted when its inputs are), and jit keys its programs
on that. A stored program therefore commits its uncommitted inputs before each call
(``StoredJit._committed``), so feeding it its own outputs (params, the rollout's pool)
runs one executable; a plain jit downstream that mixes its results with arrays of
its own would see its inputs become committed once and compile once more, so the
optimiser's update commits its inputs (``dtarl.rl.optim.Optimizer.apply``).

Trace counts: programs count their own traces (``trace_count`` attributes); a
program loaded from the store counts as built (``on_load``, called once per loaded
signature), so "no new traces after the first step" keeps its meaning. A program
whose export fails is traced once more by the plain path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np

from dtarl.aotfile import StoreError, decode, encode

STORE_SUBDIR = "dtarl-programs"

# The kernels the model may call (``attention_backend: pallas``) live beside dtarl.
_spec = importlib.util.find_spec("pallas_kernels")
_PALLAS_DIR = os.path.dirname(_spec.origin) if _spec and _spec.origin else None
_store: ProgramStore | None = None
_fingerprints: dict[str, str] = {}
_lock = threading.Lock()


def source_fingerprint(root: str | os.PathLike | None = None) -> str:
    """sha256 over every ``.py`` file under ``root`` (default: the dtarl package), by
    relative path and content; computed once per process and root. The store's key
    holds the dtarl package's and the ``pallas_kernels`` package's."""
    root = os.path.abspath(root if root is not None else Path(__file__).parent)
    with _lock:
        if root not in _fingerprints:
            h = hashlib.sha256()
            for path in sorted(Path(root).rglob("*.py")):
                h.update(path.relative_to(root).as_posix().encode() + b"\0")
                h.update(path.read_bytes() + b"\0")
            _fingerprints[root] = h.hexdigest()
        return _fingerprints[root]


def environment_key() -> str:
    """What else besides the source decides a trace: versions, devices, jax settings."""
    dev = jax.devices()[0]
    return repr(
        (
            jax.__version__,
            jaxlib.version.__version__,
            jax.default_backend(),
            dev.device_kind,
            jax.device_count(),
            jax.process_count(),
            bool(jax.config.jax_enable_x64),
            str(jax.config.jax_default_matmul_precision),
        )
    )


@dataclasses.dataclass
class StoreStats:
    """What the store did in this process (``ProgramStore.stats``)."""

    loaded: int = 0  # programs read from files (their function never traced)
    exported: int = 0  # programs exported and written
    failed: int = 0  # programs on the plain jit path after a failure
    load_seconds: float = 0.0  # reading and unpickling files
    export_seconds: float = 0.0  # jax.export (trace + lower) and writing


class ProgramStore:
    """The files of one store directory (created if missing); see the module docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        os.makedirs(self.path, exist_ok=True)
        kernels = source_fingerprint(_PALLAS_DIR) if _PALLAS_DIR else ""
        self.fingerprint = source_fingerprint() + kernels
        self.environment = environment_key()
        self.stats = StoreStats()
        self._warned: set[str] = set()

    def key_text(self, name: str, static: Any, signature: str) -> str:
        return "\n".join((self.fingerprint, self.environment, name, repr(static), signature))

    def file_for(self, name: str, key_text: str) -> str:
        digest = hashlib.sha256(key_text.encode()).hexdigest()[:40]
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:60]
        return os.path.join(self.path, f"{safe}-{digest}.program")

    def load(self, file: str, key_text: str) -> jax.export.Exported | None:
        """The stored program, None when there is no file; ``StoreError`` when the file
        is unusable."""
        t0 = time.perf_counter()
        try:
            with open(file, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {file}: {e}") from e
        exported = decode(data, key_text, file)  # key and checksum first; no pickle
        self.stats.load_seconds += time.perf_counter() - t0
        self.stats.loaded += 1
        return exported

    def save(self, file: str, key_text: str, exported: jax.export.Exported) -> None:
        """Writes ``exported`` atomically (temporary file, then ``os.replace``)."""
        data = encode(exported, key_text)  # ``Unsupported``: the program is not stored
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=".program")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, file)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def warn(self, name: str, why: str) -> None:
        """One warning per program name and process."""
        self.stats.failed += 1
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"program store: {name!r} runs on the normal jit path ({why})",
                RuntimeWarning,
                stacklevel=3,
            )


def enable_program_store(path: str | os.PathLike) -> ProgramStore:
    """Turns the store on for programs built from now on in this process (a store on
    another directory is replaced). Returns it."""
    global _store
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if _store is None or _store.path != path:
        _store = ProgramStore(path)
    return _store


def disable_program_store() -> None:
    """Programs built from now on use plain ``jax.jit`` (those built keep their path)."""
    global _store
    _store = None


def program_store() -> ProgramStore | None:
    """The enabled store, or None."""
    return _store


def jit(
    fun: Callable,
    *,
    name: str,
    static: Hashable = (),
    donate_argnums: tuple[int, ...] = (),
    out_shardings: Any = None,
    on_load: Callable[[], None] | None = None,
):
    """``jax.jit(fun, donate_argnums=, out_shardings=)``, through the program store when
    one is enabled (module docstring). ``static`` must pin down everything ``fun``
    depends on besides dtarl's source and its inputs' abstract values; ``on_load`` is
    called for each program read from the store (count it as a trace)."""
    kw: dict[str, Any] = dict(donate_argnums=donate_argnums)
    if out_shardings is not None:
        kw["out_shardings"] = out_shardings
    store = program_store()
    if store is None:
        return jax.jit(fun, **kw)
    return StoredJit(fun, store=store, name=name, static=static, jit_kwargs=kw, on_load=on_load)


class _Unsupported(Exception):
    pass


def _leaf_signature(x) -> tuple:
    """(shape, dtype, weak_type, sharding or None) of an argument leaf; the sharding
    only when it spans several devices or another memory than the device's (a
    one-device program runs on any one)."""
    if isinstance(x, np.ndarray | np.generic):
        return (x.shape, x.dtype, False, None)
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(x, "sharding", None)
        if (
            sharding is not None
            and len(sharding.device_set) == 1
            and sharding.memory_kind in (None, "device")
        ):
            sharding = None
        return (tuple(x.shape), np.dtype(x.dtype), bool(x.weak_type), sharding)
    if isinstance(x, bool | int | float | complex):
        aval = jax.typeof(x)
        return (tuple(aval.shape), np.dtype(aval.dtype), bool(aval.weak_type), None)
    raise _Unsupported(f"an argument leaf of type {type(x).__name__} is not an array")


def _sharding_text(sharding) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        return repr(
            (
                "named",
                tuple(mesh.axis_names),
                tuple(mesh.axis_sizes),
                tuple(str(t) for t in getattr(mesh, "axis_types", ())),
                str(sharding.spec),
                sharding.memory_kind,
            )
        )
    return repr(sharding)


def shardings_text(tree) -> str:
    """A pytree of shardings (or None) as text for a program's ``static`` key."""
    if tree is None:
        return "-"
    leaves, treedef = jax.tree.flatten(tree)
    return repr(treedef) + ":" + ",".join(_sharding_text(s) for s in leaves)


class StoredJit:
    """A ``jax.jit``-like callable (``f(*args)``, ``f.lower(*args)``) whose programs,
    one per abstract signature, come from the program store (module docstring)."""

    def __init__(self, fun, *, store: ProgramStore, name: str, static, jit_kwargs, on_load):
        self._fun = fun
        self._store = store
        self._name = name
        self._static = static
        self._kw = jit_kwargs
        self._on_load = on_load
        self._plain = None  # jax.jit(fun), once a signature needs it
        self._programs: dict[tuple, Any] = {}

    def _plain_jit(self):
        if self._plain is None:
            self._plain = jax.jit(self._fun, **self._kw)
        return self._plain

    def _program(self, args: tuple, *, run: bool = True) -> tuple[Any, tuple]:
        """The program for ``args``, and the arguments to call (``run``) or lower it with."""
        leaves, treedef = jax.tree.flatten(args)
        try:
            sig = (treedef, tuple(_leaf_signature(x) for x in leaves))
        except _Unsupported as e:
            self._store.warn(self._name, str(e))
            return self._plain_jit(), args
        prog = self._programs.get(sig)
        if prog is None:
            prog = self._programs[sig] = self._build(treedef, sig[1])
        if prog is self._plain:
            return prog, args
        return prog, treedef.unflatten(self._committed(leaves, treedef, run=run))

    def _committed(self, leaves: list, treedef, *, run: bool) -> list:
        """``leaves`` with every uncommitted array committed (to the device the
        committed ones are on, else its own).

        A stored program's outputs are always committed (jax commits the results of
        an ``Exported`` call), where a plain jit's stay uncommitted when its inputs
        are. Its next call (and whatever else consumes them) would then see inputs
        change from uncommitted to committed after the first step and compile once
        more; committing every call's inputs keeps a stored program on one
        executable. Donated arrays are moved with ``donate`` (``run``: a call, not a
        ``lower``). A call that mixes in arrays over several devices is left as it is
        (jit places the loose arrays)."""
        arrays = [x for x in leaves if isinstance(x, jax.Array)]
        if all(x.committed for x in arrays):
            return leaves
        placed = {x.sharding for x in arrays if x.committed}
        if len(placed) > 1 or any(len(sh.device_set) > 1 for sh in placed):
            return leaves
        target = next(iter(placed), None)
        donated = set()
        if run:
            start = 0
            for i, child in enumerate(treedef.children()):
                if i in self._kw["donate_argnums"]:
                    donated.update(range(start, start + child.num_leaves))
                start += child.num_leaves
        out = list(leaves)
        for i, x in enumerate(leaves):
            if isinstance(x, jax.Array) and not x.committed:
                sh = target or x.sharding
                if i in donated:
                    out[i] = jax.device_put(x, sh, donate=True)
                else:
                    out[i] = jax.device_put(x, sh, may_alias=True)
        return out

    def _build(self, treedef, leaf_sigs):
        store, name = self._store, self._name
        signature = (
            repr(treedef)
            + "\n"
            + "\n".join(
                f"{shape}:{dtype}:{int(weak)}:{_sharding_text(sh)}"
                for shape, dtype, weak, sh in leaf_sigs
            )
        )
        key_text = store.key_text(name, self._static, signature)
        file = store.file_for(name, key_text)
        try:
            exported = store.load(file, key_text)
        except StoreError as e:
            store.warn(name, str(e))
            return self._plain_jit()
        if exported is not None:
            if self._on_load is not None:
                self._on_load()
        else:
            t0 = time.perf_counter()
            specs = jax.tree.unflatten(
                treedef,
                [
                    jax.ShapeDtypeStruct(shape, dtype, weak_type=weak, sharding=sh)
                    for shape, dtype, weak, sh in leaf_sigs
                ],
            )
            try:
                exported = jax.export.export(jax.jit(self._fun, **self._kw))(*specs)
                store.save(file, key_text, exported)
            except Exception as e:  # export refuses many things; the plain path runs them
                store.warn(name, f"not exported: {type(e).__name__}: {e}")
                return self._plain_jit()
            store.stats.export_seconds += time.perf_counter() - t0
            store.stats.exported += 1
        return jax.jit(_caller(exported, name), **self._kw)

    def __call__(self, *args):
        prog, args = self._program(args)
        return prog(*args)

    def lower(self, *args):
        prog, args = self._program(args, run=False)
        return prog.lower(*args)


def _caller(exported: jax.export.Exported, name: str):
    def call(*args):
        return exported.call(*args)

    call.__name__ = call.__qualname__ = name  # compile events (jax.monitoring) name it
    return call
