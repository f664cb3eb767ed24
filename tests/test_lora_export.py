"""LoRA export: the merged weights load in transformers, the PEFT adapter loads in peft
onto the HF base, both with logits equal to dtarl's merged model (fp32, <= 1e-4);
and the refusals (unknown targets, rank, alpha, dropout, adapters of another rank)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.errors import ConfigError
from dtarl.lora import Adapter, LoraConfig, check_adapters, init_adapters, merge
from dtarl.lora.peft import peft_tensors, save_peft
from dtarl.model import init_model
from dtarl.testing import tiny_config

TOL = 1e-4  # fp32 composite forward vs transformers (STYLE.md #6)
CFG = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))


def _adapters(base, cfg=CFG, seed=0):
    ad = init_adapters(base, cfg, jax.random.key(seed))
    return {
        k: Adapter(a=v.a, b=0.2 * jax.random.normal(jax.random.key(i + 1), v.b.shape))
        for i, (k, v) in enumerate(sorted(ad.items()))
    }


def _dtarl_logits(graphdef, params, tokens):
    logits, _ = nnx.merge(graphdef, params)(
        tokens, np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    )
    return np.asarray(logits)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="torch not installed (the `hf` extra)")
    pytest.importorskip("transformers", reason="transformers not installed (the `hf` extra)")
    torch.set_default_dtype(torch.float32)
    from dtarl.testing.hf import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3")


def _torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_peft_adapter_and_merged_export_match_dtarl(hf_base, tmp_path):
    pytest.importorskip("peft", reason="peft not installed (the `hf` extra)")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dtarl.model import load_hf, save_hf

    model = load_hf(hf_base)
    graphdef, base = nnx.split(model, nnx.Param)
    ad = _adapters(base)
    merged = merge(base, ad, CFG)
    tokens = np.random.RandomState(0).randint(0, 256, (2, 13))
    want = _dtarl_logits(graphdef, merged, tokens)
    # The adapters change the model (else the comparison proves nothing).
    assert np.abs(want - _dtarl_logits(graphdef, base, tokens)).max() > 1e-2

    adapter_dir = save_peft(ad, CFG, str(tmp_path / "adapter"), base_model=str(hf_base))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["r"] == 4
    hf = AutoModelForCausalLM.from_pretrained(
        hf_base, attn_implementation="eager", dtype=torch.float32
    )
    peft_model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    got = _torch_logits(peft_model, tokens)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)

    out = save_hf(nnx.merge(graphdef, merged), str(tmp_path / "merged"))
    hf_merged = AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(_torch_logits(hf_merged, tokens), want, atol=TOL, rtol=0)


def test_peft_tensors_of_a_stacked_adapter_equal_the_listed_ones():
    """Layers under a scan ([L, ...] adapters, the model's layout) write the same file
    as the same adapters listed per layer (``layers/i/...``)."""
    _, base = nnx.split(init_model(tiny_config(), seed=0), nnx.Param)
    stacked = _adapters(base)
    listed_ad = {}
    for k, ad in stacked.items():
        rest = k.split("/", 1)[1]
        assert k.startswith("layers/") and ad.a.ndim == 3, (k, ad.a.shape)
        for i in range(ad.a.shape[0]):
            listed_ad[f"layers/{i}/{rest}"] = Adapter(a=ad.a[i], b=ad.b[i])
    listed = peft_tensors(listed_ad)
    got = peft_tensors(stacked)
    assert sorted(got) == sorted(listed)
    for k in listed:
        np.testing.assert_array_equal(got[k], listed[k])
    assert listed["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert listed["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(rank=0), "model.lora.rank"),
        (dict(alpha=0.0), "model.lora.alpha"),
        (dict(alpha=-1.0), "model.lora.alpha"),
        (dict(targets=("q_proj", "qkv")), "model.lora.targets"),
        (dict(targets=()), "model.lora.targets"),
        (dict(dropout=0.1), "model.lora.dropout"),
    ],
)
def test_bad_config_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LoraConfig(**kw)


def test_adapters_of_another_rank_are_refused():
    _, base = nnx.split(init_model(tiny_config(), seed=0), nnx.Param)
    ad = init_adapters(base, LoraConfig(rank=2), jax.random.key(0))
    check_adapters(ad, base, LoraConfig(rank=2), "checkpoint")
    with pytest.raises(ConfigError, match=r"rank 2, but model\.lora\.rank=4"):
        check_adapters(ad, base, LoraConfig(rank=4), "checkpoint")
    with pytest.raises(ConfigError, match="model.lora.targets"):
        check_adapters(ad, base, LoraConfig(rank=2, targets=("q_proj",)), "checkpoint")
