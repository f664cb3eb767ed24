"""``dtarl bench scale --compile``'s table: step speedups over dense and their
fraction of the token-ideal, hand-computed."""

from dtarl.bench.scale import format_table


def _engine(compile_s, step_s, step_cpu_s):
    return dict(
        compile_s=compile_s,
        compile_cpu_s=compile_s / 2,
        step_s=step_s,
        step_cpu_s=step_cpu_s,
    )


def test_step_ratios_against_dense_and_the_ideal():
    result = dict(
        model="qwen3_0p6b",
        group=8,
        prompt=512,
        response=64,
        ideal=4.5,  # 8 * 576 / (512 + 8 * 64)
        rows=[
            dict(
                layers=2,
                engines=dict(dense=_engine(10.0, 9.0, 18.0), prefix_reuse=_engine(20.0, 2.5, 4.0)),
            )
        ],
    )
    text = format_table(result)
    assert "token-ideal speedup 4.50" in text
    lines = text.splitlines()
    wall = lines.index(next(x for x in lines if x.startswith("step s")))
    cpu = lines.index(next(x for x in lines if x.startswith("step CPU s")))
    # wall: 9.0 / 2.5 = 3.60x dense = 0.80 of 4.5; CPU: 18 / 4 = 4.50x = 1.00 of 4.5
    assert lines[wall + 1].split()[-2:] == ["9.00", "2.50"]
    assert lines[wall + 2].split()[-2:] == ["1.00", "3.60"]
    assert lines[wall + 3].split() == ["of", "ideal", "0.80"]
    assert lines[cpu + 2].split()[-2:] == ["1.00", "4.50"]
    assert lines[cpu + 3].split() == ["of", "ideal", "1.00"]


def test_compile_mode_builds_every_depth_with_the_remat_policy(monkeypatch):
    """``--remat`` reaches the model of every engine in ``--compile`` mode (at 28 layers
    dense needs it to fit), and the result and table say which policy ran."""
    import flax.nnx

    import dtarl.model
    from dtarl.bench import scale
    from dtarl.model.config import Remat

    built = []

    def fake_init(cfg, seed=0):
        built.append(cfg)
        return object()

    monkeypatch.setattr(dtarl.model, "init_model", fake_init)
    monkeypatch.setattr(scale, "_engine_times", lambda *a, **k: dict(_engine(1, 2, 2), loss=0.0))
    monkeypatch.setattr(flax.nnx, "split", lambda m, *f: (None, {}))
    result = scale.run_compile(
        layers=(1, 2),
        engines=("dense",),
        rollout=False,
        remat="full",
        repeats=1,
        log=lambda s: None,
    )
    assert [(c.num_layers, c.remat) for c in built] == [(1, Remat.FULL), (2, Remat.FULL)]
    assert result["remat"] == "full"
    assert "remat full" in scale.format_table(result)
