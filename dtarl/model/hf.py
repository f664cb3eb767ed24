"""Hugging Face checkpoint I/O: ``load_hf`` / ``save_hf`` (safetensors only).

A checkpoint directory holds ``config.json`` and either one ``*.safetensors``
file or shards listed in ``model.safetensors.index.json``. Pickle-based weights
(``pytorch_model.bin``, ``*.pt``, ``*.pth``) are refused, never unpickled.

Name and layout mapping (HF ``nn.Linear`` weights are [out, in]; our kernels
are [in, out] with the head axes split). Letters: V vocab, E hidden, H query
heads, K kv heads, D head dim, F mlp::

    model.embed_tokens.weight               [V, E]    -> embed_tokens            [V, E]
    model.layers.i.input_layernorm.weight   [E]       -> layers.input_layernorm.weight[i]
    model.layers.i.post_attention_layernorm.weight    -> layers.post_attention_layernorm.weight[i]
    model.layers.i.self_attn.q_proj.weight  [H*D, E]  -> self_attn.q_proj  [E, H, D] = W.T.reshape
    model.layers.i.self_attn.k_proj.weight  [K*D, E]  -> self_attn.k_proj  [E, K, D] (v_proj alike)
    model.layers.i.self_attn.q_proj.bias    [H*D]     -> self_attn.q_bias  [H, D] (Qwen2; k, v too)
    model.layers.i.self_attn.o_proj.weight  [E, H*D]  -> self_attn.o_proj  [H, D, E] = W.T.reshape
    model.layers.i.self_attn.q_norm.weight  [D]       -> self_attn.q_norm.weight (Qwen3; k_norm)
    model.layers.i.mlp.gate_proj.weight     [F, E]    -> mlp.gate_proj     [E, F] (up_proj alike)
    model.layers.i.mlp.down_proj.weight     [E, F]    -> mlp.down_proj     [F, E]
    model.norm.weight                       [E]       -> norm.weight
    lm_head.weight                          [V, E]    -> lm_head           [E, V] (untied only)

The decoder's layer parameters are stacked ([L, ...], ``Decoder.layers``): layer i
of every ``model.layers.i.*`` tensor is row i of its ``layers.*`` parameter.

With ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight``; one that
equals the embedding is accepted and dropped. ``rotary_emb.inv_freq`` buffers
(found in old Llama checkpoints) are ignored; any other extra tensor is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dtarl.errors import CheckpointError
from dtarl.model.config import ConfigError, ModelConfig
from dtarl.model.decoder import Decoder

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_MARKER = ".dtarl-export"  # written by `dtarl export`: `--force` may replace the directory
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "pytorch_model.bin.index.json")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}
_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SAVE_DTYPES = tuple(sorted(_SAVE_DTYPES))  # the dtypes ``save_hf`` writes
_MAX_LISTED = 20
# The files of a HF tokenizer directory that an export carries along (when present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# ------------------------------------------------------------------- mapping


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: tuple  # NNX state path, e.g. ("layers", "self_attn", "q_proj")
    hf_shape: tuple[int, ...]
    to_nnx: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    layer: int | None = None  # the index into a stacked [L, ...] layer parameter

    @property
    def name(self) -> str:
        """The parameter's name with its layer: layers/3/self_attn/q_proj."""
        path = self.path if self.layer is None else self.path[:1] + (self.layer,) + self.path[1:]
        return "/".join(map(str, path))


def _identity(x):
    return x


def _transpose(x):
    return x.T


