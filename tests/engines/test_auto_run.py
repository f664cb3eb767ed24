"""auto in a run: a bucketed signature (a new depth reuses the measured choice), the
tuning budget, and the cache file of measured choices (fake timers: no assertion
depends on real time)."""

import json
import warnings

import numpy as np
import pytest
from flax import nnx
from test_no_stalls import ENGINES, capacity, forked_batch

from dtarl.engines import AutoEngine, RolloutBatch
from dtarl.engines.auto import ChoiceCache
from dtarl.losses import ClippedSurrogateLoss, MaskedNLLLoss
from dtarl.model import ModelConfig, init_model


class FixedTimer:
    """Fixed seconds per engine without running anything; records what it timed."""

    def __init__(self, seconds):
        self.seconds = dict(seconds)
        self.calls: list[str] = []

    def __call__(self, runs):
        self.calls += sorted(runs)
        return {kind: self.seconds[kind] for kind in runs}


SECONDS = {"dense": 0.3, "prefix_reuse": 0.2, "dfs": 0.1}


@pytest.fixture(scope="module")
def model_params():
    model = init_model(ModelConfig.tiny(), seed=0)
    return model, nnx.split(model, nnx.Param)[1]


def make_auto(model, *, reserve: bool = True, **settings):
    """auto with a fake timer. ``reserve`` False where a test is about something else
    than the reserve: a reserved auto also compiles, on the first batch of a loss,
    every candidate it does not time (tests/engines/test_no_stalls.py covers that)."""
    settings = {"timer": FixedTimer(SECONDS), "host_seconds": lambda k, b: 0.0, **settings}
    auto = AutoEngine(model, engine_config=ENGINES, tune_all_below=1e9, **settings)
    return auto.reserve(capacity()) if reserve else auto


