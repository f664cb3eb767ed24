"""``dtarl bench stalls``'s report from recorded steps and compile events (no training:
the run itself is the trainer's, covered by tests/engines/test_no_stalls.py)."""

import jax
import jax.numpy as jnp
import pytest

from dtarl.bench import stalls
from dtarl.rl.config import load_config

XLA, TRACE = stalls.XLA_EVENT, "/jax/core/compile/jaxpr_trace_duration"


def row(step, phase, first, compile_s=0.0, tune_s=0.0):
    return dict(
        step=step,
        phase=phase,
        phase_step=step - first + 1,
        step_seconds=1.0,
        compile_seconds=compile_s,
        autotune_seconds=tune_s,
        chosen_engine="dfs",
    )


def test_report_flags_compiles_after_the_first_step_of_each_phase():
    cfg = load_config(None, ["sft.steps=2", "steps=3"])
    rows = [
        row(1, "sft", 1, 5.0, 4.0),
        row(2, "sft", 1),
        row(3, "rl", 3, 6.0, 3.0),
        row(4, "rl", 3, 1e-5),  # a jaxpr-cache hit only
        row(5, "rl", 3, 0.5),  # a real compile mid-run
    ]
    ev = stalls.CompileEvent
    events = [
        ev(step=0, program="init", event=XLA, seconds=1.0),
        ev(step=1, program="dfs_engine", event=TRACE, seconds=1.0),
        ev(step=1, program="dfs_engine", event=XLA, seconds=4.0),
        ev(step=3, program="dfs_engine", event=XLA, seconds=6.0),
        ev(step=4, program="fn", event=TRACE, seconds=1e-5),
        ev(step=5, program="dense_engine", event=XLA, seconds=0.5),
    ]
    res = stalls.report(cfg, rows, events, wall=20.0, build_seconds=2.0)
    sft, rl = res["phases"]
    assert sft["phase"] == "sft" and sft["steps"] == 2 and sft["later_steps_compiling"] == []
    assert rl["later_steps_compiling"] == [5] and rl["later_steps_trace_only"] == [4]
    assert rl["first_compile_seconds"] == 6.0
    assert rl["later_compile_seconds"] == pytest.approx(0.50001)
    assert res["compile_seconds_total"] == pytest.approx(11.50001)
    assert res["autotune_seconds_total"] == 7.0
    assert res["compile_share"] == pytest.approx(11.50001 / 20.0)
    assert res["build_compile_seconds"] == 1.0
    progs = {p["program"]: p for p in res["programs"]}
    assert progs["dfs_engine"]["compiles"] == 2 and progs["dfs_engine"]["seconds"] == 11.0
    assert progs["dfs_engine"]["late"] == [] and progs["dense_engine"]["late"] == [5]
    assert [e["step"] for e in res["late_events"]] == [4, 5]
    text = stalls.format_report(res)
    assert "[5] (jaxpr-cache events only: [4])" in text and "dense_engine" in text


def test_recorder_names_the_program_and_the_step():
    with stalls.CompileRecorder() as rec:
        rec.step = 7

        def doubled_sum(x):
            return jnp.sum(x * 2)

        jax.jit(doubled_sum)(jnp.arange(5.0)).block_until_ready()
    names = {(e.step, e.program, e.event) for e in rec.events}
    assert (7, "doubled_sum", XLA) in names
    count = len(rec.events)
    jax.jit(lambda x: x + 1)(jnp.arange(3.0)).block_until_ready()  # unregistered
    assert len(rec.events) == count
