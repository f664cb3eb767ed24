"""HF checkpoint I/O: logits vs transformers, save round trips, and every refusal."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from dtarl.model import Decoder, ModelConfig, ModelFamily
from dtarl.model import hf as hf_io
from dtarl.model.hf import CheckpointError, load_hf, save_hf

TOL = 1e-4  # fp32 composite forward vs transformers (STYLE.md #6)
B, T = 2, 24


def _torch():
    torch = pytest.importorskip("torch", reason="torch not installed (the `hf` extra)")
    pytest.importorskip("transformers", reason="transformers not installed (the `hf` extra)")
    torch.set_default_dtype(torch.float32)
    return torch


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (B, T)).astype(np.int32)


def _dtarl_logits(model, tokens):
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits, _ = model(tokens, positions)
    return np.asarray(logits)


def _hf_logits(path, tokens):
    torch = _torch()
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _params(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def hf_ckpts(tmp_path_factory):
    """family/tie variant -> tiny transformers checkpoint dir (built once)."""
    _torch()
    from dtarl.testing.hf import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    made = {}

    def get(family, tie=None, **kw):
        key = (family, tie, tuple(sorted(kw.items())))
        if key not in made:
            out = root / f"{family}-{tie}-{len(made)}"
            made[key] = make_tiny_hf_checkpoint(out, family, tie_word_embeddings=tie, **kw)
        return made[key]

    return get


# --------------------------------------------------------- vs transformers

CASES = [("qwen3", None), ("qwen2", None), ("llama", None), ("qwen3", False), ("llama", True)]


@pytest.mark.parametrize("family,tie", CASES)
def test_logits_match_transformers(hf_ckpts, family, tie):
    path = hf_ckpts(family, tie)
    model = load_hf(path)
    assert model.cfg.family is ModelFamily(family)
    if tie is not None:
        assert model.cfg.tie_word_embeddings is tie
    tokens = _tokens()
    ref = _hf_logits(path, tokens)
    got = _dtarl_logits(model, tokens)
    assert got.shape == ref.shape == (B, T, 256)
    assert np.abs(ref).max() > 1.0  # weights are non-trivial
    diff = np.abs(got - ref).max()
    print(f"{family} tie={tie}: max |logit diff| = {diff:.2e}")
    assert diff <= TOL


def test_llama3_rope_scaling_is_exercised(hf_ckpts):
    """Dropping the rope scaling must break the match: the comparison above can fail."""
    path = hf_ckpts("llama")
    assert load_hf(path).cfg.rope_scaling is not None
    tokens = _tokens()
    wrong = _dtarl_logits(load_hf(path, rope_scaling=None), tokens)
    assert np.abs(wrong - _hf_logits(path, tokens)).max() > 100 * TOL


def test_sharded_hf_checkpoint_loads(hf_ckpts):
    path = hf_ckpts("qwen2", sharded=True)
    assert os.path.exists(os.path.join(path, hf_io.INDEX_FILE))
    tokens = _tokens(1)
    diff = np.abs(_dtarl_logits(load_hf(path), tokens) - _hf_logits(path, tokens)).max()
    assert diff <= TOL


@pytest.mark.parametrize("family,tie", [("qwen3", None), ("qwen2", False), ("llama", None)])
def test_save_hf_transformers_round_trip(hf_ckpts, tmp_path, family, tie):
    src = hf_ckpts(family, tie)
    model = load_hf(src)
    out = save_hf(model, tmp_path / "out")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    tokens = _tokens(2)
    ref = _hf_logits(src, tokens)
    assert np.abs(_hf_logits(out, tokens) - ref).max() <= TOL
    # and back into dtarl, bit for bit
    back = load_hf(out)
    assert back.cfg == model.cfg
    a, b = _params(model), _params(back)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_save_hf_sharded_round_trip(hf_ckpts, tmp_path):
    src = hf_ckpts("qwen2", False)
    model = load_hf(src)
    out = save_hf(model, tmp_path / "sharded", max_shard_bytes=40_000)
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and hf_io.INDEX_FILE in files and "model.safetensors" not in files
    with open(os.path.join(out, hf_io.INDEX_FILE)) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    for s in shards:  # only a single tensor larger than the limit may exceed it
        with safe_open(os.path.join(out, s), framework="numpy") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    assert index["metadata"]["total_size"] == 4 * model.cfg.num_params()
    tokens = _tokens(3)
    assert np.abs(_hf_logits(out, tokens) - _hf_logits(src, tokens)).max() <= TOL
    a, b = _params(model), _params(load_hf(out))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_bf16_checkpoint(hf_ckpts):
    """bf16 weights upcast exactly, so an fp32-compute forward still matches to TOL."""
    path = hf_ckpts("qwen3", dtype="bfloat16")
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    tokens = _tokens(4)
    ref = _hf_logits(path, tokens)  # transformers upcasts the bf16 weights to fp32
    bf = load_hf(path, param_dtype="bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in _params(bf).values())
    assert np.abs(_dtarl_logits(bf, tokens) - ref).max() <= TOL
    f32 = load_hf(path)
    assert all(v.dtype == np.float32 for v in _params(f32).values())
    assert np.abs(_dtarl_logits(f32, tokens) - ref).max() <= TOL


def test_fp32_checkpoint_cast_to_bf16(hf_ckpts):
    """Casting on load is round-to-nearest of each fp32 weight; logits stay close."""
    path = hf_ckpts("llama")
    f32, bf = load_hf(path), load_hf(path, param_dtype="bfloat16")
    a, b = _params(f32), _params(bf)
    for k in a:
        np.testing.assert_array_equal(a[k].astype(ml_dtypes.bfloat16), b[k], err_msg=str(k))
    tokens = _tokens(5)
    ref = _dtarl_logits(f32, tokens)
    got = _dtarl_logits(bf, tokens)
    # bf16 keeps 8 significand bits (relative error <= 2^-9 per weight). Measured:
    # max |diff| 0.021 for max |logit| 4.2 (0.5%); the bound is 2% of max |logit|.
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()
    assert np.abs(got - ref).max() > 0  # the cast really happened


def test_save_hf_bf16(hf_ckpts, tmp_path):
    src = hf_ckpts("llama")
    out = save_hf(load_hf(src), tmp_path / "bf16", dtype="bfloat16")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    tokens = _tokens(6)
    # transformers (fp32 compute on the bf16 weights) == dtarl on the same weights
    ref = _hf_logits(out, tokens)
    assert np.abs(_dtarl_logits(load_hf(out), tokens) - ref).max() <= TOL


# ----------------------------------------------- torch-free: save_hf + errors


def _save_random(tmp_path, family=ModelFamily.QWEN3, name="ckpt", **cfg_kw) -> str:
    model = Decoder(ModelConfig.tiny(family, **cfg_kw), seed=1)
    return save_hf(model, tmp_path / name)


@pytest.mark.parametrize("family", list(ModelFamily))
@pytest.mark.parametrize("tie", [True, False])
def test_layout_covers_every_decoder_param(family, tie):
    cfg = ModelConfig.tiny(family, tie_word_embeddings=tie)
    _, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg)))
    slots = dict(nnx.to_flat_state(state))
    layout = hf_io._layout(cfg)
    assert {e.path for e in layout.values()} == set(slots)
    for name, e in layout.items():
        x = np.arange(int(np.prod(e.hf_shape)), dtype=np.float32).reshape(e.hf_shape)
        y = e.to_nnx(x)
        want = tuple(slots[e.path].shape)
        # A layer's tensor is one row of its stacked [L, ...] parameter.
        assert y.shape == (want if e.layer is None else want[1:]), name
        assert (e.layer is None) == (e.path[0] != "layers"), name
        np.testing.assert_array_equal(e.to_hf(y), x, err_msg=name)


def test_save_load_round_trip_without_torch(tmp_path):
    model = Decoder(ModelConfig.tiny(ModelFamily.QWEN2, tie_word_embeddings=False), seed=3)
    back = load_hf(save_hf(model, tmp_path / "c"))
    a, b = _params(model), _params(back)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    tokens = _tokens(7)
    np.testing.assert_array_equal(_dtarl_logits(model, tokens), _dtarl_logits(back, tokens))


def test_load_hf_does_not_random_init(tmp_path, monkeypatch):
    path = _save_random(tmp_path)

    real = jax.random.normal

    def concrete_draws_fail(key, *a, **k):  # tracing under nnx.eval_shape is fine
        if not isinstance(key, jax.core.Tracer):
            raise AssertionError("load_hf drew concrete random numbers")
        return real(key, *a, **k)

    monkeypatch.setattr(jax.random, "normal", concrete_draws_fail)
    load_hf(path)
    with pytest.raises(AssertionError, match="concrete random"):  # the check can fail
        Decoder(ModelConfig.tiny())


def test_config_overrides_and_dtypes(tmp_path):
    path = _save_random(tmp_path)
    m = load_hf(path, compute_dtype="bfloat16", logits_chunk=8)
    assert m.cfg.compute_dtype == "bfloat16" and m.cfg.logits_chunk == 8
    assert m.cfg.param_dtype == "float32"


def _edit_config(path, **changes):
    fp = os.path.join(path, "config.json")
    with open(fp) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(fp, "w") as f:
        json.dump(cfg, f)


def _edit_tensors(path, fn):
    fp = os.path.join(path, "model.safetensors")
    tensors = load_file(fp)
    fn(tensors)
    save_file(tensors, fp, metadata={"format": "pt"})


def test_unknown_model_type(tmp_path):
    path = _save_random(tmp_path)
    _edit_config(path, model_type="mistral")
    with pytest.raises(CheckpointError, match=r"model_type='mistral'.*accepted.*qwen3"):
        load_hf(path)


def test_unsupported_rope_scaling(tmp_path):
    path = _save_random(tmp_path, ModelFamily.LLAMA3)
    _edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match=r"rope_scaling type 'yarn'.*llama3"):
        load_hf(path)


def test_unsupported_hidden_act(tmp_path):
    path = _save_random(tmp_path)
    _edit_config(path, hidden_act="gelu")
    with pytest.raises(CheckpointError, match=r"hidden_act='gelu'.*'silu'"):
        load_hf(path)


def test_qwen2_sliding_window_refused(tmp_path):
    path = _save_random(tmp_path, ModelFamily.QWEN2)
    _edit_config(path, use_sliding_window=True)
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        load_hf(path)


def test_missing_tensors_listed(tmp_path):
    path = _save_random(tmp_path)

    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.layers.0.self_attn.k_norm.weight"]

    _edit_tensors(path, drop)
    with pytest.raises(CheckpointError, match="2 tensor.s. missing") as e:
        load_hf(path)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "model.layers.0.self_attn.k_norm.weight" in str(e.value)


def test_untied_config_needs_lm_head(tmp_path):
    path = _save_random(tmp_path)  # qwen3 tiny is tied: no lm_head.weight in the file
    _edit_config(path, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"missing.*lm_head\.weight"):
        load_hf(path)


def test_unexpected_tensors_listed(tmp_path):
    path = _save_random(tmp_path)  # qwen3: no biases

    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
        t["model.extra.weight"] = np.zeros(3, np.float32)

    _edit_tensors(path, add)
    with pytest.raises(CheckpointError, match="2 unexpected tensor") as e:
        load_hf(path)
    assert "model.layers.0.self_attn.q_proj.bias" in str(e.value)
    assert "model.extra.weight" in str(e.value)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    path = _save_random(tmp_path, ModelFamily.LLAMA3)

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    _edit_tensors(path, add)
    load_hf(path)


def test_shape_mismatch_named(tmp_path):
    path = _save_random(tmp_path)

    def bad(t):
        t["model.norm.weight"] = np.ones(32, np.float32)
        t["model.layers.1.self_attn.o_proj.weight"] = np.ones((64, 48), np.float32)

    _edit_tensors(path, bad)
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "model.norm.weight: got [32], expected [64]" in msg
    assert "model.layers.1.self_attn.o_proj.weight: got [64, 48], expected [64, 64]" in msg


def test_non_float_tensor_refused(tmp_path):
    path = _save_random(tmp_path)
    _edit_tensors(path, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: dtype I32"):
        load_hf(path)


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
    path = _save_random(tmp_path)
    want = _params(load_hf(path))
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    got = _params(load_hf(path))
    for k in want:
        np.testing.assert_array_equal(want[k], got[k])


def test_tied_checkpoint_with_different_lm_head_refused(tmp_path):
    path = _save_random(tmp_path)
    _edit_tensors(
        path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1.0})
    )
    with pytest.raises(CheckpointError, match="tie_word_embeddings=true but lm_head.weight"):
        load_hf(path)


def test_pickle_weights_refused(tmp_path):
    path = _save_random(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x04not a real pickle; must never be opened")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never unpickles"):
        load_hf(path)


def test_no_weights(tmp_path):
    path = _save_random(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no weights found"):
        load_hf(path)


def test_missing_config(tmp_path):
    path = _save_random(tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match=r"config\.json: no such file"):
        load_hf(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(tmp_path / "nope")


def test_index_with_missing_shard(tmp_path):
    model = Decoder(ModelConfig.tiny(ModelFamily.QWEN3), seed=1)
    path = save_hf(model, tmp_path / "s", max_shard_bytes=40_000)
    with open(os.path.join(path, hf_io.INDEX_FILE)) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match=f"shard '{shard}'.*does not exist"):
        load_hf(path)


def test_index_pointing_at_wrong_shard(tmp_path):
    model = Decoder(ModelConfig.tiny(ModelFamily.QWEN3), seed=1)
    path = save_hf(model, tmp_path / "s", max_shard_bytes=40_000)
    fp = os.path.join(path, hf_io.INDEX_FILE)
    with open(fp) as f:
        index = json.load(f)
    wm = index["weight_map"]
    other = next(s for s in sorted(set(wm.values())) if s != wm["model.norm.weight"])
    wm["model.norm.weight"] = other
    with open(fp, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=f"'model.norm.weight' to {other}"):
        load_hf(path)


# --------------------------------------------------------- atomic save_hf


def test_save_hf_replaces_existing_dir_atomically(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    _save_random(tmp_path, name="ckpt")
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp or backup dirs left


def test_save_hf_failure_leaves_existing_dir_untouched(tmp_path, monkeypatch):
    path = _save_random(tmp_path, name="ckpt")
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        _save_random(tmp_path, ModelFamily.LLAMA3, name="ckpt")
    after = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    assert before == after
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_hf_refuses_file_target_and_bad_args(tmp_path):
    (tmp_path / "file").write_text("x")
    model = Decoder(ModelConfig.tiny(), seed=0)
    with pytest.raises(ValueError, match="not a directory"):
        save_hf(model, tmp_path / "file")
    with pytest.raises(ValueError, match=r"dtype='int8'.*accepted"):
        save_hf(model, tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        save_hf(model, tmp_path / "x", max_shard_bytes=0)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_checkpoint_helper_without_torch_names_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    from dtarl.testing import hf as testing_hf

    with pytest.raises(ImportError, match="`hf` extra"):
        testing_hf.make_tiny_hf_checkpoint("/nonexistent", "qwen3")
