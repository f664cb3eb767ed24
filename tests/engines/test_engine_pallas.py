"""The DFS engine with the Pallas attention backend (interpret mode on CPU)."""

import jax
import numpy as np
from flax import nnx

from dtarl.engines import DenseEngine, DFSEngine
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import AttentionBackend, ModelConfig, init_model
from dtarl.testing import grpo_groups


def test_dfs_with_pallas_matches_dense_xla():
    cfg = ModelConfig.tiny(num_layers=1)
    ref_model = init_model(cfg, seed=2)
    pal_model = init_model(cfg.replace(attention_backend=AttentionBackend.PALLAS), seed=2)
    params = nnx.split(ref_model, nnx.Param)[1]
    batch = grpo_groups(num_groups=1, group_size=3, prompt_len=10, response_len=(2, 6), seed=2)
    loss = ClippedSurrogateLoss.grpo()
    want_loss, want, want_aux = DenseEngine(ref_model).value_and_grad(params, batch, loss)
    engine = DFSEngine(pal_model, chunk_len=8, prefix_levels=1, leaf_rows=2)
    got_loss, got, aux = engine.value_and_grad(params, batch, loss)
    # Sibling leaves packed into one chunk (the kernel's segment mask) and popped
    # as rows over one shared stack prefix.
    assert aux.stats["packed_steps"] > 0 and aux.stats["row_steps"] > 0
    # The on-policy GRPO loss is ~0 (ratio 1, centred advantages): absolute floor.
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5, atol=1e-7)
    for a, b in zip(aux.logprobs, want_aux.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        assert err <= 1e-5, err
