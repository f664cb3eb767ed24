"""Writes a small GSM8K-format dataset of arithmetic word problems (generated, seeded).

    python configs/examples/make_data.py     # -> configs/examples/data/{train,val}.jsonl
    python configs/examples/make_data.py --out DIR --train 400 --val 100 --seed 0

Each line is ``{"question": ..., "answer": "<working> #### <number>", "data_source":
"dtarl/arith_words"}``: GSM8K's own keys and answer format (the solution, then
``####`` and the final number), so a config written for it (``prompt_key: question``,
``answer_key: answer``) reads GSM8K's files unchanged. The problems are short (one
operation, numbers below 10 by default) so that the embedded tiny model with its byte
tokenizer learns them in minutes (configs/examples/jsonl_tiny.yaml). The train and
validation rows do not share a question.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

NAMES = ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Ida")
THINGS = ("apples", "pens", "cards", "shells", "coins", "books")
# (question template, operation): a, b are the two numbers; name, thing fill the story.
TEMPLATES = (
    ("{name} has {a} {thing} and gets {b} more. How many {thing}?", "+"),
    ("{name} has {a} {thing} and gives away {b}. How many {thing} are left?", "-"),
    ("{name} buys {a} bags with {b} {thing} each. How many {thing}?", "*"),
)


def problem(rng: np.random.Generator, max_number: int) -> dict[str, str]:
    template, op = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    a, b = (int(x) for x in rng.integers(1, max_number + 1, 2))
    if op == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    name = NAMES[int(rng.integers(len(NAMES)))]
    thing = THINGS[int(rng.integers(len(THINGS)))]
    return {
        "question": template.format(name=name, thing=thing, a=a, b=b),
        "answer": f"{a}{op}{b}={value} #### {value}",
        "data_source": "dtarl/arith_words",
    }


def generate(n_train: int, n_val: int, *, seed: int, max_number: int):
    """(train rows, val rows): distinct questions, drawn until there are enough."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    budget = 100 * (n_train + n_val)
    while len(rows) < n_train + n_val and budget:
        budget -= 1
        row = problem(rng, max_number)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    if len(rows) < n_train + n_val:
        raise SystemExit(
            f"only {len(rows)} distinct questions with --max-number {max_number}; raise it"
        )
    return rows[:n_train], rows[n_train:]


def write_jsonl(path: str, rows) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv=None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(here, "data"))
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--val", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-number", type=int, default=9)
    a = p.parse_args(argv)
    train, val = generate(a.train, a.val, seed=a.seed, max_number=a.max_number)
    write_jsonl(os.path.join(a.out, "train.jsonl"), train)
    write_jsonl(os.path.join(a.out, "val.jsonl"), val)
    print(f"wrote {len(train)} + {len(val)} rows to {a.out}/{{train,val}}.jsonl")


if __name__ == "__main__":
    main()