def _layout(cfg: ModelConfig) -> dict[str, _Entry]:
    """HF tensor name -> where it goes in the NNX state and how it is reshaped."""
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def qkv(n):  # [n*D, E] <-> [E, n, D]
        return (lambda w: w.T.reshape(e, n, d)), (lambda a: a.reshape(e, n * d).T)

    def bias(n):  # [n*D] <-> [n, D]
        return (lambda b: b.reshape(n, d)), (lambda a: a.reshape(n * d))

    out: dict[str, _Entry] = {}
    out["model.embed_tokens.weight"] = _Entry(("embed_tokens",), (v, e), _identity, _identity)
    for i in range(cfg.num_layers):
        # Layer i is row i of the stacked [L, ...] parameters at ("layers", ...).
        p, lp = f"model.layers.{i}.", ("layers",)
        at = lambda path, shape, to_nnx, to_hf, i=i: _Entry(path, shape, to_nnx, to_hf, i)  # noqa: E731
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = at(lp + (norm, "weight"), (e,), _identity, _identity)
        a, ap = p + "self_attn.", lp + ("self_attn",)
        for name, n in (("q", h), ("k", k), ("v", k)):
            out[a + f"{name}_proj.weight"] = at(ap + (f"{name}_proj",), (n * d, e), *qkv(n))
            if cfg.attention_bias:
                out[a + f"{name}_proj.bias"] = at(ap + (f"{name}_bias",), (n * d,), *bias(n))
        out[a + "o_proj.weight"] = at(
            ap + ("o_proj",),
            (e, h * d),
            lambda w: w.T.reshape(h, d, e),
            lambda x: x.reshape(h * d, e).T,
        )
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[a + norm + ".weight"] = at(ap + (norm, "weight"), (d,), _identity, _identity)
        m, mp = p + "mlp.", lp + ("mlp",)
        out[m + "gate_proj.weight"] = at(mp + ("gate_proj",), (f, e), _transpose, _transpose)
        out[m + "up_proj.weight"] = at(mp + ("up_proj",), (f, e), _transpose, _transpose)
        out[m + "down_proj.weight"] = at(mp + ("down_proj",), (e, f), _transpose, _transpose)
    out["model.norm.weight"] = _Entry(("norm", "weight"), (e,), _identity, _identity)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _Entry(("lm_head",), (v, e), _transpose, _transpose)
    return out


def _listing(names) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    if len(names) > _MAX_LISTED:
        shown += f", ... ({len(names) - _MAX_LISTED} more)"
    return shown


# ---------------------------------------------------------------------- load


