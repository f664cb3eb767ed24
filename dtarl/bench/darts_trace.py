"""``dtarl bench darts --trace NAME``: plain GRPO against GRPO + DARTS (DARTS, arXiv
2605.30859) on a PolyTrace run's own long-tailed, per-prompt length distributions.

Workload. A pool of ``pool`` prompts (groups) of one trace step (``verl_math``: the
verl math run, ``rllm``: rllm coding, ``search_r1``: each trajectory's generated
tokens, summed over its turns, as one response); every RL step draws ``prompts`` of
them (the same prompts recur across steps, as over epochs, so DARTS' per-prompt
length EMAs have something to learn). A prompt's candidate lengths are drawn with
replacement from that prompt's own empirical group (a group of fewer than two
responses draws from the pool's pooled lengths instead), scaled so the pool's
longest response is ``max_new_tokens``; a drawn response the trace marks truncated,
or one at the cap, is truncated (never "complete"). Both arms of a step use the same
draws: candidate j of prompt i is the same length in both.

Arms. ``grpo``: M = ``group_size`` candidates per prompt, all trained. ``darts``: the
plan of ``dtarl.rl.darts.plan`` (M_total of Eq. 8-9 with ``lambda`` in relative units,
Alg. 1's allocation from the per-prompt length-std EMAs), prompts at M_up early-stopped
(the engine cancels the rest of a group once M of its candidates completed), the
others trained on the K shortest + L = M - K longest complete (``short_k``, default
M - 1, as the trainer's). The real continuous engine generates the candidates with
forced lengths (tiny model, greedy; ``slots`` slots, default N x M for both arms: the
same engine capacity, DARTS' extra candidates wait for a free slot), then the tree
engine (``dfs``) computes the kept groups' loss and gradients (PPO clipped surrogate,
random advantages: the numbers do not matter, the shapes do), its buckets reserved
for the largest batch as ``dtarl train`` reserves them (``dtarl.rl.capacity``), so
a step's training program has the same shape in both arms.

Timing. ``rounds`` rounds, arms interleaved (``dtarl.timing.alternating``), each arm
``steps`` RL steps per round, after ``warmup_steps`` untimed steps per arm (compiles;
DARTS' EMAs; default one epoch over the pool, at least 2). The warm-up steps go through
the pool in epochs (a fixed permutation, N prompts per step, so the default 2 x 8 of a
pool of 16 shows every prompt once): the paper keeps each prompt's length variance
"over preceding epochs", and a prompt DARTS has never seen is planned with the
dataset-level spread instead of its own. Timed steps draw their N prompts at random.
A step whose rollout or training compiled anything (JAX's compile events) is reported
but left out of the medians (``compiled_steps``). Per step: ``rollout_s`` (submit to
the last request), ``train_s`` (value and grad, blocked),
``step_s`` (the whole step, selection included), ``generated_tokens``,
``cancelled_tokens`` (tokens of candidates cancelled by early stop), ``kept_len_mean``
(the trained responses' mean length). The length bias of DARTS is its kept mean
over plain GRPO's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from dtarl.bench import report
from dtarl.bench.rollout import TRACE_RUNS
from dtarl.engines import RolloutBatch, make_engine
from dtarl.errors import ConfigError
from dtarl.losses import ClippedSurrogateLoss
from dtarl.model import ModelConfig, init_model
from dtarl.rl import darts
from dtarl.rl.capacity import capacity
from dtarl.rollout.compiles import compile_count
from dtarl.rollout.engine import ContinuousConfig, RolloutEngine
from dtarl.rollout.keys import member_keys
from dtarl.rollout.reasons import FinishReason
from dtarl.timing import alternating, machine_info
from dtarl.traces import default_polytrace_root
from dtarl.traces.workload import sample_group_specs

# --trace NAME -> the bench's trace runs (dtarl.bench.rollout.TRACE_RUNS)
TRACES = {"verl_math": "math", "rllm": "coding", "search_r1": "search_turns"}
ARMS = ("grpo", "darts")
JSON_KEYS = (
    "trace",
    "arm",
    "round",
    "rollout_s",
    "train_s",
    "step_s",
    "generated_tokens",
    "cancelled_tokens",
    "kept_len_mean",
)

# The step's breakdown in the --json rows besides JSON_KEYS: the rollout's decode steps
# and decode calls (the engine's counters: what the rollout did, whatever the machine
# load), the seconds of its decode calls (the rest of rollout_s is prefill and the
# host's scheduling) and its prefill calls, host planning (DARTS' plan),
# selection (+ EMA update), the rest of the step outside rollout and training (batch
# assembly included), the candidates generated, and the trained batch's prefix-tree
# tokens, DFS plan steps and padded (reserved) steps.
EXTRA_KEYS = (
    "decode_steps",
    "decode_calls",
    "decode_s",
    "prefill_calls",
    "plan_s",
    "select_s",
    "other_s",
    "candidates",
    "train_tree_tokens",
    "train_plan_steps",
    "train_padded_steps",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceBenchConfig:
    """What ``run`` measures (module docstring)."""

    trace: str = "verl_math"
    prompts: int = 8
    group_size: int = 8
    pool: int = 16
    max_new_tokens: int = 256
    prompt_len: int = 32
    steps_per_call: int = 8
    slots: int = 0  # 0: prompts x group_size
    rounds: int = 3
    steps: int = 2
    warmup_steps: int | None = None  # None: max(2, ceil(pool / prompts)), one epoch
    up_factor: float = 2.0
    short_k: int = 0  # 0: M - 1
    lam: float | str = 0.6  # relative lambda; "auto": lambda_for_budget(the trace's rho)
    seed: int = 0
    engine: str = "dfs"

    def __post_init__(self):
        if self.trace not in TRACES:
            raise ConfigError(f"trace={self.trace!r}: accepted values {sorted(TRACES)}")
        for name in (
            "prompts",
            "group_size",
            "pool",
            "max_new_tokens",
            "prompt_len",
            "steps_per_call",
            "rounds",
            "steps",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be an int >= 1")
        if self.pool < self.prompts:
            raise ConfigError(f"pool={self.pool} must be >= prompts={self.prompts}")
        w = self.warmup_steps
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise ConfigError(f"warmup_steps={w!r}: must be an int >= 0 or None (one epoch)")
        if not isinstance(self.slots, int) or self.slots < 0:
            raise ConfigError(f"slots={self.slots!r}: must be an int >= 0 (0: prompts x M)")
        if not 0 <= self.short_k <= self.group_size:
            raise ConfigError(f"short_k={self.short_k}: must be in [0, {self.group_size}]")
        if not self.up_factor >= 1.0:
            raise ConfigError(f"up_factor={self.up_factor}: must be >= 1")
        if self.lam != "auto" and not (
            isinstance(self.lam, int | float) and not isinstance(self.lam, bool) and self.lam > 0
        ):
            raise ConfigError(f"lam={self.lam!r}: must be a number > 0 or 'auto'")

    @classmethod
    def quick(cls, **overrides) -> TraceBenchConfig:
        """``--quick``: 4 prompts x M 4, 128 tokens, 2 rounds of 2 steps per arm."""
        base = dict(prompts=4, group_size=4, pool=8, max_new_tokens=128, rounds=2, steps=2)
        base.update(overrides)
        return cls(**base)

    @property
    def warmup(self) -> int:
        """Untimed steps per arm: ``warmup_steps``, or one epoch over the pool (>= 2)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(2, -(-self.pool // self.prompts))

    @property
    def m_up(self) -> int:
        return max(self.group_size, int(np.floor(self.up_factor * self.group_size)))

    def engine_config(self) -> ContinuousConfig:
        return ContinuousConfig(
            slots=self.slots or self.prompts * self.group_size,
            groups=self.prompts,
            group_size=self.m_up,
            prompt_len=self.prompt_len,
            response_len=self.max_new_tokens,
            steps_per_call=self.steps_per_call,
            prefill_batch=self.prompts,
        )


@dataclasses.dataclass(frozen=True)
class PromptDist:
    """One pool prompt: its prompt tokens, its empirical (scaled) response lengths and
    which of them the trace truncated."""

    key: str
    prompt: tuple[int, ...]
    lengths: np.ndarray
    truncated: np.ndarray


def load_pool(
    cfg: TraceBenchConfig, root: str | Path | None = None, vocab: int = 256
) -> tuple[list[PromptDist], str]:
    """The pool of prompts (module docstring) and a one-line description."""
    root = Path(root) if root else default_polytrace_root()
    path = root / TRACE_RUNS[TRACES[cfg.trace]]
    if not path.is_dir():
        raise ConfigError(f"trace={cfg.trace!r}: no PolyTrace run at {path} (set --polytrace)")
    specs, label, step = sample_group_specs(
        str(path), batch_size=cfg.pool, n_sampling=None, step=None, seed=cfg.seed
    )
    gen = [
        np.asarray([sum(n for m, n in r if m == 1) for r in s.responses], np.int64) for s in specs
    ]
    longest = max(int(g.max()) for g in gen)
    scale = cfg.max_new_tokens / max(longest, 1)
    pooled = np.concatenate(gen)
    rng = np.random.default_rng([cfg.seed, 5])
    pool = []
    for i, (s, g) in enumerate(zip(specs, gen, strict=True)):
        trunc = np.asarray(s.truncated, bool)
        if g.size < 2:  # too small a group: the pooled lengths
            g, trunc = pooled, np.zeros(pooled.size, bool)
        lens = np.clip(np.round(g * scale).astype(np.int64), 1, cfg.max_new_tokens)
        plen = int(np.clip(round(s.prompt_len * scale), 4, cfg.prompt_len))
        prompt = tuple(int(t) for t in rng.integers(1, vocab, plen))
        pool.append(
            PromptDist(f"{cfg.trace}/{i}", prompt, lens, trunc | (lens >= cfg.max_new_tokens))
        )
    mean = float(np.mean(np.concatenate([p.lengths for p in pool])))
    desc = (
        f"PolyTrace {label} step {step}: {cfg.pool} prompts, lengths x{scale:.4g} "
        f"(longest -> {cfg.max_new_tokens}), mean {mean:.1f}"
    )
    return pool, desc


def draws(pool: Sequence[PromptDist], cfg: TraceBenchConfig, rnd: int, step: int):
    """One step's prompts and, per prompt, M_up candidate (length, truncated) draws;
    both arms use these (GRPO the first M, DARTS the first M'_i). Warm-up steps
    (``rnd`` -1) take the prompts in epochs over the pool (module docstring), timed
    ones at random."""
    rng = np.random.default_rng([cfg.seed, 17, rnd + 1, step])
    picks = None
    if rnd < 0:
        order = np.random.default_rng([cfg.seed, 23]).permutation(len(pool))
        picks = order[np.arange(step * cfg.prompts, (step + 1) * cfg.prompts) % len(pool)]
    return _draw(pool, cfg, rng, picks)


def _draw(
    pool: Sequence[PromptDist],
    cfg: TraceBenchConfig,
    rng: np.random.Generator,
    picks: np.ndarray | None = None,
):
    if picks is None:
        picks = rng.choice(len(pool), size=cfg.prompts, replace=False)
    out = []
    for i in picks:
        p = pool[int(i)]
        j = rng.integers(0, p.lengths.size, cfg.m_up)
        out.append((p, p.lengths[j], p.truncated[j]))
    return out


def length_spread(pool: Sequence[PromptDist], cfg: TraceBenchConfig, steps: int = 64) -> float:
    """The trace's length spread rho = sigma~_L / L~ as DARTS' state measures it under
    plain GRPO (per step: std and mean of the N x M drawn lengths; rho = mean std /
    mean mean), over ``steps`` draws of their own (not the timed ones)."""
    m, stds, means = cfg.group_size, [], []
    for s in range(steps):
        picks = _draw(pool, cfg, np.random.default_rng([cfg.seed, 29, s]))
        lens = np.concatenate([lens[:m] for _, lens, _ in picks]).astype(np.float64)
        stds.append(float(lens.std()))
        means.append(float(lens.mean()))
    return float(np.mean(stds) / np.mean(means))


def resolve_lambda(lam: float | str, rho: float) -> float:
    """The relative lambda a run uses: ``lam``, or for ``"auto"`` the one that puts the
    trace's length spread ``rho`` at the paper's observed budget
    (``darts.lambda_for_budget``: M* = 1.5 M N)."""
    if lam != "auto":
        return float(lam)
    if not (np.isfinite(rho) and rho > 0):
        raise ConfigError(
            f"lam='auto': the trace's length spread rho={rho} (every drawn length equal) gives "
            "DARTS nothing to shape and no budget; pass a number > 0"
        )
    return darts.lambda_for_budget(rho)


class TraceBench:
    """The engines and DARTS' state of one bench run; ``step(arm, ...)`` runs one RL
    step's rollout, selection and training and returns its row."""

    def __init__(self, cfg: TraceBenchConfig, model_cfg: ModelConfig | None = None):
        self.cfg = cfg
        self.model_cfg = model_cfg or ModelConfig.tiny()
        model = init_model(self.model_cfg, seed=0)
        self.weights = nnx.split(model, nnx.Param)[1]
        self.rollout = RolloutEngine(model, cfg.engine_config()).warmup(self.weights)
        for n in range(1, cfg.m_up + 1):  # a group's member keys compile per group size
            member_keys(0, n)
        # The trainer's reservation (dtarl.rl.capacity): one training program for
        # every batch of the run, as ``dtarl train`` compiles it.
        self.trainer = make_engine(cfg.engine, model).reserve(
            capacity(
                sequences=cfg.prompts * cfg.group_size,
                groups=cfg.prompts,
                length=cfg.prompt_len + cfg.max_new_tokens,
                group_size=cfg.group_size,
                prompt_len=cfg.prompt_len,
                response_len=cfg.max_new_tokens,
                turns=1,
            )
        )
        self.loss = ClippedSurrogateLoss()
        self.state = darts.DartsState()
        self.lam = None if cfg.lam == "auto" else float(cfg.lam)  # "auto": set by ``run``

    def generate(self, picks, counts, early_stop):
        """(requests per prompt, in candidate order; finish order; rollout seconds; the
        engine's counters of this rollout)."""
        eng, m = self.rollout, self.cfg.group_size
        groups = []
        eng.stats(reset=True)
        t0 = time.perf_counter()
        for i, ((p, lens, trunc), n, stop) in enumerate(
            zip(picks, counts, early_stop, strict=True)
        ):
            ok = ~trunc[:n]

            def until(g, ok=ok):  # M complete (forced, not truncated) candidates
                done = [r.finish is FinishReason.LENGTH and ok[r.index] for r in g.requests]
                return sum(done) >= m

            groups.append(
                eng.submit(
                    list(p.prompt),
                    n=int(n),
                    forced_lengths=[int(x) for x in lens[:n]],
                    temperature=0.0,
                    seed=i,
                    until=until if stop else None,
                )
            )
        finished = eng.run(self.weights)
        seconds = time.perf_counter() - t0
        rank = {id(r): k for k, r in enumerate(finished)}
        return [g.requests for g in groups], rank, seconds, eng.stats(reset=True)

    def train(self, picks, reqs, kept) -> tuple[float, dict[str, Any]]:
        """Loss and gradients of the kept candidates: (seconds, blocked; the engine's
        stats: tree tokens, plan steps and padded steps)."""
        toks, masks, olds, gids = [], [], [], []
        for g, ((p, _, _), rs, idx) in enumerate(zip(picks, reqs, kept, strict=True)):
            for j in idx:
                r = rs[j]
                resp, lp = r.result()
                if resp.size == 0:  # cancelled before it started: one pad token
                    resp, lp = np.zeros(1, np.int32), np.zeros(1, np.float32)
                pr = np.asarray(p.prompt, np.int32)
                toks.append(np.concatenate([pr, resp]))
                masks.append(
                    np.concatenate([np.zeros(pr.size, np.float32), np.ones(resp.size, np.float32)])
                )
                olds.append(np.concatenate([np.zeros(pr.size, np.float32), np.minimum(lp, 0.0)]))
                gids.append(g)
        rng = np.random.default_rng(len(toks))
        adv = rng.standard_normal(len(toks)).astype(np.float32)
        batch = RolloutBatch(
            tokens=tuple(toks),
            loss_mask=tuple(masks),
            advantages=adv,
            old_logprobs=tuple(olds),
            group_ids=np.asarray(gids, np.int32),
        )
        t0 = time.perf_counter()
        _, grads, aux = self.trainer.value_and_grad(self.weights, batch, self.loss)
        jax.block_until_ready(grads)
        return time.perf_counter() - t0, aux.stats

    def step(self, arm: str, rnd: int, step: int) -> dict[str, Any]:
        cfg, m = self.cfg, self.cfg.group_size
        picks = draws(self.pool, cfg, rnd, step)
        compiles = compile_count()
        t0 = time.perf_counter()
        if arm == "grpo":
            counts, early = [m] * cfg.prompts, [False] * cfg.prompts
        else:
            if self.lam is None:
                raise ConfigError("lam='auto' is resolved by run() (length_spread); set it first")
            plan = darts.plan(
                self.state, [p.key for p, _, _ in picks], m=m, up_factor=cfg.up_factor,
                lam=self.lam, units="relative",
            )  # fmt: skip
            counts, early = list(plan.counts), list(plan.early_stop)
        plan_s = time.perf_counter() - t0
        reqs, rank, rollout_s, eng = self.generate(picks, counts, early)
        t1 = time.perf_counter()
        kept, update = [], {}
        k = cfg.short_k or m - 1
        for (p, _, trunc), rs, stop in zip(picks, reqs, early, strict=True):
            lens = [len(r.tokens) for r in rs]
            ok = [r.finish is FinishReason.LENGTH and not trunc[r.index] for r in rs]
            if stop:
                order = sorted(range(len(rs)), key=lambda j: rank.get(id(rs[j]), 1 << 30))
                kept.append(darts.early_stop_select(lens, ok, order, m))
            elif len(rs) > m:
                kept.append(darts.dual_end_select(lens, ok, m, min(k, m)))
            else:
                kept.append(list(range(len(rs))))
            update[p.key] = [
                x for x, r in zip(lens, rs, strict=True) if r.finish is not FinishReason.CANCELLED
            ]
        if arm == "darts":
            self.state.update(update)
        select_s = time.perf_counter() - t1
        train_s, stats = self.train(picks, reqs, kept)
        step_s = time.perf_counter() - t0
        gen = [len(r.tokens) for rs in reqs for r in rs]
        cancelled = [len(r.tokens) for rs in reqs for r in rs if r.finish is FinishReason.CANCELLED]
        kept_lens = [len(rs[j].tokens) for rs, idx in zip(reqs, kept, strict=True) for j in idx]
        return dict(
            trace=cfg.trace,
            arm=arm,
            round=rnd,
            step=step,
            rollout_s=rollout_s,
            train_s=train_s,
            step_s=step_s,
            generated_tokens=int(sum(gen)),
            cancelled_tokens=int(sum(cancelled)),
            kept_len_mean=float(np.mean(kept_lens)),
            kept_lens=kept_lens,
            decode_steps=int(eng.decode_steps),
            decode_calls=int(eng.decode_calls),
            decode_s=float(sum(c[0] for c in eng.calls)),
            prefill_calls=int(eng.prefill_calls),
            plan_s=plan_s,
            select_s=select_s,
            other_s=step_s - rollout_s - train_s,
            train_tree_tokens=int(stats.get("tree_tokens", 0)),
            train_plan_steps=int(stats.get("num_steps", 0)),
            train_padded_steps=int(stats.get("padded_steps", 0)),
            candidates=int(sum(counts)),
            early_stop_groups=int(sum(early)),
            compiled=compile_count() != compiles,
        )

    def run(self, root=None, say=print) -> dict[str, Any]:
        cfg = self.cfg
        self.pool, desc = load_pool(cfg, root, self.model_cfg.vocab_size)
        say(f"darts trace bench: {desc}")
        rho = length_spread(self.pool, cfg)
        self.lam = resolve_lambda(cfg.lam, rho)
        how = f" = rho / {darts.PAPER_BUDGET} (auto)" if cfg.lam == "auto" else ""
        say(
            f"  N={cfg.prompts} prompts x M={cfg.group_size} (M_up {cfg.m_up}), slots "
            f"{self.rollout.config.slots}, length spread rho {rho:.3f}, lambda "
            f"{self.lam:.3g}{how} (relative: M* = {rho / self.lam:.2f} M N at rho), "
            f"K={cfg.short_k or cfg.group_size - 1}"
        )
        warm = []
        for s in range(cfg.warmup):
            for arm in ARMS:
                warm.append(self.step(arm, -1, s))
        rows = []
        for r in range(cfg.rounds):
            for arm in alternating(r, list(ARMS)):
                for s in range(cfg.steps):
                    rows.append(self.step(arm, r, s))
                    x = rows[-1]
                    say(
                        f"  round {r} {arm:5s} step {s}: rollout {x['rollout_s']:.3f} s, train "
                        f"{x['train_s']:.3f} s, step {x['step_s']:.3f} s, kept len "
                        f"{x['kept_len_mean']:.1f}{' (compiled)' if x['compiled'] else ''}"
                    )
        return dict(
            config=dataclasses.asdict(cfg),
            lam=self.lam,
            rho=rho,
            workload=desc,
            rows=rows,
            warmup=warm,
            summary=summarize(rows),
            machine=machine_info(),
        )


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: medians over the timed steps that compiled nothing; DARTS' speedups and
    length bias."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        clean = [r for r in mine if not r["compiled"]] or mine
        lens = np.concatenate([r["kept_lens"] for r in mine]) if mine else np.zeros(1)
        out[arm] = dict(
            steps=len(clean),
            compiled_steps=len(mine) - len([r for r in mine if not r["compiled"]]),
            **{
                k: float(np.median([r[k] for r in clean]))
                for k in ("rollout_s", "decode_s", "train_s", "step_s", "other_s")
            },
            train_tree_tokens=float(np.mean([r["train_tree_tokens"] for r in mine])),
            train_plan_steps=float(np.mean([r["train_plan_steps"] for r in mine])),
            train_padded_steps=float(np.mean([r["train_padded_steps"] for r in mine])),
            generated_tokens=float(np.mean([r["generated_tokens"] for r in mine])),
            decode_steps=float(np.mean([r["decode_steps"] for r in mine])),
            cancelled_tokens=float(np.mean([r["cancelled_tokens"] for r in mine])),
            candidates=float(np.mean([r["candidates"] for r in mine])),
            kept_len_mean=float(lens.mean()),
            kept_len_p50=float(np.percentile(lens, 50)),
            kept_len_p90=float(np.percentile(lens, 90)),
            kept_len_max=float(lens.max()),
        )
    g, d = out["grpo"], out["darts"]
    out["speedup"] = {k: g[k] / d[k] for k in ("rollout_s", "train_s", "step_s")}
    # Medians of the rollouts' decode steps over every step (counters, not clocks).
    med = {a: float(np.median([r["decode_steps"] for r in rows if r["arm"] == a])) for a in ARMS}
    out["decode_steps_median_ratio"] = med["grpo"] / med["darts"] if med["darts"] else float("nan")
    # Paired: both arms ran the same draws at each (round, step); the ratio of their
    # summed seconds over the pairs in which neither arm compiled.
    by = {(r["round"], r["step"], r["arm"]): r for r in rows}
    pairs = [
        (by[(r, s, "grpo")], by[(r, s, "darts")])
        for r, s, a in by
        if a == "grpo" and (r, s, "darts") in by
    ]
    pairs = [(a, b) for a, b in pairs if not (a["compiled"] or b["compiled"])]
    out["paired_steps"] = len(pairs)
    out["paired_speedup"] = {
        k: sum(a[k] for a, _ in pairs) / sum(b[k] for _, b in pairs) if pairs else float("nan")
        for k in ("rollout_s", "train_s", "step_s")
    }
    # The rollouts' decode steps over every pair (compiled or not: counters, not clocks).
    every = [(by[(r, s, "grpo")], by[(r, s, "darts")]) for r, s, a in by if a == "grpo"
             and (r, s, "darts") in by]  # fmt: skip
    out["decode_steps_ratio"] = (
        sum(a["decode_steps"] for a, _ in every) / max(1, sum(b["decode_steps"] for _, b in every))
        if every
        else float("nan")
    )
    out["length_bias"] = d["kept_len_mean"] / g["kept_len_mean"]
    return out


def format_table(res: dict[str, Any]) -> str:
    s = res["summary"]
    header = ("arm", "steps", "rollout s", "decode s", "train s", "other s", "step s",
              "decode steps", "train plan steps", "candidates", "generated tok",
              "cancelled tok", "kept len mean", "p50", "p90", "max")  # fmt: skip
    cells = [
        (arm, s[arm]["steps"],
         *(f"{s[arm][k]:.3f}" for k in ("rollout_s", "decode_s", "train_s", "other_s", "step_s")),
         f"{s[arm]['decode_steps']:.1f}",
         f"{s[arm]['train_plan_steps']:.0f} / {s[arm]['train_padded_steps']:.0f}",
         f"{s[arm]['candidates']:.1f}", f"{s[arm]['generated_tokens']:.0f}",
         f"{s[arm]['cancelled_tokens']:.0f}", f"{s[arm]['kept_len_mean']:.1f}",
         f"{s[arm]['kept_len_p50']:.0f}", f"{s[arm]['kept_len_p90']:.0f}",
         f"{s[arm]['kept_len_max']:.0f}")
        for arm in ARMS
    ]  # fmt: skip
    sp = s["speedup"]
    out = "\n".join(report.markdown(header, cells, compact=True))
    ps = s["paired_speedup"]
    out += (
        f"\npaired speedup grpo/darts (summed seconds of the {s['paired_steps']} (round, step) "
        f"pairs on the same draws, neither compiled): step {ps['step_s']:.2f}x, rollout "
        f"{ps['rollout_s']:.2f}x, train {ps['train_s']:.2f}x; rollout decode steps "
        f"grpo/darts over all pairs {s['decode_steps_ratio']:.2f}x (load-independent)"
    )
    out += (
        f"\nspeedup grpo/darts (medians of steps that compiled nothing): step "
        f"{sp['step_s']:.2f}x (goal >= 1.5 on verl_math), rollout {sp['rollout_s']:.2f}x, "
        f"train {sp['train_s']:.2f}x; kept length bias (darts / grpo mean kept length) "
        f"{s['length_bias']:.2f}; steps that compiled: grpo {s['grpo']['compiled_steps']}, "
        f"darts {s['darts']['compiled_steps']}; median rollout decode steps grpo/darts "
        f"{s['decode_steps_median_ratio']:.2f}x (load-independent)"
    )
    return out


def json_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One object per arm and timed step (``JSON_KEYS``, plus step, compiled and the
    breakdown: ``EXTRA_KEYS``)."""
    return [
        {**{k: r[k] for k in JSON_KEYS}, **{k: r[k] for k in ("step", "compiled", *EXTRA_KEYS)}}
        for r in res["rows"]
    ]


def run(
    cfg: TraceBenchConfig,
    *,
    polytrace: str | Path | None = None,
    model_cfg: ModelConfig | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """The benchmark (module docstring); ``format_table`` prints it."""
    say = print if verbose else (lambda *a, **k: None)
    return TraceBench(cfg, model_cfg).run(polytrace, say)


__all__ = [
    "ARMS",
    "EXTRA_KEYS",
    "JSON_KEYS",
    "TRACES",
    "TraceBench",
    "TraceBenchConfig",
    "draws",
    "format_table",
    "json_rows",
    "length_spread",
    "load_pool",
    "resolve_lambda",
    "run",
    "summarize",
]
