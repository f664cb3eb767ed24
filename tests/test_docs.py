"""The docs stay true: docs/configuration.md is what the generator makes of the config
classes now, the README stays a first page (<= 250 lines) whose install and test
commands are the ones CI runs, every relative link resolves, and the README's Python
example runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import keyword
import re
import sys
import types
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
GENERATOR = ROOT / "tools" / "gen_config_docs.py"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang fenced blocks of a Markdown text."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _ci_commands(marker: str) -> list[str]:
    """The commands of .ci/run between ``# --- README: <marker>`` and the next ``# ---``."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"# --- README: {marker}"))
    out = []
    for ln in lines[start + 1 :]:
        if ln.startswith("# ---"):
            break
        ln = ln.strip()
        if ln and not ln.startswith("#") and not ln.startswith(("set ", "rc=")):
            out.append(ln)
    return out


def test_configuration_md_is_generated_from_the_config_classes():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == _generator().generate(), (
        "docs/configuration.md differs from the config dataclasses; regenerate it with "
        "`python tools/gen_config_docs.py` and commit the result"
    )


def _config_keys(cls, prefix=""):
    """Every leaf key of a config dataclass, dotted as ``--set`` takes it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f.name[:-1] if f.name.endswith("_") and keyword.iskeyword(f.name[:-1]) else f.name
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
        if dataclasses.is_dataclass(inner):
            yield from _config_keys(inner, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_configuration_md_names_every_config_key():
    from dtarl.rl.config import TrainerConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in _config_keys(TrainerConfig) if f"| `{k}` |" not in text]
    assert not missing, (
        f"docs/configuration.md lacks {missing}; run python tools/gen_config_docs.py"
    )


def test_readme_is_a_first_page():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; keep it <= 250 and move detail to docs/"


def test_readme_commands_are_the_ones_ci_runs():
    blocks = "\n".join(_fenced(README.read_text(), "bash")).splitlines()
    lines = {ln.strip() for ln in blocks}
    for marker in ("install", "tests"):
        ci = _ci_commands(marker)
        assert ci, f".ci/run has no command under '# --- README: {marker}'"
        for cmd in ci:
            assert cmd in lines, (
                f"README.md's ```bash blocks lack .ci/run's {marker} command {cmd!r}; "
                "the two must stay identical"
            )


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation other than
    ``-`` and ``_`` dropped, spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    text = re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M):
        slug = "".join(c for c in title.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = path.read_text()
    # Links inside code (fenced blocks and `spans`) are not links.
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http(s)://, mailto:
        if target.startswith("#"):
            target = path.name + target  # an in-page anchor
        file, _, anchor = target.partition("#")
        dest = path.parent / file
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files or headings: {broken}"


def test_readme_python_example_runs(capsys):
    blocks = _fenced(README.read_text(), "python")
    assert blocks, "README.md has no ```python example"
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(blocks[0], "README.md (python example)", "exec"), namespace)
    out = capsys.readouterr().out
    assert "tree tokens" in out
