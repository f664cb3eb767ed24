"""Issue #40 items 5, 8 and 9: bad input gets one line naming the file, row, key or
field and the accepted range; nothing non-finite or out of range gets through."""

import json
import os

import numpy as np
import pytest

from dtarl.batch import BatchError, RolloutBatch
from dtarl.cli import main as cli_main
from dtarl.errors import CheckpointError, ConfigError
from dtarl.model import ModelConfig, init_model
from dtarl.model.hf import load_hf, save_hf
from dtarl.rl.config import OptimSection, SFTSection, TrainerConfig, load_config


def one_line_error(capsys, argv) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------ 5: finite floats


@pytest.mark.parametrize(
    "assignment",
    [
        "sft.lr=.inf",
        "optim.lr=1e400",
        "optim.weight_decay=.inf",
        "optim.b1=.nan",
        "algo.clip_eps=-.inf",
    ],
)
def test_non_finite_numbers_are_refused(assignment):
    key = assignment.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=(inf|-inf|nan) must be a finite number$"):
        load_config(None, [assignment])


def test_non_finite_numbers_are_refused_in_python_too():
    with pytest.raises(ConfigError, match=r"^optim.lr=inf must be a finite number$"):
        TrainerConfig(optim=OptimSection(lr=float("inf")))
    with pytest.raises(ConfigError, match=r"^sft.lr=inf must be a finite number$"):
        TrainerConfig().replace(sft=SFTSection(lr=float("inf")))


# ---------------------------------------------------------- 8: config files


def test_config_path_that_is_a_directory(tmp_path, capsys):
    err = one_line_error(capsys, ["train", str(tmp_path), "--print-config"])
    assert f"{tmp_path}: is a directory, not a YAML config file" in err


def test_config_path_that_is_binary(tmp_path, capsys):
    fp = tmp_path / "c.yaml"
    fp.write_bytes(bytes(range(128, 256)))
    err = one_line_error(capsys, ["train", str(fp), "--print-config"])
    assert f"{fp}: not a text file (byte 0 is not UTF-8)" in err


def test_duplicate_yaml_keys(tmp_path):
    fp = tmp_path / "c.yaml"
    fp.write_text("optim:\n  lr: 1e-3\n  b1: 0.9\n  lr: 5e-3\n")
    with pytest.raises(
        ConfigError,
        match=r"c.yaml:4: malformed YAML .*duplicate key 'lr' "
        r"\(first at line 2\)",
    ):
        load_config(fp)
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(None, ["model.overrides={a: 1, a: 2}"])


def test_group_size_too_large_and_group_of_one(capsys):
    with pytest.raises(
        ConfigError,
        match=r"rollout.prompts_per_step x rollout.group_size = 16 x "
        r"100000000 rollouts per step; accepted: at most 1048576",
    ):
        load_config(None, ["rollout.group_size=100000000"])
    with pytest.raises(
        ConfigError,
        match=r"rollout.group_size=1 with algo.algorithm=grpo: .*"
        r"accepted: rollout.group_size >= 2, or algo.algorithm=ppo",
    ):
        load_config(None, ["rollout.group_size=1"])
    load_config(None, ["rollout.group_size=1", "algo.algorithm=ppo"])  # PPO: a value baseline


# -------------------------------------------------------- 8: HF checkpoints


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf(init_model(ModelConfig.tiny(num_layers=1), seed=0), path)
    return path


