"""Config parsing (every shipped YAML, overrides, errors) and atomic checkpoints."""

import errno
import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.checkpointers import async_checkpointer

from dtarl.engines import EngineConfig, EngineKind
from dtarl.rl.capacity import TOOL_TOKENS, capacity, response_budget
from dtarl.rl.checkpoint import CheckpointError, CheckpointManager
from dtarl.rl.config import (
    Algorithm,
    ConfigError,
    MeshSection,
    TrainerConfig,
    from_dict,
    load_config,
    to_dict,
)
from dtarl.rl.optim import make_loss
from dtarl.rl.tasks import TaskKind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_yaml_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainerConfig)
    assert load_config(None, [f"{k}={v}" for k, v in []]) is not None
    with open(path) as f:
        assert f.readline().startswith("# dtarl train configs/")  # header names the command


def test_overrides_and_types():
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        ["rollout.group_size=4", "algo.algorithm=dapo", "task.kind=countdown", "steps=3"],
    )
    assert cfg.rollout.group_size == 4 and cfg.steps == 3
    assert cfg.algo.algorithm is Algorithm.DAPO and cfg.algo.eps_high == 0.28
    assert cfg.algo.use_dynamic_sampling
    assert cfg.task.kind is TaskKind.COUNTDOWN
    assert to_dict(cfg)["algo"]["algorithm"] == "dapo"
    assert TrainerConfig.quickstart().model.preset == "tiny"


def test_unknown_keys_list_valid_keys():
    with pytest.raises(ConfigError, match="rollout: unknown keys \\['groupsize'\\]; valid keys"):
        load_config(None, ["rollout.groupsize=4"])
    with pytest.raises(ConfigError, match="unknown keys \\['stepz'\\]"):
        load_config(None, ["stepz=4"])
    with pytest.raises(ConfigError, match="algo.algorithm='sac' is not valid; accepted"):
        load_config(None, ["algo.algorithm=sac"])
    with pytest.raises(ConfigError, match="rollout.group_size=0 must be > 0"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(None, ["steps=abc"])
    with pytest.raises(ConfigError, match="model.overrides: unknown keys"):
        load_config(None, ["model.overrides={hiden_size: 8}"])


def test_engine_kind_and_engine_section(tmp_path):
    cfg = load_config(None, ["algo.engine=dfs", "engine.dfs.chunk_len=64"])
    assert cfg.algo.engine is EngineKind.DFS and cfg.engine.dfs.chunk_len == 64
    assert (
        TrainerConfig().algo.engine is EngineKind.AUTO and TrainerConfig().engine == EngineConfig()
    )
    path = tmp_path / "engine.yaml"
    path.write_text(
        "algo: {engine: prefix_reuse}\n"
        "engine: {dfs: {chunk_len: 32, order: greedy}, auto: {candidates: [dfs, dense]}}\n"
    )
    cfg = load_config(path)
    assert cfg.algo.engine is EngineKind.PREFIX_REUSE
    assert cfg.engine.dfs.chunk_len == 32 and cfg.engine.auto.candidates == ("dfs", "dense")
    # to_dict round-trips (checkpoint metadata is JSON): enums as values, tuples as lists.
    data = json.loads(json.dumps(to_dict(cfg)))
    assert data["engine"]["auto"]["candidates"] == ["dfs", "dense"]
    assert data["algo"]["engine"] == "prefix_reuse"
    assert from_dict(TrainerConfig, data) == cfg


def test_engine_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"algo.engine='dfz' is not valid; accepted: \['dense', "):
        load_config(None, ["algo.engine=dfz"])
    with pytest.raises(ConfigError, match=r"^engine.dfs.chunk_len=0: must be >= 1$"):
        load_config(None, ["engine.dfs.chunk_len=0"])
    with pytest.raises(ConfigError, match=r"engine.dfs: unknown keys \['chunk'\]; valid keys"):
        load_config(None, ["engine.dfs.chunk=64"])
    with pytest.raises(
        ConfigError, match="engine.auto.candidates=\\['foo'\\]: each must be one of"
    ):
        load_config(None, ["engine.auto.candidates=[foo]"])
    with pytest.raises(ConfigError, match="engine.prefix_reuse.deep_trees='x' is not valid"):
        load_config(None, ["engine.prefix_reuse.deep_trees=x"])
    # The silent fallback is gone: an old YAML key is an unknown key.
    with pytest.raises(ConfigError, match=r"algo: unknown keys \['fallback_engine'\]"):
        load_config(None, ["algo.fallback_engine=dfs"])


