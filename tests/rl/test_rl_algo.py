"""Algorithm choices of the RL trainer, hand-computed: the loss aggregation modes
(``algo.loss_agg_mode``) and the algorithms' defaults, DAPO's dynamic sampling
(filter on task accuracy, refill up to ``algo.max_generation_batches``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dtarl.batch import LossNorm, RolloutBatch
from dtarl.engines import DenseEngine, EngineAux
from dtarl.model import init_model
from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rl.config import Algorithm, ConfigError, LossAggMode, Schedule, load_config
from dtarl.rl.episodes import advantage_abs_mean, group_advantages, rl_batch
from dtarl.rl.metrics import ratio_stats
from dtarl.rl.optim import (
    accumulated_value_and_grad,
    group_splits,
    make_loss,
    make_optimizer,
    update,
)
from dtarl.rl.tasks import ArithmeticTask, Problem
from dtarl.rl.trainer import Trainer
from dtarl.rollout.sampler import FinishReason, SampleResult
from dtarl.testing import tiny_config

# Three sequences with mask sums M = (2, 3, 1.5) and advantages A = (1, -2, 0.5):
# on policy (r = 1) the per-sequence token sums are -A_i M_i = (-2, 6, -0.75).
TOKENS = ([5, 6, 7], [5, 6, 8, 9, 10], [11, 12, 13])
MASKS = ([0, 1, 1], [0, 0, 1, 1, 1], [0, 0.5, 1])
ADV = (1.0, -2.0, 0.5)
MAX_RESPONSE = 8  # c of seq-mean-token-sum-norm


@pytest.fixture(scope="module")
def dense_engine():
    model = init_model(tiny_config(), seed=0)
    _, params = nnx.split(model, nnx.Param)
    return DenseEngine(model), params


def cfg(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    "algorithm,mode",
    [
        (Algorithm.GRPO, LossAggMode.SEQ_MEAN_TOKEN_MEAN),
        (Algorithm.DAPO, LossAggMode.TOKEN_MEAN),
        (Algorithm.DR_GRPO, LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM),
        (Algorithm.PPO, LossAggMode.TOKEN_MEAN),
    ],
)
def test_algorithm_default_aggregation(algorithm, mode):
    c = cfg(f"algo.algorithm={algorithm.value}")
    assert c.algo.agg_mode is mode
    loss = make_loss(c, MAX_RESPONSE)
    assert loss.norm is mode.norm
    assert loss.norm_constant == (MAX_RESPONSE if mode.norm is LossNorm.CONSTANT else None)


@pytest.mark.parametrize(
    "mode,want",
    [
        # token-mean: -(2 - 6 + 0.75) / (2 + 3 + 1.5)
        ("token-mean", 3.25 / 6.5),
        # seq-mean-token-mean: (1/3)(-2/2 + 6/3 - 0.75/1.5)
        ("seq-mean-token-mean", 0.5 / 3),
        # seq-mean-token-sum: (1/3)(-2 + 6 - 0.75)
        ("seq-mean-token-sum", 3.25 / 3),
        # seq-mean-token-sum-norm: (-2 + 6 - 0.75) / (3 * 8)
        ("seq-mean-token-sum-norm", 3.25 / 24),
    ],
)
def test_loss_agg_mode_end_to_end(dense_engine, mode, want):
    """``algo.loss_agg_mode`` overrides the algorithm's (GRPO here) and reaches the
    loss value through make_loss and DenseEngine."""
    engine, params = dense_engine
    loss = make_loss(cfg(f"algo.loss_agg_mode={mode}"), MAX_RESPONSE)
    batch = RolloutBatch.create(tokens=TOKENS, loss_mask=MASKS, advantages=ADV)
    value, _, _ = engine.value_and_grad(params, batch, loss)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)


def test_bad_loss_agg_mode_lists_the_accepted_ones():
    with pytest.raises(ConfigError, match="algo.loss_agg_mode='mean'.*seq-mean-token-sum-norm"):
        cfg("algo.loss_agg_mode=mean")


# ------------------------------------------------------- DAPO dynamic sampling


class TableSampler:
    """A sampler double: prompt text -> the completions of its group, in order."""

    def __init__(self, tok, table):
        self.tok, self.table = tok, table
        self.calls = 0

    def generate(self, weights, prompts, *, num_samples, seed):
        self.calls += 1
        counts = [num_samples] * len(prompts) if np.ndim(num_samples) == 0 else num_samples
        toks = []
        for p, c in zip(prompts, counts, strict=True):
            texts = self.table[self.tok.decode(list(p))]
            assert len(texts) == c
            toks += [np.append(self.tok.encode(t), self.tok.eos_id).astype(np.int32) for t in texts]
        return SampleResult(
            tokens=tuple(toks),
            logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            raw_logprobs=tuple(np.full(len(t), -0.5, np.float32) for t in toks),
            finish=np.full(len(toks), FinishReason.STOP),
            prompt_index=np.repeat(np.arange(len(prompts)), counts),
            stats=dict(generated_tokens=sum(len(t) for t in toks), seconds=1.0),
        )


def _problem(name):
    return Problem(prompt=name, answer="", reference=())


def _reward(problem, completion):
    """The verifier: pass iff the completion starts with "y"."""
    return float(completion.startswith("y"))


DAPO = (
    "algo.algorithm=dapo",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "algo.overlong_buffer=4",  # lengths > 8 - 4 = 4 are penalised
)
# "p" = pass with different lengths (2 and 7 tokens with eos: shaped rewards differ),
# "f" = all fail, "m" = mixed (one pass, one fail).
TABLE = {
    "p0": ["y", "yyyyyy"],
    "p1": ["y", "yyyyyy"],
    "f0": ["n", "n"],
    "m0": ["y", "n"],
    "m1": ["n", "y"],
    "m2": ["yy", "nn"],
}


def _rl_batch(c, problems, refills=()):
    tok = ByteTokenizer()
    sampler = TableSampler(tok, TABLE)
    more = None
    if refills:

        def more(k):
            return [_problem(n) for n in refills[k - 1]]

    batch, m = rl_batch(
        c,
        [_problem(n) for n in problems],
        sampler=sampler,
        params=None,
        tokenizer=tok,
        task=ArithmeticTask(),
        reward_fn=_reward,
        key=jax.random.PRNGKey(0),
        more_problems=more,
    )
    return batch, m, sampler


def test_all_correct_group_with_different_lengths_is_dropped():
    """Group p0 passes twice; overlong shaping gives its samples different rewards
    (0 and -0.75), which the old filter (on shaped rewards) kept as signal. Filtering
    on the verifier's pass/fail drops it and keeps only the mixed group m0."""
    c = cfg(*DAPO)
    batch, m, _ = _rl_batch(c, ["p0", "m0"])
    assert batch.num_sequences == 2
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0])  # m0: "y" passes, "n" fails
    assert (m["generation_batches"], m["kept_fraction"], m["groups_short"]) == (1, 0.5, 1)


