"""LoRA adapters as a separate pytree beside a frozen base, applied by merging.

    cfg = LoraConfig(rank=8, alpha=16.0)                  # model.lora
    adapters = init_adapters(base, cfg, jax.random.key(0))  # {path: Adapter(a, b)}
    params = merge(base, adapters, cfg)                   # W + (alpha/r) A@B, base's layout
    engine = LoraEngine(engine, base, cfg)                # value_and_grad(adapters, ...)

Letters: L = leading (stacked layer) axes, I = the weight's input features (its
input axes flattened), O = its output features (its output axes flattened), r = rank.

An adapter of the weight W at ``path`` (``"layers/0/self_attn/q_proj"``) is a pair
A [*L, I, r], B [*L, r, O] in fp32; the effective weight is

    W' = W + (alpha / r) * reshape(A @ B, W.shape)                           (1)

cast to W's dtype. The leading axes L are whatever W has before its own input and
output axes (none for a layer in a list, [num_layers] for a stacked layer under a
scan), so adapters follow the model's layer layout without knowing it. Every engine
sees an ordinary parameter pytree (1), and since (1) is linear in the engine's
gradient G = dL/dW' (fp32), the adapter gradients are exactly

    dL/dA = (alpha / r) * G_IxO @ B^T,     dL/dB = (alpha / r) * A^T @ G_IxO     (2)

(``adapter_grads``), which ``LoraEngine`` applies to any engine's ``value_and_grad``:
dense, dfs, prefix_reuse, auto and ``ShardedEngine`` alike; prefix K/V cotangents
flow through the frozen base inside the engine as for full fine-tuning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dtarl.errors import ConfigError

# target -> (input axes, output axes) of the weight in the decoder's layout:
# q/k/v [E, H, D], o [H, D, E], gate/up [E, F], down [F, E].
TARGET_AXES: dict[str, tuple[int, int]] = {
    "q_proj": (1, 2),
    "k_proj": (1, 2),
    "v_proj": (1, 2),
    "o_proj": (2, 1),
    "gate_proj": (1, 1),
    "up_proj": (1, 1),
    "down_proj": (1, 1),
}
ALL_TARGETS = tuple(TARGET_AXES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """``model.lora``: adapters of rank ``rank`` on the ``targets`` projections of every
    layer, scaled by ``alpha / rank`` (PEFT's ``lora_alpha``). ``dropout`` must be 0:
    adapters are applied as merged weights (1), which have no input dropout."""

    rank: int = 8  # r: A is [in, r], B is [r, out]; >= 1
    alpha: float = 16.0  # the adapters' scale is alpha / rank (PEFT's lora_alpha); > 0
    targets: tuple[str, ...] = ALL_TARGETS  # projections adapted in every layer
    dropout: float = 0.0  # must be 0.0 (merged weights have no input dropout)

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"model.lora.rank={self.rank!r} must be an integer >= 1")
        if (
            not isinstance(self.alpha, int | float)
            or not self.alpha > 0
            or not math.isfinite(self.alpha)
        ):
            raise ConfigError(f"model.lora.alpha={self.alpha!r} must be a finite number > 0")
        targets = tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        bad = [t for t in targets if t not in TARGET_AXES]
        if bad or not targets:
            raise ConfigError(
                f"model.lora.targets: unknown target names {bad} (or none given); "
                f"accepted: {list(ALL_TARGETS)}"
            )
        if len(set(targets)) != len(targets):
            raise ConfigError(f"model.lora.targets={list(targets)} names a target twice")
        if self.dropout != 0.0:
            raise ConfigError(
                f"model.lora.dropout={self.dropout!r} is not supported: dtarl applies "
                "adapters as merged weights W + (alpha/r) A@B, which have no input dropout; "
                "use 0.0"
            )

    @property
    def scale(self) -> float:
        """alpha / rank."""
        return float(self.alpha) / self.rank


class Adapter(NamedTuple):
    """One weight's adapter: a [*L, I, r], b [*L, r, O] (fp32)."""

    a: Any
    b: Any


def path_key(path) -> str:
    """A pytree path (``jax.tree_util`` keys) as ``"layers/0/self_attn/q_proj"``: dict
    keys, attributes and indices joined by ``/``, the variable's ``value`` dropped."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        parts.append(str(name))
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def _target_of(key: str, targets) -> str | None:
    last = key.rsplit("/", 1)[-1]
    return last if last in targets else None


def _split(shape, target: str):
    """(leading axes, I, O) of a weight of ``shape`` adapted as ``target``."""
    n_in, n_out = TARGET_AXES[target]
    lead = len(shape) - n_in - n_out
    if lead < 0:
        raise ConfigError(f"model.lora: weight {target} of shape {shape} has too few axes")
    i = math.prod(shape[lead : lead + n_in])
    o = math.prod(shape[lead + n_in :])
    return tuple(shape[:lead]), i, o


def target_weights(base, cfg: LoraConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, target)}`` of the base weights the adapters adapt. Every target
    of ``cfg`` must match at least one weight."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path, w in jax.tree_util.tree_flatten_with_path(base)[0]:
        key = path_key(path)
        t = _target_of(key, cfg.targets)
        if t is not None:
            found[key] = (tuple(w.shape), t)
    missing = sorted(set(cfg.targets) - {t for _, t in found.values()})
    if missing:
        raise ConfigError(
            f"model.lora.targets: {missing} match no weight of the model "
            f"(its weights end in {sorted({k.rsplit('/', 1)[-1] for k in _keys(base)})})"
        )
    return found


def _keys(tree) -> list[str]:
    return [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def init_adapters(base, cfg: LoraConfig, key) -> dict[str, Adapter]:
    """Fresh adapters for ``base`` (PEFT's default: A ~ U(-1/sqrt(I), 1/sqrt(I)), the
    kaiming-uniform bound of ``nn.Linear``; B = 0, so ``merge(base, init) == base``)."""
    out = {}
    for n, (key_, (shape, t)) in enumerate(sorted(target_weights(base, cfg).items())):
        lead, i, o = _split(shape, t)
        bound = 1.0 / math.sqrt(i)
        a = jax.random.uniform(
            jax.random.fold_in(key, n), (*lead, i, cfg.rank), jnp.float32, -bound, bound
        )
        out[key_] = Adapter(a=a, b=jnp.zeros((*lead, cfg.rank, o), jnp.float32))
    return out


def check_adapters(adapters: dict[str, Adapter], base, cfg: LoraConfig, where: str) -> None:
    """Refuses ``adapters`` that do not fit ``base`` under ``cfg`` (another rank, other
    targets, other shapes), naming ``where`` and the key."""
    want = target_weights(base, cfg)
    if set(adapters) != set(want):
        raise ConfigError(
            f"{where}: adapters for {sorted(set(adapters) ^ set(want))[:4]} do not match "
            f"model.lora.targets={list(cfg.targets)}"
        )
    for k, ad in adapters.items():
        lead, i, o = _split(*want[k])
        rank = int(np.shape(ad.a)[-1])
        if rank != cfg.rank:
            raise ConfigError(
                f"{where}: adapter {k} has rank {rank}, but model.lora.rank={cfg.rank}"
            )
        if tuple(np.shape(ad.a)) != (*lead, i, cfg.rank) or tuple(np.shape(ad.b)) != (
            *lead,
            cfg.rank,
            o,
        ):
            raise ConfigError(
                f"{where}: adapter {k} has shapes {np.shape(ad.a)}, {np.shape(ad.b)}; "
                f"the base weight {want[k][0]} needs {(*lead, i, cfg.rank)}, {(*lead, cfg.rank, o)}"
            )


def delta(ad: Adapter, shape, scale: float):
    """(alpha/r) * A @ B in the weight's layout ``shape`` (fp32)."""
    return (scale * jnp.matmul(ad.a, ad.b)).reshape(shape)


def merge_adapted(base, adapters: dict[str, Adapter], cfg: LoraConfig) -> dict[str, Any]:
    """``{path: W'}``: (1) for the adapted weights only, each in its weight's dtype."""
    flat = {path_key(p): w for p, w in jax.tree_util.tree_flatten_with_path(base)[0]}
    out = {}
    for k, ad in adapters.items():
        w = flat[k]
        out[k] = (w.astype(jnp.float32) + delta(ad, w.shape, cfg.scale)).astype(w.dtype)
    return out


def with_weights(base, new: dict[str, Any]):
    """``base`` with the leaves at the paths of ``new`` replaced by its values; the
    other leaves are ``base``'s own arrays (no copy)."""
    return jax.tree_util.tree_map_with_path(lambda p, w: new.get(path_key(p), w), base)


def merge(base, adapters: dict[str, Adapter], cfg: LoraConfig):
    """``base`` with every adapted weight replaced by (1), in the weight's dtype; the
    other leaves are ``base``'s own arrays (no copy)."""
    return with_weights(base, merge_adapted(base, adapters, cfg))


def adapter_grads(grads, adapters: dict[str, Adapter], cfg: LoraConfig) -> dict[str, Adapter]:
    """(2): the adapters' gradients from the merged weights' gradient ``grads`` (a
    params-shaped pytree, as an engine returns it)."""
    flat = {path_key(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    out = {}
    for k, ad in adapters.items():
        g = flat[k].astype(jnp.float32)
        g = g.reshape(ad.a.shape[:-2] + (ad.a.shape[-2], ad.b.shape[-1]))
        da = cfg.scale * jnp.matmul(g, jnp.swapaxes(ad.b, -1, -2))
        db = cfg.scale * jnp.matmul(jnp.swapaxes(ad.a, -1, -2), g)
        out[k] = Adapter(a=da, b=db)
    return out


_merge_jit = jax.jit(merge_adapted, static_argnums=2)
_grads_jit = jax.jit(adapter_grads, static_argnums=2)


def merged(base, adapters, cfg: LoraConfig):
    """``merge`` compiled (one program per layout): the program returns the adapted
    weights only, so the other leaves stay the base's own arrays (a jit returning the
    whole tree would copy every leaf: the embeddings and norms too). On a mesh every
    merged weight is placed like its base weight (the layout the engines and samplers
    were given)."""
    new = _merge_jit(base, adapters, cfg)
    flat = {path_key(p): w for p, w in jax.tree_util.tree_flatten_with_path(base)[0]}
    new = {
        k: jax.device_put(m, flat[k].sharding) if isinstance(flat[k], jax.Array) else m
        for k, m in new.items()
    }
    return with_weights(base, new)


def fused_step(fn, cfg: LoraConfig):
    """``jit(f)``, ``f(base, adapters, *args) -> (loss, adapter grads, out)``: the merge
    (1), a device step ``fn(params, *args) -> (loss, grads, out)`` (a
    ``ShardedEngine.get_fn`` program) and (2) as ONE program, so that W' and dL/dW'
    are the program's temporaries instead of buffers passed between three programs
    (same operations, same values). ``dtarl bench scale --lora`` measures its peak
    (``fused_peak_bytes``); ``LoraEngine`` does not run it yet."""

    def f(base, adapters, *args):
        loss, grads, out = fn(with_weights(base, merge_adapted(base, adapters, cfg)), *args)
        return loss, adapter_grads(grads, adapters, cfg), out

    return jax.jit(f)


class LoraEngine:
    """Any engine trained through adapters: ``value_and_grad(adapters, batch, loss)``
    merges (1), runs ``engine.value_and_grad`` on the merged params and returns the
    adapters' gradients (2), so an optimiser over ``adapters`` holds only them.
    Everything else (``name``, ``reserve``, ``buckets``, ``prepare``, ...) is the wrapped
    engine's. ``engine.value_and_grad(base, ...)`` of the wrapped engine is the base
    policy's, adapters off (the KL reference: no second copy of the weights).

    The engine still accumulates dL/dW' for every parameter (its program is the full
    model's); what LoRA saves is the optimiser state and the master copy (see
    ``dtarl.lora.memory``)."""

    def __init__(self, engine, base, cfg: LoraConfig):
        self.engine, self.base, self.cfg = engine, base, cfg

    def __getattr__(self, name):
        if name in ("engine", "base", "cfg"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    def params(self, adapters):
        """The merged params the engine runs (1)."""
        return merged(self.base, adapters, self.cfg)

    def value_and_grad(self, adapters, batch, loss, **kw):
        value, grads, aux = self.engine.value_and_grad(self.params(adapters), batch, loss, **kw)
        return value, _grads_jit(grads, adapters, self.cfg), aux

    def loss_fn(self, loss, **kw):
        """``f(adapters, prepared)``: the engine's differentiable loss of the merged
        params (``jax.grad`` flows through (1) into A and B)."""
        inner = self.engine.loss_fn(loss, **kw)
        base, cfg = self.base, self.cfg

        class _Lora:
            prepare = staticmethod(inner.prepare)
            logprobs = staticmethod(getattr(inner, "logprobs", None))

            def __call__(self, adapters, prepared, **call_kw):
                return inner(merge(base, adapters, cfg), prepared, **call_kw)

        return _Lora()


@dataclasses.dataclass(frozen=True, eq=False)
class LoraBase:
    """A LoRA run's frozen base: its params (in the model's dtype, on the run's mesh),
    the config, and what a checkpoint records of it: ``path`` (``model.hf_path``; None
    for a preset) and ``checksum`` (``checksum(params)``)."""

    cfg: LoraConfig
    params: Any
    path: str | None
    checksum: str

    def record(self) -> dict[str, Any]:
        """What a checkpoint stores of the base (its adapters are the params)."""
        return {"path": self.path, "checksum": self.checksum, "rank": self.cfg.rank}

    def check(self, saved: dict[str, Any] | None, where: str) -> None:
        """Refuses to resume adapters saved at ``where`` for another base (or a
        checkpoint without adapters), naming the key."""
        from dtarl.errors import CheckpointError

        if saved is None:
            raise CheckpointError(
                f"{where}: the checkpoint holds no LoRA adapters (a full fine-tuning run), "
                "but model.lora is set; remove model.lora or use another out_dir"
            )
        if saved.get("rank") != self.cfg.rank:
            raise CheckpointError(
                f"{where}: the checkpoint's adapters have rank {saved.get('rank')}, but "
                f"model.lora.rank={self.cfg.rank}"
            )
        if saved.get("checksum") != self.checksum:
            raise CheckpointError(
                f"{where}: the checkpoint's adapters belong to another base model (path "
                f"{saved.get('path')!r}, sha256 {str(saved.get('checksum'))[:12]}...); this "
                f"run's model.hf_path={self.path!r} has sha256 {self.checksum[:12]}...; "
                "resume with the base the adapters were trained on"
            )

    def merged(self, adapters):
        """The policy's params: the base with ``adapters`` merged (1)."""
        return merged(self.params, adapters, self.cfg)


def num_adapter_params(adapters) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(adapters)))


def file_checksum(directory: str) -> str:
    """sha256 of a HF checkpoint directory's ``config.json`` and ``*.safetensors`` files
    (names and bytes, in name order): the base a checkpoint's adapters belong to."""
    import os

    h = hashlib.sha256()
    names = sorted(
        n for n in os.listdir(directory) if n == "config.json" or n.endswith(".safetensors")
    )
    for name in names:
        h.update(f"{name};".encode())
        with open(os.path.join(directory, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def checksum(params) -> str:
    """sha256 of the parameters' paths, shapes, dtypes and bytes (host copies, in path
    order): the base a checkpoint's adapters belong to."""
    h = hashlib.sha256()
    for path, x in sorted(
        jax.tree_util.tree_flatten_with_path(params)[0], key=lambda t: path_key(t[0])
    ):
        a = np.asarray(jax.device_get(x))
        h.update(f"{path_key(path)}:{a.shape}:{a.dtype};".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


__all__ = [
    "ALL_TARGETS",
    "Adapter",
    "LoraBase",
    "LoraConfig",
    "LoraEngine",
    "TARGET_AXES",
    "adapter_grads",
    "check_adapters",
    "checksum",
    "delta",
    "file_checksum",
    "fused_step",
    "init_adapters",
    "merge",
    "merge_adapted",
    "merged",
    "num_adapter_params",
    "path_key",
    "target_weights",
    "with_weights",
]
