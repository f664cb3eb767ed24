"""``model.lora`` in the trainer: the TrainState's params and the optimiser state are
the adapters only, the base stays as built (and is the KL reference: no copy), the
samplers decode the merged weights, checkpoints hold the adapters plus the base's
path and checksum, and a resume onto another base or rank is refused."""

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.errors import CheckpointError, ConfigError
from dtarl.lora import Adapter, merge
from dtarl.rl.config import load_config
from dtarl.rl.trainer import Trainer

TINY = [
    "model.overrides={num_layers: 1}",
    "model.lora={rank: 2, alpha: 4.0, targets: [q_proj, v_proj, down_proj]}",
    "task.max_operand=5",
    "sft.steps=1",
    "sft.batch_size=4",
    "steps=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "algo.kl_coef=0.1",
    "algo.engine=dfs",
    "eval.num_problems=0",
    "console=false",
    "checkpoint_every=1",
    "mesh.dp=1",
]


def varied_reward(problem, completion) -> float:
    return sum((i + 1) * ord(c) for i, c in enumerate(completion)) % 11 / 10


def _cfg(out_dir, *extra):
    return load_config(None, [*TINY, f"out_dir={out_dir}", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    trainer = Trainer(_cfg(out), reward_fn=varied_reward)
    base_before = [np.asarray(x) for x in jax.tree.leaves(trainer.lora.params)]
    adapters_before = jax.tree.map(np.asarray, trainer.params)
    result = trainer.run()
    return out, trainer, base_before, adapters_before, result


def test_state_holds_only_adapters_and_the_base_is_the_reference(run):
    _, trainer, base_before, adapters_before, result = run
    ad = trainer.params
    assert isinstance(ad, dict) and all(isinstance(v, Adapter) for v in ad.values())
    assert sorted(k.rsplit("/", 1)[1] for k in ad) == ["down_proj", "q_proj", "v_proj"]
    n_ad = sum(np.size(x) for x in jax.tree.leaves(ad))
    n_opt = sum(np.size(x) for x in jax.tree.leaves(trainer.opt_state))
    assert n_opt <= 2 * n_ad + 8  # AdamW's moments of the adapters, and step counts
    # The base is untouched and is the KL reference itself (no second copy).
    for x, y in zip(jax.tree.leaves(trainer.lora.params), base_before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    assert trainer.state.ref_params is None
    assert trainer.ref_params is trainer.lora.params
    # Training moved the adapters, and the policy is the merged base.
    moved = [
        np.abs(np.asarray(a) - b).max()
        for a, b in zip(jax.tree.leaves(ad), jax.tree.leaves(adapters_before), strict=True)
    ]
    assert max(moved) > 0
    want = merge(trainer.lora.params, ad, trainer.lora.cfg)
    for x, y in zip(jax.tree.leaves(result.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [r["phase"] for r in result.history] == ["sft", "rl"]


def test_resume_restores_the_adapters_and_refuses_another_base_or_rank(run):
    out, trainer, *_ = run
    again = Trainer(_cfg(out), reward_fn=varied_reward)
    assert again.try_resume()
    for x, y in zip(jax.tree.leaves(again.params), jax.tree.leaves(trainer.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        Trainer(_cfg(out, "model.lora.rank=3")).try_resume()
    with pytest.raises(CheckpointError, match=r"rank 2, but model\.lora\.rank=3"):
        Trainer(_cfg(out, "model.lora.rank=3", "resume.allow_changes=true")).try_resume()
    with pytest.raises(CheckpointError, match="another base model"):
        Trainer(_cfg(out, "model.seed=5", "resume.allow_changes=true")).try_resume()


def test_the_sampler_decodes_the_merged_weights(run):
    """Greedy tokens of the trainer's sampler on its policy params equal those of a
    sampler given the merged weights built independently (nnx.merge of W + s A@B)."""
    _, trainer, *_ = run
    s = trainer.lora.cfg.scale
    flat = dict(nnx.to_flat_state(trainer.lora.params))
    for key, ad in trainer.params.items():
        path = tuple(int(p) if p.isdigit() else p for p in key.split("/"))
        w = flat[path]
        flat[path] = w.replace(w[...] + (s * np.asarray(ad.a) @ np.asarray(ad.b)).reshape(w.shape))
    manual = nnx.from_flat_state(flat)
    assert type(trainer.eval_sampler).__name__ == "ContinuousSampler"  # greedy
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    got = trainer.eval_sampler.generate(trainer.policy_params, prompts, max_new_tokens=[3, 3])
    want = trainer.eval_sampler.generate(manual, prompts, max_new_tokens=[3, 3])
    assert [list(t) for t in got.tokens] == [list(t) for t in want.tokens]
    assert sum(len(t) for t in got.tokens) > 0


def test_export_writes_merged_weights_and_a_peft_adapter(run, tmp_path):
    from safetensors.numpy import load_file

    from dtarl.commands.export import ExportError, export_checkpoint
    from dtarl.lora.peft import peft_tensors
    from dtarl.model import load_hf

    out, trainer, *_ = run
    hf, adapter = tmp_path / "hf", tmp_path / "adapter"
    export_checkpoint(out, hf, adapter=adapter)
    _, got = nnx.split(load_hf(str(hf)), nnx.Param)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(trainer.policy_params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    want = peft_tensors(trainer.params)
    assert sorted(tensors) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(tensors[k], v)
    with pytest.raises(ExportError, match="nothing to write"):
        export_checkpoint(out, None)


def test_lora_on_a_mesh(tmp_path):
    """dp=2 x tp=2: the adapters stay replicated, the merged policy is split like the
    base, and a step trains the adapters."""
    cfg = _cfg(tmp_path, "mesh.dp=2", "mesh.tp=2", "sft.steps=0", "rollout.prompts_per_step=2")
    trainer = Trainer(cfg, reward_fn=varied_reward)
    before = jax.tree.map(np.asarray, trainer.params)
    result = trainer.run()
    assert np.isfinite(result.history[-1]["loss"])
    for x in jax.tree.leaves(trainer.params):
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 4
    merged = trainer.policy_params
    for m, b in zip(jax.tree.leaves(merged), jax.tree.leaves(trainer.lora.params), strict=True):
        assert m.sharding.is_equivalent_to(b.sharding, m.ndim)
    moved = max(
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(before), strict=True)
    )
    assert moved > 0
