"""Warming L2 with the next projection's weight while a decode step's short kernels run.

Theory of operation: at a handful of rows a decode step is a chain of weight streams
(the projections' GEMVs) and short kernels between them (norms, rope and the KV store,
attention and its merge, the SwiGLU) that read almost nothing. While a short kernel
runs, HBM idles; the next GEMV then starts its stream from cold. `prefetch_weight`,
launched right after a GEMV, asks the copy engines of a few SMs (Hopper's bulk
prefetch, `cp.async.bulk.prefetch.L2`) to pull the first `PREFETCH_BYTES` of the next
weight into L2 and returns; the GEMV after the short kernels finds those lines there.
Nothing is computed, so results are bit-identical with it on or off; the reference is
to do nothing, which is what the CPU path does.

The kernel takes part in programmatic dependent launch (kernels/pdl.py) in its own
order: it lets its dependents launch first, issues the prefetches (they depend on no
other kernel: weights are never written during a step), then waits for the grid before
it, so the chain's invariant holds (a grid ends only after every grid before it) and
the prefetch overlaps the tail of the GEMV it follows.

Off by default (`PREFETCH_BYTES = 0`) until a whole step measures faster with it.

Invariants: the weight is contiguous and 16-byte aligned (a torch allocation); only
whole 16-byte units are prefetched; launched only where `pdl.use_pdl` holds (Hopper
or later, not the interpreter), since both the bulk prefetch and the launch order need
sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import use_pdl

PREFETCH_BYTES = 0  # bytes of the next weight to warm (0: off); capped by the weight's size
CHUNK = 16 << 10  # bytes per bulk prefetch (one thread issues one)
BLOCK = 32  # prefetches per program (one warp)


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    start = i * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)  # <= 0 past the end
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2;"
        " mov.u32 $0, 0; }",
        "=r,l,r",
        [base_ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.extra.cuda.gdc_wait()


def prefetch_bytes(weight: torch.Tensor) -> int:
    """How much of weight `prefetch_weight` warms: PREFETCH_BYTES capped by its size, in
    whole 16-byte units."""
    return min(PREFETCH_BYTES, weight.numel() * weight.element_size()) // 16 * 16


def prefetch_weight(weight: torch.Tensor) -> None:
    """Start pulling the first `prefetch_bytes(weight)` of weight into L2 (module
    docstring); a no-op off Hopper, under the interpreter, or with PREFETCH_BYTES 0."""
    nbytes = prefetch_bytes(weight)
    if nbytes == 0 or not use_pdl(weight):
        return
    assert weight.is_contiguous() and weight.data_ptr() % 16 == 0
    grid = (triton.cdiv(nbytes, CHUNK * BLOCK),)
    _l2_prefetch_kernel[grid](
        weight.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=1,
        launch_pdl=True,
    )  # fmt: skip
