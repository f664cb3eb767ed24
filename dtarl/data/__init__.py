"""Datasets for RL: rows from JSONL / JSON / Parquet files (``data:``), chat templates.

    from dtarl.data import DataSection
    train, val = DataSection(train_files="train.jsonl").build(tokenizer, tokenizer_dir=None, seed=0)
    train.take(position, n)      # prompts, epoch by epoch in a seeded order

See docs/data-and-rewards.md.
"""

from dtarl.data.config import DataSection
from dtarl.data.dataset import Prompt, PromptDataset, PromptRenderer, Truncation, load_prompts
from dtarl.data.rows import Row, RowKeys, parse_row
from dtarl.data.template import ChatTemplate

__all__ = [
    "ChatTemplate",
    "DataSection",
    "Prompt",
    "PromptDataset",
    "PromptRenderer",
    "Row",
    "RowKeys",
    "Truncation",
    "load_prompts",
    "parse_row",
]
