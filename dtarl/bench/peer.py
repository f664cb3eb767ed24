"""``dtarl bench peer``: dtarl against Tunix (the JAX post-training library), side by side.

Both libraries build the same model (a tiny Qwen3: 4 layers, hidden 256, MLP 1024,
4 query / 2 kv heads of 64, vocab 1024, tied embeddings, fp32, random weights)
and run the same batch: G=8 samples of one prompt, on two workloads (prompt 512 +
64 new tokens, prompt 128 + 256 new tokens), with exact lengths on both sides
(Tunix's EOS is an id outside the vocabulary, so it never stops early; dtarl runs
with no stop ids).

Every measurement runs in its own process (``python -m dtarl.bench.peer --worker
...``), so the two libraries never share a process, a compile cache or an
allocator; rounds alternate the order of the sides. A worker compiles and runs
its step once untimed, then times ``repeats`` calls and reports their median.
Printed per workload and measurement: seconds per side as the range over rounds,
and the ratios (Tunix / dtarl) as the range of the per-round ratios.

Measurements:

* rollout: Tunix's vanilla ``Sampler`` vs dtarl's static ``Sampler`` and the
  continuous engine (``ContinuousSampler``, 8 slots, one group, 16 steps per call).
* update: Tunix's GRPO policy update (``RLCluster.update_actor``, its actor
  trainer's step as ``GRPOLearner`` runs it, on a fixed batch from its own
  rollout: the policy's logprobs, the clipped loss, AdamW; beta 0, so no
  reference model) vs dtarl's ``update`` (``engine.value_and_grad`` + AdamW) with
  the dense and the auto engine, on the same shapes (random completion ids).
* iteration: ``GRPOLearner.train`` (vanilla rollout, random rewards, advantages,
  update, its loop; one iteration = the time between its requests for
  consecutive batches) vs dtarl's iteration composed from its library calls
  (continuous engine rollout, group-normalised random rewards, ``update`` with
  auto), not the ``Trainer`` loop. Later batches differ in their completions,
  so auto may meet a new tree shape and tune again: that tuning is subtracted.

Both sides: AdamW (lr 1e-6, b1 0.9, b2 0.999, weight decay 0.01) behind
global-norm clipping at 1.0; temperature 1, no top-p / top-k; the weights are
random and not shared between the libraries (timing does not need equal
outputs). On a shared machine the load moves between processes: read the
per-round ratios, and run more ``--rounds`` when they spread.

Asymmetries (read the ratios with them in mind):

* Tunix repeats the prompt once per sample, in the rollout (G prefills of the same
  prompt, G copies of its K/V) and in training (G full sequences); dtarl prefills
  a group's prompt once and its tree engines train the shared prompt once.
* Tunix's sampler makes one extra decode call (it runs N decode steps after the
  prefill has already sampled the first token; dtarl runs N - 1).
* Tunix's learner loop adds Python overhead (batch assembly, metrics, its
  trainer's bookkeeping, a worker thread for the rollout) that a bare dtarl
  ``update`` and dtarl's composed iteration do not have.
* dtarl's auto engine tunes itself (times candidate programs) in its first call
  and on new shapes; that tuning is excluded from the timed steps and reported
  separately (``autotune_s``, summed over a process's calls).
* The continuous engine is compiled (``warmup``) before its first call; Tunix's
  and dtarl's static sampler compile in their untimed first call.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from dtarl.bench import report

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


WORKLOADS = (
    Workload(name="prompt 512, 64 new", prompt_len=512, new_tokens=64),
    Workload(name="prompt 128, 256 new", prompt_len=128, new_tokens=256),
)
QUICK_WORKLOADS = (
    Workload(name="prompt 128, 16 new", prompt_len=128, new_tokens=16),
    Workload(name="prompt 32, 64 new", prompt_len=32, new_tokens=64),
)

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
PARTS = ("rollout", "update", "iteration")


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
    times = _time(run, repeats)
    return dict(seconds=statistics.median(times), times=times, compile_s=compile_s)


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

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    times = _time(run, repeats)
    return dict(seconds=statistics.median(times), times=times, compile_s=compile_s)


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
    times = _time(run, repeats)
    out = dict(seconds=statistics.median(times), times=times, compile_s=compile_s)
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

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    times = _time(run, repeats)
    return dict(seconds=statistics.median(times), times=times, compile_s=compile_s)


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
    return dict(seconds=statistics.median(times), times=times, compile_s=steps[0] - times[0])


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


# ----------------------------------------------------------------------------- worker


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


def _worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    w = Workload(name="", prompt_len=a.prompt_len, new_tokens=a.new_tokens, group_size=a.group_size)
    res = worker(a.worker, w, PeerModel(), a.repeats)
    print("PEER_RESULT " + json.dumps(res), flush=True)
    return 0


def run_worker(name: str, w: Workload, repeats: int, python: str | None = None) -> dict:
    cmd = [
        python or sys.executable,
        "-m",
        "dtarl.bench.peer",
        "--worker",
        name,
        "--prompt-len",
        str(w.prompt_len),
        "--new-tokens",
        str(w.new_tokens),
        "--group-size",
        str(w.group_size),
        "--repeats",
        str(repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env())
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            return json.loads(line[len("PEER_RESULT ") :])
    raise RuntimeError(
        f"worker {name} ({w.name}) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    )


# ----------------------------------------------------------------------------- rounds

# the Tunix measurement of a part, and the dtarl ones compared with it
PAIRS = {
    "rollout": ("tunix_rollout", ("dtarl_static", "dtarl_engine")),
    "update": ("tunix_update", ("dtarl_dense", "dtarl_auto")),
    "iteration": ("tunix_iteration", ("dtarl_iteration",)),
}


def worker_env() -> dict[str, str]:
    """The environment of a measurement process: this one's, with the directory of
    the dtarl that runs the command first on PYTHONPATH, so that every worker (in
    any ``--python``) measures this same dtarl."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def check_python(python: str) -> None:
    """Raises ``PeerMissing`` when ``python`` cannot import ``tunix``."""
    if python == sys.executable:
        require_tunix()
        return
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('tunix') is None)"
    if subprocess.run([python, "-c", code], env=worker_env()).returncode != 0:
        raise PeerMissing(
            f"dtarl bench peer needs Tunix (google-tunix) in {python}; install the optional "
            f"extra: {PEER_INSTALL}"
        )