def with_forks(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with the first response token of its second sequence and the first
    two of its third copied from its first (two more tree levels), lengths unchanged."""
    toks = [t.copy() for t in batch.tokens]
    p = int(np.flatnonzero(batch.loss_mask[0])[0])  # the first response token
    for i in (1, 2):
        toks[i][p : p + i] = toks[0][p : p + i]
    return RolloutBatch.create(
        tokens=toks,
        loss_mask=batch.loss_mask,
        advantages=batch.advantages,
        group_ids=batch.group_ids,
    )


def test_signature_buckets_depth_after_reserve(model_params):
    model, _ = model_params
    loss = MaskedNLLLoss()
    flat = forked_batch(0, prompts=2, group=4, fork_at=0)
    forked = with_forks(flat)
    depths = (flat.prefix_tree().stats.depth, forked.prefix_tree().stats.depth)
    assert depths[1] >= depths[0] + 2
    unreserved = AutoEngine(model, engine_config=ENGINES)
    assert unreserved.signature(flat, loss) != unreserved.signature(forked, loss)
    auto = make_auto(model)
    assert auto.signature(flat, loss) == auto.signature(forked, loss)


def test_new_depth_reuses_the_measured_choice(model_params):
    model, params = model_params
    loss = MaskedNLLLoss()
    auto = make_auto(model)
    flat = forked_batch(0, prompts=2, group=4, fork_at=0)
    aux = auto.value_and_grad(params, flat, loss)[2]
    assert aux.stats["choice_basis"] == "measured" and aux.stats["chosen_engine"] == "dfs"
    timed = list(auto.timer.calls)
    aux = auto.value_and_grad(params, with_forks(flat), loss)[2]
    assert aux.stats["choice_basis"] == "reused" and auto.timer.calls == timed


def test_budget_spent_falls_back_to_the_prediction(model_params):
    model, params = model_params
    batch = forked_batch(1, prompts=2, group=4, fork_at=0)
    auto = make_auto(model, budget_seconds=0.0, reserve=False)
    aux = auto.value_and_grad(params, batch, MaskedNLLLoss())[2]
    assert auto.timer.calls == []
    assert aux.stats["choice_basis"] == "predicted (autotune budget spent)"
    assert "autotune budget of 0 s spent" in aux.stats["choice_reason"]
    assert aux.stats["chosen_engine"] == auto.choose(batch, MaskedNLLLoss())[0]
    # A budget that the first round spends: the next new programs are not timed.
    auto = make_auto(model, budget_seconds=1e-12, reserve=False)
    auto.value_and_grad(params, batch, MaskedNLLLoss())
    assert sorted(auto.timer.calls) == sorted(SECONDS) and auto.budget_spent
    other = ClippedSurrogateLoss()  # another loss: other programs
    batch_old = RolloutBatch.create(
        tokens=batch.tokens,
        advantages=batch.advantages,
        old_logprobs=[np.zeros(len(t), np.float32) for t in batch.tokens],
    )
    basis = auto.prepare(batch_old, other).stats["choice_basis"]
    assert basis == "predicted"  # prepare never times
    aux = auto.value_and_grad(params, batch_old, other)[2]
    assert aux.stats["choice_basis"] == "predicted (autotune budget spent)"
    assert len(auto.timer.calls) == len(SECONDS)


def test_cache_file_carries_choices_to_the_next_run(model_params, tmp_path):
    model, params = model_params
    path = str(tmp_path / "sub" / "autotune.json")
    loss = MaskedNLLLoss()
    batch = forked_batch(2, prompts=2, group=4, fork_at=0)
    first = make_auto(model, cache_path=path, reserve=False)
    assert first.value_and_grad(params, batch, loss)[2].stats["choice_basis"] == "measured"
    data = json.load(open(path))
    assert data["format"] == ChoiceCache.FORMAT and len(data["entries"]) == 1
    assert [e["kind"] for e in data["entries"].values()] == ["dfs"]
    assert not list((tmp_path / "sub").glob("*.tmp"))  # written through a temporary file
    # A new run on the same model, engines and device: the cached choice, untimed.
    second = make_auto(model, cache_path=path, reserve=False)
    aux = second.value_and_grad(params, batch, loss)[2]
    assert aux.stats["choice_basis"] == "cached" and aux.stats["chosen_engine"] == "dfs"
    assert second.timer.calls == [] and path in aux.stats["choice_reason"]
    # Other engine settings: another scope, so the cached choice does not apply.
    other = AutoEngine(
        model,
        engine_config=ENGINES.__class__(dfs=ENGINES.dfs.__class__(chunk_len=16)),
        cache_path=path,
        timer=FixedTimer(SECONDS),
    )
    assert other.cache.scope != second.cache.scope and other.cache.get(("x",)) is None
    assert other._cached(second.signature(batch, loss), batch, loss, None) is None


def test_a_reserved_run_from_the_cache_file_tunes_nothing_later(model_params, tmp_path):
    """A second run of a reserved auto with the first run's cache file: the loss's first
    batch takes the cached choice and compiles ahead of time only the engines the
    file names for that loss (not timed), and a later batch with a signature the
    file does not hold gets the cost model's pick among the compiled programs,
    without being timed or compiling mid-run."""
    model, params = model_params
    path = str(tmp_path / "autotune.json")
    loss = MaskedNLLLoss()
    batch = forked_batch(3, prompts=2, group=4, fork_at=0)
    other = forked_batch(5, prompts=3, group=4, fork_at=0)
    earlier = make_auto(model, cache_path=path)  # the earlier run's measured choices
    earlier.cache.put(earlier.signature(batch, loss), "dense", SECONDS["dense"])
    assert earlier.signature(other, loss) != earlier.signature(batch, loss)
    earlier.cache.put(earlier.signature(other, loss), "prefix_reuse", SECONDS["prefix_reuse"])
    # Another loss's choice names dfs: not built for this loss.
    earlier.cache.put(earlier.signature(batch, ClippedSurrogateLoss()), "dfs", SECONDS["dfs"])
    warm = make_auto(model, cache_path=path)
    stats = warm.value_and_grad(params, batch, loss)[2].stats
    assert stats["choice_basis"] == "cached" and stats["chosen_engine"] == "dense"
    assert stats["warmup_compiled"] == ["prefix_reuse"]
    traces = {k: e.jit.trace_count for k, e in warm.engines.items()}
    assert traces == {"dense": 1, "prefix_reuse": 1, "dfs": 0}
    later = forked_batch(4, prompts=1, group=3, fork_at=0)
    assert warm.signature(later, loss) not in (
        warm.signature(batch, loss),
        warm.signature(other, loss),
    )
    aux = warm.value_and_grad(params, later, loss)[2]
    assert warm.timer.calls == [] and aux.stats["choice_basis"] == "predicted"
    assert aux.stats["autotune_seconds"] == 0.0
    # Unsettled, the cost model ranks dfs first on this batch; dfs has no program here.
    assert make_auto(model).choose(later, loss)[0] == "dfs"
    assert aux.stats["chosen_engine"] in ("dense", "prefix_reuse")
    assert {k: e.jit.trace_count for k, e in warm.engines.items()} == traces


@pytest.mark.parametrize("content", ["{not json", json.dumps({"entries": 3}), "[1, 2]"])
def test_corrupt_cache_file_is_ignored_with_a_warning(model_params, tmp_path, content):
    model, params = model_params
    path = tmp_path / "autotune.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignored and will not be overwritten"):
        auto = make_auto(model, cache_path=str(path))
    if content != "{not json":  # one run shows a run goes on; the others: the warning
        assert path.read_text() == content
        return
    batch = forked_batch(3, prompts=2, group=4, fork_at=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aux = auto.value_and_grad(params, batch, MaskedNLLLoss())[2]
    assert aux.stats["choice_basis"] == "measured"
    assert path.read_text() == content  # never overwritten


def test_budget_and_cache_path_are_validated():
    from dtarl.engines import AutoConfig

    with pytest.raises(ValueError, match="engine.auto.budget_seconds"):
        AutoConfig(budget_seconds=-1.0)
    with pytest.raises(ValueError, match="engine.auto.cache_path"):
        AutoConfig(cache_path="")
