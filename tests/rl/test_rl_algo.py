"""Algorithm choices of the RL trainer, hand-computed: the loss aggregation modes
(``algo.loss_agg_mode``) and the algorithms' defaults."""

import numpy as np
import pytest
from flax import nnx

from dtarl.batch import LossNorm, RolloutBatch
from dtarl.engines import DenseEngine
from dtarl.model import init_model
from dtarl.rl.config import Algorithm, ConfigError, LossAggMode, load_config
from dtarl.rl.optim import make_loss
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
