"""The multi-turn rollout on any ``Rollout`` sampler and the RL step's stages."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.model import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rl import step
from dtarl.rl.config import TrainerConfig, from_dict
from dtarl.rl.multiturn import Trajectory, encode_prompt, rollout
from dtarl.rl.tasks import CalculatorTask, Problem
from dtarl.rollout.continuous import ContinuousSampler
from dtarl.rollout.engine import ContinuousConfig
from dtarl.rollout.sampler import Sampler, SamplerError, SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarkerTask(CalculatorTask):
    """The calculator task whose tool-call marker is ``marker`` (one byte); the tool
    answers every call with ``=ok;``."""

    marker: str = "]"

    @property
    def stop_strings(self):
        return (self.marker,)

    def tool(self, problem, turn_text):
        return "=ok;" if turn_text.endswith(self.marker) else None


@pytest.fixture(scope="module")
def tiny():
    model = Decoder(ModelConfig.tiny(), seed=0)
    return model, nnx.split(model, nnx.Param)[1]


def test_multi_turn_rollout_is_the_same_on_both_samplers(tiny):
    """Greedy tool turns: re-prefilled histories (static ``Sampler``, no Feature.EXTEND)
    and tool output appended in place (``ContinuousSampler``, ``on_turn``) give the same
    trajectories, and at least one of them made a tool call."""
    model, weights = tiny
    tok = ByteTokenizer()
    problems = CalculatorTask(max_operand=9).generate(np.random.default_rng(0), 6)
    probe = Sampler(model, SamplingParams.greedy(max_new_tokens=4, stop_tokens=(2,)))
    first = probe.generate(weights, [encode_prompt(tok, p.prompt) for p in problems])
    # a printable byte that some prompt's greedy answer starts with: a sure tool call
    marker = next(chr(int(t[0])) for t in first.tokens if 33 <= int(t[0]) < 127)
    task = MarkerTask(max_operand=9, max_turns=3, marker=marker)
    stops = dict(stop_sequences=((ord(marker),),))
    static = Sampler(model, SamplingParams.greedy(max_new_tokens=6, stop_tokens=(2,), **stops))
    cfg = ContinuousConfig(
        slots=8, groups=6, group_size=2, prompt_len=32, response_len=48, steps_per_call=4
    )
    cont = ContinuousSampler(model, cfg, temperature=0.0, max_new_tokens=6, stop_ids=(2,), **stops)
    kw = dict(group_size=2, key=jax.random.PRNGKey(0))
    a, sa = rollout(static, weights, tok, task, problems, **kw)
    b, sb = rollout(cont, weights, tok, task, problems, **kw)
    assert max(t.num_turns for t in a) >= 2
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        np.testing.assert_allclose(x.old_logprobs, y.old_logprobs, atol=1e-5)
        assert (x.num_turns, x.truncated, x.completion) == (y.num_turns, y.truncated, y.completion)
    assert all(t.finish_rank >= 0 for t in b) and all(t.finish_rank == -1 for t in a)
    assert sa["rollout_tokens"] == sb["rollout_tokens"] == sum(int(t.loss_mask.sum()) for t in a)
    assert "decode_calls" in sb and "decode_calls" not in sa


class PlainSampler:
    """A bare ``generate`` (no ``features``): every prompt answers ``7`` then eos."""

    def generate(self, weights, prompts, *, num_samples, seed):
        raise AssertionError("not reached: the arguments are refused first")


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(counts=[3]), "counts"),
        (dict(early_stop=[True]), "early_stop"),
        (dict(index_offset=1), "index_offset"),
        (dict(on_call=lambda e, w: None), "on_call"),
        (dict(stream=[object()]), "stream"),
    ],
)
def test_rollout_refuses_what_the_sampler_does_not_declare(kw, name):
    tok = ByteTokenizer()
    problems = [Problem(prompt="1+1=", answer="2", reference=())]
    with pytest.raises(SamplerError, match=rf"^{name}.*: needs a sampler with Feature\."):
        rollout(
            PlainSampler(),
            None,
            tok,
            CalculatorTask(max_operand=3),
            problems,
            group_size=2,
            key=jax.random.PRNGKey(0),
            **kw,
        )


def _traj(problem: int, length: int, truncated: bool = False) -> Trajectory:
    toks = np.arange(2 + length, dtype=np.int32)
    mask = np.r_[np.zeros(2), np.ones(length)].astype(np.float32)
    return Trajectory(
        tokens=toks,
        loss_mask=mask,
        old_logprobs=np.zeros(toks.size, np.float32),
        prompt_len=2,
        response_len=length,
        completion="",
        truncated=truncated,
        num_turns=1,
        problem_index=problem,
    )


def _cfg(**algo) -> TrainerConfig:
    raw = dict(
        model=dict(preset="tiny"),
        rollout=dict(prompts_per_step=2, group_size=2, max_new_tokens=8),
        algo=dict(engine="dense", **algo),
        eval=dict(num_problems=0),
        console=False,
    )
    return from_dict(TrainerConfig, raw)


def test_stages_shape_select_and_report_as_one_step():
    """Two generation batches of two problems (groups of 2): dynamic sampling keeps the
    groups with unequal task rewards, ``refill`` asks for a second batch while fewer
    than 2 are kept, ``select`` takes the first 2 kept in generation order, and the
    step's metrics are the union of the batches' records."""
    cfg = _cfg(dynamic_sampling=True, max_generation_batches=3)
    gens, scores, shaped = [], [], []
    for k, rewards in enumerate(([1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0])):
        trajs = tuple(_traj(p, 3 + i) for p in range(2) for i in range(2))
        gen = step.Generation(
            trajectories=trajs,
            stats={},
            metrics=dict(rollout_seconds=1.0, rollout_tokens=14, rollout_local_prompts=2),
        )
        sc = step.Scores(rewards=np.asarray(rewards, np.float32), errors=k, seconds=0.5)
        gens.append(gen)
        scores.append(sc)
        shaped.append(step.shape(cfg, step.Budget(), gen, sc, state=None, group_offset=2 * k))
        if k == 0:
            assert shaped[0].keep.tolist() == [True, True, False, False]
            assert step.refill(cfg.algo, shaped, 2, lambda i: None)
            assert not step.refill(cfg.algo, shaped, 2, None)
    assert not step.refill(cfg.algo, shaped, 2, lambda i: None)
    sel = step.select(shaped, 2)
    assert sel.group_ids.tolist() == [0, 0, 2, 2]
    np.testing.assert_array_equal(sel.rewards, [1.0, 0.0, 0.0, 1.0])
    m = step.batch_metrics(gens, scores, shaped, 2)
    assert m["generation_batches"] == 2 and m["kept_fraction"] == 3 / 4
    assert m["groups_short"] == 0 and m["reward_errors"] == 1 and m["reward_seconds"] == 1.0
    assert m["rollout_seconds"] == 2.0 and m["rollout_tokens"] == 28
    assert m["rollout_local_prompts"] == 4 and m["rollout_tokens_per_s"] == 14.0
    assert m["success_rate"] == 5 / 8 and m["reward_mean"] == 5 / 8
    fwd = step.forward(sel.trajectories, reference=None, value=None)
    assert fwd.ref is None and fwd.metrics == {}
    adv = step.advantage(cfg, sel, fwd, None)
    batch, tree_m = step.assemble(sel, fwd, adv)
    np.testing.assert_allclose(batch.advantages, [1, -1, -1, 1], rtol=1e-5)
    assert tree_m["num_tokens"] == batch.num_tokens
    assert tree_m["advantage_abs_mean"] == pytest.approx(1.0, rel=1e-5)
    none = [dataclasses.replace(b, keep=np.zeros_like(b.keep)) for b in shaped]
    assert step.select(none, 2) is None
