"""The RL loop at tiny sizes: a 3-step run, bit-exact resume, skipped NaN updates,
reward errors, multi-turn rollouts, the CLI, and a HF checkpoint with PPO + KL."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest

from dtarl.cli import main as dtarl_main
from dtarl.commands.train import main as cli_main
from dtarl.engines.config import EngineKind
from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rl.checkpoint import CheckpointManager
from dtarl.rl.config import ConfigError, load_config
from dtarl.rl.episodes import encode_prompt, rollout, tool_stop_sequences
from dtarl.rl.hooks import Phase
from dtarl.rl.metrics import read_metrics
from dtarl.rl.rewards import RewardError, RewardErrorPolicy
from dtarl.rl.state import HostRecord
from dtarl.rl.tasks import CalculatorTask, Problem, safe_eval
from dtarl.rl.trainer import Trainer
from dtarl.rollout.sampler import FinishReason, SampleResult
from dtarl.tree import build_tree

TINY = [
    "model.overrides={num_layers: 1}",
    "task.max_operand=5",
    "sft.steps=1",
    "sft.batch_size=4",
    "steps=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "eval_problems=0",
    "console=false",
    "tensorboard=false",
    "checkpoint_every=1",
    "keep_checkpoints=5",
    "mesh.dp=1",  # one device (the suite has 8 simulated ones; tests/rl/test_trainer_mesh.py)
]


def tiny_config(out_dir, *extra):
    return load_config(None, [*TINY, f"out_dir={out_dir}", *extra])


def leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def varied_reward(problem, completion) -> float:
    """A reward that differs between completions (the task's is 0 for every completion
    of this untrained model): nonzero advantages, so every RL step moves the parameters
    and depends on what was sampled."""
    return sum((i + 1) * ord(c) for i, c in enumerate(completion)) % 11 / 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 3-step run (A) and one resumed from A's step-2 checkpoint (B).

    A fixed engine: auto's pick is timed, so two runs may pick engines that agree
    to fp32 tolerance but not bit for bit. ``a.params_after[s]``: A's parameters
    after global step s."""
    a_dir = tmp_path_factory.mktemp("a")
    b_dir = tmp_path_factory.mktemp("b")
    a = Trainer(tiny_config(a_dir, "algo.engine=dfs"), reward_fn=varied_reward)
    a.seen = {"every 2": [], "rl every 2": []}
    a.params_after = {}
    a.add_hook(lambda i: a.seen["every 2"].append((i.step, i.phase, i.phase_step)), every=2)
    a.add_hook(lambda i: a.seen["rl every 2"].append(i), every=2, phase=Phase.RL)
    a.add_hook(lambda i: a.params_after.__setitem__(i.step, leaves(a.params)), every=1)
    res_a = a.run()
    # "Kill after step 2": B starts from nothing but the checkpoint written after step 2.
    step2 = "checkpoints/step_00000002"
    shutil.copytree(a_dir / step2, b_dir / step2)
    b = Trainer(tiny_config(b_dir, "algo.engine=dfs"), reward_fn=varied_reward)
    res_b = b.run()
    return a, res_a, b, res_b


def test_run_writes_metrics_and_checkpoints(runs):
    a, res_a, _, _ = runs
    assert res_a.steps_done == 3 and a.ckpt.steps() == [1, 2, 3]
    recs = read_metrics(a.cfg.out_dir)
    assert [r["phase"] for r in recs] == ["sft", "rl", "rl"]
    rl = recs[-1]
    for key in (
        "reward_mean",
        "reward_std",
        "response_len_mean",
        "response_len_p90",
        "response_len_max",
        "rollout_tokens_per_s",
        "train_tokens_per_s",
        "tree_token_ratio",
        "clip_fraction",
        "ratio_mean",
        "kl",
        "grad_norm",
        "loss",
    ):
        assert np.isfinite(rl[key]), key
    assert rl["tree_token_ratio"] > 1.0  # G samples share their prompt
    assert rl["skipped"] == 0
    # Buckets were reserved for the run's largest batch: the second RL step
    # compiles nothing new.
    assert rl["engine"] == "dfs" and rl["trace_count"] == recs[-2]["trace_count"] > 0
    # Compile and tuning time per step (JAX's compile events) and summed over the run.
    assert recs[0]["compile_seconds"] > 0  # the first step compiles its programs
    total = 0.0
    for r in recs:
        assert r["compile_seconds"] >= 0 and r["autotune_seconds"] == 0.0  # a fixed engine
        total += r["compile_seconds"]
        assert r["compile_seconds_total"] == pytest.approx(total)
        assert r["autotune_seconds_total"] == 0.0