def test_refill_reaches_the_target_number_of_groups():
    """Target 2 groups: batch 1 keeps m0, batch 2 (refill) keeps m1 and m2, and only
    the first two kept groups are trained on."""
    c = cfg(*DAPO)
    batch, m, sampler = _rl_batch(c, ["p0", "m0"], refills=[["m1", "m2"], ["m0", "m1"]])
    assert sampler.calls == 2
    assert (m["generation_batches"], m["kept_fraction"], m["groups_short"]) == (2, 0.75, 0)
    assert batch.num_sequences == 4 and len(np.unique(batch.group_ids)) == 2
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.0, 1.0])  # m0 then m1


def test_refill_is_bounded_and_reports_the_shortfall():
    """Every batch has only one group with signal: after max_generation_batches = 2
    the step trains on what it has and says it is one group short."""
    c = cfg(*DAPO, "algo.max_generation_batches=2")
    batch, m, sampler = _rl_batch(c, ["p0", "f0"], refills=[["m0", "p1"], ["m1", "m2"]])
    assert sampler.calls == 2
    assert (m["generation_batches"], m["kept_fraction"], m["groups_short"]) == (2, 0.25, 1)
    assert batch.num_sequences == 2


# ------------------------------------------------------------------- metrics


def test_clip_fraction_uses_per_token_advantages():
    """PPO: the sequence advantage is 0 and A_t = (-1, +1). Ratios 0.5 (A < 0: below
    1 - eps, clipped) and 1.5 (A > 0: above 1 + eps, clipped): 2 of 2. With the
    sequence's A = 0 >= 0 only the second would count (the old 1/2)."""
    lp = [np.array([0.0, np.log(0.5), np.log(1.5)])]
    old = [np.zeros(3)]
    mask = [np.array([0.0, 1.0, 1.0])]
    m = ratio_stats(
        lp,
        old,
        mask,
        np.zeros(1),
        eps_low=0.2,
        eps_high=0.2,
        token_advantages=[np.array([0.0, -1.0, 1.0])],
    )
    assert m["clip_fraction"] == 1.0
    seq = ratio_stats(lp, old, mask, np.array([-1.0]), eps_low=0.2, eps_high=0.2)
    assert seq["clip_fraction"] == 0.5  # A = -1 everywhere: only r = 0.5 is clipped


