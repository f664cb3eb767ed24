"""``dtarl launch``: run a program on P local processes under jax.distributed."""

from __future__ import annotations

import argparse

from dtarl.parallel import launch


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``launch`` to the ``dtarl`` command's subparsers (handler in ``func``)."""
    p = subparsers.add_parser(
        "launch", help="run a program on P local processes under jax.distributed"
    )
    launch.add_arguments(p)
    p.set_defaults(func=launch.run)
    return p
