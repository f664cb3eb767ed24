"""The program store's file format: JSON metadata and the StableHLO bytes, no pickle.

A ``.program`` file is::

    MAGIC                                  b"dtarl-program-v2\\n"
    8 bytes, big-endian                    length of the header
    header (UTF-8 JSON)                    {"key": ..., "module_sha256": ..., "module_size": ...,
                                            "exported": {...}}
    the serialized StableHLO module        ``Exported.mlir_module_serialized``, as it is

``decode`` reads the header with ``json`` (data only), compares the stored key with
the expected one and the module's size and SHA-256 with the header *before*
anything else is decoded; a mismatch is a ``StoreError`` (the caller warns and
runs the plain ``jax.jit`` path). The ``Exported``'s other fields are rebuilt from
plain data: avals (shape, dtype, weak type, named sharding over an abstract mesh),
HLO shardings (their ``OpSharding`` proto bytes) and the input/output tree
structures, whose node types are looked up among modules already imported (never
imported by name from a file) and must be types jax can rebuild a tree from. A
program whose fields do not fit this format (effects, aux data that is not plain
data, ...) raises ``Unsupported`` on ``encode`` and is not stored.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
from typing import Any

import jax
import numpy as np
from jax._src import core
from jax._src import mesh as mesh_lib
from jax._src.lib import xla_client as xc
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

MAGIC = b"dtarl-program-v2\n"
_LEN = struct.Struct(">Q")


class StoreError(Exception):
    """A store file that cannot be used (unreadable, foreign, another key, corrupt)."""


class Unsupported(Exception):
    """A program whose ``Exported`` this format cannot hold."""


# ------------------------------------------------------------------ plain data


def _plain(x) -> Any:
    """Typed JSON of a tree node's aux data: None, bool, int, float, str, tuple, list, dict."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return {"float": repr(x)}
    if isinstance(x, tuple):
        return {"tuple": [_plain(v) for v in x]}
    if isinstance(x, list):
        return {"list": [_plain(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[_plain(k), _plain(v)] for k, v in x.items()]}
    raise Unsupported(f"tree aux data of type {type(x).__name__} is not plain data")


def _unplain(x) -> Any:
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, dict) and len(x) == 1:
        ((kind, v),) = x.items()
        if kind == "float":
            return float(v)
        if kind == "tuple":
            return tuple(_unplain(e) for e in v)
        if kind == "list":
            return [_unplain(e) for e in v]
        if kind == "dict":
            return {_unplain(k): _unplain(e) for k, e in v}
    raise StoreError(f"malformed aux data {x!r}")


# ---------------------------------------------------------------------- trees


def _type_name(t: type) -> str:
    return f"{t.__module__}:{t.__qualname__}"


def _type(name: str) -> type:
    """A node type by name, from modules already imported (a file never imports one)."""
    if name == "builtins:NoneType":
        return type(None)
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise StoreError(f"tree node type {name!r} is not a loaded type")
    return obj


def _tree(treedef) -> Any:
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "*"
    node_type, aux = treedef.node_data()
    return {
        "type": _type_name(node_type),
        "aux": _plain(aux),
        "children": [_tree(c) for c in treedef.children()],
    }


_LEAF = jax.tree.structure(0)


def _untree(x) -> Any:
    if x == "*":
        return _LEAF
    if not isinstance(x, dict):
        raise StoreError(f"malformed tree {x!r}")
    children = [_untree(c) for c in x["children"]]
    node = (_type(x["type"]), _unplain(x["aux"]))
    try:
        return jax.tree_util.PyTreeDef.from_node_data_and_children(
            jax.tree_util.default_registry, node, children
        )
    except Exception as e:
        raise StoreError(f"tree node {x['type']!r} cannot be rebuilt ({e})") from None


# ---------------------------------------------------------- shardings, avals


def _mesh(m) -> dict:
    d = m.abstract_device
    return {
        "sizes": list(m.axis_sizes),
        "names": list(m.axis_names),
        "types": [t.name for t in m.axis_types],
        "device": None if d is None else [d.device_kind, d.num_cores, d.platform],
    }


def _unmesh(x) -> AbstractMesh:
    types = tuple(getattr(jax.sharding.AxisType, t) for t in x["types"])
    device = None if x["device"] is None else mesh_lib.AbstractDevice(*x["device"])
    return AbstractMesh(
        tuple(x["sizes"]), tuple(x["names"]), axis_types=types, abstract_device=device
    )


def _named(s) -> dict | None:
    if s is None:
        return None
    if not isinstance(s, NamedSharding) or not isinstance(s.mesh, AbstractMesh):
        raise Unsupported(f"sharding {s!r}")
    if s.spec.unreduced or s.spec.reduced:
        raise Unsupported(f"partition spec {s.spec!r}")
    spec = [list(e) if isinstance(e, tuple) else e for e in s.spec]
    return {"mesh": _mesh(s.mesh), "spec": spec, "memory_kind": s.memory_kind}


def _unnamed(x) -> NamedSharding | None:
    if x is None:
        return None
    spec = PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in x["spec"]))
    return NamedSharding(_unmesh(x["mesh"]), spec, memory_kind=x["memory_kind"])


