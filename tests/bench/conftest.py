"""Fixtures: the small synthetic PolyTrace runs of ``tests/traces`` (``single_run``,
``multi_run``), shared with the replay and simulator tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_traces_conftest", Path(__file__).resolve().parents[1] / "traces" / "conftest.py"
)
_traces = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_traces)

single_run = _traces.single_run
multi_run = _traces.multi_run
