"""``dtarl bench scale``'s memory report (``dtarl.bench.scale_memory``) at the tiny
model: the per-device bytes follow the shardings (fsdp=8 holds 1/8 of dp=8's params,
gradients and Adam moments), the JSON row has the issue's keys, and bad input (a mesh
that does not divide the devices, a peak over ``--device-memory``) is a ConfigError
naming the axis or mesh and the accepted values."""

import pytest

from dtarl.bench import scale_memory as sm
from dtarl.errors import ConfigError

SHAPE = dict(group=8, prompt=8, response=8)


@pytest.fixture(scope="module")
def rows():
    fsdp = sm.measure("tiny", sm.parse_mesh("dp=1,fsdp=8,tp=1", 8), "dense", **SHAPE)
    dp = sm.measure("tiny", sm.parse_mesh("dp=8", 8), "dense", **SHAPE)
    return fsdp, dp


def test_bytes_follow_the_fsdp_split(rows):
    fsdp, dp = rows
    assert fsdp["mesh"] == {"dp": 1, "fsdp": 8, "tp": 1} and fsdp["layers"] == 2
    assert fsdp["param_bytes"] * 8 == dp["param_bytes"] > 0  # every tiny tensor splits by 8
    for r in rows:
        assert r["grad_bytes"] == r["param_bytes"]  # fp32 gradients, split like the params
        # Adam's mu and nu like the params, plus replicated step counts.
        assert 0 <= r["opt_bytes"] - 2 * r["param_bytes"] < 64
        assert r["peak_bytes"] >= r["param_bytes"] + r["grad_bytes"] + r["opt_bytes"]
        assert r["peak_bytes"] >= r["update_peak_bytes"] and r["compile_s"] > 0
    assert fsdp["update_peak_bytes"] * 4 < dp["update_peak_bytes"]
    (row,) = sm.json_rows([fsdp])
    assert tuple(row) == sm.KEYS


def test_extrapolation_is_linear_in_depth_and_labelled(rows):
    a, _ = rows
    b = dict(a, layers=4, param_bytes=a["param_bytes"] + 100)
    row = sm.extrapolate(a, b, 10)
    assert row["extrapolated"] and row["layers"] == 10 and row["measured_layers"] == [2, 4]
    assert row["param_bytes"] == a["param_bytes"] + 400
    assert sm.json_rows([row])[0]["extrapolated"] is True
    assert "*" in sm.format_table([row])


def test_bad_input_names_the_axis_and_the_accepted_values(rows):
    with pytest.raises(ConfigError, match=r"dp x fsdp x tp = 6, but 8 devices.*\[1, 2, 4, 8\]"):
        sm.parse_mesh("dp=1,fsdp=3,tp=2", 8)
    with pytest.raises(ConfigError, match=r"unknown axis 'pp'.*accepted: dp, fsdp, tp"):
        sm.parse_mesh("pp=2")
    with pytest.raises(ConfigError, match=r"fsdp=0 must be an integer >= 1"):
        sm.parse_mesh("fsdp=0")
    with pytest.raises(ConfigError, match=r"--model 'qwen3_9b': accepted"):
        sm.model_config("qwen3_9b")
    fsdp, _ = rows
    sm.check_budget(fsdp, fsdp["peak_bytes"] / sm.GiB * 1.01)  # fits: no error
    with pytest.raises(
        ConfigError, match=r"mesh dp=1,fsdp=8,tp=1 peaks at .* GiB per device; accepted"
    ):
        sm.check_budget(fsdp, fsdp["peak_bytes"] / sm.GiB * 0.99)
