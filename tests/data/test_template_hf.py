"""Chat-templated prompt ids equal ``transformers``' ``apply_chat_template`` (the ``hf``
extra; skipped without transformers), on a small byte-level BPE tokenizer with a
Qwen-style template built here, offline."""

import json

import pytest

from dtarl.data import DataSection
from dtarl.errors import ConfigError
from dtarl.model.tokenizer import load_tokenizer
from dtarl.rl.config import load_config

transformers = pytest.importorskip("transformers")

# Qwen2.5's template, shortened (no tool calls): a default system message, roles in
# <|im_start|> ... <|im_end|> blocks, the generation prompt; plus Qwen3's namespace
# bookkeeping (the last user turn, found walking messages[::-1]) and a tojson.
QWEN_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}\n"
    "{%- for m in messages[::-1] %}\n"
    "    {%- if ns.last_user < 0 and m.role == 'user' %}"
    "{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}\n"
    "    {%- if loop.index0 == ns.last_user %}{{- {'last': loop.index0} | tojson }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Llama-style: the template writes the BOS token itself.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant.",
        "Ann has 3 apples and gets 4 more. How many apples?",
        "Solve step by step and put the answer after ####.",
        "system user assistant",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": QWEN_TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
            }
        )
    )
    return d


MESSAGES = [
    [{"role": "user", "content": "Ann has 3 apples and gets 4 more. How many apples?"}],
    [
        {"role": "system", "content": "Solve step by step and put the answer after ####."},
        {"role": "user", "content": "  How many apples?  "},
    ],
    [
        {"role": "user", "content": "How many?"},
        {"role": "assistant", "content": "7 #### 7"},
        {"role": "user", "content": "And with <|im_end|> in the text?"},
    ],
]


def _rows(tmp_path, prompts):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in prompts))
    return str(path)


def _hf_ids(directory, messages):
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_rendered_ids_equal_apply_chat_template(tok_dir, tmp_path):
    tokenizer = load_tokenizer(tok_dir)
    rows = _rows(tmp_path, [*MESSAGES, "Ann has 3 apples."])
    train, _ = DataSection(train_files=rows).build(tokenizer, tokenizer_dir=str(tok_dir), seed=0)
    got = [list(p.ids) for p in train.prompts]
    for messages, ids in zip(MESSAGES, got, strict=False):
        assert ids == _hf_ids(tok_dir, messages)
    # A string prompt is one user message.
    assert got[3] == _hf_ids(tok_dir, [{"role": "user", "content": "Ann has 3 apples."}])
    assert train.prompts[0].text.endswith("<|im_start|>assistant\n")
    # chat_template: none -> the raw text (BOS + text; this tokenizer has no BOS).
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: prompt is a list of chat messages"):
        DataSection(train_files=rows, chat_template="none").build(
            tokenizer, tokenizer_dir=str(tok_dir), seed=0
        )
    plain, _ = DataSection(
        train_files=_rows(tmp_path, ["Ann has 3 apples."]), chat_template="none"
    ).build(tokenizer, tokenizer_dir=str(tok_dir), seed=0)
    assert list(plain.prompts[0].ids) == tokenizer.encode("Ann has 3 apples.")


def test_template_file_with_special_tokens_equals_hf(tok_dir, tmp_path):
    """data.chat_template: PATH.jinja, seeing the tokenizer's bos/eos tokens."""
    d = tmp_path / "llama_tok"
    d.mkdir()
    (d / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    jinja = tmp_path / "llama.jinja"
    jinja.write_text(LLAMA_TEMPLATE)
    tokenizer = load_tokenizer(d)
    section = DataSection(train_files=_rows(tmp_path, MESSAGES), chat_template=str(jinja))
    train, _ = section.build(tokenizer, tokenizer_dir=str(d), seed=0)
    # transformers with the same template given as the tokenizer's.
    cfg["chat_template"] = LLAMA_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for messages, p in zip(MESSAGES, train.prompts, strict=True):
        assert list(p.ids) == _hf_ids(d, messages)
        assert p.ids[0] == tokenizer.bos_id  # written by the template, once


def test_hf_folder_without_tokenizer_is_an_error(tmp_path):
    from dtarl.model.tokenizer import ByteTokenizer
    from dtarl.testing.hf import make_tiny_hf_checkpoint

    ckpt = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen3")
    cfg = load_config(None, [f"model.hf_path={ckpt}"])
    with pytest.raises(ConfigError, match=r"has no tokenizer.json .* or model.tokenizer=byte"):
        cfg.model.build()
    _, tok = load_config(None, [f"model.hf_path={ckpt}", "model.tokenizer=byte"]).model.build()
    assert isinstance(tok, ByteTokenizer)
    with pytest.raises(ConfigError, match="model.tokenizer=byte with model.tokenizer_path"):
        load_config(None, ["model.tokenizer=byte", f"model.tokenizer_path={ckpt}"])
