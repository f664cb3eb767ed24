"""The measured work of ``dtarl bench peer`` (``dtarl.bench.peer``): one function per
(side, part), run alone in a worker process.

    rollout    Tunix's vanilla ``Sampler``; dtarl's static ``Sampler`` and continuous engine
    update     Tunix's GRPO actor update; dtarl's ``update`` with the dense / auto engine
    iteration  ``GRPOLearner.train``; dtarl's iteration composed from its library calls

Each compiles and runs its step once untimed, then times ``repeats`` calls
(``worker(name, workload, model, repeats)`` -> the seconds and the side's notes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

__all__ = [
    "MEASUREMENTS",
    "PEER_INSTALL",
    "PeerMissing",
    "PeerModel",
    "Workload",
    "require_tunix",
    "worker",
]

PEER_INSTALL = "pip install -e .[peer]"


class PeerMissing(RuntimeError):
    """Tunix is not installed in this interpreter."""


def require_tunix() -> None:
    """Raises ``PeerMissing`` naming the install command when ``tunix`` cannot be imported."""
    if importlib.util.find_spec("tunix") is None:
        raise PeerMissing(
            "dtarl bench peer needs Tunix (google-tunix) in this interpreter "
            f"({sys.executable}); install the optional extra: {PEER_INSTALL}"
        )


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerModel:
    """The model both sides build (a tiny Qwen3)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    prompt_len: int
    new_tokens: int
    group_size: int = 8


# measurement -> (side, kind)
MEASUREMENTS = {
    "tunix_rollout": ("tunix", "rollout"),
    "dtarl_static": ("dtarl", "rollout"),
    "dtarl_engine": ("dtarl", "rollout"),
    "tunix_update": ("tunix", "update"),
    "dtarl_dense": ("dtarl", "update"),
    "dtarl_auto": ("dtarl", "update"),
    "tunix_iteration": ("tunix", "iteration"),
    "dtarl_iteration": ("dtarl", "iteration"),
}


def _prompt(w: Workload, m: PeerModel, seed: int = 0) -> np.ndarray:
    # ids in [2, vocab): clear of dtarl's pad id 0 (Tunix's pad and EOS lie outside the vocab)
    return np.random.RandomState(seed).randint(2, m.vocab_size, w.prompt_len).astype(np.int32)


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _summary(times: list[float], compile_s: float) -> dict:
    return dict(seconds=statistics.median(times), times=times, compile_s=compile_s)


def _timed(run: Callable[[], object], repeats: int) -> dict:
    """A first call, which compiles (its seconds: ``compile_s``), then ``repeats`` timed calls."""
    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    return _summary(_time(run, repeats), compile_s)


# ----------------------------------------------------------------------------- dtarl side


def _dtarl_model(m: PeerModel):
    from dtarl.model import ModelConfig, init_model

    cfg = ModelConfig.tiny(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps,
    )
    return init_model(cfg, seed=0)


