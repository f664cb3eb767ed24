"""The training batch shared by every engine.

A batch is N ragged token sequences (prompt + response, or a whole multi-turn
trajectory) with per-token and per-sequence data. Per-token arrays are aligned
with the tokens: entry ``t`` belongs to token ``t``. Token 0 is never predicted,
so ``loss_mask[i][0]`` must be 0 and the logprob of token 0 is defined as 0.

All validation happens here, on the host, before any device work.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from dtarl.tree.trie import PrefixTree, build_tree


class BatchError(ValueError):
    """A malformed training batch; the message names the field and sequence."""


class LossNorm(enum.Enum):
    """How per-token losses l_it (mask m_it, N sequences) are normalised into the batch loss.

    TOKEN:        L = sum_i sum_t m_it l_it / sum_i sum_t m_it     (DAPO, PPO; "token-mean")
    SEQUENCE:     L = 1/N sum_i (sum_t m_it l_it / sum_t m_it)     (GRPO; "seq-mean-token-mean")
    SEQUENCE_SUM: L = 1/N sum_i sum_t m_it l_it                    ("seq-mean-token-sum")
    CONSTANT:     L = 1/(N c) sum_i sum_t m_it l_it                (Dr.GRPO, c = max response
                  length; "seq-mean-token-sum-norm")

    Every mode is a per-sequence weight w_i with L = sum_i w_i sum_t m_it l_it
    (``RolloutBatch.sequence_weights``). A sequence with no trained token still
    counts in N. The quoted names are verl's ``loss_agg_mode``s (``algo.loss_agg_mode``).
    """

    TOKEN = "token"
    SEQUENCE = "sequence"
    SEQUENCE_SUM = "sequence_sum"
    CONSTANT = "constant"


MAX_TOKEN_ID = 2**31  # token ids are stored as int32: 0 <= id < 2**31


def token_ids(name: str, values, *, error: type[ValueError] | None = None) -> np.ndarray:
    """``values`` as an int64 array of token ids, checked before any cast: an integer
    dtype (a float 5.7 is not silently 5) and ``0 <= id < 2**31`` (2**32 + 7 does
    not wrap to 7). Errors name ``name`` and the position: ``tokens[3][5] = ...``."""
    err = error or BatchError
    a = np.asarray(values)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise err(f"{name}: token ids must have an integer dtype, got {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= MAX_TOKEN_ID):
        bad = np.flatnonzero((a.reshape(-1) < 0) | (a.reshape(-1) >= MAX_TOKEN_ID))[0]
        raise err(f"{name}[{bad}] = {a.reshape(-1)[bad]} is not a token id (0 <= id < 2**31)")
    return a.astype(np.int64)


def _as_ragged(name: str, arrays, n: int, dtype, lengths: Sequence[int] | None):
    if arrays is None:
        return None
    if len(arrays) != n:
        raise BatchError(f"{name}: expected {n} sequences, got {len(arrays)}")
    out = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.ndim != 1:
            raise BatchError(f"{name}[{i}]: expected a 1-D array, got shape {a.shape}")
        if lengths is not None and a.shape[0] != lengths[i]:
            raise BatchError(f"{name}[{i}]: length {a.shape[0]} != tokens[{i}] length {lengths[i]}")
        out.append(a if dtype is None else np.ascontiguousarray(a, dtype=dtype))
    return tuple(out)


LOGPROB_SLACK = 1e-4  # a logprob may exceed 0 by this much (rounding), no more


def validate(batch: RolloutBatch) -> None:
    """Checks what every ``RolloutBatch`` must hold, however it was built (``create``
    normalises user input; the constructor takes arrays as they are): token ids in
    [0, 2**31) with an integer dtype, loss-mask weights in [0, 1], finite advantages,
    rewards and token advantages, logprobs finite and <= 0. Raises ``BatchError``
    naming the field and position."""
    n = len(batch.tokens)
    for i, t in enumerate(batch.tokens):
        token_ids(f"tokens[{i}]", t)
    for name in ("loss_mask", "old_logprobs", "ref_logprobs", "token_advantages"):
        arrs = getattr(batch, name)
        if arrs is not None and len(arrs) != n:
            raise BatchError(f"{name}: expected {n} sequences, got {len(arrs)}")
    for i, m in enumerate(batch.loss_mask):
        m = np.asarray(m)
        ok = np.isfinite(m) & (m >= 0) & (m <= 1)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise BatchError(
                f"loss_mask[{i}][{bad}] = {float(m[bad]):g}: accepted: a weight in [0, 1]"
            )
    for name in ("advantages", "rewards"):
        a = getattr(batch, name)
        if a is not None and not np.all(np.isfinite(np.asarray(a))):
            bad = int(np.flatnonzero(~np.isfinite(np.asarray(a).reshape(-1)))[0])
            raise BatchError(f"{name}[{bad}] = {np.asarray(a).reshape(-1)[bad]} is not finite")
    for name in ("old_logprobs", "ref_logprobs", "token_advantages"):
        for i, a in enumerate(getattr(batch, name) or ()):
            a = np.asarray(a)[1:]  # entry 0 is never predicted
            ok = (
                np.isfinite(a)
                if name == "token_advantages"
                else (np.isfinite(a) & (a <= LOGPROB_SLACK))
            )
            if not ok.all():
                bad = int(np.flatnonzero(~ok)[0])
                what = (
                    "is not finite"
                    if name == "token_advantages"
                    else ("is not a logprob (finite and <= 0)")
                )
                raise BatchError(f"{name}[{i}][{bad + 1}] = {a[bad]} {what}")


def _check_vocab(tokens, vocab_size: int) -> None:
    for i, t in enumerate(tokens):
        if t.max() >= vocab_size:
            j = int(np.argmax(t >= vocab_size))
            raise BatchError(f"tokens[{i}][{j}] = {int(t[j])} >= vocab_size {vocab_size}")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RolloutBatch:
    """N rollouts for one training step.

    Attributes:
      tokens: N int32 arrays [n_i], n_i >= 2.
      loss_mask: N float32 arrays [n_i]; 1 where token t is trained on (response
        tokens), 0 for prompt / tool-output tokens. Entry 0 must be 0. Entries are
        per-token weights in [0, 1] (the losses multiply by them and normalise by
        their sum).
      advantages: [N] float32 per-sequence advantage (or reward for SFT-like losses).
      old_logprobs: optional N float32 arrays [n_i]: logprob of token t under the
        sampling policy (entry 0 ignored); finite and <= 0 (``LOGPROB_SLACK`` of rounding).
      ref_logprobs: optional N float32 arrays [n_i] under a frozen reference policy.
      token_advantages: optional N float32 arrays [n_i]: a per-token advantage
        (PPO with GAE). Where given it replaces the sequence's ``advantages``.
      group_ids: [N] int32 group (prompt) ids; defaults to one group per sequence.
      rewards: optional [N] float32, carried for metrics only.
    """

    tokens: tuple[np.ndarray, ...]
    loss_mask: tuple[np.ndarray, ...]
    advantages: np.ndarray
    old_logprobs: tuple[np.ndarray, ...] | None = None
    ref_logprobs: tuple[np.ndarray, ...] | None = None
    token_advantages: tuple[np.ndarray, ...] | None = None
    group_ids: np.ndarray | None = None
    rewards: np.ndarray | None = None

    def __post_init__(self):
        validate(self)

    @classmethod
    def create(
        cls,
        *,
        tokens: Sequence,
        loss_mask: Sequence | None = None,
        advantages=None,
        old_logprobs: Sequence | None = None,
        ref_logprobs: Sequence | None = None,
        token_advantages: Sequence | None = None,
        group_ids=None,
        rewards=None,
        prompt_lens: Sequence[int] | None = None,
        vocab_size: int | None = None,
    ) -> RolloutBatch:
        """Validates and normalises user input into a batch.

        ``tokens`` must hold integers in [0, 2**31) (and < ``vocab_size`` when given).
        ``loss_mask`` defaults to all tokens after the prompt (``prompt_lens``)
        or, without prompt lengths, to every token but the first; giving both is
        an error. ``advantages`` defaults to ones.
        """
        n = len(tokens)
        if n == 0:
            raise BatchError("tokens: the batch is empty (need at least 1 sequence)")
        _as_ragged("tokens", tokens, n, None, None)  # count and rank
        toks = tuple(token_ids(f"tokens[{i}]", t) for i, t in enumerate(tokens))
        for i, t in enumerate(toks):
            if t.shape[0] < 2:
                raise BatchError(
                    f"tokens[{i}]: length {t.shape[0]} < 2; a sequence needs at least one "
                    "predicted token"
                )
        toks = tuple(t.astype(np.int32) for t in toks)
        if vocab_size is not None:
            _check_vocab(toks, vocab_size)
        lengths = [t.shape[0] for t in toks]
        if prompt_lens is not None and loss_mask is not None:
            raise BatchError(
                "prompt_lens: given together with loss_mask, which already says which "
                "tokens are trained on; pass one of them"
            )
        if loss_mask is None:
            if prompt_lens is not None:
                if len(prompt_lens) != n:
                    raise BatchError(f"prompt_lens: expected {n} entries, got {len(prompt_lens)}")
                loss_mask = []
                for i, (p, ln) in enumerate(zip(prompt_lens, lengths, strict=True)):
                    if isinstance(p, bool) or not isinstance(p, int | np.integer):
                        raise BatchError(f"prompt_lens[{i}]={p!r} must be an integer")
                    if not 1 <= p < ln:
                        raise BatchError(
                            f"prompt_lens[{i}]={p} outside [1, {ln - 1}] for a sequence of "
                            f"length {ln}"
                        )
                    m = np.zeros(ln, np.float32)
                    m[p:] = 1.0
                    loss_mask.append(m)
            else:
                loss_mask = [np.concatenate([[0.0], np.ones(ln - 1)]) for ln in lengths]
        mask = _as_ragged("loss_mask", loss_mask, n, np.float32, lengths)
        for i, m in enumerate(mask):
            if m[0] != 0:
                raise BatchError(f"loss_mask[{i}][0] = {m[0]}; token 0 is never predicted, use 0")
            if not np.all(np.isfinite(m)) or m.min() < 0 or m.max() > 1:
                bad = int(np.flatnonzero(~((m >= 0) & (m <= 1)))[0])
                raise BatchError(
                    f"loss_mask[{i}][{bad}] = {float(m[bad]):g}: accepted: a weight in [0, 1] "
                    "(1 = trained on, 0 = not)"
                )
        if advantages is None:
            advantages = np.ones(n, np.float32)
        adv = np.asarray(advantages, np.float32).reshape(-1)
        if adv.shape != (n,):
            raise BatchError(f"advantages: expected shape ({n},), got {np.shape(advantages)}")
        if not np.all(np.isfinite(adv)):
            bad = int(np.flatnonzero(~np.isfinite(adv))[0])
            raise BatchError(f"advantages[{bad}] = {adv[bad]} is not finite")
        old = _as_ragged("old_logprobs", old_logprobs, n, np.float32, lengths)
        ref = _as_ragged("ref_logprobs", ref_logprobs, n, np.float32, lengths)
        tadv = _as_ragged("token_advantages", token_advantages, n, np.float32, lengths)
        # Entry 0 is documented as ignored: make it inert (no 0 * inf in a loss).
        old, ref, tadv = (
            None
            if arrs is None
            else tuple(np.concatenate([[0.0], a[1:]]).astype(np.float32) for a in arrs)
            for arrs in (old, ref, tadv)
        )
        for name, arrs in (
            ("old_logprobs", old),
            ("ref_logprobs", ref),
            ("token_advantages", tadv),
        ):
            for i, a in enumerate(arrs or ()):
                if not np.all(np.isfinite(a[1:])):
                    bad = 1 + int(np.flatnonzero(~np.isfinite(a[1:]))[0])
                    raise BatchError(f"{name}[{i}][{bad}] = {a[bad]} is not finite")
        if group_ids is None:
            gids = np.arange(n, dtype=np.int32)
        else:
            gids = np.asarray(group_ids).reshape(-1)
            if gids.size and not np.issubdtype(gids.dtype, np.integer):
                raise BatchError(f"group_ids: must have an integer dtype, got {gids.dtype}")
            if gids.size and (gids.min() < 0 or gids.max() >= MAX_TOKEN_ID):
                raise BatchError(f"group_ids: ids must be in [0, 2**31), got {gids.tolist()}")
            gids = gids.astype(np.int32)
            if gids.shape != (n,):
                raise BatchError(f"group_ids: expected shape ({n},), got {np.shape(group_ids)}")
        rw = None
        if rewards is not None:
            rw = np.asarray(rewards, np.float32).reshape(-1)
            if rw.shape != (n,):
                raise BatchError(f"rewards: expected shape ({n},), got {np.shape(rewards)}")
            if not np.all(np.isfinite(rw)):
                bad = int(np.flatnonzero(~np.isfinite(rw))[0])
                raise BatchError(f"rewards[{bad}] = {rw[bad]} is not finite")
        return cls(
            tokens=toks,
            loss_mask=mask,
            advantages=adv,
            old_logprobs=old,
            ref_logprobs=ref,
            token_advantages=tadv,
            group_ids=gids,
            rewards=rw,
        )

    def prefix_tree(self) -> PrefixTree:
        """The batch's prefix tree, built on first use and kept with the batch, so
        the engines that ``auto`` prepares (and the benchmark) share one."""
        tree = self.__dict__.get("_prefix_tree")
        if tree is None:
            tree = build_tree(self.tokens)
            object.__setattr__(self, "_prefix_tree", tree)
        return tree

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([t.shape[0] for t in self.tokens], np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def check_vocab(self, vocab_size: int) -> None:
        _check_vocab(self.tokens, vocab_size)

    def sequence_weights(self, norm: LossNorm, constant: float | None = None) -> np.ndarray:
        """Per-sequence weight w_i so that L = sum_i w_i sum_t m_it l_it (see LossNorm)."""
        msum = np.array([m.sum() for m in self.loss_mask], np.float64)
        n = self.num_sequences
        if norm is LossNorm.TOKEN:
            total = msum.sum()
            w = np.full(n, 0.0 if total == 0 else 1.0 / total)
        elif norm is LossNorm.SEQUENCE:
            w = np.where(msum > 0, 1.0 / (n * np.maximum(msum, 1e-30)), 0.0)
        elif norm is LossNorm.SEQUENCE_SUM:
            w = np.full(n, 1.0 / n)
        elif norm is LossNorm.CONSTANT:
            if constant is None or not constant > 0:
                raise BatchError(f"LossNorm.CONSTANT needs a constant > 0, got {constant}")
            w = np.full(n, 1.0 / (n * constant))
        else:  # pragma: no cover - exhaustive enum
            raise BatchError(f"unknown normalisation {norm}")
        return w.astype(np.float32)

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """A sub-batch with the given sequences (for partitioning). Keeps weights' inputs."""
        idx = [int(i) for i in indices]

        def pick(x):
            return None if x is None else tuple(x[i] for i in idx)

        return RolloutBatch(
            tokens=pick(self.tokens),
            loss_mask=pick(self.loss_mask),
            advantages=self.advantages[idx],
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            token_advantages=pick(self.token_advantages),
            group_ids=self.group_ids[idx],
            rewards=None if self.rewards is None else self.rewards[idx],
        )
