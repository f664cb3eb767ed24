"""Tree training inside your own optax step: ``jax.grad`` of ``engine.loss_fn``.

    python examples/custom_step.py        # tiny model, CPU, a few seconds of compile

The DFS engine's loss is a differentiable JAX function (a custom VJP over the prefix
tree), so an L2 term, optax's gradient accumulation and jax.jit compose with it.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dtarl.engines import DFSEngine
from dtarl.losses import CISPOLoss
from dtarl.model import ModelConfig, init_model
from dtarl.testing import grpo_groups


def run(steps: int = 4) -> list[float]:
    model = init_model(ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64), seed=0)
    params = nnx.split(model, nnx.Param)[1]
    engine = DFSEngine(model, chunk_len=8)
    f = engine.loss_fn(CISPOLoss())  # f(params, prepared) -> loss, a jax.custom_vjp
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))

    @jax.jit
    def step(params, opt_state, prepared):
        def objective(p):  # the tree loss plus a regulariser of your own
            return f(p, prepared) + 1e-4 * sum(jnp.sum(x**2) for x in jax.tree.leaves(p))

        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = opt.init(params), []
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=8, response_len=(2, 10), seed=0)
    for _ in range(steps):  # one batch over and over: the loss must fall
        prepared = f.prepare(batch)  # host side: the prefix tree's push/pop plan
        params, opt_state, loss = step(params, opt_state, prepared)
        losses.append(float(loss))
    return losses


if __name__ == "__main__":
    for i, loss in enumerate(run()):
        print(f"step {i}: loss {loss:.4f}")
