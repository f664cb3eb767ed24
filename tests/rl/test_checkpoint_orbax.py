"""Orbax checkpoints: named leaves, async commit, keep-N, restore onto another mesh,
kill -9 mid-save, two processes writing their own shards, the old layout refused."""

import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding
from orbax.checkpoint._src.checkpointers import async_checkpointer

from dtarl.model import Decoder
from dtarl.parallel import launch as launch_lib
from dtarl.parallel.mesh import make_mesh, shard_params
from dtarl.rl.checkpoint import CheckpointError, CheckpointManager, leaf_names
from dtarl.rl.state import HostRecord, TrainState
from dtarl.testing import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def params():
    return nnx.split(Decoder(tiny_config(), rngs=nnx.Rngs(0)), nnx.Param)[1]


def _flat_names(tree, prefix=()) -> list[str]:
    if isinstance(tree, dict):
        return sum((_flat_names(v, (*prefix, k)) for k, v in tree.items()), [])
    return ["/".join(prefix)]


def test_saved_leaves_are_named_by_their_paths(tmp_path, params):
    tree = {"params": params, "opt_state": optax.adamw(1e-3).init(params)}
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(7, tree, {"data_cursor": 3})
    mgr.wait()
    # Orbax's own metadata of the saved item: a nested dict keyed by path names.
    saved = ocp.StandardCheckpointer().metadata(os.path.join(mgr.path(7), "state")).item_metadata
    names = sorted(_flat_names(dict(saved)))
    assert names == sorted(leaf_names(tree)) and len(names) == len(jax.tree.leaves(tree))
    for want in (
        "params/layers/self_attn/q_proj",
        "params/norm/weight",
        "opt_state/0/count",
        "opt_state/0/mu/layers/mlp/down_proj",
        "opt_state/0/nu/embed_tokens",
    ):
        assert want in names
    assert saved["params"]["layers"]["self_attn"]["q_proj"].shape == (2, 64, 4, 16)
    restored, meta = mgr.restore(7, tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)
    assert meta["data_cursor"] == 3 and meta["step"] == 7
    with pytest.raises(CheckpointError, match="two leaves of the tree map to"):
        leaf_names({"a": {"b": 1}, "a/b": 2})
    with pytest.raises(CheckpointError, match=r"'x\.y'.*cannot be stored"):
        mgr.save(8, {"x.y": jnp.zeros(2)})


def test_train_state_is_one_step_of_named_leaves_and_a_host_record(tmp_path, params):
    """A trainer's step: the TrainState's leaves named by field (no reference policy or
    value model when the run has none) and the host record in the same committed step;
    restored bit for bit into a template. A trainer step of an earlier layout (no train
    state) is refused naming its path."""
    opt = optax.adamw(1e-3)
    state = TrainState.create(params=params, seed=3, opt_state=opt.init(params))
    state = state.replace(step=4)
    host = HostRecord(phase="rl", data_cursor=12, skipped=1, seed=3, config={"steps": 5})
    mgr = CheckpointManager(tmp_path)
    assert mgr.save_state(state, host.to_dict()) == mgr.path(4)
    mgr.wait()
    saved = ocp.StandardCheckpointer().metadata(os.path.join(mgr.path(4), "state")).item_metadata
    names = _flat_names(dict(saved))
    assert {"step", "key", "params/norm/weight", "opt_state/0/count"} <= set(names)
    assert not any(n.startswith(("ref_params", "value_")) for n in names)
    got = HostRecord.from_dict(mgr.read_host(4), where=mgr.path(4))
    assert got == host
    target = TrainState.create(params=params, seed=0, opt_state=opt.init(params))
    restored, _ = mgr.restore_state(4, target)
    assert restored.global_step == 4
    np.testing.assert_array_equal(restored.key, np.asarray(jax.random.PRNGKey(3)))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    mgr.save(5, {"params": params}, {"data_cursor": 1})  # a pre-TrainState trainer step
    with pytest.raises(CheckpointError, match=r"step_00000005: trainer checkpoint in an old"):
        mgr.read_host(5)
    with pytest.raises(CheckpointError, match=r"step_00000004: .* lacks \['seed'\]"):
        HostRecord.from_dict(
            {"phase": "rl", "data_cursor": 0, "skipped": 0, "config": {}}, where=mgr.path(4)
        )


