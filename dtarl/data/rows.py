"""One dataset row, validated: ``parse_row(record, where, keys) -> Row``.

A row's prompt is a string or a list of chat messages ``{role, content}`` (verl's and
TRL's conversational format); its answer is the reward's ground truth (any JSON value
but null). Keys may be dotted to reach into a nested column (verl's parquet files
keep the ground truth at ``reward_model.ground_truth``). A bad row raises a
``ConfigError`` naming ``file:row``, the key and what is accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dtarl.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)  # compared (and hashed) by identity
class Row:
    """A dataset row as the reward sees it (before rendering and tokenisation).

    prompt: the text, or the chat messages (dicts with at least ``role`` and
    ``content`` strings). answer: the ground truth, as stored. response: the
    reference response (``data.response_key``; the SFT warm-up's target) or None.
    data_source / extra_info: verl's columns of those names ('' / {} when absent).
    record: the whole raw record (TRL hands every column to its reward functions).
    where: ``file:row`` (JSONL: the line number; JSON, Parquet, ``load_from_disk``:
    the 0-based row index, as pyarrow and ``datasets`` count).
    """

    prompt: str | tuple[dict[str, Any], ...]
    answer: Any
    response: str | None = None
    data_source: str = ""
    extra_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    record: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    where: str = ""

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowKeys:
    """Which columns hold what (``data.prompt_key`` etc.); dotted keys reach into
    nested mappings."""

    prompt: str = "prompt"
    answer: str = "answer"
    response: str | None = None


_MISSING = object()


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``, following dots into nested mappings (``_MISSING`` when absent)."""
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _messages(value: list, where: str, key: str) -> tuple[dict[str, Any], ...]:
    if not value:
        raise ConfigError(f"{where}: {key} is an empty list of messages")
    out = []
    for i, m in enumerate(value):
        at = f"{where}: {key}[{i}]"
        if not isinstance(m, Mapping):
            raise ConfigError(f"{at} must be a message {{role, content}}, got {type(m).__name__}")
        for field in ("role", "content"):
            if field not in m:
                raise ConfigError(f"{at} has no '{field}' (a message is {{role, content}})")
            if not isinstance(m[field], str):
                raise ConfigError(f"{at}.{field} must be a string, got {type(m[field]).__name__}")
        if not m["role"]:
            raise ConfigError(f"{at}.role is empty")
        out.append(dict(m))
    if not any(m["content"].strip() for m in out):
        raise ConfigError(f"{where}: {key} has no message with any content")
    return tuple(out)


def parse_row(record: Any, where: str, keys: RowKeys) -> Row:
    """The ``Row`` of one raw record; a bad one is a ``ConfigError`` naming ``where``
    (``file:row``) and the key."""
    if not isinstance(record, Mapping):
        raise ConfigError(
            f"{where}: a row must be an object (a mapping of columns), got {type(record).__name__}"
        )
    prompt = lookup(record, keys.prompt)
    if prompt is _MISSING:
        raise ConfigError(
            f"{where}: no key {keys.prompt!r} (data.prompt_key); the row has keys {sorted(record)}"
        )
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: {keys.prompt} is an empty string")
    elif isinstance(prompt, list | tuple):
        prompt = _messages(list(prompt), where, keys.prompt)
    else:
        raise ConfigError(
            f"{where}: {keys.prompt} must be a string or a list of messages {{role, content}}, "
            f"got {type(prompt).__name__}"
        )
    answer = lookup(record, keys.answer)
    if answer is _MISSING or answer is None:
        what = "no key" if answer is _MISSING else "a null value for"
        raise ConfigError(
            f"{where}: {what} {keys.answer!r} (data.answer_key: the reward's ground truth); "
            f"the row has keys {sorted(record)}"
        )
    if isinstance(answer, str) and not answer.strip():
        raise ConfigError(f"{where}: {keys.answer} is an empty string")
    response = None
    if keys.response is not None:
        response = lookup(record, keys.response)
        if response is _MISSING or not isinstance(response, str) or not response:
            got = "missing" if response is _MISSING else repr(response)[:40]
            raise ConfigError(
                f"{where}: {keys.response} (data.response_key: the SFT reference) must be a "
                f"non-empty string, got {got}"
            )
    source = record.get("data_source", "")
    if source is None:
        source = ""
    if not isinstance(source, str):
        raise ConfigError(f"{where}: data_source must be a string, got {type(source).__name__}")
    extra = record.get("extra_info", None)
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{where}: extra_info must be a mapping, got {type(extra).__name__}")
    return Row(
        prompt=prompt,
        answer=answer,
        response=response,
        data_source=source,
        extra_info=dict(extra),
        record=dict(record),
        where=where,
    )


__all__ = ["Row", "RowKeys", "lookup", "parse_row"]