def _check_hf_config(hf: dict[str, Any], where: str) -> None:
    """Fields ``ModelConfig.from_hf_config`` does not check but the decoder relies on."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act={act!r} is not supported; accepted: 'silu'")
    mt = hf.get("model_type")
    if mt == "qwen2" and hf.get("use_sliding_window", False):
        raise CheckpointError(
            f"{where}: use_sliding_window=true is not supported (full attention only); "
            "set it to false"
        )
    if mt == "qwen3" and hf.get("attention_bias", False):
        raise CheckpointError(f"{where}: attention_bias=true is not supported for qwen3")


def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or the files' headers."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index_path}:{e.lineno}: malformed JSON ({e.msg})") from None
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: expected a non-empty 'weight_map' object")
        where: dict[str, str] = {}
        for name, shard in weight_map.items():
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(
                    f"{index_path}: shard {shard!r} (holding {name!r}) does not exist in {path}"
                )
            where[name] = shard_path
        return where

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if os.path.join(path, SINGLE_FILE) in files:
        files = [os.path.join(path, SINGLE_FILE)]
    if not files:
        pickles = sorted(
            os.path.basename(p)
            for pat in _PICKLE_PATTERNS
            for p in glob.glob(os.path.join(path, pat))
        )
        if pickles:
            raise CheckpointError(
                f"{path}: only pickle-based weights found ({', '.join(pickles)}); dtarl loads "
                "safetensors only and never unpickles. Convert with transformers: "
                "AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, "
                "safe_serialization=True)"
            )
        raise CheckpointError(
            f"{path}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE} with shards"
        )
    where = {}
    for fp in files:
        with _safetensors(fp) as f:
            for name in f.keys():
                if name in where:
                    raise CheckpointError(f"tensor {name!r} appears in both {where[name]} and {fp}")
                where[name] = fp
    return where


@contextlib.contextmanager
def _safetensors(fp: str):
    """``safe_open(fp)``; a truncated or foreign file is a one-line ``CheckpointError``."""
    try:
        with safe_open(fp, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(
            f"{fp}: not a readable safetensors file ({e}); re-download or re-export it"
        ) from None


def _read_tensor(f, fp: str, name: str) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except (TypeError, ValueError):  # old safetensors: no bf16 in the numpy backend
        with safe_open(fp, framework="flax") as g:
            return np.asarray(g.get_tensor(name))


def load_hf(
    path: str | os.PathLike,
    *,
    param_dtype: str | None = None,
    compute_dtype: str | None = None,
    **config_overrides,
) -> Decoder:
    """Loads a HF Qwen3 / Qwen2(.5) / Llama 3 checkpoint directory into a ``Decoder``.

    The config comes from ``config.json`` (``ModelConfig.from_hf_config``;
    ``config_overrides`` such as ``attention_backend`` or ``logits_chunk`` are
    applied on top). ``param_dtype`` / ``compute_dtype`` default to the
    ``ModelConfig`` defaults (float32), whatever dtype the file stores; weights
    are cast tensor by tensor on the host. Headers (names, shapes, dtypes) are
    all checked before any weight is read, and the model is built abstractly,
    so nothing is ever randomly initialised.

    Raises ``CheckpointError`` naming the file, tensor or config field at fault.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (expected a HF checkpoint directory)")
    config_path = os.path.join(path, CONFIG_FILE)
    overrides = dict(config_overrides)
    if param_dtype is not None:
        overrides["param_dtype"] = param_dtype
    if compute_dtype is not None:
        overrides["compute_dtype"] = compute_dtype
    try:
        cfg = ModelConfig.from_hf_config(config_path, **overrides)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    with open(config_path) as f:
        _check_hf_config(json.load(f), config_path)

    layout = _layout(cfg)
    where = _weight_files(path)

    # ---- validate names, shapes and dtypes from the headers only
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in where
    extra = [
        n
        for n in where
        if n not in layout
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (tied_head and n == "lm_head.weight")
    ]
    missing = [n for n in layout if n not in where]
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) missing for {cfg.family.value} "
            f"(num_layers={cfg.num_layers}, tie_word_embeddings={cfg.tie_word_embeddings}): "
            f"{_listing(missing)}"
        )
    if extra:
        raise CheckpointError(
            f"{path}: {len(extra)} unexpected tensor(s) not used by {cfg.family.value} "
            f"(check model_type / attention_bias / tie_word_embeddings in config.json): "
            f"{_listing(extra)}"
        )
    by_file: dict[str, list[str]] = {}
    for name in list(layout) + (["lm_head.weight"] if tied_head else []):
        by_file.setdefault(where[name], []).append(name)
    bad = []
    for fp, names in by_file.items():
        with _safetensors(fp) as f:
            have = set(f.keys())
            for name in names:
                if name not in have:
                    raise CheckpointError(
                        f"{os.path.join(path, INDEX_FILE)} maps {name!r} to "
                        f"{os.path.basename(fp)}, which does not contain it"
                    )
                sl = f.get_slice(name)
                shape, dt = tuple(sl.get_shape()), sl.get_dtype()
                want = (
                    layout[name].hf_shape
                    if name in layout
                    else layout["model.embed_tokens.weight"].hf_shape
                )
                if shape != want:
                    bad.append(f"{name}: got {list(shape)}, expected {list(want)}")
                elif dt not in _FLOAT_DTYPES:
                    bad.append(f"{name}: dtype {dt}, expected one of {sorted(_FLOAT_DTYPES)}")
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} tensor(s) do not match config.json: " + "; ".join(bad)
        )

    # ---- fill the abstract state tensor by tensor
    abstract = nnx.eval_shape(lambda: Decoder(cfg))
    graphdef, state = nnx.split(abstract)
    slots = dict(nnx.to_flat_state(state))
    unmapped = set(slots) - {e.path for e in layout.values()}
    if unmapped:  # a decoder parameter the mapping does not know: a dtarl bug
        raise RuntimeError(f"dtarl.model.hf has no HF name for NNX parameters {sorted(unmapped)}")
    pd = jnp.dtype(cfg.param_dtype)
    filled = {}
    rows: dict[tuple, dict[int, np.ndarray]] = {}  # stacked parameters, by layer
    embed = None
    for fp, names in by_file.items():
        with _safetensors(fp) as f:
            for name in names:
                w = _read_tensor(f, fp, name)
                if name not in layout:  # the tied lm_head; compared once the embedding is in
                    filled["__tied_head__"] = w
                    continue
                entry = layout[name]
                if name == "model.embed_tokens.weight":
                    embed = w
                arr = np.asarray(entry.to_nnx(w)).astype(pd)
                slot = slots[entry.path]
                want = tuple(slot.shape)[1:] if entry.layer is not None else tuple(slot.shape)
                if arr.shape != want:
                    raise RuntimeError(f"{name} -> {entry.name}: {arr.shape} != {want}")
                if entry.layer is None:
                    filled[entry.path] = slot.replace(jnp.asarray(arr))
                else:
                    rows.setdefault(entry.path, {})[entry.layer] = arr
    for p_, by_layer in rows.items():
        stacked = np.stack([by_layer.pop(i) for i in range(cfg.num_layers)])
        filled[p_] = slots[p_].replace(jnp.asarray(stacked))
    if "__tied_head__" in filled:
        head = filled.pop("__tied_head__")
        if not np.array_equal(head, embed):
            raise CheckpointError(
                f"{path}: config.json has tie_word_embeddings=true but lm_head.weight differs "
                "from model.embed_tokens.weight; set tie_word_embeddings=false to load both"
            )
    new_state = nnx.from_flat_state([(p, filled[p]) for p in slots])
    return nnx.merge(graphdef, new_state)


