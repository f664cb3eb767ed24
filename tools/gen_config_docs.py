"""Writes ``docs/configuration.md`` from the trainer's config dataclasses.

    python tools/gen_config_docs.py           # rewrite docs/configuration.md
    python tools/gen_config_docs.py --check   # exit 1 when the committed file is stale

The walk starts at ``dtarl.rl.config.TrainerConfig`` and follows ``dataclasses.fields``
and the resolved type hints into every nested section, wherever its class is defined
(``model.overrides`` is walked into ``dtarl.model.ModelConfig``, whose fields it takes).
A field's meaning is its comment in the source file of its class
(``inspect.getsourcefile``): the comment at the end of its line, else the comment
lines right above it, else the part of the class docstring that names it
(```` ``name``: ```` or ``name:``), else the docstring of its enum type.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import keyword
import sys
import tokenize
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"
COMMAND = "python tools/gen_config_docs.py"


# Fields typed ``dict`` whose keys are another dataclass's fields (the dict is applied
# with ``dataclasses.replace``): documented as that class's keys below the field.
def _dict_sections() -> dict[str, type]:
    from dtarl.model import ModelConfig

    return {"model.overrides": ModelConfig}


# Meanings of the fields that have no comment in their class's source yet (the
# source wins as soon as it has one; ``--check`` lists the keys that still use these).
FALLBACK = {
    "steps": "RL steps after the SFT warm-up",
    "seed": "seed of the run (problems, sampling keys)",
    "out_dir": "directory of the run: metrics.jsonl, checkpoints/, TensorBoard events",
    "keep_checkpoints": "the newest this many checkpoints are kept",
    "console": "print a progress bar and a line per step",
    "reward_on_error": "what a failing reward function does",
    "model.preset": "a `ModelConfig` preset (`ModelConfig.PRESETS`)",
    "model.hf_path": "a local Hugging Face checkpoint directory (config.json + safetensors)",
    "model.seed": "seed of the random initialisation (presets without hf_path)",
    "model.overrides.family": "decoder family",
    "model.overrides.vocab_size": "vocabulary size",
    "model.overrides.hidden_size": "width of the residual stream",
    "model.overrides.intermediate_size": "width of the MLP",
    "model.overrides.num_layers": "decoder layers",
    "model.overrides.num_heads": "query heads",
    "model.overrides.num_kv_heads": "key/value heads (grouped-query attention)",
    "model.overrides.head_dim": "width of one head (even, for RoPE)",
    "model.overrides.rms_norm_eps": "epsilon of RMSNorm",
    "model.overrides.rope_theta": "RoPE base frequency",
    "model.overrides.tie_word_embeddings": "the output head shares the embedding matrix",
    "model.overrides.max_position_embeddings": "longest position the model takes",
    "model.overrides.param_dtype": "dtype of the stored parameters: float32, bfloat16 or float16",
    "model.overrides.compute_dtype": "dtype the parameters are cast to where they are used"
    " (bfloat16: see docs/precision.md)",
    "model.overrides.attention_backend": "attention implementation",
    "model.overrides.rope_scaling.factor": "RoPE frequency scaling factor (>= 1)",
    "model.overrides.rope_scaling.low_freq_factor": "Llama 3 low-frequency factor",
    "model.overrides.rope_scaling.high_freq_factor": "Llama 3 high-frequency factor",
    "model.overrides.rope_scaling.original_max_position_embeddings": "context length the"
    " frequencies were trained at",
    "task.kind": "the built-in task the run trains on",
    "rollout.prompts_per_step": "problems per RL step (N)",
    "rollout.group_size": "samples per problem (G, DARTS's M)",
    "rollout.top_p": "nucleus sampling threshold (1 = off)",
    "rollout.top_k": "sample among the k most likely tokens (0 = off)",
    "rollout.engine": "the rollout engine: continuous batching or the static reference sampler",
    "rollout.streaming.enabled": "turn token-level streaming on",
    "rollout.streaming.chunk": "tokens per scorer call",
    "rollout.pat.enabled": "turn adaptive TP on",
    "rollout.pat.tp_candidates": "TP degrees the controller may switch to",
    "rollout.pat.check_every": "decode calls between two switch decisions",
    "algo.algorithm": "the RL objective and advantage estimator",
    "algo.clip_eps": "clip range of the policy ratio (low side; the high side too unless"
    " clip_eps_high is set)",
    "optim.lr": "learning rate (RL steps)",
    "optim.weight_decay": "AdamW's decoupled weight decay",
    "optim.b1": "AdamW's first-moment decay",
    "optim.b2": "AdamW's second-moment decay",
    "optim.max_grad_norm": "global-norm gradient clipping",
    "optim.warmup_steps": "linear warm-up steps of the schedule",
    "optim.schedule": "learning-rate schedule after the warm-up",
    "sft.steps": "SFT warm-up steps (0 = no warm-up)",
    "sft.batch_size": "reference solutions per SFT step",
    "sft.lr": "learning rate of the SFT warm-up",
    "sft.warmup_steps": "linear warm-up steps of the SFT learning rate",
    "mesh.dp": "data-parallel ranks (null: every device not used by tp)",
    "mesh.tp": "tensor-parallel ways",
    "resume.enabled": "resume from the latest checkpoint in out_dir/checkpoints",
    "resume.allow_changes": "resume even when the saved config differs",
}
_USED_FALLBACK: list[str] = []

# The papers the code's docstrings cite by their old file names, as docs/papers.md cites them.
PAPERS = {
    "papers/000": "AREAL-DTA",
    "papers/001": "Schedule-Level Shared-Prefix Reuse",
    "papers/002": "DARTS, arXiv:2605.30859",
    "papers/003": "PAT",
    "papers/004": "PolyTrace",
}


# Pointers into the old README that the docs pages replaced.
MOVED = {'README, "Precision"': "docs/precision.md", "README's DARTS section": "docs/darts.md"}


def _cite(text: str) -> str:
    for old, new in {**PAPERS, **MOVED}.items():
        text = text.replace(old, new)
    return text


# ----------------------------------------------------------------- source comments


@dataclasses.dataclass
class _ClassSource:
    doc: str
    comments: dict[str, str]  # field / enum member name -> its comment


_SOURCES: dict[type, _ClassSource] = {}


def _comments_by_line(text: str) -> tuple[dict[int, str], set[int]]:
    """{line: comment text} and the lines that hold code (tokens other than comments)."""
    comments: dict[int, str] = {}
    code: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in skip:
            for line in range(tok.start[0], tok.end[0] + 1):
                code.add(line)
    return comments, code


def _find_class(tree: ast.Module, qualname: str) -> ast.ClassDef | None:
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def _source(cls: type) -> _ClassSource:
    if cls in _SOURCES:
        return _SOURCES[cls]
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    if doc.startswith(cls.__name__ + "("):  # the dataclass-generated signature
        doc = ""
    comments: dict[str, str] = {}
    path = inspect.getsourcefile(cls)
    text = Path(path).read_text() if path else ""
    node = _find_class(ast.parse(text), cls.__qualname__) if text else None
    if node is not None:
        by_line, code = _comments_by_line(text)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name = stmt.target.id
            elif (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                name = stmt.targets[0].id
            else:
                continue
            trailing = [by_line[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in by_line]
            above: list[str] = []
            n = stmt.lineno - 1
            while n in by_line and n not in code:
                above.insert(0, by_line[n])
                n -= 1
            comments[name] = " ".join(trailing) if trailing else " ".join(above)
    _SOURCES[cls] = _ClassSource(doc=doc, comments=comments)
    return _SOURCES[cls]


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose body declares field ``name``."""
    for base in cls.__mro__:
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


