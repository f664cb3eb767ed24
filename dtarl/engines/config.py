"""Engine settings: one frozen dataclass per engine, the engine kind, and capacity.

    EngineKind          dense | dense_remat | dfs | prefix_reuse | auto
    DenseConfig         microbatch, remat
    DFSConfig           chunk_len, order, pack_leaves, leaf_rows, wide_chunks, ...
    PrefixReuseConfig   microbatch, prefix_activations, deep_trees, dfs_chunk_len, ...
    AutoConfig          candidates and the autotuner's settings
    EngineConfig        all four, as the ``engine:`` section of a trainer config
    Capacity            the largest batch of a run: ``engine.reserve(capacity)``

``make_engine(kind, model, config)`` (``dtarl.engines``) builds an engine from
these; each engine also takes its own config, or its fields as keywords:
``DFSEngine(model, DFSConfig(chunk_len=64))`` == ``DFSEngine(model, chunk_len=64)``.
Every field is checked when the config is built, and the error names the field
and the accepted range.
"""

from __future__ import annotations

import dataclasses
import enum

from dtarl.tree.order import DFSOrder


class EngineKind(enum.Enum):
    DENSE = "dense"  # padded per-sequence baseline
    DENSE_REMAT = "dense_remat"  # dense with per-layer rematerialisation
    DFS = "dfs"  # AREAL-DTA depth-first tree training
    PREFIX_REUSE = "prefix_reuse"  # schedule-level prefix reuse (the shared-prefix reuse paper)
    AUTO = "auto"  # cost model + autotuning over the three above

    @classmethod
    def parse(cls, value: EngineKind | str, *, field: str = "engine") -> EngineKind:
        """``value`` as an EngineKind; an unknown one is a ValueError listing the kinds."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"{field}={value!r} is not a known engine; accepted: {[k.value for k in cls]}"
            ) from None

    @classmethod
    def auto_candidates(cls) -> tuple[EngineKind, ...]:
        """The engines auto chooses among (its candidates and the cost model's keys),
        in tie-break order."""
        return (cls.DENSE, cls.PREFIX_REUSE, cls.DFS)


class PrefixActivations(enum.Enum):
    """What happens to the prefix's activations (other than K/V) during the suffixes."""

    REMAT = "remat"
    KEEP = "keep"
    OFFLOAD = "offload"


class DeepTrees(enum.Enum):
    """How ``PrefixReuseEngine`` trains groups that branch below their prefix."""

    DFS = "dfs"  # deep groups go to the DFS engine: every node computed once
    ROWS = "rows"  # one dense suffix row per leaf: shared deeper nodes recomputed


def _at_least(obj, minimum, *names):
    for n in names:
        v = getattr(obj, n)
        if not v >= minimum:
            raise ValueError(f"{obj.SECTION}.{n}={v!r}: must be >= {minimum}")


def _enum(obj, name, kind):
    """Accepts the enum's value as a string (YAML) and stores the member."""
    v = getattr(obj, name)
    if not isinstance(v, kind):
        try:
            object.__setattr__(obj, name, kind(v))
        except ValueError:
            raise ValueError(
                f"{obj.SECTION}.{name}={v!r}: accepted: {[k.value for k in kind]}"
            ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseConfig:
    SECTION = "engine.dense"
    microbatch: int = 8  # sequences per microbatch (gradients accumulate over them)
    remat: bool = False  # rematerialise each layer in the backward pass

    def __post_init__(self):
        _at_least(self, 1, "microbatch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFSConfig:
    SECTION = "engine.dfs"
    chunk_len: int = 256  # tokens per push/pop step (chunked backprop)
    order: DFSOrder = DFSOrder.GREEDY  # child order of the DFS
    pack_leaves: bool = True  # sibling leaves shorter than a chunk share a step
    # rows of sibling leaves per step; 1: no row-pop body (engines.md, "Program bodies")
    leaf_rows: int = 1
    wide_chunks: int = 4  # leaves longer than a chunk pop as rows of up to this many chunks
    wide_slack: float = 0.25  # accepted extra FLOPs of a wide row over chunking it
    prefix_levels: int = 3  # stack levels kept as separate prefix segments
    # None: one program body per op whose attention reads only the step's prefix
    # bucket (a switch inside the attention). True: one whole-model body per (op,
    # prefix bucket): a program that grows with the buckets. False: one body per op
    # attending the whole path buffer, masked: slower steps (engines.md, "Program
    # bodies").
    bucket_bodies: bool | None = None
    # A push keeps each layer's output of its chunk ([L, path, E]) so that the chunk's
    # pop runs only the backward pass (``dtarl.model.reverse``); leaves, never pushed,
    # run forward then backward in the same bodies. None: when ``model.remat`` is
    # full (there a pop would otherwise run the forward twice before its backward).
    keep_layer_outputs: bool | None = None
    # With ``model.logits_chunk`` > 0 the head builds its [tokens, vocab] logits
    # logits_chunk * logits_rows tokens at a time (dense builds logits_chunk positions
    # of each of its microbatch's 8 rows): a step's single row in blocks of
    # logits_chunk tokens would stream the whole head weight per block.
    logits_rows: int = 8

    def __post_init__(self):
        _enum(self, "order", DFSOrder)
        _at_least(self, 1, "chunk_len", "leaf_rows", "prefix_levels", "logits_rows")
        _at_least(self, 0, "wide_chunks", "wide_slack")
        if not (self.bucket_bodies is None or isinstance(self.bucket_bodies, bool)):
            raise ValueError(
                f"{self.SECTION}.bucket_bodies={self.bucket_bodies!r}: accepted: null "
                "(per-op bodies, bucketed attention), true, false"
            )
        if not (self.keep_layer_outputs is None or isinstance(self.keep_layer_outputs, bool)):
            raise ValueError(
                f"{self.SECTION}.keep_layer_outputs={self.keep_layer_outputs!r}: accepted: "
                "null (when model.remat is full), true, false"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixReuseConfig:
    SECTION = "engine.prefix_reuse"
    microbatch: int = 8  # suffix rows per microbatch
    prefix_activations: PrefixActivations = PrefixActivations.OFFLOAD
    deep_trees: DeepTrees = DeepTrees.DFS
    dfs_chunk_len: int = 128  # chunk length of the deep groups' DFS program
    offload_on_cpu: bool = False  # run the OFFLOAD program on a CPU too (tests)

    def __post_init__(self):
        _enum(self, "prefix_activations", PrefixActivations)
        _enum(self, "deep_trees", DeepTrees)
        _at_least(self, 1, "microbatch", "dfs_chunk_len")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """The autotuner (``dtarl.engines.auto``; its docstring explains each field)."""

    SECTION = "engine.auto"
    # engines auto may pick (EngineKind values)
    candidates: tuple[str, ...] = tuple(k.value for k in EngineKind.auto_candidates())
    autotune: bool = True  # time the close candidates once per shape bucket
    tune_margin: float = 2.0  # time candidates whose estimate is within this factor
    tune_all_below: float = 0.05  # seconds: below this best estimate, time them all
    # After reserve, the first batch of a loss times (and compiles) the candidates
    # within this factor of the best estimate; None: all of them.
    reserve_margin: float | None = 4.0
    # A tree engine is picked over dense only when its measured step is more than this
    # fraction faster (dense's program is the smallest to compile and to load).
    prefer_dense_within: float = 0.03
    tune_repeats: int = 5  # timed calls per program (the median counts)
    reuse_choices: bool = True  # a batch of a measured signature goes to its pick
    recheck_every: int = 64  # re-run the full choice every N batches of a signature
    budget_seconds: float | None = None  # total tuning time; then the cost model decides
    cache_path: str | None = None  # JSON file of measured choices reused across runs

    def __post_init__(self):
        object.__setattr__(self, "candidates", tuple(self.candidates))
        accepted = [k.value for k in EngineKind.auto_candidates()]
        if not self.candidates or any(c not in accepted for c in self.candidates):
            raise ValueError(
                f"{self.SECTION}.candidates={list(self.candidates)!r}: each must be one of "
                f"{accepted}, at least one"
            )
        _at_least(self, 1.0, "tune_margin")
        _at_least(self, 0.0, "tune_all_below")
        _at_least(self, 1, "tune_repeats")
        if self.reserve_margin is not None:
            _at_least(self, 1.0, "reserve_margin")
        _at_least(self, 0, "recheck_every")
        _at_least(self, 0.0, "prefer_dense_within")
        if self.budget_seconds is not None:
            _at_least(self, 0.0, "budget_seconds")
        if self.cache_path is not None and not (
            isinstance(self.cache_path, str) and self.cache_path
        ):
            raise ValueError(
                f"{self.SECTION}.cache_path={self.cache_path!r}: must be a file path or None"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every engine's settings (the trainer's ``engine:`` section); the engine that
    runs is chosen by ``algo.engine``. auto builds its candidates from these too."""

    dense: DenseConfig = DenseConfig()
    dfs: DFSConfig = DFSConfig()
    prefix_reuse: PrefixReuseConfig = PrefixReuseConfig()
    auto: AutoConfig = AutoConfig()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capacity:
    """The largest batch a run gives an engine. ``engine.reserve(capacity)`` grows its
    shape buckets to fit it, so that no batch within it compiles a new program.

    ``sequences`` sequences of at most ``length`` tokens, ``tokens`` in all
    (default ``sequences * length``), in ``groups`` prompt groups of at most
    ``group_size`` sequences each. ``prompt_len`` and ``response_len`` (optional)
    bound a group's shared prefix and each suffix: prefix_reuse reserves its group
    shapes only when they are given, since padding every group to them costs.
    ``turns`` > 1 (multi-turn episodes: trees that branch below the prompt) makes
    prefix_reuse reserve its two-program form for deep groups up front.
    """

    sequences: int
    length: int
    tokens: int | None = None
    group_size: int = 1
    groups: int = 1
    prompt_len: int | None = None
    response_len: int | None = None
    turns: int = 1

    def __post_init__(self):
        for name in ("sequences", "length", "group_size", "groups", "turns"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"Capacity.{name}={v!r}: must be an int >= 1")
        if self.tokens is None:
            object.__setattr__(self, "tokens", self.sequences * self.length)
        for name in ("tokens", "prompt_len", "response_len"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"Capacity.{name}={v!r}: must be an int >= 1 (or None)")

    @property
    def tree_tokens(self) -> int:
        """A bound on a batch's prefix-tree tokens: ``tokens``, or, when the prompt and
        response lengths are bounded, a prompt per group plus a response per sequence."""
        if self.prompt_len is None or self.response_len is None:
            return self.tokens
        return min(self.tokens, self.groups * self.prompt_len + self.sequences * self.response_len)

    def plan_steps(self, chunk_len: int) -> int:
        """A bound on the steps of a DFS plan of chunk ``chunk_len`` for any batch
        within this capacity. A node of n tokens costs at most ceil(n / C) pushes and
        as many pops, and a tree of N sequences has at most 2N nodes (N leaves or
        ends, at most N - 1 forks), so steps <= 2 * ceil(tree_tokens / C) + 4N
        (packing, rows, wide pops and merged runs only remove steps). Padding steps
        are no-ops in the scan, cheap next to a compile."""
        return 2 * -(-self.tree_tokens // chunk_len) + 4 * self.sequences


def configured(cls, config, settings: dict):
    """``config`` (default ``cls()``) with ``settings`` replaced: how each engine takes
    ``XEngine(model, config, **settings)``. An unknown setting names the accepted ones."""
    config = cls() if config is None else config
    if not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__}, got {type(config).__name__}")
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"{cls.SECTION}: unknown settings {unknown}; accepted: {accepted}")
    return dataclasses.replace(config, **settings) if settings else config
