"""dtarl's input errors, shared by every layer.

Both are ``ValueError``s, like dtarl's other input errors, so the ``dtarl`` CLI prints
their one-line message instead of a traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration (model or trainer); the message names the key and the
    accepted values."""


class CheckpointError(ValueError):
    """A checkpoint (HF or Orbax) that cannot be written or restored; the message names
    the path, file, tensor or field."""


__all__ = ["CheckpointError", "ConfigError"]