def _dtarl_rollout(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    import jax
    from flax import nnx

    model = _dtarl_model(m)
    weights = nnx.state(model, nnx.Param)
    prompt = _prompt(w, m)
    n = w.new_tokens
    g = w.group_size
    t0 = time.perf_counter()
    if name == "dtarl_static":
        from dtarl.rollout import Sampler, SamplingParams

        sampler = Sampler(model, SamplingParams(temperature=1.0, max_new_tokens=n))

        def run():
            res = sampler.generate(weights, [prompt], num_samples=g, seed=0)
            assert int(res.lengths.sum()) == g * n, res.lengths
            return res
    else:
        from dtarl.rollout.continuous import ContinuousSampler
        from dtarl.rollout.engine import ContinuousConfig

        sampler = ContinuousSampler(
            model,
            ContinuousConfig(
                slots=g,
                groups=1,
                group_size=g,
                prompt_len=w.prompt_len,
                response_len=n,
                steps_per_call=16,
            ),
            max_new_tokens=n,
        )
        sampler.engine.warmup(weights, filtered=False)

        def run():
            res = sampler.generate(weights, [prompt], num_samples=g, seed=0)
            assert int(res.lengths.sum()) == g * n, res.lengths
            return res

    jax.block_until_ready(run().tokens)
    compile_s = time.perf_counter() - t0
    return _summary(_time(run, repeats), compile_s)


# ----------------------------------------------------------------------------- Tunix side


class _IdTokenizer:
    """Tunix's sampler takes strings: space-separated ids. bos 0 (falsy: none is
    prepended); pad and EOS outside the vocabulary: no sample stops early, and no
    generated token is taken for padding (Tunix masks pad-valued tokens out of
    attention and out of the completion mask)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in str(text).split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return self.vocab_size + 1

    def pad_id(self) -> int:
        return self.vocab_size


def _tunix_model(m: PeerModel):
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    cfg = qwen3.ModelConfig(
        num_layers=m.num_layers,
        vocab_size=m.vocab_size,
        embed_dim=m.hidden_size,
        hidden_dim=m.intermediate_size,
        num_heads=m.num_heads,
        head_dim=m.head_dim,
        num_kv_heads=m.num_kv_heads,
        rope_theta=int(m.rope_theta),
        norm_eps=m.rms_norm_eps,
        use_tied_embedding=True,
    )
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)), cfg


def _tunix_rollout(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    from tunix.generate import sampler as tsampler

    model, cfg = _tunix_model(m)
    tok = _IdTokenizer(m.vocab_size)
    s = tsampler.Sampler(
        model,
        tok,
        tsampler.CacheConfig(
            cache_size=w.prompt_len + w.new_tokens,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
        ),
    )
    text = tok.decode(_prompt(w, m))
    g, n = w.group_size, w.new_tokens

    def run():
        out = s(
            [text] * g,
            max_generation_steps=n,
            max_prompt_length=w.prompt_len,
            eos_tokens=[tok.eos_id()],
            temperature=1.0,
            top_p=1.0,
            seed=0,
            return_logprobs=True,
        )
        lens = [len(t) for t in out.tokens]
        assert lens == [n] * g, lens
        return out

    return _timed(run, repeats)


LR = 1e-6  # both sides: AdamW (b1 0.9, b2 0.999, weight decay 0.01), global-norm clip 1.0


def _dtarl_batch(w: Workload, m: PeerModel, completions=None, seed: int = 0):
    """G sequences of the shared prompt and a completion each (random ids unless given),
    advantages from random rewards normalised within the group (GRPO)."""
    from dtarl.batch import RolloutBatch

    rs = np.random.RandomState(seed + 1)
    prompt = _prompt(w, m)
    g = w.group_size
    if completions is None:
        completions = [rs.randint(2, m.vocab_size, w.new_tokens) for _ in range(g)]
    r = rs.randn(g)
    adv = (r - r.mean()) / (r.std() + 1e-6)
    return RolloutBatch.create(
        tokens=[np.concatenate([prompt, np.asarray(c, np.int32)]) for c in completions],
        prompt_lens=[w.prompt_len] * g,
        advantages=adv,
        group_ids=np.zeros(g, np.int64),
    )


def _dtarl_optimizer():
    import optax

    from dtarl.rl.optim import Optimizer

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(LR, b1=0.9, b2=0.999, weight_decay=0.01),
    )
    return Optimizer(tx, optax.constant_schedule(LR))


def _dtarl_update(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    import jax
    from flax import nnx

    from dtarl.engines import make_engine
    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.rl.optim import update

    model = _dtarl_model(m)
    params = nnx.split(model, nnx.Param)[1]
    engine = make_engine(name.split("_", 1)[1], model)
    loss = ClippedSurrogateLoss.grpo()
    opt = _dtarl_optimizer()
    state = dict(params=params, opt=opt.init(params))
    batch = _dtarl_batch(w, m)
    stats = {}

    def run():
        res = update(state["params"], state["opt"], batch, engine=engine, loss=loss, optimizer=opt)
        assert res.applied, res.skip_reason
        jax.block_until_ready(res.params)
        state.update(params=res.params, opt=res.opt_state)
        stats.update(res.aux.stats)
        return res

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    first = dict(stats)
    out = _summary(_time(run, repeats), compile_s)
    if name == "dtarl_auto":
        out["autotune_s"] = float(first.get("autotune_seconds", 0.0))
        out["picked"] = str(stats.get("chosen_engine", ""))
    return out


def _tunix_learner(w: Workload, m: PeerModel, steps: int):
    """A ``GRPOLearner`` on an ``RLCluster`` with the vanilla rollout, no reference model
    (beta 0), one update per batch (G samples of one prompt), and ``steps`` steps."""
    import jax
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    model, _ = _tunix_model(m)
    tok = _IdTokenizer(m.vocab_size)
    role = rl_cluster_lib.Role
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(LR, b1=0.9, b2=0.999, weight_decay=0.01),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in (role.ACTOR, role.ROLLOUT)},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=tx,
                eval_every_n_steps=10**9,
                max_steps=steps,
                metrics_logging_options=metrics_logger.MetricsLoggerOptions(
                    log_dir="/tmp/dtarl-peer-tunix-metrics", flush_every_n_steps=10**9
                ),
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=w.new_tokens,
                max_prompt_length=w.prompt_len,
                kv_cache_size=w.prompt_len + w.new_tokens,
                temperature=1.0,
                top_p=1.0,
                eos_tokens=[tok.eos_id()],
            ),
        ),
    )
    rng = np.random.RandomState(0)

    def reward(prompts, completions, **_):
        return list(rng.randn(len(completions)))

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=w.group_size, num_iterations=1, beta=0.0, epsilon=0.2
        ),
        reward_fns=reward,
    )
    return learner, cluster, tok


def _tunix_update(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    import jax
    from flax import nnx

    learner, cluster, tok = _tunix_learner(w, m, steps=10**6)
    prompts = [tok.decode(_prompt(w, m))] * w.group_size
    # the learner's own batch sizes (train() sets them from the first batch)
    learner._rollout_micro_batch_size = 1
    learner._compute_logps_micro_batch_size = 1
    example = learner._generate_and_compute_advantage({"prompts": prompts})
    assert example.completion_ids.shape == (w.group_size, w.new_tokens)
    assert bool(example.completion_mask.all())

    def run():
        cluster.update_actor([example], None, False)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))

    return _timed(run, repeats)


def _tunix_iteration(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    """``GRPOLearner.train`` over 1 + ``repeats`` batches of one prompt; an iteration's
    seconds are the time between the learner's requests for consecutive batches (its
    rollout, rewards, advantages, update and loop bookkeeping)."""
    learner, _, tok = _tunix_learner(w, m, steps=1 + repeats)
    text = tok.decode(_prompt(w, m))
    stamps: list[float] = []

    def batches():
        while True:
            stamps.append(time.perf_counter())
            yield {"prompts": np.array([text])}  # a batch of one, as a data loader gives

    learner.train(batches())
    stamps.append(time.perf_counter())
    # stamps: train() peeks at the first batch (step 1 starts), each later step asks for
    # its batch when the previous one is done, and train() returns
    steps = np.diff(stamps).tolist()
    assert len(steps) == 1 + repeats, (len(stamps), repeats)
    times = steps[1:]
    return _summary(times, steps[0] - times[0])


def _dtarl_iteration(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    """dtarl's iteration from its library calls: the continuous engine's rollout of G
    samples, random rewards normalised in the group, one ``update`` with the auto
    engine. Auto's tuning (on new shapes) is subtracted and reported (``autotune_s``)."""
    import jax
    from flax import nnx

    from dtarl.engines import make_engine
    from dtarl.losses import ClippedSurrogateLoss
    from dtarl.rl.optim import update
    from dtarl.rollout.continuous import ContinuousSampler
    from dtarl.rollout.engine import ContinuousConfig

    model = _dtarl_model(m)
    params = nnx.split(model, nnx.Param)[1]
    g, n = w.group_size, w.new_tokens
    sampler = ContinuousSampler(
        model,
        ContinuousConfig(slots=g, groups=1, group_size=g, prompt_len=w.prompt_len, response_len=n),
        max_new_tokens=n,
    )
    sampler.engine.warmup(params, filtered=False)
    engine = make_engine("auto", model)
    loss = ClippedSurrogateLoss.grpo()
    opt = _dtarl_optimizer()
    state = dict(params=params, opt=opt.init(params), step=0)
    prompt = _prompt(w, m)
    tune: list[float] = []

    def run():
        roll = sampler.generate(state["params"], [prompt], num_samples=g, seed=state["step"])
        assert int(roll.lengths.sum()) == g * n, roll.lengths
        batch = _dtarl_batch(w, m, completions=roll.tokens, seed=state["step"])
        res = update(state["params"], state["opt"], batch, engine=engine, loss=loss, optimizer=opt)
        assert res.applied, res.skip_reason
        jax.block_until_ready(res.params)
        state.update(params=res.params, opt=res.opt_state, step=state["step"] + 1)
        tune.append(float(res.aux.stats.get("autotune_seconds", 0.0)))

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    raw = _time(run, repeats)
    times = [t - s for t, s in zip(raw, tune[1:], strict=True)]
    return dict(
        seconds=statistics.median(times),
        times=times,
        compile_s=compile_s - tune[0],
        autotune_s=sum(tune),
    )


def worker(name: str, w: Workload, m: PeerModel, repeats: int) -> dict:
    side, kind = MEASUREMENTS[name]
    if side == "tunix":
        require_tunix()
    fn = {
        ("dtarl", "rollout"): _dtarl_rollout,
        ("tunix", "rollout"): _tunix_rollout,
        ("tunix", "update"): _tunix_update,
        ("dtarl", "update"): _dtarl_update,
        ("tunix", "iteration"): _tunix_iteration,
        ("dtarl", "iteration"): _dtarl_iteration,
    }[side, kind]
    return fn(name, w, m, repeats)
