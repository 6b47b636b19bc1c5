"""The bulk L2 prefetch kernel behind kernels/l2_prefetch.py (its docstring says why and
when; the reference is to do nothing). One thread issues one `cp.async.bulk.prefetch.L2`
of CHUNK bytes; BLOCK threads (one warp) per program. It lets its dependents launch,
prefetches, then waits for the grid before it, so the PDL chain keeps its order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import use_pdl

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


def l2_prefetch_triton(weight: torch.Tensor, nbytes: int) -> None:
    """Prefetch weight's first nbytes (a multiple of 16) into L2; a no-op where
    `pdl.use_pdl` does not hold (before Hopper, under the interpreter)."""
    if nbytes == 0 or not use_pdl(weight):
        return
    assert weight.is_contiguous() and weight.data_ptr() % 16 == 0 and nbytes % 16 == 0
    grid = (triton.cdiv(nbytes, CHUNK * BLOCK),)
    _l2_prefetch_kernel[grid](
        weight.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=1,
        launch_pdl=True,
    )  # fmt: skip
