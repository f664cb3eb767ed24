"""Tokenizers: a ``Tokenizer`` protocol, the built-in ``ByteTokenizer`` and ``load_tokenizer``.

``load_tokenizer`` reads a local ``tokenizer.json`` with the ``tokenizers``
library; nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol, runtime_checkable


class TokenizerError(ValueError):
    """Bad tokenizer input or files; the message names the file/field/token."""


@runtime_checkable
class Tokenizer(Protocol):
    """What rollouts and training need from a tokenizer.

    ``encode`` adds no special tokens; ``decode`` drops pad/bos/eos (and, for
    ``tokenizers``-backed ones, every special token) unless ``skip_special=False``.
    """

    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: vocab 256, id == byte value.

    Bytes 0x00, 0x01, 0x02 double as the special ids ``pad_id = 0``,
    ``bos_id = 1``, ``eos_id = 2``. To keep encoding unambiguous, ``encode``
    rejects text containing the characters U+0000, U+0001 or U+0002 (NUL, SOH,
    STX) with a ``TokenizerError``; every other string round-trips exactly.
    ``decode`` drops the special ids (``skip_special=True``, the default) and
    replaces invalid UTF-8 (e.g. from a sampled byte sequence) with U+FFFD.
    """

    vocab_size = 256
    pad_id = 0
    bos_id = 1
    eos_id = 2
    special_ids = (0, 1, 2)

    def encode(self, text: str) -> list[int]:
        for ch in ("\x00", "\x01", "\x02"):
            at = text.find(ch)
            if at >= 0:
                raise TokenizerError(
                    f"text contains U+{ord(ch):04X} at character {at}; ByteTokenizer reserves "
                    "bytes 0x00-0x02 as pad/bos/eos ids. Remove or replace these characters"
                )
        return list(text.encode("utf-8"))

    def decode(self, ids, *, skip_special: bool = True) -> str:
        out = bytearray()
        for i, t in enumerate(ids):
            t = int(t)
            if not 0 <= t < 256:
                raise TokenizerError(f"ids[{i}]={t} is out of range for ByteTokenizer [0, 256)")
            if skip_special and t in self.special_ids:
                continue
            out.append(t)
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with its special ids (see ``load_tokenizer``)."""

    def __init__(self, tok, *, eos_id: int, pad_id: int, bos_id: int | None):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.bos_id = bos_id

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _read_json(fp: str) -> dict[str, Any]:
    if not os.path.exists(fp):
        return {}
    try:
        with open(fp) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{fp}:{e.lineno}: malformed JSON ({e.msg})") from None


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """Loads a local HF tokenizer: a directory with ``tokenizer.json``, or that file.

    Special ids, first found wins:

    - ``tokenizer_config.json``: ``eos_token`` / ``pad_token`` / ``bos_token``
      (a string or ``{"content": ...}``), looked up in the vocabulary;
    - ``generation_config.json`` then ``config.json``: ``eos_token_id`` (the
      first one if a list), ``pad_token_id``, ``bos_token_id``.

    An eos id is required; pad defaults to eos; bos may be None.
    """
    from tokenizers import Tokenizer as _Tok

    path = os.fspath(path)
    if os.path.isdir(path):
        directory, tok_file = path, os.path.join(path, "tokenizer.json")
    else:
        directory, tok_file = os.path.dirname(path), path
    if not os.path.isfile(tok_file):
        raise TokenizerError(
            f"{tok_file}: no such file; load_tokenizer needs a local tokenizer.json "
            "(a 'fast' tokenizer; slow sentencepiece/vocab-only tokenizers are not supported)"
        )
    try:
        tok = _Tok.from_file(tok_file)
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise TokenizerError(f"{tok_file}: cannot be parsed by `tokenizers` ({e})") from None

    tcfg_path = os.path.join(directory, "tokenizer_config.json")
    tcfg = _read_json(tcfg_path)
    configs = [
        (fp, _read_json(fp))
        for fp in (
            os.path.join(directory, "generation_config.json"),
            os.path.join(directory, "config.json"),
        )
    ]

    def special(kind: str) -> int | None:
        tok_str = tcfg.get(f"{kind}_token")
        if isinstance(tok_str, dict):
            tok_str = tok_str.get("content")
        if isinstance(tok_str, str):
            tid = tok.token_to_id(tok_str)
            if tid is None:
                raise TokenizerError(
                    f"{tcfg_path}: {kind}_token={tok_str!r} is not in the vocabulary of {tok_file}"
                )
            return tid
        for fp, cfg in configs:
            tid = cfg.get(f"{kind}_token_id")
            if isinstance(tid, list):
                tid = tid[0] if tid else None
            if tid is not None:
                if not isinstance(tid, int) or not 0 <= tid < tok.get_vocab_size(True):
                    raise TokenizerError(
                        f"{fp}: {kind}_token_id={tid!r} must be an id in "
                        f"[0, {tok.get_vocab_size(True)})"
                    )
                return tid
        return None

    eos = special("eos")
    if eos is None:
        raise TokenizerError(
            f"{directory}: no eos token found; set eos_token in tokenizer_config.json or "
            "eos_token_id in generation_config.json / config.json"
        )
    pad = special("pad")
    return HFTokenizer(tok, eos_id=eos, pad_id=eos if pad is None else pad, bos_id=special("bos"))


__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]
