"""tests/reliability: fault injection (corrupt checkpoints, planted files, bad input,
kill -9 mid-write); every case fails on dtarl before the fix and passes after it."""

import pytest
from faults import small_tree


@pytest.fixture
def two_steps(tmp_path):
    """A checkpoints directory with intact steps 1 and 2 (step 2 has other values)."""
    from dtarl.rl.checkpoint import CheckpointManager

    d = tmp_path / "run" / "checkpoints"
    with CheckpointManager(d, keep=5) as mgr:
        mgr.save(1, small_tree(1.0), {"config": {"x": 1}})
        mgr.save(2, small_tree(2.0), {"config": {"x": 1}})
    return d
