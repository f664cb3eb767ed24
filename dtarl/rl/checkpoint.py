"""Training checkpoints on Orbax's ``CheckpointManager``: named, sharded, async.

Layout under ``directory`` (Orbax's own)::

    step_00000010/                        a committed checkpoint
      state/                              the pytree (Orbax PyTree/OCDBT), leaves named
                                          by their paths: params/layers/self_attn/q_proj,
                                          opt_state/0/mu/embed_tokens, ...
      meta/metadata                       JSON: step, layout, fingerprint, user data (a
                                          trainer's: its host record, ``contents``)
    step_00000012.orbax-checkpoint-tmp/   a save in progress, or one a crash interrupted
    .deleted/                             steps dropped by keep-N, being deleted

Saves are asynchronous: ``save`` returns once the arrays are copied off the
devices; a background thread writes them and then commits the step by renaming
its temporary directory (atomic on POSIX). A crash (even ``kill -9``) mid-save
leaves only the ``.orbax-checkpoint-tmp`` directory, which ``steps`` never
lists and the next save removes. Steps beyond ``keep`` are first renamed
into ``.deleted/`` and only then deleted, so a crash mid-delete never leaves a
half-deleted step in the listing either. ``wait`` blocks until the pending save is
committed; ``restore`` and ``save`` wait for it first.

Every process writes its own shards of the (possibly multi-process, sharded)
``jax.Array`` leaves; nothing is gathered to one host. ``restore(step, target)``
reads the arrays into ``target``'s structure and shardings (any mesh: a
checkpoint saved at dp=4, tp=2 restores at dp=8 or on one device), after
checking the saved leaves' names, shapes and dtypes against the target.

A trainer saves its whole state in one step (``save_state`` / ``restore_state``):
the ``TrainState`` pytree (``dtarl.rl.state``) as ``state`` (leaves ``params/...``,
``opt_state/...``, ``ref_params/...``, ``value_params/...``, ``value_opt_state/...``,
``step``, ``key``) and its ``HostRecord`` fields as ``meta`` (with ``contents`` =
``TRAIN_STATE``), so one commit covers both. A trainer checkpoint of an earlier
dtarl (no ``contents``) is refused by ``read_host``, naming its path.

Leaf names come from ``jax.tree_util`` key paths: dict keys and sequence indices
as written, NamedTuple fields (optax states) by name, and an ``nnx.Variable``'s
``value`` attribute dropped (``params/norm/weight``, not ``.../weight/value``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dtarl.errors import CheckpointError
from dtarl.rl import integrity

LAYOUT = "dtarl-orbax-1"
# A trainer's step: the TrainState pytree as ``state``, the host record as ``meta``.
TRAIN_STATE = "dtarl-train-state-1"
_STATE, _META = "state", "meta"
_STEP_RE = re.compile(r"^step_(\d{8})$")
# A leaf of a decoder saved with one parameter per layer (before the layers were stacked).
_UNSTACKED = re.compile(r"(^|/)layers/\d+/")
_TRASH = ".deleted"  # Orbax renames dropped steps here (atomic); dtarl empties it


# ------------------------------------------------------------------ leaf names


def _key_name(key) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _path_name(path) -> str:
    keys = list(path)
    # An nnx.Variable flattens to its ``value`` attribute: name the variable.
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
        keys = keys[:-1]
    return "/".join(_key_name(k) for k in keys)


def leaf_names(tree) -> list[str]:
    """The '/'-joined key path of every leaf of ``tree`` (in ``jax.tree.leaves`` order).

    Raises CheckpointError when two leaves get the same name or a name cannot be
    stored (empty, or a component holding '.', Orbax's own separator).
    """
    names = [_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    seen: set[str] = set()
    for name in names:
        parts = name.split("/")
        if not name or any(not p or "." in p for p in parts):
            raise CheckpointError(
                f"leaf {name!r}: cannot be stored as a checkpoint name (empty component "
                "or '.' in a key); rename the key"
            )
        if name in seen:
            raise CheckpointError(f"leaf {name!r}: two leaves of the tree map to this name")
        seen.add(name)
    return names


def _nest(names: list[str], leaves: list) -> dict:
    """{'a/b/c': x} -> {'a': {'b': {'c': x}}}; a name that is a prefix of another is an error."""
    out: dict = {}
    for name, leaf in zip(names, leaves, strict=True):
        node = out
        parts = name.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"leaf {name!r}: a prefix of it is itself a leaf")
        if parts[-1] in node:
            raise CheckpointError(f"leaf {name!r}: it is also a prefix of another leaf")
        node[parts[-1]] = leaf
    return out


def _lookup(nested: dict, name: str):
    node = nested
    for p in name.split("/"):
        node = node[p]
    return node


def _shape_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return tuple(int(d) for d in np.shape(x)), np.dtype(dtype)


def _fingerprint(names: list[str], leaves: list) -> list[list]:
    sds = map(_shape_dtype, leaves)
    return [[n, list(s), str(d)] for n, (s, d) in zip(names, sds, strict=True)]


def _abstract(x):
    """What Orbax restores a target leaf as: its shape, dtype and sharding."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return np.zeros(*_shape_dtype(x))  # host leaves restore as numpy arrays


# --------------------------------------------------------------------- manager


class CheckpointManager:
    """Saves and restores ``(pytree, meta)`` pairs by step; keeps the ``keep`` most
    recently saved steps (Orbax's ``max_to_keep``).

    A thin layer over ``orbax.checkpoint.CheckpointManager`` (async saves,
    ``max_to_keep=keep``) with two items per step: ``state`` (the pytree, leaves
    named by path) and ``meta`` (JSON). Every process of a multi-process run must
    make the same calls (Orbax synchronizes them).
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 2, on_corrupt: str = "previous"
    ):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep
        self._mgr: ocp.CheckpointManager | None = None
        self._pending: int | None = None  # the step of the last save not yet waited for
        self._integrity = integrity.StepVerifier(on_corrupt)  # manifests (dtarl.rl.integrity)

    def _manager(self) -> ocp.CheckpointManager:
        """The Orbax manager, made on the first save (reads do not need it)."""
        if self._mgr is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                enable_async_checkpointing=True,
                step_prefix="step",
                step_format_fixed_length=8,
                cleanup_tmp_directories=True,
                todelete_subdir=_TRASH,
                create=True,
            )
            try:
                self._mgr = ocp.CheckpointManager(
                    self.directory, options=options, item_names=(_STATE, _META)
                )
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.directory}: cannot open checkpoints ({e})") from e
            self._empty_trash()
        return self._mgr

    def _empty_trash(self) -> None:
        """Deletes the steps Orbax dropped (keep-N, replaced steps). They were renamed
        out of the listing first, so a crash mid-delete never leaves a partial step."""
        trash = os.path.join(self.directory, _TRASH)
        if jax.process_index() == 0 and os.path.isdir(trash):
            shutil.rmtree(trash, ignore_errors=True)

    # -------------------------------------------------------------- listing

    def steps(self) -> list[int]:
        """Committed steps, ascending (in-progress and interrupted saves are not listed)."""
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            m = _STEP_RE.match(name)
            if m and os.path.isdir(os.path.join(self.directory, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        """The newest committed step whose files match its manifest (``integrity``)."""
        return self._integrity.latest(self.steps(), self.path)

    def _last_good(self) -> int | None:
        """``latest_step`` for error messages: None instead of raising."""
        try:
            return self.latest_step()
        except CheckpointError:
            return None

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    # ---------------------------------------------------------------- write

    def save(self, step: int, tree, meta: dict[str, Any] | None = None) -> str:
        """Starts writing checkpoint ``step`` (async) and returns its path.

        Returns once the arrays are copied off the devices; ``wait()`` blocks until
        the step is committed. Re-saving an existing step replaces it.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"{self.directory}: step={step!r} must be an int >= 0")
        step = int(step)
        final = self.path(step)
        leaves = jax.tree.leaves(tree)
        names = leaf_names(tree)
        bad = integrity.nonfinite_leaf(names, leaves)
        if bad is not None:
            raise CheckpointError(f"{final}: leaf {bad!r} holds NaN or inf; not saved")
        full_meta = dict(meta or {})
        full_meta.update(step=step, layout=LAYOUT, fingerprint=_fingerprint(names, leaves))
        try:
            json.dumps(full_meta)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{final}: metadata is not JSON-serializable ({e})") from None
        self.wait()
        mgr = self._manager()
        self._integrity.pending = (final, step, full_meta.get("config"))
        try:
            mgr.reload()
            if step in mgr.all_steps():
                mgr.delete(step)
            saved = mgr.save(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardSave(_nest(names, leaves)),
                        _META: ocp.args.JsonSave(full_meta),
                    }
                ),
                force=True,
            )
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{final}: checkpoint write failed ({e}); the previous checkpoint "
                f"(step {self._last_good()}) is still valid"
            ) from e
        if not saved:
            raise CheckpointError(f"{final}: Orbax declined to save step {step}")
        self._pending = step
        self._integrity.watch(mgr.wait_until_finished)  # writes the manifest once committed
        return final

    def save_state(self, state, host: dict[str, Any]) -> str:
        """Starts writing a trainer's step ``state.step``: the ``TrainState`` ``state``
        (named leaves) and its host record ``host`` (JSON), committed together."""
        return self.save(int(state.step), state, {**host, "contents": TRAIN_STATE})

    def wait(self) -> None:
        """Blocks until the pending async save is committed (no-op when none is)."""
        if self._mgr is None or self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._integrity.join()
            self._mgr.wait_until_finished()
        except Exception as e:
            raise CheckpointError(
                f"{self.path(step)}: checkpoint write failed ({e}); the previous checkpoint "
                f"(step {self._last_good()}) is still valid"
            ) from e
        if not os.path.isdir(self.path(step)):
            raise CheckpointError(
                f"{self.path(step)}: the save of step {step} was not committed (see the log); "
                f"the previous checkpoint (step {self._last_good()}) is still valid"
            )
        self._integrity.committed()
        self._empty_trash()

    def close(self) -> None:
        """Waits for the pending save and releases Orbax's threads."""
        try:
            self.wait()
        finally:
            if self._mgr is not None:
                self._mgr.close()
                self._mgr = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- read

    def _check_layout(self, step: int) -> None:
        p = self.path(step)
        if not os.path.isdir(p):
            raise CheckpointError(f"{p}: no checkpoint at step {step} (have {self.steps()})")
        if os.path.isfile(os.path.join(p, "meta.json")) and not os.path.isdir(
            os.path.join(p, _META)
        ):
            raise CheckpointError(
                f"{p}: checkpoint in the old layout (state/ with leaves '0', '1', ... and "
                "meta.json) written by an earlier dtarl; this version reads only the "
                f"{LAYOUT} layout (named leaves, meta/): retrain, or restore it with the "
                "dtarl version that wrote it"
            )
        if not os.path.isdir(os.path.join(p, _STATE)) or not os.path.isdir(os.path.join(p, _META)):
            raise CheckpointError(f"{p}: not a dtarl checkpoint (no {_STATE}/ and {_META}/ items)")

    def read_meta(self, step: int) -> dict[str, Any]:
        self.wait()
        self._check_layout(step)
        fp = os.path.join(self.path(step), _META, "metadata")
        try:
            with open(fp) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{fp}: cannot read checkpoint metadata ({e})") from None
        if not isinstance(meta, dict) or meta.get("layout") != LAYOUT:
            raise CheckpointError(f"{fp}: not {LAYOUT} metadata")
        return meta

    def read_host(self, step: int) -> dict[str, Any]:
        """The host record of trainer checkpoint ``step`` (``save_state``); a checkpoint
        of an earlier dtarl trainer is refused with its path."""
        meta = self.read_meta(step)
        if meta.get("contents") != TRAIN_STATE:
            raise CheckpointError(
                f"{self.path(step)}: trainer checkpoint in an old layout (no {TRAIN_STATE} "
                "train state); this dtarl resumes only checkpoints it wrote: use a fresh "
                "out_dir, or the dtarl version that wrote it"
            )
        return {k: v for k, v in meta.items() if k not in ("contents", "fingerprint", "layout")}

    def restore_state(self, step: int, target) -> tuple[Any, dict[str, Any]]:
        """(``TrainState`` shaped and sharded like ``target``, host record) of trainer
        checkpoint ``step`` (``save_state``)."""
        host = self.read_host(step)
        state, _ = self.restore(step, target)
        return state, host

    def restore(self, step: int, target) -> tuple[Any, dict[str, Any]]:
        """Returns (tree with ``target``'s structure and shardings, meta) of checkpoint ``step``.

        ``target``'s leaves may be arrays (``jax.Array``: restored with its
        sharding; numpy: restored on the host) or ``jax.ShapeDtypeStruct`` with a
        sharding.
        """
        self.wait()
        self._check_layout(step)
        self._integrity.check(self.path(step))
        meta = self.read_meta(step)
        leaves, treedef = jax.tree.flatten(target)
        names = leaf_names(target)
        self._check_fingerprint(step, meta.get("fingerprint"), _fingerprint(names, leaves))
        abstract = _nest(names, [_abstract(x) for x in leaves])
        # A plain (synchronous) checkpointer on the committed item: unlike opening
        # Orbax's manager, reading never touches the directory (no tmp cleanup that
        # could remove the in-flight save of a run writing there).
        reader = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        try:
            out = reader.restore(
                os.path.join(self.path(step), _STATE), args=ocp.args.StandardRestore(abstract)
            )
        except Exception as e:
            raise CheckpointError(f"{self.path(step)}: cannot restore ({e})") from e
        finally:
            reader.close()
        restored = [_lookup(out, n) for n in names]
        return jax.tree.unflatten(treedef, restored), meta

    def _check_fingerprint(self, step: int, saved, want: list[list]) -> None:
        if saved == want:
            return
        saved = saved or []
        have = {n: (s, d) for n, s, d in saved}
        need = {n: (s, d) for n, s, d in want}
        missing = [n for n in need if n not in have]
        extra = [n for n in have if n not in need]
        differ = [
            f"{n}: saved {tuple(s)} {d}, expected {tuple(need[n][0])} {need[n][1]}"
            for n, (s, d) in have.items()
            if n in need and (s, d) != need[n]
        ]
        what = []
        if missing:
            what.append(f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if extra:
            what.append(f"not expected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        what += differ[:3]
        if any(_UNSTACKED.search(n) for n in have) and not any(_UNSTACKED.search(n) for n in need):
            raise CheckpointError(
                f"{self.path(step)}: saved by a dtarl whose decoder layers were separate "
                "parameters (leaves like params/layers/0/...); the decoder now stacks them "
                "into one [L, ...] parameter each (params/layers/...), and such a checkpoint "
                "is not converted: resume it with that dtarl, or export it to HF "
                "safetensors there (dtarl export) and load that with model.hf_path"
            )
        raise CheckpointError(
            f"{self.path(step)}: saved state does not match the model/optimizer built from "
            f"the config ({len(saved)} saved leaves vs {len(want)} expected; "
            f"{'; '.join(what) or 'different leaf order'}); use a fresh out_dir or the same config"
        )


__all__ = ["LAYOUT", "TRAIN_STATE", "CheckpointError", "CheckpointManager", "leaf_names"]