def test_hooks_run_on_their_steps(runs):
    a, res_a, _, _ = runs
    assert a.seen["every 2"] == [(2, Phase.RL, 1)]  # global step 2 = the first RL step
    (info,) = a.seen["rl every 2"]  # RL steps are counted from the end of the warm-up
    assert (info.step, info.phase_step) == (3, 2)
    assert info.metrics is res_a.history[-1]  # hooks added later see the logged record


def test_engine_section_reaches_the_engine(tmp_path):
    t = Trainer(tiny_config(tmp_path, "algo.engine=dfs", "engine.dfs.chunk_len=64"))
    assert t.engine.name == "dfs" and t.engine.config.chunk_len == 64
    cache = str(tmp_path / "choices.json")
    extra = ("algo.autotune_budget_seconds=30", f"algo.autotune_cache={cache}")
    auto = Trainer(tiny_config(tmp_path, *extra)).engine
    assert auto.config.budget_seconds == 30 and auto.cache.path == cache
    for bad, match in (("-1", "algo.autotune_budget_seconds=-1"), ("''", "algo.autotune_cache")):
        key = "autotune_budget_seconds" if bad == "-1" else "autotune_cache"
        with pytest.raises(ConfigError, match=match):
            tiny_config(tmp_path, f"algo.{key}={bad}")


