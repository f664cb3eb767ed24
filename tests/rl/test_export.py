"""HF export: ``export.hf_dir`` at the end of a run and ``dtarl export`` of a saved step.

A 2-step tiny run (SFT steps, which always move the weights; a checkpoint after
each) exports its final policy; ``transformers`` loads the export and matches
dtarl's logits on the trained parameters, and ``dtarl export`` of step 1 gives
step 1's parameters.
"""

import os

import numpy as np
import pytest
from flax import nnx

from dtarl.cli import main as cli_main
from dtarl.commands.export import ExportError, export_checkpoint
from dtarl.model import init_model
from dtarl.model.config import ModelConfig
from dtarl.model.hf import check_export_dir, load_hf, save_hf, tokenizer_files
from dtarl.model.tokenizer import load_tokenizer
from dtarl.rl import trainer as trainer_mod
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import ConfigError, load_config
from dtarl.rl.trainer import Trainer

TOL = 1e-4  # fp32 forward, dtarl vs transformers (as tests/model/test_hf.py)

TINY = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=2",
    "sft.batch_size=4",
    "steps=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "eval.num_problems=0",
    "console=false",
    "checkpoint_every=1",
    "keep_checkpoints=5",
    "mesh.dp=1",
    "algo.engine=dfs",
]


def _flat(params) -> dict:
    return {p: np.array(v[...], copy=True) for p, v in nnx.to_flat_state(params)}


def _model_params(model) -> dict:
    return _flat(nnx.state(model, nnx.Param))


def _assert_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run (its Trainer, TrainResult) and the parameters after each global step."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [*TINY, f"out_dir={out}", f"export.hf_dir={out / 'hf'}"])
    t = Trainer(cfg)
    after = {}
    t.add_hook(lambda info: after.__setitem__(info.step, _flat(t.params)))
    reports = []  # dtarl launch's watchdog hears from the trainer once per step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_mod, "report_progress", lambda: reports.append(t.step))
        res = t.run()
    assert res.steps_done == 2 and t.ckpt.steps() == [1, 2]
    assert reports == [1, 2]
    return t, res, after


def test_run_export_loads_in_transformers(run):
    torch = pytest.importorskip("torch", reason="torch not installed (the `hf` extra)")
    transformers = pytest.importorskip("transformers", reason="the `hf` extra")
    t, res, after = run
    hf_dir = t.cfg.export.hf_dir
    # The byte tokenizer is no HF tokenizer: weights and config only.
    assert sorted(os.listdir(hf_dir)) == ["config.json", "model.safetensors"]
    _assert_equal(_model_params(load_hf(hf_dir)), _flat(res.params))
    _assert_equal(_flat(res.params), after[2])

    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape)
    ours, _ = nnx.merge(t.graphdef, res.params)(tokens, positions)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(theirs).max() > 0.1  # not a degenerate model
    diff = np.abs(np.asarray(ours) - theirs).max()
    print(f"max |logit diff| dtarl vs transformers on the export: {diff:.2e}")
    assert diff <= TOL


def test_export_command_writes_a_saved_step(run, tmp_path, capsys):
    t, res, after = run
    # The training steps changed the weights: exporting the wrong step would show.
    assert any(not np.array_equal(after[1][k], after[2][k]) for k in after[1])
    out_dir = t.cfg.out_dir
    assert cli_main(["export", out_dir, "--hf", str(tmp_path / "s1"), "--step", "1"]) == 0
    assert "step 1 of" in capsys.readouterr().out
    _assert_equal(_model_params(load_hf(tmp_path / "s1")), after[1])

    # A step directory names its step; a checkpoints/ directory exports the latest.
    step1 = CheckpointManager(os.path.join(out_dir, "checkpoints")).path(1)
    assert export_checkpoint(step1, tmp_path / "s1b") == (str(tmp_path / "s1b"), 1)
    _assert_equal(_model_params(load_hf(tmp_path / "s1b")), after[1])
    ckpts = os.path.join(out_dir, "checkpoints")
    _, step = export_checkpoint(ckpts, tmp_path / "s1", force=True)  # replaces s1
    assert step == 2
    _assert_equal(_model_params(load_hf(tmp_path / "s1")), after[2])