def test_advantage_abs_mean_reads_per_token_advantages():
    """Masked mean |A_t| = (|-1| + |3| + 0.5 |2|) / 2.5 = 2 where the sequence advantages
    are all 0 (the old metric: 0)."""
    batch = RolloutBatch.create(
        tokens=[[1, 2, 3], [1, 2]],
        loss_mask=[[0, 1, 1], [0, 0.5]],
        advantages=[0.0, 0.0],
        token_advantages=[[0.0, -1.0, 3.0], [0.0, 2.0]],
    )
    assert advantage_abs_mean(batch) == pytest.approx(5.0 / 2.5)
    assert advantage_abs_mean(batch.select([0])) == pytest.approx(2.0)
    plain = RolloutBatch.create(tokens=[[1, 2], [1, 2]], advantages=[1.0, -3.0])
    assert advantage_abs_mean(plain) == 2.0


class ConstGradEngine:
    """An engine double: gradient ``g`` for every parameter (NaN: a skipped update)."""

    name = "const"

    def __init__(self, g):
        self.g = g

    def value_and_grad(self, params, batch, loss):
        grads = jax.tree.map(lambda p: jnp.full_like(p, self.g), params)
        return jnp.float32(self.g), grads, EngineAux(logprobs=(), stats={})


def test_lr_follows_the_optimiser_step_count():
    """A linear warm-up 0 -> 1 over 4 steps: lr = count / 4. A skipped (non-finite)
    update does not advance the count, so neither does the logged lr; the old
    schedule(step) said 0.5 at the third step after one of two updates was skipped."""
    opt = make_optimizer(lr=1.0, warmup=4, total=8, schedule=Schedule.CONSTANT, cfg=cfg().optim)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    batch = RolloutBatch.create(tokens=[[1, 2]])
    lrs = []
    for g in (1.0, np.nan, 1.0):
        lrs.append(opt.lr(state))
        u = update(params, state, batch, engine=ConstGradEngine(g), loss=None, optimizer=opt)
        assert u.applied == np.isfinite(g)
        params, state = u.params, u.opt_state
    assert lrs + [opt.lr(state)] == [0.0, 0.25, 0.25, 0.5]


