"""PPO pieces: a value model (decoder trunk + linear head), GAE, and a per-token-advantage loss.

Value convention: per-token arrays are aligned with the tokens; ``V[t]`` is the
value of the state *before* token t (the head applied to the hidden state at
t - 1), so action t (a response token) pairs with V[t] and GAE runs over the
action positions of each sequence (``dtarl.advantages.gae_advantages``).

Rewards per token (PPO-RLHF): ``r_t = -beta (logp_t - logp_ref_t)`` on every
action, plus the task reward on the last one (``kl_penalty_rewards``; beta = 0
without a reference). Advantages are whitened over the batch's actions.

Value loss (clipped, as PPO2):
    L_V = 1/2 mean_t max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)

The policy loss is ``ClippedSurrogateLoss.ppo()`` with the GAE advantages in the
batch's ``token_advantages``; the KL term lives in the reward instead of the loss.

With ``rollout.streaming`` the values are computed during the rollout instead, by
an incremental forward of the same trunk and head (``dtarl.rollout.stream``,
``ScoreKind.VALUES``), and handed to ``advantages(values=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dtarl import advantages as adv_fns
from dtarl.tree.plan import bucket


class ValueModel:
    """A critic: its own decoder trunk (initialised from the policy) + a linear value head."""

    def __init__(self, policy, *, lr: float = 1e-3, value_clip: float = 0.2, seed: int = 0):
        graphdef, params = nnx.split(policy, nnx.Param)
        self.graphdef = graphdef
        self.cfg = policy.cfg
        e = self.cfg.hidden_size
        self.params = {
            "trunk": jax.tree.map(jnp.array, params),
            "head": {"w": jnp.zeros((e,), jnp.float32), "b": jnp.zeros((), jnp.float32)},
        }
        self.tx = optax.adamw(lr)
        self.opt_state = self.tx.init(self.params)
        self.value_clip = value_clip
        self._min = dict(n=1, t=8)
        self._values = jax.jit(self._values_fn)
        self._step = jax.jit(self._train_fn)
        self._pending = None

    def _values_fn(self, params, tokens_NxT):
        model = nnx.merge(self.graphdef, params["trunk"])
        n, t = tokens_NxT.shape
        pos = jnp.broadcast_to(jnp.arange(t), (n, t))
        hidden, _ = model(tokens_NxT, pos, return_hidden=True)
        v = hidden.astype(jnp.float32) @ params["head"]["w"] + params["head"]["b"]
        # V[t] = head(hidden[t - 1]); V[0] = 0.
        return jnp.concatenate([jnp.zeros((n, 1), jnp.float32), v[:, :-1]], axis=1)

    def _train_fn(self, params, opt_state, tokens, returns, old_values, mask):
        def loss_fn(p):
            v = self._values_fn(p, tokens)
            vc = old_values + jnp.clip(v - old_values, -self.value_clip, self.value_clip)
            err = jnp.maximum((v - returns) ** 2, (vc - returns) ** 2)
            return 0.5 * jnp.sum(mask * err) / jnp.maximum(jnp.sum(mask), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def _pad(self, arrays: Sequence[np.ndarray], dtype) -> np.ndarray:
        self._min["n"] = n = bucket(len(arrays), self._min["n"])
        self._min["t"] = t = bucket(max(len(a) for a in arrays), self._min["t"])
        out = np.zeros((n, t), dtype)
        for i, a in enumerate(arrays):
            out[i, : len(a)] = a
        return out

    def values(self, tokens: Sequence[np.ndarray]) -> list[np.ndarray]:
        v = np.asarray(self._values(self.params, self._pad(tokens, np.int32)))
        return [v[i, : len(x)].copy() for i, x in enumerate(tokens)]

    def advantages(
        self,
        tokens: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        logprobs: Sequence[np.ndarray],
        rewards: np.ndarray,
        ref_logprobs: Sequence[np.ndarray] | None,
        *,
        kl_coef: float,
        gamma: float,
        lam: float,
        values: Sequence[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Whitened per-token GAE advantages; remembers returns for ``train``.

        ``values``: the current params' ``values(tokens)`` when already computed (a
        streamed critic, ``dtarl.rollout.stream``; only the action positions are read)."""
        if values is None:
            values = self.values(tokens)
        elif [len(v) for v in values] != [len(t) for t in tokens]:
            raise ValueError(
                f"values of lengths {[len(v) for v in values]} do not match the tokens' "
                f"{[len(t) for t in tokens]}"
            )
        advs, rets = [], []
        for i, (v, m, lp) in enumerate(zip(values, masks, logprobs, strict=True)):
            ref = lp if ref_logprobs is None else ref_logprobs[i]
            r = adv_fns.kl_penalty_rewards(
                float(rewards[i]), lp, ref, m, kl_coef=kl_coef if ref_logprobs is not None else 0
            )
            a, ret = adv_fns.gae_advantages(r, v, m, gamma=gamma, lam=lam)
            advs.append(a)
            rets.append(ret)
        flat_a = np.concatenate(advs)
        flat_m = np.concatenate([np.asarray(m) for m in masks])
        white = adv_fns.whiten(flat_a, flat_m)
        out, o = [], 0
        for a in advs:
            out.append(white[o : o + len(a)])
            o += len(a)
        self._pending = (values, rets)
        sel = flat_m > 0
        vflat = np.concatenate(values)[sel]
        return out, dict(value_mean=float(vflat.mean()) if vflat.size else 0.0)

    def train(self, tokens: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> dict[str, float]:
        """One optimizer step of the clipped value loss on the last ``advantages`` batch."""
        if self._pending is None:
            raise RuntimeError("ValueModel.train needs a preceding advantages() call")
        values, rets = self._pending
        self._pending = None
        self.params, self.opt_state, loss = self._step(
            self.params,
            self.opt_state,
            self._pad(tokens, np.int32),
            self._pad(rets, np.float32),
            self._pad(values, np.float32),
            self._pad(masks, np.float32),
        )
        return dict(value_loss=float(loss))

    def state(self):
        return {"params": self.params, "opt_state": self.opt_state}

    def load_state(self, state) -> None:
        self.params = state["params"]
        self.opt_state = state["opt_state"]


__all__ = ["ValueModel"]
