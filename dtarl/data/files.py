"""Dataset files -> raw records with their ``file:row``: JSONL, JSON, Parquet, a
directory of them, or a ``datasets.Dataset.save_to_disk`` folder.

    expand(paths, key)           -> the files, in order (a directory: its data files, sorted)
    read_records(path)           -> [(where, record)], where = "file:row"

JSONL rows are numbered by line (1-based, as editors show them; blank lines are not
rows); a JSON file holds a list of objects (or is JSON Lines, as ``datasets``'
``to_json`` writes it); Parquet and ``load_from_disk`` rows by their 0-based index.
Parquet is read with pyarrow, ``load_from_disk`` folders with ``datasets`` (the
``data`` extra). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from dtarl.errors import ConfigError

SUFFIXES = (".jsonl", ".json", ".parquet")
# The files ``datasets.Dataset.save_to_disk`` writes beside its arrow shards.
_SAVED_DATASET = ("dataset_info.json", "state.json")


def _is_saved_dataset(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _SAVED_DATASET)


def expand(paths: Sequence[str], key: str) -> list[str]:
    """The data files (or ``load_from_disk`` folders) that ``paths`` name, in order;
    a missing path, an unknown suffix or a directory without data files is a
    ``ConfigError`` naming ``key``."""
    out: list[str] = []
    for i, p in enumerate(paths):
        at = f"{key}[{i}]={p!r}" if len(paths) > 1 else f"{key}={p!r}"
        if os.path.isdir(p):
            if _is_saved_dataset(p) or os.path.isfile(os.path.join(p, "dataset_dict.json")):
                out.append(p)
                continue
            found = sorted(
                os.path.join(root, f)
                for root, _, files in os.walk(p)
                for f in files
                if f.endswith(SUFFIXES)
            )
            if not found:
                raise ConfigError(
                    f"{at}: the directory has no data files (accepted: {', '.join(SUFFIXES)}, "
                    "or a datasets.save_to_disk folder)"
                )
            out.extend(found)
        elif os.path.isfile(p):
            if not p.endswith(SUFFIXES):
                raise ConfigError(
                    f"{at}: unknown file type; accepted: {', '.join(SUFFIXES)}, a directory of "
                    "them, or a datasets.save_to_disk folder"
                )
            out.append(p)
        else:
            raise ConfigError(f"{at}: no such file or directory")
    return out


def _jsonl(path: str, text: str, first_line: int = 1) -> list[tuple[str, Any]]:
    out = []
    for n, line in enumerate(text.splitlines(), start=first_line):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
    return out


def _json(path: str, text: str) -> list[tuple[str, Any]]:
    if not text.lstrip().startswith("["):
        return _jsonl(path, text)  # JSON Lines in a .json file (datasets' to_json)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
    return [(f"{path}:row {i}", r) for i, r in enumerate(data)]


def _parquet(path: str) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise ConfigError(f"{path}: cannot be read as Parquet ({e})") from None
    return [(f"{path}:row {i}", r) for i, r in enumerate(table.to_pylist())]


def _saved_dataset(path: str) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path} is a datasets.save_to_disk folder: reading it needs the `datasets` "
            "package (pip install 'dtarl[data]'), or export it with to_json / to_parquet"
        ) from None
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise ConfigError(
            f"{path} holds a DatasetDict (splits {splits}); name one split's folder, e.g. "
            f"{os.path.join(path, splits[0] if splits else 'train')}"
        )
    ds = datasets.load_from_disk(path)
    return [(f"{path}:row {i}", r) for i, r in enumerate(ds)]


def read_records(path: str) -> list[tuple[str, Any]]:
    """``[(where, record)]`` of one data file or ``load_from_disk`` folder."""
    if os.path.isdir(path):
        return _saved_dataset(path)
    if path.endswith(".parquet"):
        return _parquet(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); expected JSON") from None
    return _json(path, text) if path.endswith(".json") else _jsonl(path, text)


__all__ = ["SUFFIXES", "expand", "read_records"]