def _docstring_part(doc: str, name: str, others: list[str]) -> str:
    """The part of a class docstring that documents field ``name``: from ```` ``name``: ````
    or ``name:`` (at a sentence start) up to the next field so introduced, or the end
    of its paragraph."""
    flat = " ".join(doc.split())

    def start_of(n: str, text: str) -> tuple[int, int] | None:
        for pat in (f"``{n}``:", f"{n}:"):
            i = 0
            while (i := text.find(pat, i)) >= 0:
                before = text[:i].rstrip()
                if not before or before.endswith((".", ";")):  # a sentence's subject
                    return i, i + len(pat)
                i += len(pat)
        return None

    found = start_of(name, flat)
    if found is None:
        return ""
    rest = flat[found[1] :]
    end = len(rest)
    for other in others:
        if other != name and (o := start_of(other, rest)) is not None:
            end = min(end, o[0])
    return rest[:end].strip()


# ----------------------------------------------------------------- rendering


def _unwrap_optional(tp) -> tuple[object, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _type_text(tp) -> str:
    inner, optional = _unwrap_optional(tp)
    suffix = " or null" if optional else ""
    if typing.get_origin(inner) in (typing.Union, types.UnionType):  # str | tuple[str, ...]
        args = typing.get_args(inner)
        return " or ".join(_type_text(a) for a in args if a is not type(None)) + suffix
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in inner) + suffix
    origin = typing.get_origin(inner)
    if origin is tuple:
        args = [a for a in typing.get_args(inner) if a is not Ellipsis]
        item = _type_text(args[0]) if args else "any"
        return f"list of {item}" + suffix
    if origin is dict or inner is dict:
        return "mapping" + suffix
    if isinstance(inner, type):
        return inner.__name__ + suffix
    return str(inner).replace("typing.", "") + suffix


