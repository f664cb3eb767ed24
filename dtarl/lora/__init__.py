"""LoRA: adapters trained beside a frozen base (``docs/lora.md``).

``dtarl.lora.adapters``: the config, the adapter pytree, the merge and the exact
adapter gradients of any engine (``LoraEngine``); ``dtarl.lora.peft``: PEFT-format
adapter files; ``dtarl.lora.memory``: per-device bytes with and without LoRA.
"""

from dtarl.lora.adapters import (
    ALL_TARGETS,
    TARGET_AXES,
    Adapter,
    LoraBase,
    LoraConfig,
    LoraEngine,
    adapter_grads,
    check_adapters,
    checksum,
    fused_step,
    init_adapters,
    merge,
    merge_adapted,
    merged,
    num_adapter_params,
    path_key,
    target_weights,
    with_weights,
)

__all__ = [
    "ALL_TARGETS",
    "Adapter",
    "LoraBase",
    "LoraConfig",
    "LoraEngine",
    "TARGET_AXES",
    "adapter_grads",
    "check_adapters",
    "checksum",
    "fused_step",
    "init_adapters",
    "merge",
    "merge_adapted",
    "merged",
    "num_adapter_params",
    "path_key",
    "target_weights",
    "with_weights",
]