def _aval(a) -> dict:
    if getattr(a, "vma", None) or str(getattr(a, "memory_space", "Device")).split(".")[-1] != (
        "Device"
    ):
        raise Unsupported(f"aval {a!r}")
    sh = getattr(a, "sharding", None)
    named = None if sh is None or sh.mesh.empty else _named(sh)
    return {
        "shape": [int(d) for d in a.shape],
        "dtype": np.dtype(a.dtype).name if a.dtype != jax.dtypes.float0 else "float0",
        "weak": bool(a.weak_type),
        "sharding": named,
    }


def _unaval(x) -> core.ShapedArray:
    dtype = jax.numpy.dtype(x["dtype"])
    kw = {} if x["sharding"] is None else {"sharding": _unnamed(x["sharding"])}
    return core.ShapedArray(tuple(x["shape"]), dtype, weak_type=x["weak"], **kw)


def _hlo(s) -> str | None:
    if s is None:
        return None
    return base64.b64encode(s.to_proto().SerializeToString()).decode()


def _unhlo(x) -> Any:
    if x is None:
        return None
    proto = xc.OpSharding()
    proto.ParseFromString(base64.b64decode(x))
    return xc.HloSharding.from_proto(proto)


# --------------------------------------------------------------------- files


def encode(exported: jax.export.Exported, key_text: str) -> bytes:
    """The file content for ``exported`` under ``key_text``; ``Unsupported`` when the
    program does not fit the format."""
    e = exported
    if e.ordered_effects or e.unordered_effects:
        raise Unsupported(f"the program has effects {e.ordered_effects or e.unordered_effects}")
    if e.disabled_safety_checks:
        raise Unsupported(f"disabled safety checks {e.disabled_safety_checks}")
    meta = {
        "fun_name": e.fun_name,
        "in_tree": _tree(e.in_tree),
        "out_tree": _tree(e.out_tree),
        "in_avals": [_aval(a) for a in e.in_avals],
        "out_avals": [_aval(a) for a in e.out_avals],
        "has_named_shardings": bool(e._has_named_shardings),
        "in_named_shardings": [_named(s) for s in e._in_named_shardings or ()],
        "out_named_shardings": [_named(s) for s in e._out_named_shardings or ()],
        "in_shardings_hlo": [_hlo(s) for s in e.in_shardings_hlo],
        "out_shardings_hlo": [_hlo(s) for s in e.out_shardings_hlo],
        "nr_devices": int(e.nr_devices),
        "platforms": list(e.platforms),
        "calling_convention_version": int(e.calling_convention_version),
        "module_kept_var_idx": [int(i) for i in e.module_kept_var_idx],
        "uses_global_constants": bool(e.uses_global_constants),
    }
    module = bytes(e.mlir_module_serialized)
    header = json.dumps(
        {
            "key": key_text,
            "module_sha256": hashlib.sha256(module).hexdigest(),
            "module_size": len(module),
            "exported": meta,
        }
    ).encode()
    return MAGIC + _LEN.pack(len(header)) + header + module


def decode(data: bytes, key_text: str, where: str) -> jax.export.Exported:
    """The ``Exported`` in ``data``; ``StoreError`` (naming ``where``) when the key, the
    size or the checksum does not match, or the file is not a dtarl program file."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise StoreError(f"{where} is not a dtarl program file")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(data[start : start + n].decode())
        stored_key = header["key"]
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{where}: malformed header ({e})") from None
    if stored_key != key_text:
        raise StoreError(f"{where} holds another program (key mismatch)")
    module = data[start + n :]
    if len(module) != header.get("module_size") or (
        hashlib.sha256(module).hexdigest() != header.get("module_sha256")
    ):
        raise StoreError(f"{where}: the program does not match its checksum (corrupt)")
    try:
        m = header["exported"]
        return jax.export.Exported(
            fun_name=m["fun_name"],
            in_tree=_untree(m["in_tree"]),
            in_avals=tuple(_unaval(a) for a in m["in_avals"]),
            out_tree=_untree(m["out_tree"]),
            out_avals=tuple(_unaval(a) for a in m["out_avals"]),
            _has_named_shardings=m["has_named_shardings"],
            _in_named_shardings=tuple(_unnamed(s) for s in m["in_named_shardings"]),
            _out_named_shardings=tuple(_unnamed(s) for s in m["out_named_shardings"]),
            in_shardings_hlo=tuple(_unhlo(s) for s in m["in_shardings_hlo"]),
            out_shardings_hlo=tuple(_unhlo(s) for s in m["out_shardings_hlo"]),
            nr_devices=m["nr_devices"],
            platforms=tuple(m["platforms"]),
            ordered_effects=(),
            unordered_effects=(),
            disabled_safety_checks=(),
            mlir_module_serialized=module,
            calling_convention_version=m["calling_convention_version"],
            module_kept_var_idx=tuple(m["module_kept_var_idx"]),
            uses_global_constants=m["uses_global_constants"],
            _get_vjp=None,
        )
    except StoreError:
        raise
    except Exception as e:  # malformed metadata: a foreign or damaged file
        raise StoreError(f"{where}: cannot be decoded ({type(e).__name__}: {e})") from None


__all__ = ["MAGIC", "StoreError", "Unsupported", "decode", "encode"]
