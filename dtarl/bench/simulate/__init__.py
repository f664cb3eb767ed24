"""Step-time simulator: predict a workload's RL step on a described cluster, without running it.

A replayed step (``dtarl.bench.replay``) has five stages; each has a model here:

  train    per engine, the linear cost model (1) over the features of the program
           the engine would compile for the batch;
  rollout  the linear cost model (2) over the static sampler's generate calls (one
           per turn; a replay on the continuous engine gets no rollout row);
  tool     the critical path of the workload's sampled tool latencies on the
           simulated clock (seeded like the replay; nothing is fitted);
  reward   the replay's sampled per-rank reward times of the workload's own run
           and step (only rllm records them; nothing is fitted);
  inference  forward-only logprob passes: the dense train coefficients applied
           to the scorer's forward FLOPs (``predict_inference``).
Tool and reward are production seconds unless ``tool_time_scale`` converts
them; a step total is only formed in one unit system.

Train cost model. For engine e the training step time of a batch is

    t_e = a_e F_lin + b_e F_attn + c_e n_steps + d_e                         (1)

The features are read off the engine's own host-side preparation: a fresh engine
of kind e on a shape-only model (``nnx.eval_shape``, no weights) runs
``prepare(batch)`` (prefix tree, plan, padding to its shape buckets) and the
padded arrays it would hand to the device are counted, so the features follow
the engines' bucketing and planning as they change; nothing is mirrored here.
With f0 = ``cfg.flops_per_token(0)`` (linear layers + LM head, forward) and
fa = FLOPs per attended key (``cfg.flops_per_token(1) - f0``); backward = 2x:

  dense         M microbatches of B rows of T tokens (static (M, B, T)):
                F_lin = k M B T f0, F_attn = k M B T^2 fa, n_steps = M
                (k = 3; 4 for dense_remat)
  dfs           plan steps t (chunk C) with op in {PUSH, POP, POP_ROWS, NOOP},
                each running r_t rows of C (r = 1; the plan's rows for POP_ROWS;
                0 for NOOP) against the stack prefix bucket p_t plus the chunk:
                F_lin = C f0 sum_t w_t r_t, F_attn = C fa sum_t w_t r_t (p_t + C),
                w = 1 (PUSH), 3 (POP*: recompute + backward); n_steps = padded steps
  prefix_reuse  G groups of a P-token prefix and M x B suffix rows of C tokens:
                F_lin = f0 (k_p G P + 3 G M B C),
                F_attn = fa (k_p G P^2 + 3 G M B C (P + C)), n_steps = G (M + 1)
                (k_p = 4 with ``PrefixActivations.REMAT``, else 3); groups with
                forks below the top level go to a DFS program inside the same
                call, a sub-program priced with the dfs coefficients minus their
                per-call constant (``WorkFeatures.sub``, ``price``)
  auto          the program of the engine ``AutoEngine.choose`` picks (with auto's
                own settings), priced with *that* engine's coefficients, plus the
                host time of the choice beyond the pick's own ``prepare`` (auto
                prepares every candidate to choose): t_choose = h_tok N + h_0  (3)

Rollout cost model. The replay's rollout runs one ``Sampler.generate`` per turn
on one sampler whose buckets only grow, so after its warm-up every timed call
runs the largest buckets of the rollout: Q prompts padded to P tokens, R rows
with a cache of S = P + R_len positions. A call whose longest forced length is
n runs the prefill once and n - 1 decode steps:

    t_roll = sum_calls a F_prefill + b F_dec_lin + c F_dec_attn + e n_decode + g   (2)

with F_prefill = Q P (f0 + fa P), F_dec_lin = R (n - 1) f0 (every row runs every
step, finished or not), F_dec_attn = R (n - 1) S fa (each step reads the whole
cache) and n_decode = n - 1 (``rollout_features`` mirrors ``Sampler.init``'s
buckets).

Fitting. Every coefficient is >= 0, fitted by non-negative least squares with
each row weighted by 1 / t (relative error), on synthetic calibration batches
(``calibration_batches``, ``calibration_rollouts``) that are *not* trace
workloads but span the replay suite's regime: 4-48 sequences up to ~256 tokens,
GRPO groups with short and long prompts, and per-turn multi-turn trees; when
auto is calibrated, dfs is also timed at auto's chunk length on every other
batch, so its one fit covers both programs. Kinds without sub-programs are
fitted first, so a sub-program's time can be taken
out of its host's measurements (``fit_engine_costs``). Timing follows the
replay's protocol, which is what makes the two comparable on a shared machine:
every (engine, batch) is compiled first, then timed in interleaved rounds, each
call held until other processes are quiet (``dtarl.timing.QuietGate``,
``replay.replay_rounds``), and the minimum is fitted (the median and the
background load of the fastest call are kept alongside).

Cluster (``ClusterSpec``). The batch is partitioned over ``dp`` ranks
(``dtarl.parallel.partition``); a rank's compute time is (1) with the FLOP terms
divided by tp x throughput_scale; tensor parallelism adds 4 L all-reduces of
the [tokens, hidden] activations per step (2 forward, 2 backward); the step adds
one ring all-reduce of the fp32 gradient (2 (dp-1)/dp x bytes / bandwidth +
2 (dp-1) latency). Predicted train time = max over ranks + all-reduce. The
rollout's samples are split evenly over the dp ranks (its FLOP terms divided
by tp x throughput_scale; no tp traffic is modelled for generation).

Production (``production``, ``dtarl trace validate``): a separate, trace-only
model of the original deployment's rollout (SGLang per-turn latency under
processor sharing, tool calls on each trajectory's timeline) and reward time,
fitted on some steps of the traces' real timings and scored on held-out steps.

Validation (``validate``) regenerates the workloads of a ``replay`` JSON,
predicts every stage with a profile, and reports |pred - measured| / measured
per (workload, stage, engine) against both the replay's minimum and median.
A profile made minutes before the replay carries the machine's drift in
between (on a small shared machine: tens of percent) into that error;
``calibrate_and_replay`` (``dtarl trace simulate --joint``) times the
calibration inside the replay's own rounds, so the error it reports is the
model's.
"""