def _tree(x):
    return {"w": jnp.full((3,), x, jnp.float32), "count": jnp.asarray(int(x), jnp.int32)}


def test_checkpoint_roundtrip_and_keep(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for s in (1, 2, 3):
        mgr.save(s, _tree(s), {"data_cursor": s * 10})
    mgr.wait()  # saves are async: step 3 is listed once committed
    assert mgr.steps() == [2, 3]
    tree, meta = mgr.restore(3, _tree(0))
    np.testing.assert_array_equal(tree["w"], [3, 3, 3])
    assert int(tree["count"]) == 3 and meta["data_cursor"] == 30 and meta["step"] == 3
    with pytest.raises(CheckpointError, match=r"does not match.*w: saved \(3,\) float32, exp"):
        mgr.restore(3, {"w": jnp.zeros((4,)), "count": jnp.asarray(0, jnp.int32)})
    with pytest.raises(CheckpointError, match=r"missing \['v'\]"):
        mgr.restore(3, {"v": jnp.zeros((3,))})


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The disk fills up while step 2 is written in the background: ``wait`` raises,
    step 1 stays the latest and valid, and the next save of step 2 succeeds."""
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save(1, _tree(1), {"data_cursor": 1})
    mgr.wait()

    def full_disk(tmpdir, checkpoint_start_time):  # Orbax's commit (the rename), dies
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", full_disk)
    mgr.save(2, _tree(2), {"data_cursor": 2})  # returns: the write is in the background
    with pytest.raises(CheckpointError, match=r"step_00000002.*still valid"):
        mgr.wait()
    assert mgr.latest_step() == 1
    assert "step_00000002.orbax-checkpoint-tmp" in os.listdir(tmp_path)  # written, uncommitted
    monkeypatch.undo()
    tree, meta = CheckpointManager(tmp_path).restore(1, _tree(0))
    np.testing.assert_array_equal(tree["w"], [1, 1, 1])
    again = CheckpointManager(tmp_path, keep=3)
    again.save(2, _tree(2), {"data_cursor": 2})
    again.wait()
    assert again.steps() == [1, 2] and again.restore(2, _tree(0))[1]["data_cursor"] == 2
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]  # tmp removed


def test_entropy_coef_reaches_the_loss():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml")
    loss = make_loss(load_config(path, overrides=["algo.entropy_coef=0.01"]), 32)
    assert loss.entropy_coef == 0.01 and loss.needs_entropy
    assert not make_loss(load_config(path), 32).needs_entropy
    with pytest.raises(ConfigError, match="entropy_coef"):
        load_config(path, overrides=["algo.entropy_coef=-1"])


def test_exponent_floats_parse_as_numbers(tmp_path):
    """``1e-3`` as users type it (YAML 1.1 wants ``1.0e-3`` and reads ``1e-3`` as a string)."""
    cfg = load_config(None, ["optim.lr=1e-3", "sft.lr=5E-4", "algo.value_lr=2.5e-2"])
    assert cfg.optim.lr == 0.001 and cfg.sft.lr == 0.0005 and cfg.algo.value_lr == 0.025
    path = tmp_path / "lr.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  weight_decay: 1e-2\nsteps: 3\nout_dir: 1e3run\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 0.001 and cfg.optim.weight_decay == 0.01
    assert cfg.steps == 3 and cfg.out_dir == "1e3run"  # ints and strings are unchanged
    with pytest.raises(ConfigError, match="steps=1000.0 must be an integer"):
        load_config(None, ["steps=1e3"])


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in (0, 1]"),
        ("rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]"),
        ("rollout.temperature=-0.5", "rollout.temperature=-0.5 must be >= 0"),
        ("rollout.top_k=-1", "rollout.top_k=-1 must be >= 0"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 must be > 0"),
        ("algo.clip_eps=1.2", "algo.clip_eps=1.2 must be in [0, 1)"),
        ("algo.clip_eps=-0.1", "algo.clip_eps=-0.1 must be in [0, 1)"),
        ("algo.clip_eps_high=-0.1", "algo.clip_eps_high=-0.1 must be >= 0"),
        ("algo.kl_coef=-1", "algo.kl_coef=-1.0 must be >= 0"),
        ("algo.gamma=1.5", "algo.gamma=1.5 must be in [0, 1]"),
        ("algo.lam=-0.1", "algo.lam=-0.1 must be in [0, 1]"),
        ("algo.updates_per_batch=0", "algo.updates_per_batch=0 must be > 0"),
        ("algo.overlong_buffer=7", "algo.overlong_buffer=7 must be <= the response budget"),
        ("task.max_turns=3", "task.max_turns=3: only the calculator task has turns"),
        ("task.max_operand=0", "task.max_operand=0 must be > 0"),
        ("task.ops='+/'", "task.ops='+/' must be a non-empty subset of '+-*'"),
        ("optim.lr=-1e-3", "optim.lr=-0.001 must be > 0"),
        ("optim.b1=1", "optim.b1=1.0 must be in [0, 1)"),
        ("optim.weight_decay=-1", "optim.weight_decay=-1.0 must be >= 0"),
        ("optim.max_grad_norm=0", "optim.max_grad_norm=0.0 must be > 0"),
        ("sft.lr=0", "sft.lr=0.0 must be > 0"),
        ("sft.batch_size=0", "sft.batch_size=0 must be > 0"),
        ("model.seed=-1", "model.seed=-1 must be >= 0"),
        ("model.overrides={num_layers: 0}", "model.overrides={'num_layers': 0}: num_layers=0"),
        ("seed=-1", "seed=-1 must be >= 0"),
        ("steps=-1", "steps=-1 must be >= 0"),
        ("keep_checkpoints=0", "keep_checkpoints=0 must be > 0"),
        ("model.tokenizer_path=/nonexistent", "model.tokenizer_path='/nonexistent' has no"),
    ],
)
def test_bad_values_exit_2_before_any_model(assignment, message, capsys, monkeypatch):
    """Every range check runs at config load: one line naming key, value and range,
    exit code 2, and no model is built."""
    import dtarl.model as model_mod
    from dtarl import cli

    def no_model(*a, **k):
        raise AssertionError("a model was built for a bad config")

    monkeypatch.setattr(model_mod, "init_model", no_model)  # ModelSection.build's
    monkeypatch.setattr(model_mod, "load_hf", no_model)
    quickstart = os.path.join(ROOT, "configs", "quickstart.yaml")
    assert cli.main(["train", quickstart, "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_calculator_turns_are_checked():
    assert load_config(None, ["task.kind=calculator", "task.max_turns=3"]).task.max_turns == 3
    with pytest.raises(ConfigError, match=r"task.max_turns=1 must be >= 2 \(calculator\)"):
        load_config(None, ["task.kind=calculator", "task.max_turns=1"])


def test_sections_build_their_objects():
    """Each section builds its own object; the run's capacity is computed in one place."""
    cfg = load_config(None, ["optim.lr=0.5", "optim.warmup_steps=2", "sft.lr=0.25"])
    opt = cfg.optim.build(total=8)
    assert [float(opt.schedule(s)) for s in (0, 1, 2, 7)] == [0.0, 0.25, 0.5, 0.5]
    sft = cfg.sft.build_optimizer(cfg.optim)
    assert float(sft.schedule(0)) == 0.25  # no warm-up, constant
    assert MeshSection(dp=1, tp=1).build() is None  # one device: no mesh
    algo = load_config(None, ["algo.autotune_budget_seconds=7", "algo.darts.enabled=true"]).algo
    assert algo.engine_config(EngineConfig()).auto.budget_seconds == 7
    assert algo.darts.candidates(4) == 8 and cfg.algo.darts.candidates(4) == 4
    assert cfg.algo.build_loss(32) == make_loss(cfg, 32)
    assert cfg.algo.build_value(None, seed=0) is None  # GRPO: no value model
    assert response_budget(8, 1) == 8 and response_budget(8, 3) == 8 * 3 + 2 * TOOL_TOKENS
    cap = capacity(
        sequences=9,
        groups=3,
        length=40,
        group_size=3,
        prompt_len=8,
        response_len=32,
        turns=1,
        dp=2,
    )
    assert (cap.sequences, cap.groups, cap.length, cap.group_size) == (5, 2, 40, 3)
