"""Pick the chunk-attention Pallas kernel for a platform (``AttentionBackend.PALLAS``).

* ``gpu`` (CUDA; ROCm untested): :func:`pallas_kernels.chunk_attention.chunk_attention`,
  the Triton-style kernel, compiled.
* ``tpu``: :func:`pallas_kernels.chunk_attention_tpu.chunk_attention_tpu`, the
  Mosaic kernel, compiled.
* ``cpu``: no native kernel; the GPU kernel runs in Pallas interpret mode (the
  tests' path). Pass ``platform="tpu"`` on a CPU to run the TPU kernel in TPU
  interpret mode instead.

Any other platform raises an error naming it (use the ``xla`` backend there,
which is also the default everywhere).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.chunk_attention import chunk_attention
from pallas_kernels.chunk_attention_tpu import chunk_attention_tpu

__all__ = ["KERNELS", "chunk_attention_for_platform"]

# Target platform -> kernel; "cpu" has none of its own.
KERNELS = {"gpu": chunk_attention, "tpu": chunk_attention_tpu}


def chunk_attention_for_platform(platform: str | None = None):
    """The chunk-attention kernel for ``platform`` (default: ``jax.default_backend()``).

    Returns a callable with :func:`~pallas_kernels.chunk_attention.chunk_attention`'s
    signature whose ``interpret`` is fixed: compiled when the running backend
    is the kernel's platform, interpret mode when running on a CPU.
    """
    running = jax.default_backend()
    target = running if platform is None else platform
    if target == "cpu":
        target = "gpu"  # the CPU default: the GPU kernel, interpreted
    if target not in KERNELS:
        raise NotImplementedError(
            f"AttentionBackend.PALLAS has no kernel for platform {target!r} "
            f"(kernels: {sorted(KERNELS)}, plus 'cpu' in interpret mode); use "
            f"attention_backend='xla' there."
        )
    if running == target:
        interpret = False
    elif running == "cpu":
        interpret = True
    else:
        raise NotImplementedError(
            f"the {target!r} chunk-attention kernel cannot run on platform {running!r} "
            f"(only natively, or in interpret mode on 'cpu')."
        )
    return functools.partial(KERNELS[target], interpret=interpret)
