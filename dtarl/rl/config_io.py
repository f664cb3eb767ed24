"""Configs <-> YAML / nested dicts: the parsing behind ``dtarl.rl.config.load_config``.

``from_dict(cls, data)`` builds any config dataclass from nested dicts (unknown keys
list the valid ones, values are converted to the field's type and named on error),
``to_dict`` is its inverse (JSON/YAML-able), ``apply_override`` applies one
``--set a.b=value`` and ``read_yaml`` reads a config file (YAML 1.2 floats).
"""

from __future__ import annotations

import dataclasses
import enum
import keyword
import math
import os
import types
import typing
from typing import Any

import yaml

from dtarl import yamlconf
from dtarl.errors import ConfigError


def _yaml_load(stream):
    return yamlconf.load(stream)  # YAML 1.2 floats; a duplicate key is an error


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A one-line description of a YAML error (PyYAML's own spans several lines)."""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    text = ", ".join(p for p in parts if p) or str(e)
    return " ".join(text.split())


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, list | tuple):  # ``str | tuple[str, ...]``: a list is the tuple
            args = [a for a in args if typing.get_origin(a) is tuple] or args
        return _convert(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, bool) and "enabled" in {f.name for f in dataclasses.fields(tp)}:
            value = {"enabled": value}  # ``resume: false`` = ``resume: {enabled: false}``
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(
                f"{where}={value!r} is not valid; accepted: {[e.value for e in tp]}"
            ) from None
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}={value!r} must be a list")
        (item, *rest) = typing.get_args(tp) or (Any,)
        if rest and rest != [Ellipsis]:
            raise ConfigError(f"{where}: fixed-length tuples are not supported")
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}={value!r} must be a number")
        if not math.isfinite(value):  # .inf, 1e400, .nan
            raise ConfigError(f"{where}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    return value


def _field_name(key: str, fields) -> str:
    """A YAML key that is a Python keyword (``lambda``) names the field ``lambda_``."""
    return key + "_" if keyword.iskeyword(key) and key + "_" in fields else key


def _yaml_key(name: str) -> str:
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def from_dict(cls, data: dict[str, Any], where: str = ""):
    """Builds dataclass ``cls`` from nested dicts; unknown keys list the valid ones."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = {_field_name(k, fields): v for k, v in data.items()}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        section = where or "config"
        raise ConfigError(f"{section}: unknown keys {unknown}; valid keys: {sorted(fields)}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(hints[k], v, f"{where}.{k}" if where else k)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        # The engine configs' own errors already start with their key.
        msg = str(e)
        raise ConfigError(
            msg if where and msg.startswith(where) else f"{where or 'config'}: {msg}"
        ) from None


def check_finite(obj, prefix: str = "") -> None:
    """Raises ``ConfigError`` naming the first float key (dotted) holding inf or nan."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{_yaml_key(f.name)}"
        if dataclasses.is_dataclass(v):
            check_finite(v, key + ".")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}={v!r} must be a finite number")


def to_dict(obj) -> dict[str, Any]:
    """Plain YAML/JSON-able dict of a config (enums as their values, tuples as lists);
    ``from_dict(type(obj), to_dict(obj)) == obj``."""
    return {_yaml_key(f.name): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(v):
    if dataclasses.is_dataclass(v):
        return to_dict(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    return v


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Applies ``a.b.c=value`` (value parsed as YAML) to nested dict ``data`` in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. rollout.group_size=8")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: malformed key {key!r}")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {assignment!r}: value is not valid YAML ({_yaml_problem(e)}); "
            "quote it, e.g. --set \"task.ops='+-*'\""
        ) from None
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if isinstance(child, bool):  # ``resume: false`` then ``--set resume.allow_changes=..``
            child = node[p] = {"enabled": child}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The sections of config file ``path`` (empty for an empty file); a missing file or
    malformed YAML raises ``ConfigError`` naming ``path`` (and the line)."""
    p = os.fspath(path)
    try:
        with open(p) as f:
            loaded = _yaml_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, not a YAML config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p}: not a text file (byte {e.start} is not UTF-8); expected a YAML config"
        ) from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}{line}: malformed YAML ({_yaml_problem(e)})") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return loaded or {}


__all__ = ["apply_override", "check_finite", "from_dict", "read_yaml", "to_dict"]
