"""The typed record model for PolyTrace workload traces.

One frozen dataclass per kind of JSONL line (see ``polytrace/README.md``):

  PromptGroup     single-turn packed-length log line: one GRPO group (prompt + G responses)
  DapoFilterBatch DAPO dynamic-sampling record: which prompts of a generation batch were kept
  RewardTiming    rllm sandboxed-reward timing of one rank and step
  Trajectory      search_r1 multi-turn trajectory (Turn and ToolCall entries, loss-mask RLE)

and the fitted production distributions (``FittedWorkload``) in ``fitted.py``.
Records hold lengths, counts and timings only, never token content.
"""

from __future__ import annotations

import dataclasses


class TraceFormatError(ValueError):
    """A malformed trace; the message names ``file:line`` and the offending field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptGroup:
    """One prompt and its ``n_sampling`` response lengths (verl, rllm, verl-video logs).

    Attributes:
      step: training step the group was generated for.
      input: prompt length in tokens.
      output: response lengths, one per sample (len == n_sampling).
      n_sampling: GRPO group size G.
      rank, dp_rank, tp_rank, local_index: where the group was generated (-1 if absent).
      validate: whether the group came from a validation pass.
    """

    step: int
    input: int
    output: tuple[int, ...]
    n_sampling: int
    rank: int = -1
    dp_rank: int = -1
    tp_rank: int = -1
    local_index: int = -1
    validate: bool = False

    @property
    def dense_tokens(self) -> int:
        """Tokens of the G sequences laid out densely: G * input + sum(output)."""
        return self.n_sampling * self.input + sum(self.output)

    @property
    def tree_tokens(self) -> int:
        """Tokens of the prefix tree (shared prompt once): input + sum(output)."""
        return self.input + sum(self.output)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DapoFilterBatch:
    """One DAPO generation batch: the prompts kept by dynamic sampling and those trained on."""

    workload_step: int
    trainer_step: int
    gen_batch_index: int
    prompt_count: int
    n_sampling: int
    train_batch_size: int
    num_prompt_in_batch_before: int
    kept_prompt_indices: tuple[int, ...]
    used_prompt_indices: tuple[int, ...]

    @property
    def kept_fraction(self) -> float:
        return len(self.kept_prompt_indices) / max(self.prompt_count, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardTiming:
    """Reward computation time of one rank and step (rllm: sandboxed test execution)."""

    step: int
    rank: int
    dp_rank: int
    tp_rank: int
    batch_size: int
    reward_time_s: float
    response_sum: int
    response_mean: float
    response_max: int
    validate: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Turn:
    """One model generation inside a multi-turn trajectory."""

    turn: int
    generation_prompt_len: int
    cached_tokens: int
    completion_tokens: int
    assistant_append_len: int
    assistant_loss_len: int
    finish_reason: str
    tool_call_count: int
    engine_latency_s: float
    # Tokens of the turn's decoded text (the paper's "search output"); None when the
    # trace does not record it. ``completion_tokens`` also counts the tool-call markup.
    generated_text_token_len: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One tool invocation (search) inside a multi-turn trajectory."""

    turn: int
    tool_name: str
    latency_s: float
    response_token_len: int
    append_len: int
    status: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trajectory:
    """A multi-turn tool-use trajectory (search_r1).

    The trained sequence is ``prompt_len`` prompt tokens followed by
    ``final_response_len`` response tokens, described by ``loss_mask_rle``:
    runs ``(mask, length)`` with mask 1 = model tokens (trained on), 0 = tool output.
    The response may be cut at ``max_response_len`` (then ``final_total_len``,
    the untruncated context, is larger than ``prompt_len + final_response_len``).

    Attributes:
      step, prompt_group_id, sample_id: identity; the trajectories of one
        prompt group share the prompt.
      prompt_len: prompt tokens.
      max_response_len: response budget of the run.
      turns, tool_calls: per-generation and per-tool-call records.
      final_total_len: untruncated prompt + response length.
      final_response_len: trained response length (== sum of RLE lengths).
      loss_mask_rle: ((mask, length), ...) over the response.
      finish_reason: finish reason of the last turn.
    """

    step: int
    prompt_group_id: int
    sample_id: int
    prompt_len: int
    max_response_len: int
    turns: tuple[Turn, ...]
    tool_calls: tuple[ToolCall, ...]
    final_total_len: int
    final_response_len: int
    loss_mask_rle: tuple[tuple[int, int], ...]
    finish_reason: str
    validate: bool = False

    @property
    def turn_count(self) -> int:
        return len(self.turns)

    @property
    def model_runs(self) -> tuple[int, ...]:
        """Lengths of the model-token runs (mask 1), one per trained turn."""
        return tuple(n for m, n in self.loss_mask_rle if m == 1)

    @property
    def truncated(self) -> bool:
        """True when the response hit the run's budget or the last turn hit its limit."""
        return self.final_response_len >= self.max_response_len or self.finish_reason == "length"

    @property
    def sequence_len(self) -> int:
        """Length of the trained sequence: prompt + (possibly truncated) response."""
        return self.prompt_len + self.final_response_len

    @property
    def per_turn_lens(self) -> tuple[int, ...]:
        """Length of each per-turn training sample: the context up to the end of turn k.

        Per-turn samples are prefixes of each other: sample k ends where the
        k-th model run (mask 1) of the RLE ends.
        """
        out, pos = [], self.prompt_len
        for m, n in self.loss_mask_rle:
            pos += n
            if m == 1:
                out.append(pos)
        return tuple(out)
