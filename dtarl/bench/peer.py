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

The measured work of each side (what a worker process runs) is in
``dtarl.bench.peer_sides``; this module runs the rounds and writes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from dtarl.bench import report
from dtarl.bench.peer_sides import (
    MEASUREMENTS,
    PEER_INSTALL,
    PeerMissing,
    PeerModel,
    Workload,
    require_tunix,
    worker,
)

WORKLOADS = (
    Workload(name="prompt 512, 64 new", prompt_len=512, new_tokens=64),
    Workload(name="prompt 128, 256 new", prompt_len=128, new_tokens=256),
)
QUICK_WORKLOADS = (
    Workload(name="prompt 128, 16 new", prompt_len=128, new_tokens=16),
    Workload(name="prompt 32, 64 new", prompt_len=32, new_tokens=64),
)

PARTS = ("rollout", "update", "iteration")


# ----------------------------------------------------------------------------- worker


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


__all__ = [
    "MEASUREMENTS",
    "PAIRS",
    "PARTS",
    "PEER_INSTALL",
    "QUICK_WORKLOADS",
    "WORKLOADS",
    "PeerMissing",
    "PeerModel",
    "Workload",
    "check_python",
    "format_table",
    "require_tunix",
    "run",
    "run_worker",
    "worker",
    "worker_env",
]


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