def test_save_returns_before_the_commit_and_keeps_n(tmp_path, monkeypatch):
    """The commit (Orbax's rename of the temporary directory) is held back: ``save``
    has returned, the step is not listed, its arrays are on disk uncommitted (and
    deleting the saved device array meanwhile is safe); once released, ``wait``
    commits it. Then keep=2 drops the oldest steps."""
    gate = threading.Event()
    real_commit = async_checkpointer._on_commit_callback

    def held_commit(*args, **kwargs):
        gate.wait(60)
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", held_commit)
    mgr = CheckpointManager(tmp_path, keep=2)
    tree = {"w": jnp.arange(6.0).reshape(2, 3)}
    donated = jnp.arange(6.0).reshape(2, 3) * 10
    assert mgr.save(1, {"w": donated}) == mgr.path(1)
    donated.delete()  # as a donating update would: save has copied it off the device
    assert mgr.steps() == [] and mgr.latest_step() is None
    # The background write creates the temporary directory a moment after ``save``
    # returns (on a loaded machine, after this line): wait for it, never for the commit.
    deadline = time.monotonic() + 60
    while not os.listdir(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.listdir(tmp_path) == ["step_00000001.orbax-checkpoint-tmp"]
    gate.set()
    mgr.wait()
    assert mgr.steps() == [1]
    np.testing.assert_array_equal(mgr.restore(1, tree)[0]["w"], tree["w"] * 10)
    for s in (2, 3, 4):
        mgr.save(s, {"w": tree["w"] + s})
    mgr.wait()
    assert mgr.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
    np.testing.assert_array_equal(mgr.restore(4, tree)[0]["w"], tree["w"] + 4)
    mgr.save(4, {"w": tree["w"] - 1})  # re-saving a step replaces it
    mgr.close()
    np.testing.assert_array_equal(
        CheckpointManager(tmp_path).restore(4, tree)[0]["w"], tree["w"] - 1
    )


def test_restore_onto_a_different_mesh(tmp_path, params):
    """Saved tp-sharded at dp=4, tp=2; restored at dp=8 and on one device."""
    saved = shard_params(params, make_mesh(dp=4, tp=2))
    q = saved["layers"]["self_attn"]["q_proj"].get_value()
    assert "tp" in q.sharding.spec and len(q.addressable_shards) == 8
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"params": saved})
    host = [np.asarray(x) for x in jax.tree.leaves(params)]

    at_dp8 = shard_params(jax.tree.map(jnp.zeros_like, params), make_mesh(dp=8, tp=1))
    one_dev = jax.device_put(jax.tree.map(jnp.zeros_like, params), jax.devices()[0])
    for target in (at_dp8, one_dev):
        out, _ = mgr.restore(1, {"params": target})
        for got, want, t in zip(
            jax.tree.leaves(out["params"]), host, jax.tree.leaves(target), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got), want)
            assert got.sharding == t.sharding
    leaf = jax.tree.leaves(out["params"])[0]
    assert isinstance(leaf.sharding, SingleDeviceSharding)
    # An abstract target (shapes + shardings only) restores too.
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), at_dp8
    )
    out, _ = mgr.restore(1, {"params": abstract})
    np.testing.assert_array_equal(jax.tree.leaves(out["params"])[0], host[0])


def test_old_layout_is_refused(tmp_path):
    old = tmp_path / "step_00000005"
    (old / "state").mkdir(parents=True)
    (old / "meta.json").write_text('{"step": 5}')
    mgr = CheckpointManager(tmp_path)
    # Not verifiable (no manifest), and not skipped into a silent fresh start either.
    with pytest.raises(CheckpointError, match=r"none of the saved steps \[5\] is intact"):
        mgr.latest_step()
    assert mgr.steps() == [5]
    for call in (lambda: mgr.read_meta(5), lambda: mgr.restore(5, {"w": jnp.zeros(2)})):
        with pytest.raises(CheckpointError, match=r"step_00000005: checkpoint in the old layout"):
            call()
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 6 \(have \[5\]\)"):
        mgr.read_meta(6)


# ------------------------------------------------------------ kill -9 mid-save

KILL_CHILD = """
import sys, threading
import jax.numpy as jnp
from orbax.checkpoint._src.checkpointers import async_checkpointer
from dtarl.rl.checkpoint import CheckpointManager

def f(s):
    return {"a": jnp.full((128, 256), s, jnp.float32), "b": jnp.arange(4096) * s}

directory, hold = sys.argv[1], sys.argv[2] == "hold"
written = threading.Event()
if hold:  # the write completes but its commit (the rename) never happens

    def held(*a, **k):
        written.set()  # the write is complete: its tmp directory exists
        threading.Event().wait()

    async_checkpointer._on_commit_callback = held
mgr = CheckpointManager(directory, keep=3)
s = (mgr.latest_step() or 0) + 1
while True:
    mgr.save(s, f(s), {"s": s})
    if hold:  # killed only once the write is complete (not while it may not have begun)
        written.wait()
    print("returned", s, flush=True)
    if hold:
        threading.Event().wait()
    s += 1
"""


