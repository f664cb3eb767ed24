"""``dtarl bench quickstart``: its seeds' configs, the table, the argument errors (the
runs themselves are the main job: see docs/training.md for their numbers)."""

import argparse

import pytest

from dtarl.bench.quickstart import SeedResult, format_table, seed_config
from dtarl.commands.bench_quickstart import _DEFAULT, _seeds
from dtarl.errors import ConfigError


def test_seed_config(tmp_path):
    cfg = seed_config(_DEFAULT, 2, str(tmp_path), ["steps=3"])
    assert (cfg.seed, cfg.steps, cfg.console, cfg.resume.enabled) == (2, 3, False, False)
    assert cfg.out_dir == f"{tmp_path}/seed_2" and cfg.sft.steps > 0
    with pytest.raises(ConfigError, match="unknown keys"):
        seed_config(_DEFAULT, 0, str(tmp_path), ["nope=1"])


def test_table_and_gain():
    rows = [
        SeedResult(
            seed=s,
            before=0.0,
            sft=0.5,
            grpo=g,
            seconds=10.0 * (s + 1),
            load_before=1.0,
            load_after=2.5,
        )
        for s, g in ((0, 0.75), (1, 0.5))
    ]
    assert [r.gain for r in rows] == [0.25, 0.0]
    text = format_table(rows, cores=2)
    assert "(2 cores;" in text
    assert "   0   0.000   0.500   0.750  +0.250     10.0   1.0-2.5" in text
    assert text.endswith("mean gain +0.125 (min +0.000); mean 15.0 s per run")


def test_seeds_argument():
    assert _seeds("0,1,2") == [0, 1, 2]
    for bad in ("0,x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
            _seeds(bad)