def run(
    *,
    parts: Sequence[str] = PARTS,
    rounds: int = 2,
    repeats: int = 3,
    quick: bool = False,
    python: str | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Alternating rounds of one process per measurement; returns the results by
    workload and measurement (``seconds``: the per-round medians) and the ratios."""
    from dtarl.timing import alternating

    log = log or (lambda line: print(line, flush=True))
    python = python or sys.executable
    check_python(python)
    workloads = QUICK_WORKLOADS if quick else WORKLOADS
    names = [n for part in parts for n in (PAIRS[part][0], *PAIRS[part][1])]
    out: dict = dict(
        model=dataclasses.asdict(PeerModel()),
        python=python,
        rounds=rounds,
        repeats=repeats,
        workloads={},
    )
    for w in workloads:
        rows = {n: [] for n in names}
        for r in range(rounds):
            for n in alternating(r, names):
                res = run_worker(n, w, repeats, python)
                rows[n].append(res)
                log(f"  {w.name:<22} round {r + 1}/{rounds}  {n:<14} {res['seconds']:.3f} s")
        out["workloads"][w.name] = dict(
            workload=dataclasses.asdict(w),
            runs=rows,
            ratios={
                f"{peer}/{n}": [
                    a["seconds"] / b["seconds"] for a, b in zip(rows[peer], rows[n], strict=True)
                ]
                for part in parts
                for peer, ours in [PAIRS[part]]
                for n in ours
            },
        )
    return out


def _range(xs: Sequence[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    lo, hi = min(xs), max(xs)
    a, b = fmt.format(lo), fmt.format(hi)
    return f"{a}{unit}" if a == b else f"{a}-{b}{unit}"


def format_table(res: dict) -> str:
    """The table: seconds per side (range over rounds), Tunix / dtarl ratios."""
    lines = []
    for part in PARTS:
        peer, ours = PAIRS[part]
        wl = [(k, v) for k, v in res["workloads"].items() if peer in v["runs"]]
        if not wl:
            continue
        head = ["workload", f"Tunix {part}"] + [n.replace("_", " ") for n in ours]
        head += [f"Tunix / {n.split('_', 1)[1]}" for n in ours]
        cells = [
            [name]
            + [_range([x["seconds"] for x in v["runs"][n]], unit=" s") for n in (peer, *ours)]
            + [_range(v["ratios"][f"{peer}/{n}"], unit="x") for n in ours]
            for name, v in wl
        ]
        lines += report.markdown(head, cells, compact=True)
        extra = [
            f"{name}: {n} autotune {_range([x['autotune_s'] for x in v['runs'][n]], unit=' s')}"
            for name, v in wl
            for n in ours
            if all("autotune_s" in x for x in v["runs"][n])
        ]
        lines += extra
        lines.append("")
    lines.append(
        "seconds: the range over rounds of each process's median call; "
        "Tunix / x: Tunix's seconds over x's in the same round (> 1: dtarl is faster)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