def test_resume_reproduces_the_uninterrupted_run(runs):
    a, res_a, b, res_b = runs
    assert res_b.steps_done == 3
    # The resumed step has something to reproduce: both RL steps had a gradient, and
    # step 3 (the one B re-runs) moved the parameters, by an update that depends on the
    # step's rollouts (its key, the data cursor) and on the restored optimizer state.
    rl = [r for r in read_metrics(a.cfg.out_dir) if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in rl)
    moved = max(
        np.abs(x - y).max() for x, y in zip(a.params_after[2], a.params_after[3], strict=True)
    )
    assert moved > 1e-5
    for x, y in zip(leaves(res_a.params), leaves(res_b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(leaves(a.opt_state), leaves(b.opt_state), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.data_cursor == b.data_cursor


def test_checkpoint_is_the_train_state_and_host_record(runs, tmp_path, capsys):
    """A step holds the whole TrainState (named leaves) and the host record; a trainer
    checkpoint of the earlier layout is refused in one line naming its path."""
    a, _, _, _ = runs
    host = a.ckpt.read_host(3)
    assert (host["phase"], host["data_cursor"], host["seed"]) == ("rl", a.data_cursor, 0)
    assert host["has_ref"] is False and host["config"]["steps"] == 2
    target = a.restore_target(3, HostRecord.from_dict(host, where="a"))
    state, _ = a.ckpt.restore_state(3, target)
    assert state.global_step == 3
    for x, y in zip(leaves(state), leaves(a.state), strict=True):
        np.testing.assert_array_equal(x, y)
    old = CheckpointManager(tmp_path / "checkpoints")
    old.save(2, {"params": a.params}, {"data_cursor": 4, "config": {}})  # no train state
    old.wait()
    args = [*TINY, f"out_dir={tmp_path}", "algo.engine=dfs"]
    assert dtarl_main(["train", *sum((["--set", x] for x in args), [])]) == 2
    err = capsys.readouterr().err
    assert "step_00000002: trainer checkpoint in an old layout" in err and err.count("\n") == 1


class NaNEngine:
    """Wraps an engine and poisons its gradients."""

    def __init__(self, inner):
        self.inner = inner
        self.name = "nan"

    def value_and_grad(self, params, batch, loss):
        val, grads, aux = self.inner.value_and_grad(params, batch, loss)
        return val * np.nan, jax.tree.map(lambda g: g * np.nan, grads), aux


def test_nan_update_is_skipped_and_reported(runs):
    _, _, b, _ = runs
    before = leaves(b.params)
    engine = b.engine
    b.engine = NaNEngine(engine)
    try:
        m = b.rl_step(5)
    finally:
        b.engine = engine
    assert m["skipped"] == 1 and "non-finite" in m["skip_reason"]
    for x, y in zip(before, leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_raising_reward_function(runs):
    _, _, b, _ = runs

    def broken(problem, completion):
        raise ZeroDivisionError("bad verifier")

    fn, policy = b.reward_fn, b.cfg
    b.reward_fn = broken
    try:
        with pytest.raises(RewardError, match="sample 0 .*ZeroDivisionError: bad verifier"):
            b.rl_step(6)
        b.cfg = b.cfg.replace(reward_on_error=RewardErrorPolicy.ZERO)
        m = b.rl_step(6)
    finally:
        b.reward_fn, b.cfg = fn, policy
    assert m["reward_errors"] == 4 and m["reward_mean"] == 0.0


class ScriptedSampler:
    """A sampler double: turn 0 calls the calculator, turn 1 answers."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, weights, prompts, *, num_samples, seed):
        counts = [num_samples] * len(prompts) if np.ndim(num_samples) == 0 else num_samples
        toks, finish = [], []
        for p, c in zip(prompts, counts, strict=True):
            text = self.tok.decode(list(p))
            out = "6]" if not text.endswith(";") else "12"
            ids = np.asarray(self.tok.encode("[2*3]" if out == "6]" else out), np.int32)
            if out == "12":
                ids = np.append(ids, self.tok.eos_id)
            toks += [ids] * c
            finish += [FinishReason.STOP] * c
        return SampleResult(
            tokens=tuple(toks),
            logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            raw_logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            finish=np.asarray(finish),
            prompt_index=np.repeat(np.arange(len(prompts)), counts),
            stats=dict(generated_tokens=sum(len(t) for t in toks), seconds=1.0),
        )


def test_multi_turn_rollout_masks_tool_output_and_shares_turns():
    tok = ByteTokenizer()
    task = CalculatorTask(max_operand=3)
    problems = task.generate(np.random.default_rng(0), 2)
    trajs, stats = rollout(
        ScriptedSampler(tok), None, tok, task, problems, group_size=3, key=jax.random.PRNGKey(0)
    )
    assert len(trajs) == 6 and stats["rollout_tokens"] > 0
    t = trajs[0]
    assert t.num_turns == 2 and t.completion == "[2*3]=6;12"
    text = tok.decode(t.tokens.tolist(), skip_special=False)
    masked = "".join(c for c, m in zip(text, t.loss_mask, strict=True) if m)
    # the calls, the answer and eos are trained on; the prompt and tool output "=6;" are not
    assert masked == "[2*3]12\x02"
    np.testing.assert_array_equal(t.old_logprobs[t.loss_mask == 0], 0.0)
    tree = build_tree([x.tokens for x in trajs])
    assert tree.stats.depth >= 1 and tree.stats.ideal_token_ratio > 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarkerTask(CalculatorTask):
    """The calculator with a tool call ending in ``marker`` (any number of tokens)."""

    marker: str = "</call>"

    @property
    def stop_strings(self):
        return (self.marker,)

    def tool(self, problem, turn_text):
        if not turn_text.endswith(self.marker):
            return None
        expr = turn_text[: -len(self.marker)].rsplit("<call>", 1)[-1]
        return f"={safe_eval(expr)[0]};" if expr[:1].isdigit() else "=ok;"


class TaggedSampler:
    """A sampler double: prompt 0 calls ``<call>2*3</call>`` then answers; prompt 1 ends
    its turn with eos after ``</call`` (part of the marker): no tool call."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, weights, prompts, *, num_samples, seed):
        counts = [num_samples] * len(prompts) if np.ndim(num_samples) == 0 else num_samples
        toks = []
        for p, c in zip(prompts, counts, strict=True):
            text = self.tok.decode(list(p))
            if text.endswith(";"):
                ids = self.tok.encode("12") + [self.tok.eos_id]
            elif text.startswith("1*"):
                ids = self.tok.encode("<call>2*3</call>")
            else:
                ids = self.tok.encode("<call>2*3</call") + [self.tok.eos_id]
            toks += [np.asarray(ids, np.int32)] * c
        return SampleResult(
            tokens=tuple(toks),
            logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            raw_logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            finish=np.full(len(toks), FinishReason.STOP),
            prompt_index=np.repeat(np.arange(len(prompts)), counts),
            stats=dict(generated_tokens=sum(len(t) for t in toks), seconds=1.0),
        )


def test_multi_token_tool_marker_calls_the_tool():
    """A turn whose tokens end with the 7-token marker ``</call>`` gets the tool output
    appended (not trained on) and a next turn; one ending in part of it does not."""
    tok = ByteTokenizer()
    task = MarkerTask(max_operand=3)
    assert tool_stop_sequences(tok, task) == (tuple(tok.encode("</call>")),)
    problems = [Problem(prompt=q, answer="5", reference=()) for q in ("1*2+3=", "2*2+1=")]
    trajs, _ = rollout(
        TaggedSampler(tok), None, tok, task, problems, group_size=2, key=jax.random.PRNGKey(0)
    )
    called, partial = trajs[0], trajs[2]
    assert called.num_turns == 2 and called.completion == "<call>2*3</call>=6;12"
    text = tok.decode(called.tokens.tolist(), skip_special=False)
    masked = "".join(c for c, m in zip(text, called.loss_mask, strict=True) if m)
    assert masked == "<call>2*3</call>12\x02"  # the tool output "=6;" is not trained on
    assert partial.num_turns == 1 and partial.completion == "<call>2*3</call"


def test_multi_token_tool_marker_stops_the_real_sampler(tmp_path):
    """End to end with the trainer's own (greedy) sampler: the marker is two tokens the
    tiny model generates first for some prompt; the sampler stops right after them
    (a stop sequence, not a stop token) and the rollout appends the tool output."""
    c = tiny_config(
        tmp_path,
        "task.kind=calculator",
        "task.max_operand=3",
        "rollout.temperature=0",
        "rollout.max_new_tokens=8",
    )
    t = Trainer(c)
    problems = t.task.generate(np.random.default_rng(0), 16)
    res = t.sampler.generate(t.params, [encode_prompt(t.tokenizer, p.prompt) for p in problems])
    firsts = [r[:2].tolist() for r in res.tokens]
    i = next(i for i, f in enumerate(firsts) if len(f) == 2 and all(33 <= x < 127 for x in f))
    marker = t.tokenizer.decode(firsts[i])
    assert marker != "]" and len(t.tokenizer.encode(marker)) == 2
    t = Trainer(c, task=MarkerTask(max_operand=3, marker=marker))
    assert tuple(t.tokenizer.encode(marker)) in t.sampler.params.stop_sequences
    assert t.sampler.params.stop_tokens == (t.tokenizer.eos_id,)
    (traj,), _ = rollout(
        t.sampler,
        t.params,
        t.tokenizer,
        t.task,
        [problems[i]],
        group_size=1,
        key=jax.random.PRNGKey(0),
    )
    assert traj.num_turns == 2
    assert traj.completion.startswith(marker + "=ok;")
    p = traj.prompt_len
    assert traj.tokens[p : p + 2].tolist() == firsts[i]
    assert traj.loss_mask[p : p + 2].tolist() == [1, 1]
    assert traj.loss_mask[p + 2 : p + 6].tolist() == [0, 0, 0, 0]  # "=ok;"


def test_cli_print_config_and_errors(capsys):
    assert cli_main(["configs/quickstart.yaml", "--print-config", "--set", "steps=2"]) == 0
    assert '"steps": 2' in capsys.readouterr().out
    assert cli_main(["configs/quickstart.yaml", "--set", "rollout.bogus=1"]) == 2
    assert "valid keys" in capsys.readouterr().err


def test_hf_checkpoint_with_ppo_and_kl(tmp_path):
    from dtarl.testing.hf import make_tiny_hf_checkpoint

    ckpt = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen3")
    cfg = tiny_config(
        tmp_path / "run",
        f"model.hf_path={ckpt}",
        "model.tokenizer=byte",  # the tiny checkpoint has no tokenizer files
        "model.overrides={}",
        "sft.steps=0",
        "steps=1",
        "algo.algorithm=ppo",
        "algo.kl_coef=0.05",
    )
    model, tok = cfg.model.build()
    assert isinstance(tok, ByteTokenizer) and model.cfg.vocab_size == 256
    res = Trainer(cfg).run()
    rec = res.history[-1]
    assert rec["skipped"] == 0 and np.isfinite(rec["value_loss"]) and np.isfinite(rec["kl"])
    # The default engine is auto: the metrics say what it ran and what tuning cost.
    assert rec["engine"] == "auto" and rec["chosen_engine"] in [
        k.value for k in EngineKind.auto_candidates()
    ]
    assert rec["autotune_seconds"] >= 0 and rec["trace_count"] > 0


def test_auto_candidates_get_the_buckets_they_would_get_alone(tmp_path):
    """The trainer pre-sizes auto's candidates exactly as it sizes each engine run
    alone, so auto compares (and runs) the programs a fixed engine would run."""
    auto = Trainer(tiny_config(tmp_path / "auto")).engine
    assert auto.name == "auto"
    for kind in ("dense", "dfs", "prefix_reuse"):
        alone = Trainer(tiny_config(tmp_path / kind, f"algo.engine={kind}")).engine
        assert alone.buckets == auto.engines[kind].buckets, kind
        assert alone.buckets != type(alone)(alone.model).buckets, kind  # something was reserved
    deep = Trainer(tiny_config(tmp_path / "pr", "algo.engine=prefix_reuse")).engine.dfs
    assert deep.buckets == auto.engines["prefix_reuse"].dfs.buckets
    assert deep.buckets["steps"] > 1  # the deep groups' DFS program is sized too


def test_killed_run_resumes_without_duplicate_metrics(tmp_path, capsys):
    """A run killed after step 3 (last checkpoint: step 2) and resumed: every step's
    metrics record appears once, and a changed config is refused with its keys."""
    extra = ("algo.engine=dfs", "steps=3", "checkpoint_every=2", "eval_problems=2")
    Trainer(tiny_config(tmp_path, *extra)).run(max_steps=3)  # "killed" after step 3
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"phase": "rl", "glob')  # ... in the middle of a write
    res = Trainer(tiny_config(tmp_path, *extra)).run()
    assert res.steps_done == 4
    recs = read_metrics(tmp_path)
    assert [r["global_step"] for r in recs if r["phase"] != "eval"] == [1, 2, 3, 4]
    assert [(r["global_step"], r.get("after")) for r in recs if r["phase"] == "eval"] == [
        (0, None),
        (1, "sft"),
        (4, None),
    ]
    # A changed config (or seed) is refused, naming the keys; allow_changes resumes.
    changed = tiny_config(tmp_path, *extra, "optim.lr=2e-3", "seed=5", "console=true")
    with pytest.raises(ConfigError, match=r"the config changed \(seed: 0 -> 5; optim.lr: "):
        Trainer(changed).run()
    args = [*TINY, f"out_dir={tmp_path}", *extra, "rollout.top_k=3"]
    assert cli_main(sum((["--set", a] for a in args), [])) == 2
    err = capsys.readouterr().err
    assert "rollout.top_k: 0 -> 3" in err and "resume.allow_changes=true" in err
    allowed = tiny_config(tmp_path, *extra, "optim.lr=2e-3", "resume.allow_changes=true")
    assert Trainer(allowed).try_resume()
    # Keys that do not change the computation (out_dir, logging, eval, engine) are free.
    assert Trainer(tiny_config(tmp_path, *extra[1:], "algo.engine=dense")).try_resume()


def test_resume_section_shorthand():
    assert load_config(None, ["resume=false"]).resume.enabled is False
    cfg = load_config(None, ["resume=false", "resume.allow_changes=true"])
    assert not cfg.resume.enabled and cfg.resume.allow_changes
