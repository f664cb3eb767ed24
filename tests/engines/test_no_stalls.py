"""No compile stalls in a run: every engine, reserved from the run's maxima, compiles
its program on the first batch and never again, while the batches of a trainer-like
sequence differ in depth (forks at different positions), leaf counts and lengths."""

import jax
import numpy as np
import pytest
from flax import nnx

from dtarl.batch import LossNorm
from dtarl.bench import train as bench_train
from dtarl.engines import Capacity, EngineKind, RolloutBatch, make_engine
from dtarl.engines.config import DFSConfig, EngineConfig, PrefixReuseConfig
from dtarl.engines.prefix_reuse import deep_sequences
from dtarl.losses import MaskedNLLLoss
from dtarl.model import ModelConfig, init_model
from dtarl.rl.episodes import Scorer
from dtarl.testing import grpo_groups

# The run's maxima (a trainer reserves these from its config).
PROMPTS, GROUP, PROMPT_LEN, RESPONSE_LEN, TURNS = 2, 4, 12, 24, 1
BOS = 1


def capacity(turns: int = TURNS) -> Capacity:
    return Capacity(
        sequences=PROMPTS * GROUP,
        length=PROMPT_LEN + RESPONSE_LEN,
        group_size=GROUP,
        groups=PROMPTS,
        prompt_len=PROMPT_LEN,
        response_len=RESPONSE_LEN,
        turns=turns,
    )


