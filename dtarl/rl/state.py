"""A run's state: ``TrainState`` (the arrays, one pytree) and ``HostRecord`` (the rest).

    state = TrainState.create(params=params, opt_state=opt.init(params), seed=0)
    state = state.replace(params=new_params, opt_state=new_opt_state, step=state.step + 1)
    ckpt.save_state(state, host.to_dict())          # one Orbax step: named leaves + JSON
    state, host = ckpt.restore_state(step, target)  # ``target``: a TrainState template

``TrainState`` is what changes on the devices from step to step: the policy's
params and optimiser state, the KL reference policy (None without a KL term), the
PPO value model's params and optimiser state (None for the other algorithms), the
number of completed global steps and the run's base PRNG key (raw ``uint32`` key
data, ``jax.random.key_data``). ``step`` and ``key`` are host numpy arrays, so that
every process of a multi-process run writes the same values and none needs a
device array of another. Its leaves are named by field in the checkpoint
(``params/layers/self_attn/q_proj``, ``opt_state/0/mu/...``, ``ref_params/...``,
``value_params/...``, ``value_opt_state/...``, ``step``, ``key``).

``HostRecord`` is the host-side rest of a resumable run, saved as the checkpoint's
JSON item beside the arrays (committed with them): the phase of the next step, the
data position (``data_cursor``: problems consumed), the count of skipped updates,
DARTS' statistics, and the config and seed the resume check compares.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dtarl.errors import CheckpointError, ConfigError
from dtarl.rl.config import TrainerConfig, config_changes, to_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """The arrays of a run (see the module docstring); a pytree, leaves named by field."""

    params: Any  # nnx.State of the policy's nnx.Param variables
    opt_state: Any  # the current phase's optimiser state (SFT's, then RL's)
    ref_params: Any = None  # the frozen KL reference policy (algo.kl_coef > 0)
    value_params: Any = None  # PPO's value model
    value_opt_state: Any = None
    step: Any = dataclasses.field(default_factory=lambda: np.asarray(0, np.int64))
    key: Any = dataclasses.field(default_factory=lambda: key_data(jax.random.PRNGKey(0)))

    @classmethod
    def create(cls, *, params, seed: int, opt_state=None, value=None) -> TrainState:
        """Step 0 of a run seeded ``seed`` (key ``PRNGKey(seed)``), with the params and
        optimiser state of PPO's ``value`` model (a ``ValueModel``) when there is one."""
        v = {} if value is None else value.state()
        return cls(
            params=params,
            opt_state=opt_state,
            value_params=v.get("params"),
            value_opt_state=v.get("opt_state"),
            key=key_data(jax.random.PRNGKey(seed)),
        )

    def replace(self, **changes) -> TrainState:
        if "step" in changes:
            changes["step"] = np.asarray(int(changes["step"]), np.int64)
        return dataclasses.replace(self, **changes)

    def target(self, *, opt_state, has_ref: bool, has_value: bool) -> TrainState:
        """The shape a checkpoint restores into: these arrays with ``opt_state`` (the saved
        phase's optimiser state, freshly initialised) and a reference policy (the params'
        shape) and value model only where the checkpoint has them."""
        return self.replace(
            opt_state=opt_state,
            ref_params=self.params if has_ref else None,
            value_params=self.value_params if has_value else None,
            value_opt_state=self.value_opt_state if has_value else None,
        )

    @property
    def global_step(self) -> int:
        """Completed global steps (SFT + RL) as a Python int."""
        return int(self.step)

    @property
    def rng(self) -> jax.Array:
        """The run's base PRNG key (``PRNGKey(seed)``) as JAX's raw uint32 key."""
        return jax.numpy.asarray(self.key, jax.numpy.uint32)


jax.tree_util.register_dataclass(
    TrainState,
    data_fields=[f.name for f in dataclasses.fields(TrainState)],
    meta_fields=[],
)


def state_attribute(name: str) -> property:
    """A property ``owner.<name>`` for ``owner.state.<name>``; setting it replaces
    ``owner.state`` with a copy holding the new value."""

    def get(owner):
        return getattr(owner.state, name)

    def set_(owner, value):
        owner.state = owner.state.replace(**{name: value})

    return property(get, set_, doc=f"``state.{name}`` (``TrainState``)")


def key_data(key) -> np.ndarray:
    """A PRNG key (typed or raw) as a host uint32 array."""
    if jax.numpy.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key, np.uint32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostRecord:
    """The host-side rest of a resumable run (see the module docstring)."""

    phase: str  # the phase of the next global step: "sft" or "rl"
    data_cursor: int  # problems consumed so far
    skipped: int  # updates skipped so far (non-finite loss or gradient)
    seed: int  # the run's seed (the resume check)
    config: dict[str, Any]  # ``to_dict`` of the run's config (the resume check)
    darts: dict[str, Any] | None = None  # ``DartsState.state_dict()``
    has_ref: bool = False  # whether the TrainState holds a reference policy
    has_value: bool = False  # ... a value model
    data: str | None = None  # the training rows' fingerprint (data.train_files; None: a task)
    lora_base: dict[str, Any] | None = None  # model.lora: the base's path, sha256 and rank

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str) -> HostRecord:
        """The record saved at ``where`` (a checkpoint path); a missing field is a
        ``CheckpointError`` naming it."""
        names = [f.name for f in dataclasses.fields(cls)]
        required = [n for n in names if cls.__dataclass_fields__[n].default is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise CheckpointError(
                f"{where}: the checkpoint's host record lacks {missing}; it was not written "
                "by this dtarl trainer: use a fresh out_dir"
            )
        return cls(**{n: d[n] for n in names if n in d})


def check_resume(host: HostRecord, cfg: TrainerConfig, *, where: str) -> None:
    """Refuses to continue the checkpoint at ``where`` (host record ``host``) with a
    config ``cfg`` or seed other than the one that wrote it (``resume.allow_changes``
    overrides); keys in ``RESUME_FREE_KEYS`` may change."""
    if cfg.resume.allow_changes:
        return
    diffs = []
    if host.seed != cfg.seed:
        diffs.append(f"seed: {host.seed!r} -> {cfg.seed!r}")
    diffs += [d for d in config_changes(host.config, to_dict(cfg)) if d not in diffs]
    if diffs:
        raise ConfigError(
            f"cannot resume from {where}: the config changed ({'; '.join(diffs)}); restore "
            "those values, use another out_dir, or --set resume.allow_changes=true"
        )


__all__ = ["HostRecord", "TrainState", "check_resume", "key_data", "state_attribute"]
