"""A tiny run with ``reward.function``, ``eval.num_samples`` and every logging backend:
the configured reward scores the rollouts and the evaluation, metrics are logged under
verl's names, and the TensorBoard / W&B (offline) files are read back."""

import glob
import os

import numpy as np
import pytest

from dtarl.errors import ConfigError
from dtarl.rl.config import load_config
from dtarl.rl.logging_backends import METRIC_NAMES, flat_record, logged_record
from dtarl.rl.metrics import read_metrics, sampled_entropy
from dtarl.rl.trainer import Trainer

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "arithmetic" and extra_info is None
    return {"score": 0.5, "chars": len(solution_str)}
"""

TINY = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=0",
    "steps=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "eval.num_problems=3",
    "eval.num_samples=2",
    "console=false",
    "mesh.dp=1",
]


def test_reward_eval_and_backends(tmp_path, monkeypatch):
    backends = ["jsonl"]
    for module, name in (("tensorboardX", "tensorboard"), ("wandb", "wandb")):
        try:
            __import__(module)
            backends.append(name)
        except ImportError:
            pass
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rfile = tmp_path / "reward.py"
    rfile.write_text(REWARD)
    out = tmp_path / "run"
    sets = [f"reward.function={rfile}", f"logging.backends=[{', '.join(backends)}]"]
    res = Trainer(load_config(None, [*TINY, f"out_dir={out}", *sets])).run()
    # The configured reward scored the rollouts (its dict's other number is a metric)...
    (rl,) = [h for h in res.history if h["phase"] == "rl"]
    assert rl["reward_mean"] == rl["score_mean"] == 0.5 and rl["success_rate"] == 0.0
    assert rl["reward/chars"] > 0 and rl["entropy"] > 0
    # ... and the evaluation: greedy reward 0.5 everywhere, which is no success.
    evals = [h for h in res.history if h["phase"] == "eval"]
    assert len(evals) == 2
    for e in evals:
        assert e["val/reward_mean"] == 0.5 and e["val/pass@1"] == e["val/pass@2"] == 0.0
        assert e["val/pass@k"] == 0.0 and 0 < e["val/response_length/mean"] <= 3
    assert res.eval_start == res.eval_end == 0.0
    # metrics.jsonl: verl's names; read back flat, the history.
    recs = read_metrics(str(out))
    (logged,) = [r for r in recs if r["phase"] == "rl"]
    for name in (
        "actor/pg_loss",
        "actor/entropy",
        "actor/kl",
        "actor/clip_fraction",
        "actor/grad_norm",
        "critic/score/mean",
        "response_length/mean",
        "timing/rollout_s",
        "perf/tree_token_ratio",
        "reward/chars",
    ):
        assert name in logged, name
    assert "loss" not in logged and logged["critic/score/mean"] == 0.5
    assert read_metrics(str(out), flat=True)[1]["loss"] == rl["loss"]
    if "tensorboard" in backends:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = glob.glob(str(out / "tb" / "events.out.tfevents.*"))
        acc = EventAccumulator(events)
        acc.Reload()
        tags = acc.Tags()["scalars"]
        # (TensorBoard writes val/pass@1 as val/pass_1: "@" is not a tag character)
        assert {"actor/pg_loss", "val/pass_1", "critic/score/mean"} <= set(tags)
        (ev,) = acc.Scalars("actor/pg_loss")
        assert ev.step == 1 and np.isclose(ev.value, rl["loss"], rtol=1e-6)
    if "wandb" in backends:
        runs = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(runs) == 1 and os.path.getsize(runs[0]) > 0


def test_names_round_trip_and_entropy():
    m = {"loss": 1.0, "eval_success_rate": 0.25, "val/pass@1": 0.5, "phase": "rl", "x": 3}
    rec = logged_record(m)
    assert rec == {"actor/pg_loss": 1.0, "val/pass@1": 0.5, "phase": "rl", "x": 3}
    assert flat_record(rec)["loss"] == 1.0
    assert len(set(METRIC_NAMES.values())) == len(METRIC_NAMES)
    lp = [np.log([1.0, 0.5, 0.25]), np.log([0.5, 0.5])]
    masks = [np.array([0, 1, 1]), np.array([1, 0])]
    np.testing.assert_allclose(sampled_entropy(lp, masks), (np.log(2) * 2 + np.log(4)) / 3)


@pytest.mark.parametrize(
    "sets, match",
    [
        (["eval.num_samples=0"], r"eval.num_samples=0 must be an integer >= 1"),
        (["eval.num_samples=32"], r"eval.num_samples=32 must be <= rollout.group_size=8"),
        (["eval_every=5"], r"eval_every is now eval.every"),
        (["tensorboard=true"], r"tensorboard is now logging.backends"),
        (["logging.backends=[jsonl, mlflow]"], r"'mlflow' is not valid; accepted: \['jsonl',"),
        (["logging.backends=[jsonl, jsonl]"], r"names a backend twice"),
    ],
)
def test_bad_eval_logging_config(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, sets)


class AnswerSampler:
    """A sampler double: ``num_samples`` completions per prompt, the last one of a group
    right for the problems in ``right_last`` (every one in a group of one: greedy)
    and the rest wrong."""

    def __init__(self, tok, problems, right_last):
        self.tok = tok
        self.answers = {p.prompt: p.answer for p in problems}
        self.right = {problems[i].prompt for i in right_last}

    def generate(self, weights, prompts, *, num_samples, seed):
        from dtarl.rollout.sampler import FinishReason, SampleResult

        counts = [num_samples] * len(prompts) if np.ndim(num_samples) == 0 else num_samples
        toks = []
        for p, c in zip(prompts, counts, strict=True):
            text = self.tok.decode(list(p))
            prompt = max((q for q in self.answers if text.endswith(q)), key=len)
            for j in range(c):
                ok = prompt in self.right and j == c - 1
                ans = self.answers[prompt] if ok else self.answers[prompt] + "0"
                toks.append(np.append(np.asarray(self.tok.encode(ans), np.int32), self.tok.eos_id))
        return SampleResult(
            tokens=tuple(toks),
            logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            raw_logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            finish=np.asarray([FinishReason.STOP] * len(toks)),
            prompt_index=np.repeat(np.arange(len(prompts)), counts),
            stats=dict(generated_tokens=sum(len(t) for t in toks), seconds=1.0),
        )


def test_pass_at_k_counts_a_problem_once_one_sample_succeeds():
    from dtarl.model.tokenizer import ByteTokenizer
    from dtarl.rl.evaluate import evaluate_policy
    from dtarl.rl.tasks import ArithmeticTask

    tok, task = ByteTokenizer(), ArithmeticTask(max_operand=50)
    problems = task.generate(np.random.default_rng(0), 8)
    greedy = AnswerSampler(tok, problems, right_last=[0])  # greedy: only problem 0
    sampled = AnswerSampler(tok, problems, right_last=[0, 2, 4])  # one of k for 0, 2, 4
    res = evaluate_policy(greedy, None, tok, task, problems, sampler=sampled, k=3, chunk=3)
    assert (res.pass_at_1, res.pass_at_k, res.k) == (1 / 8, 3 / 8, 3)
    assert res.metrics()["val/pass@3"] == 3 / 8 and res.reward_mean == 1 / 8
    assert evaluate_policy(greedy, None, tok, task, []) is None