def forked_batch(seed: int, *, prompts: int, group: int, fork_at: int | None) -> RolloutBatch:
    """``prompts`` groups of ``group`` responses (at most the run's maxima). Responses
    copy a prefix of an earlier response of the group (a fork at a random position,
    or at ``fork_at``) and continue at random, so the tree's depth changes."""
    rs = np.random.RandomState(seed)
    toks, gids, plens = [], [], []
    for g in range(prompts):
        # Every prompt starts with the same token (a BOS), as the trainer's do.
        prompt = [BOS] + list(rs.randint(3, 256, rs.randint(PROMPT_LEN // 2, PROMPT_LEN)))
        responses: list[list[int]] = []
        for _ in range(group):
            n = int(rs.randint(2, RESPONSE_LEN + 1))
            shared: list[int] = []
            if responses and rs.rand() < 0.7:
                other = responses[rs.randint(len(responses))]
                k = fork_at if fork_at is not None else rs.randint(1, len(other) + 1)
                shared = other[: min(k, len(other), n - 1)]
            responses.append(shared + list(rs.randint(3, 256, n - len(shared))))
        toks += [prompt + r for r in responses]
        gids += [g] * group
        plens += [len(prompt)] * group
    return RolloutBatch.create(
        tokens=toks, prompt_lens=plens, advantages=rs.randn(len(toks)), group_ids=np.asarray(gids)
    )


def trainer_like_batches() -> list[RolloutBatch]:
    """Depth 2 (no forks), then forks early, late and everywhere, fewer groups and
    leaves, longest and shortest lengths."""
    return [
        forked_batch(0, prompts=PROMPTS, group=GROUP, fork_at=0),
        forked_batch(1, prompts=PROMPTS, group=GROUP, fork_at=1),
        forked_batch(2, prompts=PROMPTS, group=GROUP, fork_at=RESPONSE_LEN - 2),
        forked_batch(3, prompts=1, group=GROUP - 1, fork_at=None),
        forked_batch(4, prompts=PROMPTS, group=GROUP, fork_at=None),
        forked_batch(5, prompts=PROMPTS, group=2, fork_at=3),
        forked_batch(6, prompts=PROMPTS, group=GROUP, fork_at=None),
    ]


@pytest.fixture(scope="module")
def model_params():
    model = init_model(ModelConfig.tiny(), seed=0)
    return model, nnx.split(model, nnx.Param)[1]


ENGINES = EngineConfig(
    dfs=DFSConfig(chunk_len=8, leaf_rows=2, wide_chunks=2),
    prefix_reuse=PrefixReuseConfig(microbatch=2, dfs_chunk_len=8),
)


def test_batches_differ_in_depth_leaves_and_lengths():
    stats = [b.prefix_tree().stats for b in trainer_like_batches()]
    assert len({s.depth for s in stats}) >= 3
    assert len({s.num_leaves for s in stats}) >= 3
    assert len({s.longest_path for s in stats}) >= 3
    # Some batches have a group that forks deep below its prompt (prefix_reuse's
    # deep groups), some do not.
    deep = [bool(deep_sequences(b.prefix_tree()).any()) for b in trainer_like_batches()]
    assert any(deep) and not all(deep)


def buckets_of(engine):
    """An engine's buckets (auto: each candidate's)."""
    if hasattr(engine, "engines"):
        return {k: e.buckets for k, e in engine.engines.items()}
    return engine.buckets


def run_once_timer(runs):
    """auto's timer: one call of every candidate (compiling it, as the real timer's
    warm-up does) and fixed seconds (dfs fastest): no assertion depends on real time."""
    for run in runs.values():
        jax.block_until_ready(run())
    return {k: {"dense": 0.3, "prefix_reuse": 0.2, "dfs": 0.1}[k] for k in runs}


@pytest.mark.parametrize("kind", ["dense", "dfs", "prefix_reuse", "auto"])
def test_reserved_engine_compiles_once(model_params, kind):
    model, params = model_params
    settings = {}
    if kind == "auto":  # every candidate timed (and compiled) on the first batch
        settings = dict(timer=run_once_timer, host_seconds=lambda k, b: 0.0, tune_all_below=1e9)
    engine = make_engine(EngineKind(kind), model, ENGINES, **settings).reserve(capacity())
    loss = MaskedNLLLoss()
    reserved = buckets_of(engine)
    counts, tune_seconds = [], []
    for batch in trainer_like_batches():
        aux = engine.value_and_grad(params, batch, loss)[2]
        counts.append(engine.trace_count)
        tune_seconds.append(aux.stats.get("autotune_seconds", 0.0))
    first = counts[0]  # auto: one program per candidate
    assert counts == [first] * len(counts) and first == (3 if kind == "auto" else 1), counts
    assert buckets_of(engine) == reserved, f"a batch outgrew the reserve: {buckets_of(engine)}"
    if kind == "auto":  # tuned once; later depths and sizes reuse or re-pick untimed
        assert all(s == 0.0 for s in tune_seconds[1:]), tune_seconds


def test_reserved_prefix_reuse_multiturn_form(model_params):
    """With turns > 1 prefix_reuse reserves its two-program form (deep groups through
    its DFS program) up front, so a first deep batch does not switch programs."""
    model, params = model_params
    engine = make_engine(EngineKind.PREFIX_REUSE, model, ENGINES).reserve(capacity(turns=2))
    loss = MaskedNLLLoss()
    for batch in trainer_like_batches()[:3]:
        engine.value_and_grad(params, batch, loss)
    assert engine.trace_count == 1


def test_reserved_dense_rows_are_the_capacity_length():
    """dense pads to the reserved length itself (rounded up to 8), not to its
    quarter-octave bucket (prompt 512 + 64 new tokens: 576, not 640)."""
    model = init_model(ModelConfig.tiny(), seed=0)
    cap = Capacity(sequences=8, length=PROMPT_LEN + RESPONSE_LEN)  # 36 -> 40, bucket 48
    engine = make_engine(EngineKind.DENSE, model, ENGINES).reserve(cap)
    for batch in trainer_like_batches()[:2]:
        prepared = engine.prepare(batch, MaskedNLLLoss())
        assert prepared.static.length == 40, prepared.static
    assert (
        make_engine(EngineKind.DENSE, model)
        .reserve(Capacity(sequences=8, length=576))
        .buckets["length"]
        == 576
    )


def test_bench_train_reserves_its_workloads_like_a_run():
    """``dtarl bench train`` reserves each workload's maxima as the trainer reserves its
    config's: dense pads prompt 512 + 64 new tokens to 576, not to the 640 bucket
    (host preparation only)."""
    model = init_model(ModelConfig.tiny(), seed=0)
    batch = grpo_groups(num_groups=2, group_size=4, prompt_len=512, response_len=(40, 64))
    cap = bench_train.workload_capacity(batch)
    assert (cap.sequences, cap.groups, cap.group_size) == (8, 2, 4)
    assert (cap.length, cap.prompt_len, cap.response_len, cap.turns) == (576, 512, 64, 1)
    pad = bench_train.dense_padding(model, batch, cap, 8, MaskedNLLLoss())
    assert pad["unreserved"]["padded_length"] == 640 and pad["reserved"]["padded_length"] == 576
    assert pad["reserved"]["computed_tokens"] == 8 * 576
    assert pad["unreserved"]["excess"] > pad["reserved"]["excess"] >= 0
    # Over dp = 4 ranks: each rank's share, rounded up.
    per_rank = bench_train.workload_capacity(batch, dp=4)
    assert (per_rank.sequences, per_rank.groups, per_rank.length) == (2, 1, 576)
    # A batch with a group that branches deep below its prompt is reserved as a
    # multi-turn run's (prefix_reuse's two-program form), the others as one turn.
    batches = trainer_like_batches()
    turns = [bench_train.workload_capacity(b).turns for b in batches]
    deep = [bool(deep_sequences(b.prefix_tree()).any()) for b in batches]
    assert turns == [2 if d else 1 for d in deep] and sorted(set(turns)) == [1, 2]


def test_reserved_scorer_compiles_every_length_bucket_at_its_first_call(model_params):
    """The KL reference scorer reserved for 4 rows of up to 40 tokens compiles, at its
    first call, the length buckets from that call's up to 64 (8..64 for a first batch
    of 7 tokens; 32 and 64 for one of 20: a bucket never shrinks, so the smaller ones
    would never run); a longer batch later compiles nothing, each batch still runs at
    its own bucket, and the values equal an unreserved one."""
    model, params = model_params
    scorer = Scorer(model).reserve(sequences=4, length=40)
    short = [np.arange(3, 10, dtype=np.int32)] * 4
    got = scorer(params, short)
    assert sorted(scorer._compiled) == [(4, 8), (4, 16), (4, 32), (4, 64)]
    assert scorer._min == dict(n=4, t=8)  # the short batch ran at its own bucket
    scorer(params, [np.arange(3, 40, dtype=np.int32)] * 3)
    assert len(scorer._compiled) == 4 and scorer._min == dict(n=4, t=64)
    want = Scorer(model)(params, short)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    longer = Scorer(model).reserve(sequences=4, length=40)
    longer(params, [np.arange(3, 23, dtype=np.int32)] * 2)
    assert sorted(longer._compiled) == [(4, 32), (4, 64)]


def _slow_host(batches):
    """Host seconds: 10 s for dense on the first batch, for prefix_reuse on the others."""

    def host(kind, batch):
        slow = "dense" if batch is batches[0] else "prefix_reuse"
        return 10.0 if kind == slow else 0.0

    return host


def _two_candidate_auto(model, host, **settings):
    """auto over dense and prefix_reuse, timed once per program, ``host`` seconds of host
    work, every batch tuned by the margin rules (``tune_all_below=0``)."""
    return make_engine(
        EngineKind.AUTO,
        model,
        ENGINES,
        candidates=("dense", "prefix_reuse"),
        timer=run_once_timer,
        host_seconds=host,
        tune_all_below=0.0,
        **settings,
    )


def test_reserved_auto_compiles_and_tunes_only_on_the_first_batch_of_each_loss(model_params):
    """auto (dense or prefix_reuse) with a real margin (1: only the predicted best is
    timed) on an SFT-like phase, then an RL-like one (another loss: other programs).
    On the first batch dense is out of margin (10 s of host work on it), on later
    ones prefix_reuse is the one with 10 s of host work: unreserved, auto would
    compile and time dense mid-run. Reserved, the first batch of the first loss
    times both candidates, which spends the tuning budget; the first batch of the
    second loss picks prefix_reuse from the prediction and compiles dense ahead of
    time, which the later batches then pick. No later batch compiles or tunes."""
    model, params = model_params
    batches = trainer_like_batches()

    host = _slow_host(batches)
    auto = _two_candidate_auto(
        model,
        host,
        tune_margin=1.0,
        reserve_margin=None,  # the first batch times every candidate
        budget_seconds=1e-12,  # spent by the first round
    ).reserve(capacity())
    counts, tuned, picks, firsts = [], [], [], []
    for loss in (MaskedNLLLoss(), MaskedNLLLoss(norm=LossNorm.SEQUENCE)):
        for i, batch in enumerate(batches):
            aux = auto.value_and_grad(params, batch, loss)[2]
            counts.append(auto.trace_count)
            tuned.append(aux.stats["autotune_seconds"])
            picks.append(aux.stats["chosen_engine"])
            if i == 0:
                firsts.append(aux.stats)
    n = len(batches)
    assert counts == [2] * n + [4] * n, counts
    assert tuned[0] > 0 and tuned[1:] == [0.0] * (2 * n - 1), tuned
    sft, rl = firsts
    assert sorted(sft["autotuned"]) == ["dense", "prefix_reuse"] and sft["warmup_compiled"] == []
    assert rl["autotuned"] == [] and rl["choice_basis"] == "predicted (autotune budget spent)"
    assert rl["chosen_engine"] == "prefix_reuse" and rl["warmup_compiled"] == ["dense"]
    assert set(picks[n + 1 :]) == {"dense"}, picks  # compiled ahead, run without compiling


def test_reserve_margin_leaves_a_far_candidate_uncompiled_for_the_run(model_params):
    """The same phases with the default ``reserve_margin`` (4): on each loss's first
    batch dense is predicted far behind (10 s of host work), so it is neither timed
    nor compiled; later batches, where prefix_reuse carries the 10 s and dense
    would be predicted best, still run prefix_reuse, the only compiled program."""
    model, params = model_params
    batches = trainer_like_batches()

    host = _slow_host(batches)
    auto = _two_candidate_auto(
        model,
        host,
    ).reserve(capacity())
    assert auto.config.reserve_margin == 4.0
    counts, picks, firsts = [], [], []
    for loss in (MaskedNLLLoss(), MaskedNLLLoss(norm=LossNorm.SEQUENCE)):
        for i, batch in enumerate(batches):
            aux = auto.value_and_grad(params, batch, loss)[2]
            counts.append(auto.engines["dense"].jit.trace_count)
            picks.append(aux.stats["chosen_engine"])
            if i == 0:
                firsts.append(aux.stats)
    assert counts == [0] * (2 * len(batches)), counts
    assert set(picks) == {"prefix_reuse"}, picks
    for first in firsts:
        assert first["autotuned"] == ["prefix_reuse"] and first["warmup_skipped"] == ["dense"]
        assert first["warmup_compiled"] == []
    # Unsettled, the cost model would have picked dense on a later batch.
    assert auto.engines["prefix_reuse"].jit.trace_count == 2
    fresh = make_engine(
        EngineKind.AUTO, model, ENGINES, candidates=("dense", "prefix_reuse"), host_seconds=host
    )
    assert fresh.choose(batches[1], MaskedNLLLoss())[0] == "dense"
