"""One writer for the tables and JSON files of the bench commands.

    markdown(header, rows)        lines of a Markdown table (``| a | b |`` under a rule)
    text_table(columns, rows)     lines of a fixed-width text table
    Column(title, width, align)   one column of a text table (width None: the widest cell)
    json_rows(rows)               result rows as fresh JSON-ready dicts (NaN -> null on ask)
    write_json(path, obj)         a ``--json`` file, parent folders created
    save_figure(fig, path)        a matplotlib figure as a PNG, parent folders created

Cells are strings formatted by the caller (``f"{x:.3f}"``); the writer only lays
them out, so every bench keeps its own number formats and column names.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Column", "json_rows", "markdown", "save_figure", "text_table", "write_json"]


def markdown(header: Sequence[str], rows: Iterable[Sequence[Any]], *, compact: bool = False):
    """Lines of a Markdown table: the header, a rule (``| --- | --- |``, or ``|---|---|``
    when ``compact``) and one ``| a | b |`` line per row of cells."""
    if not header:
        raise ValueError("markdown: header is empty; a table needs at least one column")
    rule = (
        "|---" * len(header) + "|" if compact else "| " + " | ".join(["---"] * len(header)) + " |"
    )
    lines = ["| " + " | ".join(header) + " |", rule]
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(
                f"markdown: row {i} has {len(row)} cells; the header has {len(header)}"
            )
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return lines


@dataclasses.dataclass(frozen=True, kw_only=True)
class Column:
    """A text table's column: its title, width (None: the widest of title and cells) and
    alignment (``">"`` right, ``"<"`` left)."""

    title: str
    width: int | None = None
    align: str = ">"

    def __post_init__(self):
        if self.align not in ("<", ">"):
            raise ValueError(f"Column.align={self.align!r}: accepted: '<', '>'")
        if self.width is not None and self.width < 0:
            raise ValueError(f"Column.width={self.width}: must be >= 0 or None")


def text_table(
    columns: Sequence[Column],
    rows: Iterable[Sequence[str]],
    *,
    sep: str | Sequence[str] = " ",
    rule: bool = False,
) -> list[str]:
    """Lines of a fixed-width table: the titles, a rule of ``-`` as long as the title line
    (``rule``), then one line per row; cells are padded to their column and joined by
    ``sep`` (one string, or one per gap between columns)."""
    if not columns:
        raise ValueError("text_table: no columns; a table needs at least one")
    seps = [sep] * (len(columns) - 1) if isinstance(sep, str) else list(sep)
    if len(seps) != max(len(columns) - 1, 0):
        raise ValueError(f"text_table: {len(seps)} separators for {len(columns)} columns")
    rows = [[str(c) for c in r] for r in rows]
    for i, r in enumerate(rows):
        if len(r) != len(columns):
            raise ValueError(f"text_table: row {i} has {len(r)} cells; there are {len(columns)}")
    widths = [
        c.width if c.width is not None else max([len(c.title)] + [len(r[j]) for r in rows])
        for j, c in enumerate(columns)
    ]

    def line(cells: Sequence[str]) -> str:
        out = [format(x, f"{c.align}{w}") for c, w, x in zip(columns, widths, cells, strict=True)]
        return out[0] + "".join(g + x for g, x in zip(seps, out[1:], strict=True))

    head = line([c.title for c in columns])
    return [head] + (["-" * len(head)] if rule else []) + [line(r) for r in rows]


def _nan_to_none(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _nan_to_none(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nan_to_none(x) for x in v]
    return v


def json_rows(rows: Iterable[Mapping[str, Any]], *, nan_to_null: bool = False) -> list[dict]:
    """The rows of a result as fresh dicts for ``--json`` (keys kept); with ``nan_to_null``
    a NaN anywhere inside (a metric a row does not have) becomes None (JSON null)."""
    out = [dict(r) for r in rows]
    return [_nan_to_none(r) for r in out] if nan_to_null else out


def write_json(path: str | Path, obj, *, say: Callable[[str], Any] | None = None, **dumps_kw):
    """Writes ``obj`` as indented JSON to ``path`` (parent folders created) and returns the
    path; ``say`` (e.g. ``print``) gets ``wrote <path>``. ``dumps_kw`` go to ``json.dumps``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, **dumps_kw))
    if say is not None:
        say(f"wrote {path}")
    return path


def save_figure(fig, path: str | Path, *, dpi: int) -> Path:
    """Lays out ``fig`` (``tight_layout``), saves it at ``path`` (parent folders created)
    and closes it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
