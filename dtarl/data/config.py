"""The ``data:`` section: prompts from dataset files instead of the procedural task.

    data:
      train_files: data/train.jsonl         # a path or a list; JSONL, JSON, Parquet, a directory
      val_files: data/val.jsonl             # evaluation rows (held out)
      prompt_key: question                  # a string, or a list of messages {role, content}
      answer_key: answer                    # the reward's ground truth
      max_prompt_length: 512                # tokens, after the chat template
      truncation: error                     # error | left | right | drop
      chat_template: auto                   # auto | none | PATH.jinja

Paths are relative to the working directory (verl's convention). ``DataSection.build``
reads, validates, renders and tokenises every row once (``dtarl.data.dataset``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

from dtarl.data.dataset import (
    LoadStats,
    PromptDataset,
    PromptRenderer,
    Truncation,
    load_prompts,
)
from dtarl.data.files import expand
from dtarl.data.rows import RowKeys
from dtarl.data.template import ChatTemplate
from dtarl.errors import ConfigError

# ``data.chat_template``'s words; anything else is the path of a .jinja file.
TEMPLATE_AUTO, TEMPLATE_NONE = "auto", "none"


def _paths(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, list | tuple) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(
            f"{key}={value!r} must be a path or a list of paths (JSONL, JSON, Parquet files or "
            "directories of them)"
        )
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """Dataset prompts (verl's ``data:`` names). With ``train_files`` set, RL steps draw
    their prompts from it (``task:`` is then not used) in epochs without replacement,
    in an order seeded by ``seed``; the position is saved in every checkpoint."""

    SECTION: typing.ClassVar[str] = "data"
    # training rows: a path or a list of paths (.jsonl, .json, .parquet, a directory of
    # them, a datasets.save_to_disk folder); empty: the procedural task (task:)
    train_files: str | tuple[str, ...] = ()
    # evaluation rows (held out); empty: evaluation draws from train_files
    val_files: str | tuple[str, ...] = ()
    prompt_key: str = "prompt"  # column of the prompt: a string or a list of {role, content}
    answer_key: str = "answer"  # column of the ground truth handed to the reward (dots: nested)
    response_key: str | None = None  # column of a reference response (the SFT warm-up's target)
    max_prompt_length: int = 512  # tokens, after the chat template
    truncation: Truncation = Truncation.ERROR
    # auto: the tokenizer's chat_template when it has one; none: BOS + the prompt text;
    # or the path of a .jinja template
    chat_template: str = TEMPLATE_AUTO
    shuffle: bool = True  # a new seeded order every epoch (false: file order)
    seed: int | None = None  # of the order (null: the run's seed)

    def __post_init__(self):
        set_ = object.__setattr__  # normalised in place: a path becomes a 1-tuple
        set_(self, "train_files", _paths(self.train_files, "data.train_files"))
        set_(self, "val_files", _paths(self.val_files, "data.val_files"))
        if self.val_files and not self.train_files:
            raise ConfigError(
                "data.val_files is set without data.train_files; set both (the procedural "
                "task has its own held-out generator)"
            )
        for name in ("prompt_key", "answer_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"data.{name}={getattr(self, name)!r} must be a column name")
        if self.response_key == "":
            raise ConfigError("data.response_key='' must be a column name (or null: none)")
        if isinstance(self.max_prompt_length, bool) or not self.max_prompt_length >= 1:
            raise ConfigError(f"data.max_prompt_length={self.max_prompt_length!r} must be >= 1")
        if not self.chat_template:
            raise ConfigError(
                "data.chat_template='' is not valid; accepted: auto, none, or a .jinja path"
            )
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"data.seed={self.seed!r} must be >= 0 (or null: the run's seed)")

    @property
    def enabled(self) -> bool:
        return bool(self.train_files)

    @property
    def keys(self) -> RowKeys:
        return RowKeys(prompt=self.prompt_key, answer=self.answer_key, response=self.response_key)

    def check_files(self) -> None:
        """Raises the ``ConfigError`` of a missing or unreadable-kind path now (before a
        model is loaded); the rows themselves are checked by ``build``."""
        expand(self.train_files, "data.train_files")
        if self.val_files:
            expand(self.val_files, "data.val_files")
        if self.chat_template not in (TEMPLATE_AUTO, TEMPLATE_NONE):
            self.template(None)

    def template(self, tokenizer_dir: str | None) -> ChatTemplate | None:
        """The chat template prompts are rendered with (None: plain BOS + text)."""
        from dtarl.data.template import special_tokens

        if self.chat_template == TEMPLATE_NONE:
            return None
        if self.chat_template == TEMPLATE_AUTO:
            return ChatTemplate.from_tokenizer_dir(tokenizer_dir)
        if not os.path.isfile(self.chat_template):
            raise ConfigError(
                f"data.chat_template={self.chat_template!r} is not a file; accepted: auto, "
                "none, or the path of a .jinja template"
            )
        return ChatTemplate.from_file(self.chat_template, special=special_tokens(tokenizer_dir))

    def build(
        self, tokenizer, *, tokenizer_dir: str | None, seed: int
    ) -> tuple[PromptDataset, PromptDataset | None]:
        """(train, val or None): every row read, validated, rendered and tokenised."""
        renderer = PromptRenderer(tokenizer, self.template(tokenizer_dir))
        seed = seed if self.seed is None else self.seed

        def load(paths, key, shuffle):
            prompts, stats = load_prompts(
                paths,
                self.keys,
                renderer=renderer,
                max_length=self.max_prompt_length,
                truncation=self.truncation,
                key=key,
            )
            return PromptDataset(prompts, shuffle=shuffle, seed=seed, stats=stats)

        train = load(self.train_files, "data.train_files", self.shuffle)
        val = load(self.val_files, "data.val_files", False) if self.val_files else None
        return train, val


__all__ = ["DataSection", "LoadStats", "TEMPLATE_AUTO", "TEMPLATE_NONE", "Truncation"]
