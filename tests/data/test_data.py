"""dtarl.data without a model: files -> rows -> prompts, errors naming file:row and key,
truncation, the seeded epoch order, the data: section and the shipped example data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtarl.data import (
    ChatTemplate,
    DataSection,
    PromptDataset,
    PromptRenderer,
    RowKeys,
    Truncation,
    load_prompts,
)
from dtarl.errors import ConfigError
from dtarl.model.tokenizer import ByteTokenizer
from dtarl.rl.config import load_config
from dtarl.rl.datatask import DatasetTask, final_answer

ROOT = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()
PLAIN = PromptRenderer(TOK, None)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(paths, keys=None, *, max_length=64, truncation=Truncation.ERROR, renderer=PLAIN):
    keys = RowKeys() if keys is None else keys
    return load_prompts(
        paths, keys, renderer=renderer, max_length=max_length, truncation=truncation, key="k"
    )


def test_jsonl_json_parquet_and_directory_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "1+1=", "answer": "2", "data_source": "s", "extra_info": {"i": 0}},
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": 4},
    ]
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "a.jsonl", rows[:1])
    (d / "b.json").write_text(json.dumps(rows[1:]))
    pq.write_table(pa.Table.from_pylist(rows[:1]), str(tmp_path / "c.parquet"))
    (d / "notes.txt").write_text("not data")  # other files in a directory are not data
    got, stats = load([str(d), str(tmp_path / "c.parquet")], renderer=_TemplateRenderer())
    assert stats.rows == 3 and stats.dropped == 0
    assert [p.row.answer for p in got] == ["2", 4, "2"]
    assert got[0].row.where == f"{d}/a.jsonl:1" and got[1].row.where == f"{d}/b.json:row 0"
    assert got[2].row.where == f"{tmp_path}/c.parquet:row 0"
    assert got[0].row.data_source == "s" and got[0].row.extra_info == {"i": 0}
    assert got[2].row.extra_info == {"i": 0} and got[1].row.extra_info == {}
    assert got[1].row.prompt == ({"role": "user", "content": "2+2="},)
    # Plain rendering: BOS + the text's bytes.
    plain, _ = load([str(d / "a.jsonl")])
    assert plain[0].text == "1+1=" and plain[0].ids == (TOK.bos_id, *b"1+1=")


class _TemplateRenderer(PromptRenderer):
    def __init__(self):
        tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        super().__init__(
            TOK, ChatTemplate(tpl + "{% if add_generation_prompt %}>{% endif %}", where="t")
        )


def test_dotted_keys_reach_verl_nested_columns(tmp_path):
    rows = [{"q": "x", "reward_model": {"ground_truth": "7", "style": "rule"}}]
    keys = RowKeys(prompt="q", answer="reward_model.ground_truth", response=None)
    (got,), _ = load([write_jsonl(tmp_path / "v.jsonl", rows)], keys)
    assert got.row.answer == "7" and got.row.record["reward_model"]["style"] == "rule"


@pytest.mark.parametrize(
    "row, match",
    [
        ({"answer": "1"}, r"v.jsonl:2: no key 'prompt' \(data.prompt_key\)"),
        ({"prompt": "a"}, r"v.jsonl:2: no key 'answer' \(data.answer_key"),
        ({"prompt": "a", "answer": None}, r"v.jsonl:2: a null value for 'answer'"),
        ({"prompt": "  ", "answer": "1"}, r"v.jsonl:2: prompt is an empty string"),
        ({"prompt": 3, "answer": "1"}, r"v.jsonl:2: prompt must be a string or a list of messages"),
        ({"prompt": [], "answer": "1"}, r"v.jsonl:2: prompt is an empty list of messages"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, r"v.jsonl:2: prompt\[0\] has no 'content'"),
        (
            {"prompt": [{"role": "user", "content": 5}], "answer": "1"},
            r"v.jsonl:2: prompt\[0\].content must be a string",
        ),
        (
            {"prompt": "a", "answer": "1", "extra_info": 3},
            r"v.jsonl:2: extra_info must be a mapping",
        ),
        ([1, 2], r"v.jsonl:2: a row must be an object"),
    ],
)
def test_bad_rows_name_file_row_and_key(tmp_path, row, match):
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(ConfigError, match=match):
        load([path])


def test_bad_files_name_the_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": oops}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: malformed JSON"):
        load([str(p)])
    with pytest.raises(ConfigError, match=r"k='.*missing.jsonl': no such file"):
        load([str(tmp_path / "missing.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"unknown file type; accepted: .jsonl, .json, .parquet"):
        load([str(tmp_path / "x.csv")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="the directory has no data files"):
        load([str(tmp_path / "empty")])
    # A chat prompt needs a template.
    chat = write_jsonl(
        tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "a"}], "answer": "1"}]
    )
    with pytest.raises(ConfigError, match=r"c.jsonl:1: prompt is a list of chat messages but"):
        load([chat])
    # The byte tokenizer's reserved characters name the row.
    ctrl = write_jsonl(tmp_path / "ctrl.jsonl", [{"prompt": "a\x01", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"ctrl.jsonl:1: prompt cannot be tokenised"):
        load([ctrl])


def test_truncation_modes(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"prompt": "abcdefgh", "answer": "1"}, {"prompt": "ab", "answer": "2"}],
    )
    with pytest.raises(
        ConfigError,
        match=r"t.jsonl:1: prompt is 9 tokens, over "
        r"data.max_prompt_length=5; .* left, right or drop",
    ):
        load([path], max_length=5)
    left, s = load([path], max_length=5, truncation=Truncation.LEFT)
    assert left[0].ids == tuple(b"defgh") and left[0].truncated and s.truncated == 1
    right, _ = load([path], max_length=5, truncation=Truncation.RIGHT)
    assert right[0].ids == (TOK.bos_id, *b"abcd") and not right[1].truncated
    dropped, s = load([path], max_length=5, truncation=Truncation.DROP)
    assert [p.row.answer for p in dropped] == ["2"] and (s.rows, s.dropped) == (2, 1)
    with pytest.raises(ConfigError, match=r"no rows \(2 dropped by data.truncation=drop\)"):
        load([path], max_length=2, truncation=Truncation.DROP)


def _prompts(tmp_path, n):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]
    return load([write_jsonl(tmp_path / "d.jsonl", rows)])[0]


def test_epochs_are_seeded_permutations_by_position(tmp_path):
    prompts = _prompts(tmp_path, 7)
    ds = PromptDataset(prompts, shuffle=True, seed=3)
    order = [ds.index(p) for p in range(21)]
    for e in range(3):  # every epoch draws every row once
        assert sorted(order[7 * e : 7 * e + 7]) == list(range(7))
    assert order[:7] != order[7:14]  # a new order each epoch
    assert order[:7] != list(range(7))
    # A pure function of (seed, position): any split into takes gives the same stream.
    again = PromptDataset(prompts, shuffle=True, seed=3)
    drawn = again.take(0, 5) + again.take(5, 9) + again.take(14, 7)
    assert [p.row.answer for p in drawn] == [str(i) for i in order]
    assert [ds.epoch(p) for p in (0, 6, 7, 20)] == [0, 0, 1, 2]
    other = PromptDataset(prompts, shuffle=True, seed=4)
    assert [other.index(p) for p in range(7)] != order[:7]
    plain = PromptDataset(prompts, shuffle=False, seed=3)
    assert [plain.index(p) for p in range(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert (
        ds.fingerprint()
        == plain.fingerprint()
        != PromptDataset(prompts[1:], shuffle=False, seed=0).fingerprint()
    )


def test_dataset_task_problems_carry_the_row(tmp_path):
    rows = [
        {
            "prompt": "q",
            "answer": "3*4=12 #### 12",
            "data_source": "gsm",
            "extra_info": {"a": 1},
            "sol": "3*4=12 #### 12",
        }
    ]
    keys = RowKeys(prompt="prompt", answer="answer", response="sol")
    prompts, _ = load([write_jsonl(tmp_path / "r.jsonl", rows)], keys)
    task = DatasetTask(train=PromptDataset(prompts, shuffle=True, seed=0))
    (p,) = task.take(5, 1)
    assert p.prompt == "q" and p.prompt_ids == (TOK.bos_id, ord("q"))
    assert (p.answer, p.data_source, p.extra_info) == ("3*4=12 #### 12", "gsm", {"a": 1})
    assert p.row.where.endswith("r.jsonl:1") and p.reference[0][1] == "3*4=12 #### 12"
    assert task.reward(p, "3*4=12 #### 12") == 1.0 and task.reward(p, " 12 ") == 1.0
    assert task.reward(p, "#### 13") == 0.0
    assert final_answer("so #### 1,234") == "1234"
    assert task.metrics(3) == {"data/epoch": 3, "data/dropped_rows": 0, "data/truncated_rows": 0}


def test_data_section_keys_and_errors(tmp_path):
    d = DataSection(train_files="a.jsonl", val_files=["b.jsonl", "c.parquet"])
    assert d.train_files == ("a.jsonl",) and d.val_files == ("b.jsonl", "c.parquet")
    assert DataSection().enabled is False and d.enabled
    for kwargs, match in (
        (dict(train_files=3), r"data.train_files=3 must be a path or a list"),
        (dict(val_files=["v.jsonl"]), "data.val_files is set without data.train_files"),
        (dict(train_files="a", max_prompt_length=0), r"data.max_prompt_length=0 must be >= 1"),
        (dict(train_files="a", prompt_key=""), r"data.prompt_key='' must be a column name"),
    ):
        with pytest.raises(ConfigError, match=match):
            DataSection(**kwargs)
    with pytest.raises(
        ConfigError,
        match=r"data.truncation='cut' is not valid; accepted: "
        r"\['error', 'left', 'right', 'drop'\]",
    ):
        load_config(None, ["data.train_files=a.jsonl", "data.truncation=cut"])
    with pytest.raises(ConfigError, match="set data.response_key"):
        load_config(None, ["data.train_files=a.jsonl", "sft.steps=2"])
    with pytest.raises(ConfigError, match="task: and data.train_files are both set"):
        load_config(None, ["data.train_files=a.jsonl", "task.kind=countdown"])
    cfg = load_config(None, ["data.train_files=[a.jsonl]", "data.chat_template=missing.jinja"])
    with pytest.raises(
        ConfigError,
        match=r"data.chat_template='missing.jinja' is not a file; "
        "accepted: auto, none",
    ):
        cfg.data.template(None)
    assert cfg.data.keys == RowKeys()


def test_chat_template_renders_like_hf(tmp_path):
    """Hand-checked output of a Qwen-style template: trim_blocks / lstrip_blocks, the
    special tokens as variables, tojson without HTML escaping, raise_exception."""
    tpl = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m.role) }}{% endif %}\n"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        "{{ {'k': '<&>'} | tojson }}"
    )
    t = ChatTemplate(tpl, special={"bos_token": "<s>"}, where="t.jinja")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q", "name": None}]
    assert t.render(msgs) == (
        "<s><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        '<|im_start|>assistant\n{"k": "<&>"}'
    )
    assert not t.render(msgs, add_generation_prompt=False).count("assistant")
    with pytest.raises(
        ConfigError, match="t.jinja: rendering the chat template failed: bad role x"
    ):
        t.render([{"role": "x", "content": "a"}])
    with pytest.raises(ConfigError, match=r"t.jinja:1: chat template syntax error"):
        ChatTemplate("{% for %}", where="t.jinja")
    # From a tokenizer directory: tokenizer_config.json's (a named list's default).
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D{{ eos_token }}"},
                ],
                "eos_token": {"content": "</s>"},
            }
        )
    )
    assert ChatTemplate.from_tokenizer_dir(str(tmp_path)).render([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")  # transformers 5 saves it separately
    assert ChatTemplate.from_tokenizer_dir(str(tmp_path)).render([]) == "J"
    assert ChatTemplate.from_tokenizer_dir(None) is None


def test_example_data_is_what_make_data_writes(tmp_path):
    """configs/examples/data/ is generated: the script rewrites it byte for byte."""
    subprocess.run(
        [sys.executable, str(ROOT / "configs/examples/make_data.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in ("train.jsonl", "val.jsonl"):
        shipped = (ROOT / "configs/examples/data" / name).read_text()
        assert (tmp_path / name).read_text() == shipped, name
    train = {json.loads(x)["question"] for x in (tmp_path / "train.jsonl").read_text().splitlines()}
    val = [json.loads(x) for x in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert len(train) == 400 and len(val) == 100 and not train & {r["question"] for r in val}
    # Every row parses under the example config's keys, and its answer is its arithmetic.
    cfg = load_config(ROOT / "configs/examples/jsonl_tiny.yaml")
    prompts, _ = load([str(tmp_path / "val.jsonl")], cfg.data.keys, max_length=96)
    for p in prompts:
        work, value = p.row.answer.split(" #### ")
        expr, result = work.split("=")
        assert eval(expr) == int(result) == int(value)  # noqa: S307 (digits and one operator)
    assert os.path.basename(cfg.data.train_files[0]) == "train.jsonl"


def test_load_from_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    got, _ = load([str(tmp_path / "saved")])
    assert [p.row.answer for p in got] == ["2", "4"]
    assert got[1].row.where == f"{tmp_path / 'saved'}:row 1"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match=r"holds a DatasetDict \(splits \['train'\]\); name one"):
        load([str(tmp_path / "dict")])


def test_missing_files_fail_before_the_model_loads(tmp_path):
    cfg = load_config(None, [f"data.train_files={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(ConfigError, match=r"data.train_files='.*nope.jsonl': no such file"):
        cfg.data.check_files()
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": "1"}])
    cfg = load_config(None, [f"data.train_files={ok}", f"data.val_files={tmp_path / 'v'}"])
    with pytest.raises(ConfigError, match=r"data.val_files='.*v': no such file"):
        cfg.data.check_files()