def test_export_command_errors(run, tmp_path, capsys):
    t, _, _ = run
    out_dir = t.cfg.out_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"no checkpoint found; looked for .*meta\.json"):
        export_checkpoint(tmp_path / "empty", tmp_path / "x")
    with pytest.raises(ExportError, match="no such directory"):
        export_checkpoint(tmp_path / "missing", tmp_path / "x")
    with pytest.raises(ExportError, match=r"step 7 not found in .*; available steps: \[1, 2\]"):
        export_checkpoint(out_dir, tmp_path / "x", step=7)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"exists and is not empty \(notes\.txt\); pass --force"):
        export_checkpoint(out_dir, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="contains the checkpoints being exported"):
        export_checkpoint(out_dir, out_dir, force=True)
    step1 = CheckpointManager(os.path.join(out_dir, "checkpoints")).path(1)
    with pytest.raises(ExportError, match="directory of step 1 but --step 2"):
        export_checkpoint(step1, tmp_path / "x", step=2)
    # Through the CLI: one line naming the problem, exit 2.
    assert cli_main(["export", out_dir, "--hf", str(tmp_path / "x"), "--step", "9"]) == 2
    assert "available steps: [1, 2]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_check_export_dir(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    cfg = load_config(None, [*TINY, f"out_dir={tmp_path / 'run'}", f"export.hf_dir={tmp_path}/hf"])
    with pytest.raises(ValueError, match=r"export\.hf_dir=.* holds files that are not a HF export"):
        check_export_dir(cfg.export.hf_dir, what="export.hf_dir")
    with pytest.raises(ValueError, match=r"export\.hf_dir=.* contains out_dir="):
        check_export_dir(tmp_path, what="export.hf_dir", protect=[("out_dir", tmp_path / "r")])
    check_export_dir(tmp_path / "new")  # absent: fine
    assert load_config(None, []).export.hf_dir is None
    with pytest.raises(ConfigError, match=r"export: unknown keys \['dir'\]"):
        load_config(None, ["export.dir=x"])


def test_save_hf_carries_tokenizer_files(tmp_path):
    """A run whose tokenizer came from a HF directory exports its tokenizer files, in the
    same atomic write; unrelated files of that directory stay behind."""
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "x.txt"):
        (tok / name).write_text("{}")
    files = tokenizer_files(tok)
    assert sorted(os.path.basename(f) for f in files) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert tokenizer_files(None) == [] and tokenizer_files(tmp_path) == []
    model = init_model(ModelConfig.tiny(num_layers=1), seed=0)
    out = save_hf(model, tmp_path / "hf", extra_files=files)
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    check_export_dir(out)  # a previous export may be replaced
    with pytest.raises(ValueError, match="would overwrite the checkpoint's own config.json"):
        save_hf(model, tmp_path / "hf2", extra_files=[out + "/config.json"])
    assert not (tmp_path / "hf2").exists()


def test_trainer_export_carries_the_runs_hf_tokenizer(tmp_path):
    """A run whose tokenizer is a HF tokenizer.json: the export holds its files and
    loads back as the same tokenizer (the byte tokenizer's export has none, above)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["what is 3 + 4? the answer is 7"] * 5, trainer=bpe)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>", "pad_token": "<pad>"}')
    (tok_dir / "README.md").write_text("not a tokenizer file")
    cfg = load_config(
        None,
        [*TINY, f"out_dir={tmp_path / 'run'}", f"model.tokenizer_path={tok_dir}"]
        + ["model.overrides={num_layers: 1, vocab_size: 320}"],
    )
    t = Trainer(cfg)
    out = t.export_hf(str(tmp_path / "hf"))
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    back = load_tokenizer(out)
    text = "what is 3 + 4?"
    assert back.encode(text) == t.tokenizer.encode(text)
    assert (back.eos_id, back.pad_id) == (t.tokenizer.eos_id, t.tokenizer.pad_id)
    assert load_hf(out).cfg.vocab_size == 320
