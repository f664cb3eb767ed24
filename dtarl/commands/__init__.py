"""Subcommand parsers of the ``dtarl`` command: each ``register(subparsers)`` adds one."""
