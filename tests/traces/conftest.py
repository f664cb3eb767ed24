"""Fixtures: the shared PolyTrace folder (skipped if absent) and small synthetic traces.

The shared traces are never copied into the repo: they are read from
``<repo>/../shared/polytrace`` or ``$DTARL_POLYTRACE``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtarl.traces.loaders import FITTED_RELPATH, default_polytrace_root

# ---------------------------------------------------------------------------- shared traces


@pytest.fixture(scope="session")
def polytrace_root() -> Path:
    root = default_polytrace_root()
    if not (root / FITTED_RELPATH).exists():
        pytest.skip(
            f"PolyTrace data not found at {root} (set $DTARL_POLYTRACE to the polytrace folder)"
        )
    return root


# ---------------------------------------------------------------------------- synthetic traces


def packed_row(step: int, i: int, inp: int, outs: list[int]) -> dict:
    return {
        "step": step,
        "rank": 0,
        "dp_rank": 0,
        "tp_rank": 0,
        "local_index": i,
        "input": inp,
        "output": outs,
        "n_sampling": len(outs),
        "validate": False,
    }


def trajectory_row(
    step: int, group: int, sample: int, prompt: int, rle: list[list[int]], max_resp: int = 60
) -> dict:
    """A consistent search_r1-style record whose turns follow the RLE's model runs."""
    resp = sum(n for _, n in rle)
    model_runs = [n for m, n in rle if m == 1]
    turns = [
        {
            "turn": k,
            "generation_prompt_len": prompt,
            "cached_tokens": 0,
            "completion_tokens": n,
            "assistant_append_len": n,
            "assistant_loss_len": n,
            "finish_reason": "tool_calls" if k < len(model_runs) - 1 else "stop",
            "tool_call_count": 1 if k < len(model_runs) - 1 else 0,
            "engine_latency_s": 0.5,
        }
        for k, n in enumerate(model_runs)
    ]
    tool_runs = [n for m, n in rle if m == 0]
    calls = [
        {
            "turn": k,
            "tool_name": "search",
            "latency_s": 0.1 * (k + 1) + 0.01 * sample,
            "response_token_len": n,
            "append_len": n,
            "status": "success",
        }
        for k, n in enumerate(tool_runs)
    ]
    return {
        "step": step,
        "prompt_len": prompt,
        "max_response_len": max_resp,
        "turns": turns,
        "tool_calls": calls,
        "finish_reason": "stop",
        "final_total_len": prompt + resp,
        "final_response_len": resp,
        "response_loss_mask_rle": rle,
        "turn_count": len(turns),
        "tool_call_count": len(calls),
        "validate": False,
        "prompt_group_id": group,
        "sample_id": sample,
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


SINGLE_STEPS = {
    0: [(5, [3, 7, 2, 9]), (8, [9, 1, 4, 4]), (3, [6, 6, 9, 2])],
    1: [(4, [2, 2, 2, 2]), (6, [9, 5, 1, 3])],
}

MULTI_STEP0 = [
    # (group, sample, prompt, rle)
    (0, 0, 6, [[1, 4], [0, 7], [1, 3]]),
    (0, 1, 6, [[1, 2]]),
    (0, 2, 6, [[1, 5], [0, 3], [1, 2], [0, 4], [1, 6]]),
    (1, 0, 9, [[1, 3], [0, 5], [1, 4], [0, 48]]),  # truncated: trailing tool run, resp = 60
    (1, 1, 9, [[1, 8]]),
    (1, 2, 9, [[1, 2], [0, 2], [1, 2]]),
]


@pytest.fixture()
def single_run(tmp_path) -> Path:
    """A verl-like run: 2 steps of packed lengths, reward timings and a DAPO filter file."""
    d = tmp_path / "synth" / "profile" / "packed_length_log" / "run1"
    for step, groups in SINGLE_STEPS.items():
        write_jsonl(
            d / f"packed_lengths_step_{step}.jsonl",
            [packed_row(step, i, inp, outs) for i, (inp, outs) in enumerate(groups)],
        )
        write_jsonl(
            d / f"reward_timings_step_{step}.jsonl",
            [
                {
                    "step": step,
                    "rank": r,
                    "tp_rank": 0,
                    "dp_rank": r,
                    "batch_size": 4,
                    "reward_time_s": 1.5 + r + step,
                    "response_sum": 100 * (r + 1) + step,
                    "response_mean": 25.0,
                    "response_max": 9,
                    "validate": False,
                }
                for r in range(3)
            ],
        )
    write_jsonl(
        d / "dapo_filter_indices.jsonl",
        [
            {
                "workload_step": 0,
                "trainer_step": 1,
                "gen_batch_index": 1,
                "prompt_count": 3,
                "n_sampling": 4,
                "train_batch_size": 2,
                "num_prompt_in_batch_before": 0,
                "kept_prompt_count": 2,
                "used_prompt_count": 1,
                "kept_prompt_indices": [0, 2],
                "used_prompt_indices": [2],
            }
        ],
    )
    return d


@pytest.fixture()
def multi_run(tmp_path) -> Path:
    d = tmp_path / "synth_mt" / "profile" / "multiturn_workload_log" / "run2"
    write_jsonl(
        d / "multiturn_workload_step_0.jsonl",
        [trajectory_row(0, g, s, p, rle) for g, s, p, rle in MULTI_STEP0],
    )
    return d


def fitted_dict() -> dict:
    return {
        "version": "1.0",
        "extraction_info": {"total_math_samples": 10, "total_tool_calling_samples": 20},
        "math_task": {
            "input_distribution": {"type": "lognorm", "parameters": [0.2, 0.0, 100.0]},
            "output_distribution": {"type": "lognorm", "parameters": [0.5, 0.0, 1000.0]},
            "gmm_parameters": {
                "weights": [0.5, 0.5],
                "means": [[100.0, 500.0], [150.0, 2000.0]],
                "covariances": [[[25.0, 0.0], [0.0, 400.0]], [[25.0, 0.0], [0.0, 900.0]]],
            },
        },
        "tool_calling_task": {
            "call_count_distribution": {"1": 5, "2": 15},
            "sequence_models": {
                "1": {
                    "feature_names": ["input_1", "output_1", "total_input"],
                    "mean_vector": [200.0, 50.0, 200.0],
                    "covariance_matrix": [[4.0, 0, 4.0], [0, 9.0, 0], [4.0, 0, 4.0]],
                },
                "2": {
                    "feature_names": ["input_1", "input_2", "output_1", "output_2"],
                    "mean_vector": [200.0, 480.0, 60.0, 90.0],
                    "covariance_matrix": [
                        [4.0, 0, 0, 0],
                        [0, 4.0, 0, 0],
                        [0, 0, 9.0, 0],
                        [0, 0, 0, 9.0],
                    ],
                },
            },
        },
    }


@pytest.fixture()
def fitted_file(tmp_path) -> Path:
    p = tmp_path / "fitted_root" / FITTED_RELPATH
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(fitted_dict(), indent=1))
    return p


@pytest.fixture()
def synth():
    """Helpers to write synthetic trace rows (tests import nothing from conftest)."""
    import types

    return types.SimpleNamespace(
        packed_row=packed_row,
        trajectory_row=trajectory_row,
        write_jsonl=write_jsonl,
        fitted_dict=fitted_dict,
        SINGLE_STEPS=SINGLE_STEPS,
        MULTI_STEP0=MULTI_STEP0,
    )
