"""Prompt datasets: rows read, validated, rendered and tokenised once; drawn in a seeded
order, epoch by epoch, without replacement.

    prompts = load_prompts(files, keys, renderer=..., max_length=512, truncation=...)
    ds = PromptDataset(prompts, shuffle=True, seed=0)
    batch = ds.take(position, n)       # rows position .. position + n - 1 of the stream

The stream is grain's ``MapDataset.range(len).shuffle(seed).repeat()``: epoch e is a
permutation of the rows seeded by (seed, e), and position p is row ``order[p]``: a
pure function of the position, so the position alone (the trainer's
``data_cursor``, saved in every checkpoint) is the dataset's state, and a resumed run
draws exactly the rows the uninterrupted one would have.

Prompts longer than ``max_length`` tokens (after the chat template) follow
``truncation``: ``error`` (a ``ConfigError`` naming ``file:row``), ``left`` (keep the
last ``max_length`` ids), ``right`` (keep the first), ``drop`` (leave the row out;
counted in ``PromptDataset.dropped`` and reported by the trainer).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Sequence

from dtarl.data.files import expand, read_records
from dtarl.data.rows import Row, RowKeys, parse_row
from dtarl.data.template import ChatTemplate
from dtarl.errors import ConfigError


class Truncation(enum.Enum):
    """What a prompt longer than ``data.max_prompt_length`` tokens does (verl's names)."""

    ERROR = "error"  # stop with an error naming the row
    LEFT = "left"  # keep the last max_prompt_length tokens
    RIGHT = "right"  # keep the first max_prompt_length tokens
    DROP = "drop"  # leave the row out (counted: data/dropped_rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    """A row ready to roll out: ``text`` is what the model reads (the chat template
    applied) and ``ids`` its tokens (truncated when ``truncated``)."""

    row: Row
    text: str
    ids: tuple[int, ...]
    truncated: bool = False


class PromptRenderer:
    """Row -> (text, ids). With a ``ChatTemplate``: a string prompt becomes one user
    message, the messages are rendered with ``add_generation_prompt=True`` and the
    text is tokenised without special tokens (the template writes its own). Without
    one: the text is BOS + the prompt string; a chat prompt is an error."""

    def __init__(self, tokenizer, template: ChatTemplate | None):
        self.tokenizer = tokenizer
        self.template = template

    def __call__(self, row: Row, key: str) -> tuple[str, list[int]]:
        if self.template is None:
            if row.is_chat:
                raise ConfigError(
                    f"{row.where}: {key} is a list of chat messages but the run has no chat "
                    "template (data.chat_template=none, or a tokenizer without one); set "
                    "data.chat_template to a .jinja file, use a tokenizer with a chat_template, "
                    "or give string prompts"
                )
            text, bos = row.prompt, self.tokenizer.bos_id
            prefix = [] if bos is None else [bos]
        else:
            msgs = row.prompt if row.is_chat else ({"role": "user", "content": row.prompt},)
            text, prefix = self.template.render(msgs, add_generation_prompt=True), []
        try:
            return text, prefix + list(self.tokenizer.encode(text))
        except ValueError as e:
            raise ConfigError(f"{row.where}: {key} cannot be tokenised: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadStats:
    rows: int  # rows read
    dropped: int  # left out (truncation=drop)
    truncated: int  # cut to max_length (truncation=left/right)


def load_prompts(
    paths: Sequence[str],
    keys: RowKeys,
    *,
    renderer: PromptRenderer,
    max_length: int,
    truncation: Truncation,
    key: str,
) -> tuple[list[Prompt], LoadStats]:
    """Every row of ``paths`` (``key`` names the config key in errors), validated,
    rendered and tokenised, in file order; rows over ``max_length`` tokens handled by
    ``truncation``."""
    prompts: list[Prompt] = []
    rows = dropped = truncated = 0
    for path in expand(paths, key):
        for where, record in read_records(path):
            rows += 1
            row = parse_row(record, where, keys)
            text, ids = renderer(row, keys.prompt)
            cut = len(ids) > max_length
            if cut:
                if truncation is Truncation.ERROR:
                    raise ConfigError(
                        f"{where}: {keys.prompt} is {len(ids)} tokens, over "
                        f"data.max_prompt_length={max_length}; raise it, or set "
                        "data.truncation to left, right or drop"
                    )
                if truncation is Truncation.DROP:
                    dropped += 1
                    continue
                truncated += 1
                ids = ids[-max_length:] if truncation is Truncation.LEFT else ids[:max_length]
            prompts.append(Prompt(row=row, text=text, ids=tuple(ids), truncated=cut))
    if not prompts:
        why = f" ({dropped} dropped by data.truncation=drop)" if dropped else ""
        raise ConfigError(f"{key}={list(paths)!r}: no rows{why}")
    return prompts, LoadStats(rows=rows, dropped=dropped, truncated=truncated)


class PromptDataset:
    """Prompts in a seeded epoch order (see the module docstring)."""

    def __init__(self, prompts: Sequence[Prompt], *, shuffle: bool, seed: int, stats=None):
        import grain

        if not prompts:
            raise ValueError("PromptDataset needs at least one prompt")
        self.prompts = list(prompts)
        self.shuffle = shuffle
        self.seed = seed
        self.stats = stats or LoadStats(rows=len(prompts), dropped=0, truncated=0)
        order = grain.MapDataset.range(len(self.prompts))
        if shuffle:
            order = order.shuffle(seed=seed)
        self._order = order.repeat()

    def __len__(self) -> int:
        return len(self.prompts)

    def index(self, position: int) -> int:
        """The row drawn at stream position ``position`` (>= 0)."""
        if position < 0:
            raise ValueError(f"position={position} must be >= 0")
        return int(self._order[position])

    def take(self, position: int, n: int) -> list[Prompt]:
        """The prompts at stream positions ``position`` .. ``position + n - 1``."""
        return [self.prompts[self.index(p)] for p in range(position, position + n)]

    def epoch(self, position: int) -> int:
        """The epoch stream position ``position`` falls in (0-based)."""
        return position // len(self.prompts)

    @property
    def longest(self) -> int:
        """The most prompt tokens of any row."""
        return max(len(p.ids) for p in self.prompts)

    def fingerprint(self) -> str:
        """A hash of every row's prompt ids and answer, in file order: a resumed run checks
        that its data is the data the checkpoint's position counts in."""
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(repr((p.ids, p.row.answer)).encode())
        return h.hexdigest()[:16]


__all__ = ["LoadStats", "Prompt", "PromptDataset", "PromptRenderer", "Truncation", "load_prompts"]
