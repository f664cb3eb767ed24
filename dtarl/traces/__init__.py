"""PolyTrace: real RL workload traces -> typed records, reports and training batches.

load_trace(path)            RunTrace (streamed records) or FittedWorkload
find_traces(root)           every run / fitted JSON below a folder
sample_workload(source, *, batch_size, ...) -> RolloutBatch with the real prefix structure
generate_workload(...)      + WorkloadInfo (groups, lengths, truncation, tree tokens)
ToolLatencySampler          empirical search_r1 tool latencies (seeded)
write_report(path, out_dir) Markdown/HTML + PNG characterization (dtarl.traces.report)

Data only: no JAX is imported here. Replay and the step-time simulator, which run
the engines, are measurement and live in ``dtarl.bench``.
"""

from dtarl.traces.fitted import FittedWorkload, load_fitted
from dtarl.traces.loaders import (
    FileKind,
    RunKind,
    RunTrace,
    default_polytrace_root,
    detect_file,
    find_traces,
    iter_jsonl,
    load_trace,
)
from dtarl.traces.records import (
    DapoFilterBatch,
    PromptGroup,
    RewardTiming,
    ToolCall,
    TraceFormatError,
    Trajectory,
    Turn,
)
from dtarl.traces.workload import (
    GroupCorrelation,
    GroupSpec,
    RewardTimeSampler,
    ToolLatencySampler,
    Workload,
    WorkloadInfo,
    WorkloadMode,
    build_workload,
    generate_workload,
    measure_group_correlation,
    sample_workload,
)

__all__ = [
    "DapoFilterBatch",
    "FileKind",
    "FittedWorkload",
    "GroupCorrelation",
    "GroupSpec",
    "PromptGroup",
    "RewardTimeSampler",
    "RewardTiming",
    "RunKind",
    "RunTrace",
    "ToolCall",
    "ToolLatencySampler",
    "TraceFormatError",
    "Trajectory",
    "Turn",
    "Workload",
    "WorkloadInfo",
    "WorkloadMode",
    "build_workload",
    "default_polytrace_root",
    "detect_file",
    "find_traces",
    "generate_workload",
    "iter_jsonl",
    "load_fitted",
    "load_trace",
    "measure_group_correlation",
    "sample_workload",
]