def _f(s):
    return {"a": np.full((128, 256), s, np.float32), "b": np.arange(4096) * s}


def _run_and_kill(script, directory, mode, after):
    """Runs the saving loop and SIGKILLs it as soon as it printed ``returned after``."""
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    log = script.parent / "child.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(directory), mode],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        try:
            seen = 0
            for line in proc.stdout:
                if line.startswith("returned"):
                    seen += 1
                    if seen == after:
                        break
            os.kill(proc.pid, signal.SIGKILL)
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == -signal.SIGKILL, f"the saving loop ended by itself:\n{log.read_text()[-3000:]}"
    return seen


def test_kill_9_during_saves_never_leaves_a_bad_checkpoint(tmp_path):
    """Rounds of a saving loop (value = f(step)) killed with SIGKILL: right after the
    2nd save returned, with a write complete but uncommitted, right after the 1st
    save returned (its write in flight), and after the 5th (past keep=3, so while
    old steps are being dropped). After each, a fresh manager lists only complete
    steps, and each restores to exactly f(step)."""
    script = tmp_path / "child.py"
    script.write_text(KILL_CHILD)
    directory = tmp_path / "ckpt"
    template = {"a": np.zeros((128, 256), np.float32), "b": np.zeros(4096, np.int32)}
    last = 0
    for mode, after in (("loop", 2), ("hold", 1), ("loop", 1), ("loop", 5)):
        assert _run_and_kill(script, directory, mode, after) == after
        mgr = CheckpointManager(directory, keep=3)
        steps = mgr.steps()
        if mode == "hold":  # the held step was written but never committed
            assert steps[-1] == last
        else:  # a save starts once the previous one is committed
            assert steps[-1] in (last + after - 1, last + after)
        assert len(steps) <= 4  # keep=3 (+1 when killed between a commit and the delete)
        for s in steps:
            tree, meta = mgr.restore(s, template)
            assert meta["s"] == s
            for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(_f(s)), strict=True):
                np.testing.assert_array_equal(got, want)
        if mode == "hold":  # its uncommitted write is there, and reads left it alone
            assert f"step_{last + 1:08d}.orbax-checkpoint-tmp" in os.listdir(directory)
        last = steps[-1]
    assert last >= 5  # the last round ran past keep=3: old steps were dropped


# ------------------------------------------------------------- two processes

MP_WORKER = """
import sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dtarl.parallel.mesh import make_mesh, global_array
from dtarl.rl.checkpoint import CheckpointManager

mesh = make_mesh(dp=jax.device_count(), tp=1)
sharding = NamedSharding(mesh, P("dp"))
host = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
x = global_array(host, sharding)
assert not x.is_fully_addressable  # a global array: each process holds half
mgr = CheckpointManager(sys.argv[1], keep=2)
mgr.save(1, {"w": x}, {"procs": jax.process_count()})
mgr.wait()
target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
tree, meta = mgr.restore(1, target)
for shard in tree["w"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
assert tree["w"].sharding == sharding and meta["procs"] == 2
mgr.close()
print(f"rank {jax.process_index()} restored its shards", flush=True)
"""


def test_two_processes_write_their_own_shards(tmp_path, capsys):
    (tmp_path / "worker.py").write_text(MP_WORKER)
    directory = tmp_path / "ckpt"
    res = launch_lib.launch(
        [str(tmp_path / "worker.py"), str(directory)],
        2,
        devices_per_proc=2,
        init_timeout=60,
        timeout=120,
    )
    out = capsys.readouterr()
    assert res.returncode == 0, out.out[-3000:] + out.err[-3000:]
    for r in (0, 1):
        assert f"[rank {r}] rank {r} restored its shards" in out.out
    state = directory / "step_00000001" / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state))
    # This single process (8 devices) reads the two-process checkpoint back whole.
    tree, _ = CheckpointManager(directory).restore(1, {"w": jnp.zeros((8, 3))})
    np.testing.assert_array_equal(tree["w"], np.arange(24, dtype=np.float32).reshape(8, 3))


def test_a_checkpoint_of_unstacked_layers_is_refused(tmp_path, params):
    """Saved when each decoder layer had its own parameters (params/layers/0/...):
    refused with what to do, not restored into the stacked [L, ...] layout."""
    stacked = {"params": params}
    unstacked = {
        "params": {
            "embed_tokens": params["embed_tokens"].get_value(),
            "layers": {
                str(i): {"mlp": {"up_proj": params["layers"]["mlp"]["up_proj"].get_value()[i]}}
                for i in range(2)
            },
        }
    }
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, unstacked)
    with pytest.raises(CheckpointError, match=r"layers were separate parameters.*not converted"):
        mgr.restore(1, stacked)
