"""PAT switching inside the rollout engine: ``reshard`` between decode calls keeps every
token and logprob of the generation (both K/V modes), compiles nothing the second time."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.model.config import ModelConfig
from dtarl.model.decoder import Decoder
from dtarl.parallel.mesh import make_mesh
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine

# kv heads = 8, so every tp in {1, 2, 4, 8} splits them.
CFG = ModelConfig.tiny(num_heads=8, num_kv_heads=8, head_dim=8)
SMALL = ContinuousConfig(
    slots=8, groups=4, group_size=4, prompt_len=16, response_len=32, steps_per_call=4
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=0)


@pytest.fixture(scope="module")
def weights(model):
    return nnx.split(model, nnx.Param)[1]


def _prompts(n, seed=0, lo=3, hi=16):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, CFG.vocab_size, rng.randint(lo, hi)).tolist() for _ in range(n)]


PROMPTS = _prompts(3, seed=5)
LENGTHS = [[3, 7, 26, 11], [5, 19, 2], [28]]  # a long tail


def _submit(eng, **kw):
    return [
        eng.submit(p, n=len(m), max_new_tokens=m, temperature=0.0, seed=i, **kw)
        for i, (p, m) in enumerate(zip(PROMPTS, LENGTHS, strict=True))
    ]


def _switcher(plan, mode, infos):
    """on_call: at decode call k (1-based) switch to plan[k] = (dp, tp)."""
    calls = [0]

    def on_call(eng, w):
        calls[0] += 1
        if calls[0] in plan:
            w, info = eng.reshard(plan[calls[0]], w, mode=mode)
            infos.append(info)
            return w
        return None

    return on_call


def _results(groups):
    return [r.result() for g in groups for r in g.requests]


def _assert_same(got, ref):
    for (t, lp), (t_ref, lp_ref) in zip(got, ref, strict=True):
        assert t.tolist() == t_ref.tolist()
        np.testing.assert_allclose(lp, lp_ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def reference(model, weights):
    eng = RolloutEngine(model, SMALL, mesh=make_mesh(8, 1))
    groups = _submit(eng)
    eng.run(eng.place(weights))
    return _results(groups)


@pytest.mark.parametrize("mode", ["migrate", "recompute"])
def test_several_switches_keep_tokens_and_logprobs(model, weights, reference, mode):
    eng = RolloutEngine(model, SMALL, mesh=make_mesh(8, 1))
    infos = []
    groups = _submit(eng)
    plan = {1: (4, 2), 3: (2, 4), 5: (1, 8)}
    eng.run(eng.place(weights), on_call=_switcher(plan, mode, infos))
    _assert_same(_results(groups), reference)
    assert [(i["dp"], i["tp"]) for i in infos] == [(4, 2), (2, 4), (1, 8)]
    assert all(i["mode"] == mode for i in infos)