def _copy(hf_dir, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    for name in os.listdir(hf_dir):
        (out / name).write_bytes((hf_dir / name).read_bytes())
    return out


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_bad_safetensors_names_the_file(hf_dir, tmp_path, damage):
    d = _copy(hf_dir, tmp_path)
    fp = d / "model.safetensors"
    data = fp.read_bytes()
    fp.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(4096))
    with pytest.raises(CheckpointError, match=rf"{fp}: not a readable safetensors file"):
        load_hf(d)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: [c], r"config.json: expected a JSON object of fields, got list"),
        (lambda c: {**c, "vocab_size": "abc"}, r"config.json: vocab_size='abc' must be an integer"),
        (lambda c: {**c, "rms_norm_eps": [1]}, r"config.json: a field has the wrong type"),
    ],
    ids=["list", "vocab-string", "eps-list"],
)
def test_bad_config_json_is_one_line(hf_dir, tmp_path, edit, message):
    d = _copy(hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(CheckpointError, match=message):
        load_hf(d)


# ------------------------------------------------------------ 8, 9: traces


def test_trace_report_bad_paths(tmp_path, capsys):
    missing = tmp_path / "nope"
    err = one_line_error(capsys, ["trace", "report", str(missing), "--out", str(tmp_path / "o")])
    assert f"{missing}: no such file or directory" in err
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    err = one_line_error(capsys, ["trace", "report", str(empty_dir), "--out", str(tmp_path / "o")])
    assert f"{empty_dir}: no PolyTrace files found" in err
    empty = tmp_path / "packed_lengths_step_1.jsonl"
    empty.write_text("")
    err = one_line_error(capsys, ["trace", "report", str(empty), "--out", str(tmp_path / "o")])
    assert f"{empty}: empty trace file (no records)" in err
    binary = tmp_path / "b" / "packed_lengths_step_2.jsonl"
    binary.parent.mkdir()
    binary.write_bytes(bytes(range(128, 256)))
    err = one_line_error(capsys, ["trace", "report", str(binary), "--out", str(tmp_path / "o")])
    assert f"{binary}: a trace file is not UTF-8 text" in err


# ------------------------------------------------------------- 9: batches


def _batch(**kw):
    base = dict(
        tokens=(np.array([1, 2, 3], np.int32),),
        loss_mask=(np.array([0, 1, 1], np.float32),),
        advantages=np.ones(1, np.float32),
    )
    return {**base, **kw}


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(tokens=(np.array([1, -4, 3], np.int32),)),
            r"tokens\[0\]\[1\] = -4 is not a token id",
        ),
        (dict(advantages=np.array([np.nan], np.float32)), r"advantages\[0\] = nan is not finite"),
        (dict(rewards=np.array([np.inf], np.float32)), r"rewards\[0\] = inf is not finite"),
        (
            dict(old_logprobs=(np.array([0, -1, 0.5], np.float32),)),
            r"old_logprobs\[0\]\[2\] = 0.5 is not a logprob",
        ),
        (
            dict(loss_mask=(np.array([0, 1, 1e30], np.float32),)),
            r"loss_mask\[0\]\[2\] = 1e\+30: accepted: a weight in \[0, 1\]",
        ),
    ],
    ids=["negative-id", "nan-advantage", "inf-reward", "positive-logprob", "huge-mask"],
)
def test_rollout_batch_constructor_validates(kw, message):
    with pytest.raises(BatchError, match=message):
        RolloutBatch(**_batch(**kw))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(rewards=[float("nan")]), r"rewards\[0\] = nan is not finite"),
        (dict(old_logprobs=[[0.0, -0.5, 2.0]]), r"old_logprobs\[0\]\[2\] = 2.0 is not a logprob"),
        (dict(loss_mask=[[0, 1, 1e30]]), r"loss_mask\[0\]\[2\] = 1e\+30: accepted: a weight"),
    ],
    ids=["nan-reward", "positive-logprob", "huge-mask"],
)
def test_rollout_batch_create_validates(kw, message):
    with pytest.raises(BatchError, match=message):
        RolloutBatch.create(tokens=[[1, 2, 3]], **kw)
    ok = RolloutBatch.create(tokens=[[1, 2, 3]], loss_mask=[[0, 0.5, 1]], old_logprobs=[[0, -1, 0]])
    assert ok.loss_mask[0][1] == 0.5
