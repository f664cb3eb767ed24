"""Chat templates with Hugging Face semantics: ``ChatTemplate.render(messages)``.

A HF tokenizer's ``chat_template`` (``tokenizer_config.json``'s, or the
``chat_template.jinja`` file newer ``transformers`` versions save) is a Jinja template
that turns a list of messages into the model's prompt text. It is rendered the way
``transformers``' ``apply_chat_template`` renders it: a sandboxed Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the
``{% generation %}`` tag, a ``tojson`` filter that does not escape HTML, the
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` globals, and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables. The
rendered text is then tokenised without adding special tokens (the template writes
its own), so the ids equal ``apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)``'s (``tests/data/test_template_hf.py`` checks this).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dtarl.errors import ConfigError

# The named special tokens transformers passes to a template (``special_tokens_map``).
SPECIAL_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    return env


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None


def special_tokens(directory: str | None) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}``: the named special tokens of a HF tokenizer
    directory's ``tokenizer_config.json`` (then ``special_tokens_map.json``), as
    ``transformers`` hands them to a chat template."""
    if directory is None:
        return {}
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        cfg = _read_json(os.path.join(directory, name))
        for kind in SPECIAL_TOKENS:
            v = cfg.get(f"{kind}_token")
            if isinstance(v, Mapping):
                v = v.get("content")
            if isinstance(v, str):
                out[f"{kind}_token"] = v
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it sees. ``where`` names its
    source in errors."""

    def __init__(self, source: str, *, special: Mapping[str, str] | None = None, where: str):
        import jinja2

        self.source = source
        self.where = where
        self.special = dict(special or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(
                f"{where}:{e.lineno}: chat template syntax error ({e.message})"
            ) from None

    @classmethod
    def from_file(cls, path: str, *, special: Mapping[str, str] | None = None) -> ChatTemplate:
        """A ``.jinja`` file (``data.chat_template: PATH``)."""
        try:
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), special=special, where=path)
        except OSError as e:
            raise ConfigError(
                f"data.chat_template={path!r}: cannot read the template ({e.strerror or e}); "
                "accepted: auto, none, or the path of a .jinja file"
            ) from None

    @classmethod
    def from_tokenizer_dir(cls, directory: str | None) -> ChatTemplate | None:
        """The template of a HF tokenizer directory (None when it has none):
        ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a
        string, or a list of ``{name, template}`` of which the one named ``default``)."""
        if directory is None:
            return None
        special = special_tokens(directory)
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            return cls.from_file(jinja_file, special=special)
        cfg_file = os.path.join(directory, "tokenizer_config.json")
        tpl = _read_json(cfg_file).get("chat_template")
        where = f"{cfg_file}: chat_template"
        if tpl is None:
            return None
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
            if "default" not in named:
                raise ConfigError(
                    f"{where} is a list of named templates {sorted(map(str, named))} without "
                    "'default'; set data.chat_template to a .jinja file"
                )
            tpl = named["default"]
        if not isinstance(tpl, str) or not tpl:
            raise ConfigError(f"{where} must be a non-empty string")
        return cls(tpl, special=special, where=where)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of ``messages`` (keys with a None value dropped, as
        ``transformers`` does)."""
        import jinja2

        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except jinja2.TemplateError as e:
            raise ConfigError(f"{self.where}: rendering the chat template failed: {e}") from None


__all__ = ["SPECIAL_TOKENS", "ChatTemplate", "special_tokens"]
