"""A run on dataset rows: the problems carry the rows, the data position is checkpointed
and a resumed run draws exactly the prompts of the uninterrupted one (bit for bit)."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from dtarl.errors import ConfigError
from dtarl.rl.config import load_config
from dtarl.rl.metrics import read_metrics
from dtarl.rl.trainer import Trainer

TINY = [
    "model.overrides={num_layers: 1}",
    "sft.steps=1",
    "sft.batch_size=2",
    "steps=3",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "eval.num_problems=2",
    "console=false",
    "checkpoint_every=1",
    "keep_checkpoints=5",
    "mesh.dp=1",
    "algo.engine=dfs",  # a fixed engine: auto's timed pick could differ between runs
    "data.prompt_key=q",
    "data.response_key=sol",
    "data.max_prompt_length=8",
    "data.truncation=drop",
]


def tiny_config(out_dir, data_dir, *extra):
    files = f"data.train_files={data_dir / 'train.jsonl'}"
    val = f"data.val_files=[{data_dir / 'val.jsonl'}]"
    return load_config(None, [*TINY, files, val, f"out_dir={out_dir}", *extra])


class Recorder:
    """A reward function that records the training rows it scores (a row's ``where``) and
    scores completions unevenly, so that every RL step has nonzero advantages."""

    def __init__(self):
        self.seen: list[str] = []

    def __call__(self, problem, completion) -> float:
        if "val.jsonl" not in problem.row.where:  # evaluation scores with it too
            self.seen.append(problem.row.where)
        assert problem.answer == problem.row.answer and problem.data_source == "toy"
        return sum((i + 1) * ord(c) for i, c in enumerate(completion)) % 11 / 10


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [{"q": f"{a}+{a}=", "answer": str(2 * a), "sol": str(2 * a)} for a in range(5)]
    rows.append({"q": "a much longer prompt", "answer": "0", "sol": "0"})  # dropped: > 8 ids
    for name, part in (("train.jsonl", rows), ("val.jsonl", rows[:2])):
        with open(d / name, "w") as f:
            for r in part:
                f.write(json.dumps({**r, "data_source": "toy"}) + "\n")
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """An uninterrupted 4-step run (A: 1 SFT + 3 RL) and one resumed from A's step-2
    checkpoint (B); each records the rows its reward function saw, per step."""
    a_dir, b_dir = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    rec_a, rec_b = Recorder(), Recorder()
    a = Trainer(tiny_config(a_dir, data_dir), reward_fn=rec_a)
    a.by_step = {}
    a.add_hook(lambda i: a.by_step.__setitem__(i.step, len(rec_a.seen)), every=1)
    res_a = a.run()
    step2 = "checkpoints/step_00000002"
    shutil.copytree(a_dir / step2, b_dir / step2)
    b = Trainer(tiny_config(b_dir, data_dir), reward_fn=rec_b)
    res_b = b.run()
    return a, rec_a, res_a, b, rec_b, res_b


def test_resumed_run_draws_the_uninterrupted_runs_prompts(runs, data_dir):
    a, rec_a, res_a, b, rec_b, res_b = runs
    # 5 rows (one dropped): SFT drew positions 0-1, RL steps 2-3, 4-5, 6-7 (epoch 1).
    assert a.data_cursor == b.data_cursor == 8
    rl = [r for r in read_metrics(a.cfg.out_dir) if r["phase"] == "rl"]
    assert [r["data/epoch"] for r in rl] == [0, 1, 1]
    assert all(r["data/dropped_rows"] == 1 and r["critic/rewards/std"] > 0 for r in rl)
    # B re-ran global steps 3 and 4: the same rows, in the same order, as A's.
    assert rec_b.seen == rec_a.seen[a.by_step[2] :] and len(rec_b.seen) == 2 * 2 * 2
    order = [a.task.train.index(p) for p in range(8)]
    rows = [a.task.train.prompts[i].row.where for i in order]
    assert rec_a.seen[::2] == rows[2:]  # group_size 2: each row scored twice
    assert sorted(order[:4]) == sorted(set(order[:4]))  # no row twice within an epoch
    for x, y in zip(jax.tree.leaves(res_a.params), jax.tree.leaves(res_b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Evaluation ran on the validation rows.
    assert [p.row.where for p in a.eval_problems] == [
        f"{data_dir / 'val.jsonl'}:{n}" for n in (1, 2)
    ]
    assert res_a.eval_end is not None or res_a.eval_start is not None


def test_resume_refuses_changed_rows(runs, data_dir, tmp_path):
    """The checkpoint's data position counts rows of the data it was written with: the
    same files with other rows are refused (the host record's fingerprint)."""
    a = runs[0]
    shutil.copytree(a.cfg.out_dir, tmp_path / "run")
    train = data_dir / "train.jsonl"
    original = train.read_text()
    try:
        with open(train, "a") as f:
            f.write(json.dumps({"q": "9+9=", "answer": "18", "sol": "18", "data_source": "toy"}))
        with pytest.raises(ConfigError, match="the training rows changed .*fingerprint"):
            Trainer(tiny_config(tmp_path / "run", data_dir)).try_resume()
        allowed = tiny_config(tmp_path / "run", data_dir, "resume.allow_changes=true")
        assert Trainer(allowed).try_resume()
    finally:
        train.write_text(original)


@pytest.mark.slow
def test_example_config_trains_through_the_cli(tmp_path, monkeypatch, capsys):
    """configs/examples/jsonl_tiny.yaml as `dtarl train` runs it (from the repository
    root, its paths relative to it), cut to one SFT and one RL step."""
    from dtarl.commands.train import main as cli_main

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    small = [
        "sft.steps=1",
        "steps=1",
        "sft.batch_size=2",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "eval.num_problems=2",
        "eval.every=0",
        "model.overrides={num_layers: 1}",
        "mesh.dp=1",  # one device (the suite simulates 8)
        "algo.engine=dfs",  # no timed engine tuning
        f"out_dir={tmp_path}",
    ]
    argv = ["configs/examples/jsonl_tiny.yaml"] + [x for s in small for x in ("--set", s)]
    assert cli_main(argv) == 0
    recs = read_metrics(str(tmp_path))
    assert [r["phase"] for r in recs if r["phase"] != "eval"] == ["sft", "rl"]
    (rl,) = [r for r in recs if r["phase"] == "rl"]
    assert rl["data/epoch"] == 0 and rl["data/dropped_rows"] == 0
    assert "data: 400 training rows (400 read, 0 dropped" in capsys.readouterr().out
