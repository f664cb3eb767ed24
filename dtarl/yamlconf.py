"""dtarl's YAML reader for configs: PyYAML's safe loader, strict about two things.

* YAML 1.2 floats: ``1e-3`` and ``5E4`` are numbers (YAML 1.1 wants a dot and a
  signed exponent, ``1.0e-3``, and reads ``1e-3`` as a string).
* A key given twice in one mapping is an error naming both lines (PyYAML keeps the
  last one silently).
"""

from __future__ import annotations

import re

import yaml
from yaml.constructor import ConstructorError


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 floats and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)  # merge keys (<<) first: a merged key may be overridden
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r} (first at line {first.line + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load(stream):
    """One YAML document from ``stream`` (a str or a file) with ``Loader``."""
    return yaml.load(stream, Loader=Loader)


__all__ = ["Loader", "load"]