def _value_text(v) -> str:
    if v is dataclasses.MISSING:
        return "required"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if isinstance(v, enum.Enum):
        return f"`{v.value}`"
    if isinstance(v, tuple | list):
        return "`[" + ", ".join(_value_text(x).strip("`") for x in v) + "]`"
    if isinstance(v, dict):
        return "`{}`" if not v else f"`{v}`"
    if isinstance(v, str):
        return f'`"{v}"`' if v == "" else f"`{v}`"
    return f"`{v!r}`"


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _yaml_key(name: str) -> str:
    """``lambda_`` is written ``lambda`` in YAML (a field named after a Python keyword)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


@dataclasses.dataclass
class _Section:
    key: str  # dotted path ("" for the top level)
    cls: type
    rows: list[tuple[str, str, str, str]]


def _walk(
    cls: type,
    prefix: str,
    sections: list[_Section],
    enums: dict[type, None],
    *,
    preset: bool = False,
) -> None:
    section = _Section(key=prefix, cls=cls, rows=[])
    sections.append(section)
    src = _source(cls)
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields] + [_yaml_key(f.name) for f in fields]
    nested: list[tuple[str, type]] = []
    for f in fields:
        key = f"{prefix}.{_yaml_key(f.name)}" if prefix else _yaml_key(f.name)
        tp = hints[f.name]
        inner, _ = _unwrap_optional(tp)
        owner = _owner(cls, f.name)  # a field inherited from a base class: the base's source
        meaning = _source(owner).comments.get(f.name, "")
        if not meaning:
            meaning = _docstring_part(src.doc, _yaml_key(f.name), names)
            if not meaning and f.name != _yaml_key(f.name):
                meaning = _docstring_part(src.doc, f.name, names)
        if not meaning:
            meaning = FALLBACK.get(key, "")
            if meaning:
                _USED_FALLBACK.append(key)
        if isinstance(inner, type) and issubclass(inner, enum.Enum):
            enums[inner] = None
            if not meaning:
                meaning = inspect.cleandoc(inner.__doc__ or "")
                if meaning == inspect.cleandoc(enum.Enum.__doc__ or ""):
                    meaning = ""
        if dataclasses.is_dataclass(inner):
            nested.append((key, inner))
            meaning = meaning or f"section: see [{key}](#{_anchor(key)})"
            section.rows.append((key, "section", "", meaning))
            continue
        extra = _dict_sections().get(key)
        if extra is not None:
            nested.append((key, extra))
            meaning = (meaning + "; " if meaning else "") + f"keys: see [{key}](#{_anchor(key)})"
        default = _default(f)
        shown = (
            "from the preset" if preset and default is dataclasses.MISSING else _value_text(default)
        )
        section.rows.append((key, _type_text(tp), shown, meaning))
    for key, sub in nested:
        _walk(sub, key, sections, enums, preset=preset or key in _dict_sections())


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-``/``_`` dropped,
    spaces as ``-``."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")


def generate() -> str:
    """The text of docs/configuration.md, from the config classes as they are now."""
    from dtarl.model import ModelConfig
    from dtarl.rl.config import TrainerConfig

    presets = ", ".join(f"`{p}`" for p in ModelConfig.PRESETS)
    FALLBACK["model.preset"] = f"a `ModelConfig` preset: {presets}"

    _USED_FALLBACK.clear()
    sections: list[_Section] = []
    enums: dict[type, None] = {}
    _walk(TrainerConfig, "", sections, enums)
    out = [
        "# Configuration",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses; do not edit by hand."
        " tests/test_docs.py fails when this file is stale. -->",
        "",
        "`dtarl train CONFIG.yaml [--set KEY=VALUE ...]` builds a `TrainerConfig`"
        " (`dtarl.rl.config`): the defaults below, then the YAML file's overrides (nested by"
        " section), then each `--set` (the value parsed as YAML, e.g."
        " `--set rollout.group_size=8`, `--set engine.dfs.chunk_len=64`). An unknown key"
        " is an error listing the section's valid keys; a bad value names its key and the"
        " accepted range, at load, before any model is built."
        " `dtarl train CONFIG --print-config` prints the parsed config.",
        "",
        "Every key below is its dotted path as `--set` takes it; in YAML it nests"
        " (`rollout.streaming.chunk: 8` is `rollout: {streaming: {chunk: 8}}`)."
        " A section with an `enabled` field also takes a bare boolean"
        " (`resume: false` is `resume: {enabled: false}`).",
        "",
        "The papers named below are listed in [papers.md](papers.md).",
        "",
        "Sections: "
        + ", ".join(f"[{s.key or 'top level'}](#{_anchor(s.key or 'top level')})" for s in sections)
        + ".",
        "",
    ]
    for s in sections:
        title = s.key or "top level"
        out.append(f"## {title}")
        out.append("")
        where = f"`{s.cls.__module__}.{s.cls.__qualname__}`"
        doc = _source(s.cls).doc
        intro = " ".join(doc.split()) if doc else ""
        if s.key in _dict_sections():
            intro = (
                f"Keys of the `{s.key}` mapping: fields of {where}, applied to the preset"
                " (or to the HF checkpoint's config). Defaults are the class's; required"
                " fields and the fields a preset names come from the preset."
                + (" " + intro if intro else "")
            )
        else:
            intro = f"{where}. " + intro if intro else f"{where}."
        out.append(_cite(intro.strip()))
        out.append("")
        out.append("| key | type | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        for key, tp, default, meaning in s.rows:
            out.append(f"| `{key}` | {tp} | {default} | {_cell(_cite(meaning))} |")
        out.append("")
    out.append("## Values of the enumerations")
    out.append("")
    for e in sorted(enums, key=lambda c: c.__qualname__):
        comments = _source(e).comments
        out.append(f"- `{e.__module__}.{e.__qualname__}`:")
        for m in e:
            note = comments.get(m.name, "")
            out.append(f"  - `{m.value}`" + (f": {_cell(_cite(note))}" if note else ""))
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = p.parse_args(argv)
    text = generate()
    if _USED_FALLBACK:
        print(
            f"{len(_USED_FALLBACK)} keys have no comment in their class's source; their meaning"
            f" is this script's FALLBACK: {', '.join(_USED_FALLBACK)}",
            file=sys.stderr,
        )
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
