"""The program store (``dtarl.aot``): a program read back is the program exported, the
function behind it never traced again; any other key misses; a bad file or a program
jax cannot export runs on the plain jit path with a warning."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtarl import aot
from dtarl.batch import RolloutBatch
from dtarl.engines import base
from dtarl.engines.dense import DenseEngine
from dtarl.losses import MaskedNLLLoss
from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine


def counted(fn):
    """``fn`` and a list that grows by one each time it is traced."""
    traces = []

    def f(*args):
        traces.append(1)
        return fn(*args)

    return f, traces


def axpy(a, x, y):
    return a * x + jnp.sin(y), (x * y).sum()


ARGS = (np.float32(2.0), np.arange(6, dtype=np.float32), np.ones(6, np.float32))


def test_store_off_is_plain_jit():
    assert aot.program_store() is None  # the suite never enables it process-wide
    f = aot.jit(axpy, name="axpy")
    assert not isinstance(f, aot.StoredJit)


def test_second_build_loads_and_never_traces(store):
    f1, t1 = counted(axpy)
    want = aot.jit(f1, name="axpy", static="v1")(*ARGS)
    assert len(t1) == 1 and store.stats.exported == 1 and store.stats.loaded == 0
    loads = []
    f2, t2 = counted(axpy)
    got = aot.jit(f2, name="axpy", static="v1", on_load=lambda: loads.append(1))(*ARGS)
    assert t2 == [] and loads == [1] and store.stats.loaded == 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_other_shapes_static_or_source_miss(store, monkeypatch):
    aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    # (A fresh function each time: jax keeps traces of one function across jits.)
    f, traces = counted(axpy)
    g = aot.jit(f, name="axpy", static="v1")
    g(np.float32(2.0), np.arange(4, dtype=np.float32), np.ones(4, np.float32))  # shapes
    g(2.0, *ARGS[1:])  # a weak-typed scalar
    f, more = counted(axpy)
    aot.jit(f, name="axpy", static="v2")(*ARGS)  # static
    monkeypatch.setattr(store, "fingerprint", "another source")
    f, source = counted(axpy)
    aot.jit(f, name="axpy", static="v1")(*ARGS)  # source
    assert (len(traces), len(more), len(source)) == (2, 1, 1)
    assert store.stats.loaded == 0 and store.stats.exported == 5


def test_fingerprint_follows_the_source(tmp_path):
    def package(name: str, b: str):
        pkg = tmp_path / name
        (pkg / "sub").mkdir(parents=True)
        (pkg / "a.py").write_text("x = 1\n")
        (pkg / "sub" / "b.py").write_text(b)
        (pkg / "notes.txt").write_text(name)  # not source
        return pkg

    first = aot.source_fingerprint(package("one", "y = 2\n"))
    assert aot.source_fingerprint(package("two", "y = 2\n")) == first  # content, not place
    assert aot.source_fingerprint(package("three", "y = 3\n")) != first
    assert len(aot.source_fingerprint()) == 64  # the dtarl package's own


def test_corrupt_file_warns_and_runs_plain(store):
    want = aot.jit(axpy, name="axpy", static="v1")(*ARGS)
    (file,) = [p for p in os.listdir(store.path) if p.endswith(".program")]
    path = os.path.join(store.path, file)
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])  # truncated
    f, traces = counted(axpy)
    with pytest.warns(RuntimeWarning, match="'axpy' runs on the normal jit path"):
        got = aot.jit(f, name="axpy", static="v1")(*ARGS)
    assert len(traces) == 1 and store.stats.loaded == 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unexportable_program_warns_and_runs_plain(store):
    def with_callback(x):
        y = jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return y + 1.0

    x = np.linspace(0, 1, 5, dtype=np.float32)
    with pytest.warns(RuntimeWarning, match="'cb' runs on the normal jit path"):
        got = aot.jit(with_callback, name="cb")(x)
    np.testing.assert_allclose(np.asarray(got), np.cos(x) + 1.0, rtol=1e-6)
    assert store.stats.exported == 0 and store.stats.failed == 1
    assert not [p for p in os.listdir(store.path) if p.endswith(".program")]


def test_donation_and_out_shardings_kept(store):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
    rows = NamedSharding(mesh, P("dp"))

    def step(w, pool):
        return pool + w.sum(), w * 2.0

    w = np.ones((4, 4), np.float32)
    results = []
    for _ in range(2):  # exported, then loaded
        pool = jax.device_put(jnp.zeros((8, 4)), rows)
        f = aot.jit(step, name="step", donate_argnums=(1,), out_shardings=(rows, rows))
        new, w2 = f(w, pool)
        assert pool.is_deleted()
        assert new.sharding == rows and w2.sharding == rows
        results.append((np.asarray(new), np.asarray(w2)))
    assert store.stats.exported == 1 and store.stats.loaded == 1
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


TINY = ModelConfig.tiny(num_layers=1)


def tiny_batch() -> RolloutBatch:
    rs = np.random.RandomState(0)
    toks = [[1] + list(rs.randint(3, 200, n)) for n in (5, 9, 7, 3)]
    return RolloutBatch.create(
        tokens=toks,
        prompt_lens=[2, 2, 3, 3],
        advantages=rs.randn(4),
        group_ids=np.asarray([0, 0, 1, 1]),
    )


def test_engine_from_warm_store_traces_nothing_and_matches(store):
    model = Decoder(TINY, seed=0)
    params = nnx.split(model, nnx.Param)[1]
    batch, loss = tiny_batch(), MaskedNLLLoss()
    first = DenseEngine(model)
    want = first.value_and_grad(params, batch, loss)
    assert first.trace_count == 1 and store.stats.exported == 1

    second = DenseEngine(model)
    device_fn = second.device_fn
    built = []

    def spy(loss, static):
        inner = device_fn(loss, static)
        f, traces = counted(inner)
        built.append(traces)
        return f

    second.device_fn = spy
    got = second.value_and_grad(params, batch, loss)
    assert [len(t) for t in built] == [0]  # built, never traced: read from the store
    assert second.trace_count == 1 and store.stats.loaded == 1  # a load counts as built
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(got[2].logprobs, want[2].logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
    # Another temperature is another program (the engine's settings are in the key).
    assert base.engine_identity(DenseEngine(model, temperature=0.5)) != base.engine_identity(second)
    # The stored program is the plain jit's: same numbers bit for bit.
    aot.disable_program_store()
    plain = DenseEngine(model).value_and_grad(params, batch, loss)
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(want[0]))
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rollout_engine_from_warm_store_same_tokens(store):
    model = Decoder(TINY, seed=0)
    weights = nnx.split(model, nnx.Param)[1]
    cfg = ContinuousConfig(
        slots=2, groups=1, group_size=2, prompt_len=16, response_len=16, steps_per_call=4
    )

    def run(eng):
        g = eng.submit([1, 5, 9, 4], n=2, max_new_tokens=6, seed=3)
        eng.run(weights)
        return [r.result() for r in g.requests]

    first = RolloutEngine(model, cfg)
    want = run(first)
    exported = store.stats.exported
    assert exported >= 2 and store.stats.loaded == 0  # prefill and decode at least

    second = RolloutEngine(model, cfg)
    got = run(second)
    assert store.stats.loaded == exported and store.stats.exported == exported
    assert store.stats.failed == 0
    assert second.trace_count == first.trace_count  # each load counts as a trace
    for (t, lp), (t_ref, lp_ref) in zip(got, want, strict=True):
        assert t.tolist() == t_ref.tolist()
        np.testing.assert_array_equal(lp, lp_ref)


def test_outputs_fed_back_run_one_executable(store):
    """A stored program's outputs are committed arrays; fed back (a training loop's
    params, the rollout's pool), they must not make its next call compile again."""
    compiles = []

    def on_duration(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            if "feedback" in str(kwargs.get("fun_name", "")):
                compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        f = aot.jit(lambda s, x: (s + x, x * 2.0), name="feedback", donate_argnums=(0,))
        s, x = jnp.zeros(3), jnp.ones(3)  # uncommitted, as a fresh model's params
        for _ in range(3):
            s, x = f(s, x)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert len(compiles) == 1
    np.testing.assert_array_equal(np.asarray(s), np.full(3, 7.0, np.float32))
