"""``model.lora`` in a trainer config, and the memory model of ``dtarl bench lora``
against hand-computed counts."""

import json

import pytest

from dtarl import cli
from dtarl.errors import ConfigError
from dtarl.lora import LoraConfig
from dtarl.lora.memory import adapter_params, memory_table, state_bytes
from dtarl.model import ModelConfig
from dtarl.rl.config import load_config


def test_model_lora_parses_and_defaults_to_absent():
    assert load_config(None, []).model.lora is None
    cfg = load_config(None, ["model.lora={rank: 4, alpha: 8, targets: [q_proj, v_proj]}"])
    assert cfg.model.lora == LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))


@pytest.mark.parametrize(
    "value,key",
    [
        ("{rank: 0}", "model.lora.rank"),
        ("{alpha: 0}", "model.lora.alpha"),
        ("{targets: [q_proj, lm_head]}", "model.lora.targets"),
        ("{dropout: 0.05}", "model.lora.dropout"),
        ("{rnak: 4}", "model.lora"),
    ],
)
def test_bad_model_lora_names_the_key(value, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [f"model.lora={value}"])


def test_adapter_count_by_hand():
    # qwen3_0p6b: 28 layers, E=1024, F=3072, 16 q heads, 8 kv heads, head_dim 128.
    # rank 16: q 16(1024+2048), k and v 16(1024+1024), o 16(2048+1024),
    # gate/up/down 16(1024+3072) each.
    per_layer = 16 * (3072 + 2 * 2048 + 3072 + 3 * 4096)
    assert adapter_params(ModelConfig.qwen3_0p6b(), LoraConfig(rank=16)) == 28 * per_layer


def test_state_bytes_by_hand():
    cfg = ModelConfig.tiny()  # fp32 params
    p = cfg.num_params()
    lora = LoraConfig(rank=2, targets=("down_proj",))
    n = cfg.num_layers * 2 * (cfg.intermediate_size + cfg.hidden_size)
    full = state_bytes(cfg, None, kl=True)
    assert full.total == 4 * p + 4 * p + 8 * p + 4 * p  # weights, grads, moments, reference
    lo = state_bytes(cfg, lora, kl=True)
    merged = cfg.num_layers * cfg.intermediate_size * cfg.hidden_size * 4
    assert lo.total == 4 * p + merged + 4 * p + 8 * n + 8 * n
    assert lo.reference == 0
    half = state_bytes(cfg, lora, kl=True, shards=2)
    assert half.weights == -(-4 * p // 2) and half.adapters == lo.adapters


def test_bench_lora_memory_table(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert cli.main(["bench", "lora", "--rank", "16", "--engines", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "qwen3_8b" in printed
    rows = json.loads(out.read_text())["memory"]
    assert [r["preset"] for r in rows] == ["qwen3_0p6b", "qwen3_1p7b", "qwen3_4b", "qwen3_8b"]
    want = memory_table(LoraConfig(rank=16, alpha=32.0))
    assert [r["lora_bytes"] for r in rows] == [r["lora_bytes"] for r in want]
    for r in rows:
        assert r["lora_bytes"] < r["full_bytes"]
        assert r["reference_saved_bytes"] == r["full"]["reference"] > 0


def test_file_checksum_names_the_hf_base(tmp_path):
    from dtarl.lora.adapters import file_checksum

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "README.md").write_text("not part of the weights")
    first = file_checksum(str(tmp_path))
    (tmp_path / "README.md").write_text("changed")
    assert file_checksum(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert file_checksum(str(tmp_path)) != first
