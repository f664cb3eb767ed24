"""PAT: adaptive tensor parallelism during generation (arXiv 2605.23945 §4.2-4.3).

The rollout engine (``dtarl.rollout.engine``) decodes on a ('dp', 'tp') mesh of D
devices; ``RolloutEngine.reshard`` changes the mesh shape (and compacts the live
requests into fewer slots) between two decode calls. This module decides *when*
and *to what*:

* **Profile** (``dtarl.bench.pat_profile.profile_engine``; ``dtarl bench rollout
  --profile OUT.json``; the JSON format and its checks are ``Profile`` here): the
  engine's own decode programs for one engine config, for each TP in {1, 2, 4, 8}
  that divides the kv heads and D: B = slots per DP group on the levels the
  engine's slot merge reaches, L = the response window of the call (R/4, R/2, R);
  per point one prefill then R forced decode steps on dummy tokens, the fastest
  per-step seconds over the full calls that compiled nothing (background load only
  adds time; their median and coefficient of variation, ``cv``, are kept) and one
  factor for all points, ``decode_scale``: the median over every timed step of its
  seconds over its point's fastest (how much slower a typical call runs); the
  prefill's seconds; one call of each of the engine's prefill and extend programs per
  length bucket (``kv_calls``: what a recompute switch runs); the weight-reshard and
  K/V-move bandwidths (``jax.device_put`` between the shardings of two meshes); the
  seconds of one point's compiles. The JSON records the model, the engine config,
  the device kind, the jax version and the mesh axes (``Profile.save`` /
  ``Profile.load``).
* **Predictor** (``Predictor``): per-step latency ``l(B, T; tp)`` with T the
  aggregate context tokens *per DP group*: piecewise linear in T for every
  profiled B (below the smallest profiled T its value; above the largest T the last
  segment's slope when positive, else flat), interpolated linearly between the two
  nearest profiled B (below the smallest B: the smallest B's curve; above the
  largest: extended with the two largest B's slope when positive, else flat). Each
  neighbour's curve is read at the same context *per request* (T B' / B for a
  neighbour B'), not at the same T: a B' level was profiled over the T range its
  own requests reach, so at a larger B's T a smaller level would be read far past
  its last point, on its last segment's noise (an 82% held-out error on one CPU
  profile; 5.5% against 7.4% mean over seven profiles). Latency is taken never to
  fall with more tokens or a larger batch outside the grid, so a noisy negative
  slope is not extrapolated. The curves are the fastest
  steps times ``decode_scale``: per point the fastest is the least noisy statistic
  (a point's median moved 7-20% between profiles on the 2-core CPU), and the one
  pooled factor turns it into a typical call's seconds (the fastest alone
  under-predicted every static run, by 6-19%). ``est_rem_time`` sums it
  over the remaining steps as the context grows (Alg. 1's ``est_rem_time``).
  ``leave_one_out`` reports the error on held-out points inside the grid (between
  windows of one B; between B levels).
* **Switch cost** (``switch_cost``): weight bytes / reshard bandwidth +
  min(T_move, T_recomp) + a compile when the target program is not cached.
  T_move is Eq. 1-2 (K/V bytes per source rank / per-rank bandwidth) over the rows
  the engine's migrate moves: the valid ones, padded as ``reshard.migrate_rows`` pads.
  T_recomp is what the engine's recompute runs (``Predictor.recompute_seconds``):
  the prefill calls over the resident prompts and the extend calls over every
  request holding a slot, chunked and padded as the engine does
  (``dtarl.rollout.engine.recompute_calls``, the one list the engine runs too), each
  priced at its bucket from the profile's ``kv_calls``, plus the recompute's fixed
  part (old pool freed, empty one created). A profile made before those
  were timed (no ``kv_calls``) falls back to the paper's Eq. 3-4 (one profiled
  prefill of ceil(n / dp) prompts at the RMS context length). A switch that keeps
  the TP (compaction into fewer slots) has no weight term.
* **Controller** (``PatController``; Alg. 1): every ``check_every`` decode calls,
  when no request waits, it compares the predicted remaining time now with the
  remaining time + switch cost of every candidate TP (the live requests merged
  into the fewest slots the target DP spreads evenly; the current TP counts too,
  compacted into fewer slots without moving the weights) and switches to the best
  one when it is lower. It can switch several times per generation, records a
  timeline, and plugs in as the engine's ``on_call`` hook.

*What B and T mean on this engine.* A decode program computes every slot and
reads padded K/V: the prompt part of the cascade (Q prompt rows x M members x P
rows) and every slot's response rows up to the call's window. So its cost depends
on the program's shape, not on how many slots are still active: the controller
predicts with B = slots / dp and T = (Q M P + slots x window) / dp, the rows one DP
group's program reads per step, and the profile times exactly these programs (T
of a profiled point is defined the same way), so a generation's call lands on a
profiled (B, T) point or between two. Profile the engine config the run uses: a
profile of other shapes is interpolated and extrapolated from programs the run
never executes. The *paper's* B and T (active requests and their summed contexts,
``stats().active_per_step`` / ``.context_per_step``) are what ``replay``
feeds a saved profile, to predict the gain on an engine whose step cost follows
the active batch (e.g. a GPU server); that is a prediction and is labelled so.
"""

from __future__ import annotations

from dtarl.rollout.config import decode_windows, merged_slots, recompute_calls
from dtarl.rollout.pat_controller import (
    Decision,
    EngineState,
    PatController,
    check_candidates,
    decide,
    engine_rem_time,
    engine_state,
    program_tokens,
    replay,
)
from dtarl.rollout.pat_predictor import (
    CALL_KINDS,
    FORMAT,
    TP_DEGREES,
    PatError,
    Predictor,
    Profile,
    SwitchCost,
    kv_rank_bytes,
    leave_one_out,
    switch_cost,
)

__all__ = [
    "FORMAT",
    "TP_DEGREES",
    "Decision",
    "EngineState",
    "PatController",
    "CALL_KINDS",
    "PatError",
    "Predictor",
    "Profile",
    "SwitchCost",
    "check_candidates",
    "decide",
    "decode_windows",
    "engine_state",
    "engine_rem_time",
    "kv_rank_bytes",
    "leave_one_out",
    "merged_slots",
    "program_tokens",
    "recompute_calls",
    "replay",
    "switch_cost",
]
