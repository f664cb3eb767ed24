"""The DFS program's plan input: per-step records and the flat real entries
(``PlanSteps``, ``PlanEntries``), expanded on the device to exactly the padded [T, E]
arrays of the plan (``expand_step`` == ``SegmentPlan.padded``)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from dtarl.engines import DFSEngine
from dtarl.engines.dfs import PlanEntries, PlanSteps, expand_step
from dtarl.model import ModelConfig, init_model
from dtarl.tree import build_tree, compile_plan
from dtarl.tree.plan import ENTRY_FIELDS
from tests.tree.test_plan_reference import _random_sequences


@functools.cache
def _engine(**settings) -> DFSEngine:
    return DFSEngine(init_model(ModelConfig.tiny(num_layers=1), seed=0), **settings)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "settings", [dict(chunk_len=8, leaf_rows=2, wide_chunks=3), dict(chunk_len=4, leaf_rows=1)]
)
def test_expanded_steps_equal_the_padded_plan(seed, settings):
    engine = _engine(**settings)
    plan = compile_plan(
        build_tree(_random_sequences(seed)),
        chunk_len=settings["chunk_len"],
        rows=settings["leaf_rows"],
        wide=settings.get("wide_chunks", 0),
    )
    steps = engine.device_plan(plan)
    entries, steps = steps.entries, steps._replace(entries=None)
    assert isinstance(steps, PlanSteps) and isinstance(entries, PlanEntries)
    n, e = plan.num_entries, plan.width
    assert entries.col.shape[0] >= n + e and steps.op.shape == plan.op.shape
    got = jax.jit(jax.vmap(lambda p: expand_step(p, entries, e)))(steps)
    for name in ENTRY_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), plan.padded(name), name)
    for name in ("op", "start", "pbucket", "slots", "slot_seg"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(plan, name))