from dtarl.bench.simulate.calibrate import (
    CalibrationPlan,
    calibrate_and_replay,
    calibration_batches,
    calibration_kinds,
    calibration_plan,
    calibration_rollouts,
    fit_profile,
    multi_turn_batch,
    profile_engines,
)
from dtarl.bench.simulate.features import (
    AUTO,
    FEATURE_NAMES,
    ROLLOUT_FEATURE_NAMES,
    TRAIN_KINDS,
    RolloutFeatures,
    WorkFeatures,
    engine_features,
    feature_engine,
    rollout_call_features,
    rollout_features,
)
from dtarl.bench.simulate.fit import (
    PROFILE_KIND,
    PROFILE_VERSION,
    AutoCost,
    CalibrationPoint,
    CostProfile,
    EngineCost,
    RolloutCost,
    fit_engine_costs,
    fit_relative,
    price,
)
from dtarl.bench.simulate.predict import (
    ClusterSpec,
    EnginePrediction,
    StepPrediction,
    inference_features,
    predict_inference,
    predict_rollout,
    predict_step,
    predict_workload,
)
from dtarl.bench.simulate.production import (
    EngineLatencyModel,
    ProductionReport,
    RewardTimeModel,
    TurnTable,
    validate_production,
)
from dtarl.bench.simulate.validate import ValidationReport, ValidationRow, validate
from dtarl.engines.cost import nnls

__all__ = [
    "AUTO",
    "FEATURE_NAMES",
    "PROFILE_KIND",
    "PROFILE_VERSION",
    "ROLLOUT_FEATURE_NAMES",
    "TRAIN_KINDS",
    "AutoCost",
    "CalibrationPoint",
    "ClusterSpec",
    "CostProfile",
    "EngineCost",
    "EngineLatencyModel",
    "ProductionReport",
    "RewardTimeModel",
    "TurnTable",
    "validate_production",
    "EnginePrediction",
    "RolloutCost",
    "RolloutFeatures",
    "WorkFeatures",
    "StepPrediction",
    "ValidationReport",
    "ValidationRow",
    "CalibrationPlan",
    "calibrate_and_replay",
    "calibration_batches",
    "calibration_kinds",
    "calibration_rollouts",
    "engine_features",
    "feature_engine",
    "fit_engine_costs",
    "fit_profile",
    "calibration_plan",
    "fit_relative",
    "multi_turn_batch",
    "nnls",
    "inference_features",
    "predict_inference",
    "predict_rollout",
    "price",
    "predict_step",
    "predict_workload",
    "profile_engines",
    "rollout_call_features",
    "rollout_features",
    "validate",
]
