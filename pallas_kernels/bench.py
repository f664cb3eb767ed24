"""Benchmark chunk_attention against jax.nn.dot_product_attention ('xla', 'cudnn').

Meant for a GPU (the Pallas kernel's default block sizes are unmeasured
guesses until this has been run on one); on CPU it runs in interpret mode at
tiny shapes only, as a smoke test.

    python -m pallas_kernels.bench --C 512 --prefix 2048          # GPU
    python -m pallas_kernels.bench --C 16 --prefix 16 --Hq 2 --Hkv 1 --D 16 --interpret

Letters as in chunk_attention: B batch, C chunk, P prefix, S = P + C keys,
Hq/Hkv heads, D head dim.

TFLOP/s counts *useful* work only, the same for every implementation: the
visible (query, key) pairs of the bottom-right aligned causal mask, i.e.
``pairs = sum_i (P + i + 1)``, times ``4 * D * Hq * B`` for the forward
(QK^T and PV) and 2.5x that for the backward (five matmuls instead of two).
The dense baselines compute all C*S pairs, so their number understates the
FLOPs they execute but states the speed the user gets.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_attention import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    chunk_attention,
)

__all__ = ["bench"]


def _time_ms(fn, args, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(
    C,
    prefix,
    Hq=32,
    Hkv=8,
    D=128,
    dtype=jnp.bfloat16,
    *,
    B=1,
    block_q=DEFAULT_BLOCK_Q,
    block_k=DEFAULT_BLOCK_K,
    interpret=None,
    impls=("pallas", "xla", "cudnn"),
    backward=True,
    iters=20,
    warmup=2,
    verbose=True,
):
    """Time forward (and forward+backward) of one chunk-over-prefix attention.

    Returns ``{impl: {"fwd_ms", "fwd_tflops"[, "fwdbwd_ms", "fwdbwd_tflops"]}}``,
    or ``{impl: {"error": message}}`` for an implementation that is
    unavailable here (e.g. cuDNN on CPU, or cuDNN rejecting the explicit mask).
    """
    S = prefix + C
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q_BxCxHqxD = jax.random.normal(kq, (B, C, Hq, D), dtype)
    k_BxSxHkvxD = jax.random.normal(kk, (B, S, Hkv, D), dtype)
    v_BxSxHkvxD = jax.random.normal(kv, (B, S, Hkv, D), dtype)
    start_B = jnp.full((B,), prefix, jnp.int32)
    kv_len_B = jnp.full((B,), S, jnp.int32)
    # Explicit bottom-right aligned causal mask for the dense baselines.
    mask_Bx1xCxS = (jnp.arange(S)[None, :] <= prefix + jnp.arange(C)[:, None])[None, None]
    mask_Bx1xCxS = jnp.broadcast_to(mask_Bx1xCxS, (B, 1, C, S))

    pairs = C * prefix + C * (C + 1) // 2
    fwd_flops = 4.0 * pairs * D * Hq * B
    bwd_flops = 2.5 * fwd_flops

    def make(impl):
        if impl == "pallas":
            return lambda q, k, v: chunk_attention(
                q, k, v, start_B, kv_len_B, block_q=block_q, block_k=block_k, interpret=interpret
            )
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask_Bx1xCxS, implementation=impl
        )

    args = (q_BxCxHqxD, k_BxSxHkvxD, v_BxSxHkvxD)
    results = {}
    for impl in impls:
        attn = make(impl)
        fwd = jax.jit(attn)
        grad = jax.jit(
            jax.grad(
                lambda q, k, v, f=attn: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)
            )
        )
        try:
            ms = _time_ms(fwd, args, iters, warmup)
            row = {"fwd_ms": ms, "fwd_tflops": fwd_flops / (ms * 1e-3) / 1e12}
            if backward:
                ms = _time_ms(grad, args, iters, warmup)
                row.update(fwdbwd_ms=ms, fwdbwd_tflops=(fwd_flops + bwd_flops) / (ms * 1e-3) / 1e12)
        except Exception as e:  # noqa: BLE001 - report, don't crash the sweep
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        results[impl] = row
    if verbose:
        print(
            f"chunk attention B={B} C={C} P={prefix} Hq={Hq} Hkv={Hkv} D={D} "
            f"{jnp.dtype(dtype).name} on {jax.devices()[0].device_kind}"
        )
        for impl, row in results.items():
            if "error" in row:
                print(f"  {impl:7s} unavailable: {row['error']}")
                continue
            line = f"  {impl:7s} fwd {row['fwd_ms']:9.3f} ms {row['fwd_tflops']:8.2f} TFLOP/s"
            if "fwdbwd_ms" in row:
                line += f" | fwd+bwd {row['fwdbwd_ms']:9.3f} ms {row['fwdbwd_tflops']:8.2f} TFLOP/s"
            print(line)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--C", type=int, nargs="+", default=[128, 512])
    p.add_argument("--prefix", type=int, nargs="+", default=[0, 1024, 4096])
    p.add_argument("--Hq", type=int, default=32)
    p.add_argument("--Hkv", type=int, default=8)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--block-q", type=int, default=DEFAULT_BLOCK_Q)
    p.add_argument("--block-k", type=int, default=DEFAULT_BLOCK_K)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--interpret", action="store_true")
    a = p.parse_args(argv)
    for C in a.C:
        for prefix in a.prefix:
            bench(
                C,
                prefix,
                a.Hq,
                a.Hkv,
                a.D,
                jnp.dtype(a.dtype),
                B=a.B,
                block_q=a.block_q,
                block_k=a.block_k,
                interpret=True if a.interpret else None,
                iters=a.iters,
            )


if __name__ == "__main__":
    main()