def test_std_ddof_reaches_group_advantages():
    """algo.std_ddof=1 divides by the unbiased std: group (1, 0) has population std
    0.5 (A = +-1) and unbiased std sqrt(0.5) (A = +-0.7071)."""
    r, g = np.array([1.0, 0.0]), np.array([0, 0])
    np.testing.assert_allclose(group_advantages(cfg(), r, g), [1, -1], rtol=1e-5)
    one = group_advantages(cfg("algo.std_ddof=1"), r, g)
    np.testing.assert_allclose(one, [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5)], rtol=1e-5)
    with pytest.raises(ConfigError, match="algo.std_ddof=2"):
        cfg("algo.std_ddof=2")


# ------------------------------------------ minibatches and gradient accumulation

GROUPED = dict(
    tokens=[[5, 6, 7], [5, 6, 8, 9], [11, 12, 13, 14, 15], [11, 12], [20, 21, 22]],
    loss_mask=[[0, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 1], [0, 0.5, 1]],
    advantages=[1.0, -1.0, 0.5, -0.5, 2.0],
    group_ids=[0, 0, 1, 1, 2],
)


def _rel_err(a, b):
    """max over parameter tensors of ||a - b|| / ||b|| (the equivalence tests' measure)."""
    return max(
        float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(y), 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_group_splits_keep_groups_whole():
    batch = RolloutBatch.create(**GROUPED)
    assert [ix.tolist() for ix in group_splits(batch, 2)] == [[0, 1, 2, 3], [4]]
    assert [ix.tolist() for ix in group_splits(batch, 3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="3 groups into 4 parts"):
        group_splits(batch, 4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("parts", [2, 3])
def test_accumulated_gradient_equals_the_full_batch(dense_engine, mode, parts):
    """Summing the parts' fp32 gradients, each weighted with the whole batch's w_i,
    gives the full batch's loss and gradient, and the same optimiser update."""
    engine, params = dense_engine
    loss = make_loss(cfg(f"algo.loss_agg_mode={mode}"), MAX_RESPONSE)
    batch = RolloutBatch.create(**GROUPED)
    v_full, g_full, aux_full = engine.value_and_grad(params, batch, loss)
    v_acc, g_acc, aux_acc = accumulated_value_and_grad(engine, params, batch, loss, parts)
    np.testing.assert_allclose(float(v_acc), float(v_full), rtol=1e-5)
    assert _rel_err(g_acc, g_full) < 1e-5
    for a, b in zip(aux_acc.logprobs, aux_full.logprobs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    opt = make_optimizer(lr=1e-2, warmup=0, total=1, schedule=Schedule.CONSTANT, cfg=cfg().optim)
    state = opt.init(params)
    one = update(params, state, batch, engine=engine, loss=loss, optimizer=opt)
    acc = update(params, state, batch, engine=engine, loss=loss, optimizer=opt, grad_accum=parts)
    assert _rel_err(acc.params, one.params) < 1e-5


def test_trainer_step_with_minibatches_and_accumulation(tmp_path):
    """One RL step on 4 groups: 2 minibatches of 2 groups, each gradient accumulated
    over 2 parts: two optimiser steps (the count), metrics on the last minibatch."""
    c = load_config(
        None,
        [
            "model.overrides={num_layers: 1}",
            "task.max_operand=5",
            "steps=1",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            "algo.engine=dense",
            "algo.minibatches=2",
            "algo.grad_accum=2",
            "mesh.dp=1",
            "eval.num_problems=0",
            "console=false",
            f"out_dir={tmp_path}",
        ],
    )
    t = Trainer(c)
    t.opt_state = t.rl_opt.init(t.params)
    m = t.rl_step(0)
    assert m["skipped"] == 0 and np.isfinite(m["loss"]) and np.isfinite(m["clip_fraction"])
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    (sched,) = [x for x in jax.tree.leaves(t.opt_state, is_leaf=is_sched) if is_sched(x)]
    assert int(sched.count) == 2
