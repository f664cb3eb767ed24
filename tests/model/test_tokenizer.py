"""ByteTokenizer and load_tokenizer (a tokenizer.json built offline)."""

from __future__ import annotations

import json

import pytest

from dtarl.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

TEXTS = ["hello world", "naïve café — 数学 ∑ 🙂", "tabs\tand\nnewlines\r\x03\x7f", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert not set(ids) & {tok.pad_id, tok.bos_id, tok.eos_id}
    assert tok.decode(ids) == text


def test_byte_special_ids():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (256, 0, 1, 2)
    ids = [tok.bos_id] + tok.encode("hi") + [tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "\x01hi\x02\x00\x00"


@pytest.mark.parametrize("ch,at", [("\x00", 3), ("\x01", 0), ("\x02", 5)])
def test_byte_rejects_reserved_characters(ch, at):
    text = "abcdef"[:at] + ch + "xyz"
    with pytest.raises(TokenizerError, match=f"U\\+000{ord(ch)} at character {at}"):
        ByteTokenizer().encode(text)


def test_byte_decode_bad_ids_and_invalid_utf8():
    tok = ByteTokenizer()
    with pytest.raises(TokenizerError, match=r"ids\[1\]=256 is out of range"):
        tok.decode([65, 256])
    assert tok.decode([0xE6, 0x95]) == "\ufffd"  # a truncated 3-byte sequence


# ------------------------------------------------------------ tokenizers


CORPUS = ["the quick brown fox", "jumps over the lazy dog", "the dog sleeps"] * 5
SPECIALS = ["<pad>", "<s>", "</s>"]


def _build(tmp_path, *, tokenizer_config=None, config=None, generation_config=None):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    for name, obj in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation_config),
    ):
        if obj is not None:
            (tmp_path / name).write_text(json.dumps(obj))
    return tmp_path


def test_load_tokenizer_round_trip(tmp_path):
    path = _build(
        tmp_path,
        tokenizer_config={
            "eos_token": "</s>",
            "pad_token": {"content": "<pad>"},
            "bos_token": "<s>",
        },
    )
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size > 256  # byte alphabet + merges + specials
    for text in ["the quick brown dog", "naïve 🙂 text never seen", ""]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.bos_id not in ids
        assert tok.decode(ids) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges used
    ids = tok.encode("the dog") + [tok.eos_id]
    assert tok.decode(ids) == "the dog"
    assert tok.decode(ids, skip_special=False) == "the dog</s>"
    assert load_tokenizer(path / "tokenizer.json").eos_id == 2  # the file itself works too


def test_load_tokenizer_ids_from_configs(tmp_path):
    path = _build(
        tmp_path,
        generation_config={"eos_token_id": [2, 1]},
        config={"eos_token_id": 0, "bos_token_id": 1},
    )
    tok = load_tokenizer(path)
    assert tok.eos_id == 2  # generation_config.json wins, first of the list
    assert tok.pad_id == 2  # no pad anywhere: pad = eos
    assert tok.bos_id == 1


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: no such file"):
        load_tokenizer(tmp_path)
    path = _build(tmp_path)
    with pytest.raises(TokenizerError, match="no eos token found"):
        load_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    with pytest.raises(TokenizerError, match=r"eos_token='<\|end\|>' is not in the vocabulary"):
        load_tokenizer(path)
    (path / "tokenizer_config.json").unlink()
    (path / "config.json").write_text(json.dumps({"eos_token_id": 10_000}))
    with pytest.raises(TokenizerError, match="eos_token_id=10000 must be an id in"):
        load_tokenizer(path)
    (path / "config.json").write_text("{bad json")
    with pytest.raises(TokenizerError, match=r"config\.json:1: malformed JSON"):
        load_tokenizer(path)
    (path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError, match="cannot be parsed"):
        load_tokenizer(path)