# ---------------------------------------------------------------------- save


def _fsync(fp: str) -> None:
    fd = os.open(fp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_hf(
    model: Decoder,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    extra_files: Sequence[str | os.PathLike] = (),
) -> str:
    """Writes ``model`` as a HF checkpoint directory that ``transformers`` loads.

    Writes ``config.json`` (``ModelConfig.to_hf_config``) and the weights in
    ``dtype`` (default: the model's ``param_dtype``; accepted: float32,
    bfloat16, float16). With ``max_shard_bytes`` the weights are split into
    ``model-0000k-of-0000n.safetensors`` files of at most that many bytes (a
    single larger tensor gets its own file) plus ``model.safetensors.index.json``.
    ``extra_files`` (e.g. ``tokenizer_files(dir)``) are copied in by base name; one
    named like a file ``save_hf`` writes is an error.

    The write is atomic: everything goes to a temporary directory next to
    ``path`` which is then renamed; an existing ``path`` is replaced as a whole
    (other files in it, e.g. tokenizer files, are not kept) only once the new
    one is complete. Returns ``path``.
    """
    cfg: ModelConfig = model.cfg
    dtype = dtype or cfg.param_dtype
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted: {sorted(_SAVE_DTYPES)}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1 (or None)")
    extra = [os.fspath(fp) for fp in extra_files]
    for fp in extra:
        name = os.path.basename(fp)
        if name in (CONFIG_FILE, INDEX_FILE) or name.endswith(".safetensors"):
            raise ValueError(f"extra_files: {fp} would overwrite the checkpoint's own {name}")
        if not os.path.isfile(fp):
            raise ValueError(f"extra_files: {fp} is not a file")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory; save_hf writes a directory")
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)

    layout = _layout(cfg)
    slots = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    missing = {e.path for e in layout.values()} - set(slots)
    if missing:
        raise ValueError(f"model has no parameters at {sorted(missing)} for {cfg.family.value}")
    np_dtype = _SAVE_DTYPES[dtype]

    def hf_tensor(entry: _Entry) -> np.ndarray:
        arr = slots[entry.path][...]
        if entry.layer is not None:
            arr = arr[entry.layer]
        arr = np.asarray(jax.device_get(arr))
        if not np.isfinite(arr).all():  # never export NaN / inf weights
            raise ValueError(f"{path}: parameter {entry.name} holds NaN or inf; not exported")
        return np.ascontiguousarray(entry.to_hf(arr).astype(np_dtype))

    itemsize = np.dtype(np_dtype).itemsize
    shards: list[list[str]] = [[]]
    size = 0
    for name, entry in layout.items():
        nbytes = int(np.prod(entry.hf_shape)) * itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        hf_config = cfg.to_hf_config()
        hf_config["torch_dtype"] = dtype
        hf_config["dtype"] = dtype
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
            f.write("\n")
        _fsync(os.path.join(tmp, CONFIG_FILE))
        n = len(shards)
        weight_map: dict[str, str] = {}
        total = 0
        for k, names in enumerate(shards):
            fname = SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            tensors = {name: hf_tensor(layout[name]) for name in names}
            total += sum(t.nbytes for t in tensors.values())
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
            _fsync(os.path.join(tmp, fname))
            weight_map.update(dict.fromkeys(names, fname))
            del tensors
        if n > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": weight_map},
                    f,
                    indent=2,
                    sort_keys=True,
                )
                f.write("\n")
            _fsync(os.path.join(tmp, INDEX_FILE))
        for fp in extra:
            dst = os.path.join(tmp, os.path.basename(fp))
            shutil.copyfile(fp, dst)
            _fsync(dst)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        if os.path.exists(path):
            old = os.path.join(parent, f".{base}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def tokenizer_files(directory: str | os.PathLike | None) -> list[str]:
    """The ``TOKENIZER_FILES`` in ``directory`` when it holds a ``tokenizer.json`` (a HF
    tokenizer, as ``load_tokenizer`` reads it); [] otherwise (e.g. None)."""
    if directory is None or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return []
    paths = (os.path.join(os.fspath(directory), n) for n in TOKENIZER_FILES)
    return [p for p in paths if os.path.isfile(p)]


def _written_by_save_hf(name: str) -> bool:
    return name in (CONFIG_FILE, INDEX_FILE, EXPORT_MARKER) or name.endswith(".safetensors")


def _inside(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_export_dir(
    path: str | os.PathLike,
    *,
    what: str = "export directory",
    protect: Sequence[tuple[str, str | os.PathLike]] = (),
) -> None:
    """Refuses ``path`` as the target of a repeated export (``save_hf`` replaces it as a
    whole) unless it is absent, an empty directory, or a previous export: nothing in it
    but a HF checkpoint and tokenizer files. ``protect``: ``(name, dir)`` pairs that
    must not be ``path`` or inside it (e.g. the run's out_dir). ``what`` names the
    setting in the errors."""
    path = os.fspath(path)
    for name, keep in protect:
        if _inside(os.fspath(keep), path):
            raise ValueError(
                f"{what}={path!r} contains {name}={os.fspath(keep)!r}, which the export "
                f"would delete (it replaces {what} as a whole): choose another directory "
                f"(one inside {name} is fine)"
            )
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"{what}={path!r} exists and is not a directory")
    foreign = [
        n
        for n in os.listdir(path)
        if not (_written_by_save_hf(n) and os.path.isfile(os.path.join(path, n)))
        and n not in TOKENIZER_FILES
    ]
    if foreign:
        raise ValueError(
            f"{what}={path!r} holds files that are not a HF export ({_listing(foreign)}); "
            "the export replaces the directory as a whole: choose a new or empty one"
        )


__all__ = [
    "EXPORT_MARKER",
    "SAVE_DTYPES",
    "TOKENIZER_FILES",
    "CheckpointError",
    "check_export_dir",
    "load_hf",
    "save_hf",
    "tokenizer_files",
]
