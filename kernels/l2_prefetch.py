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

Off by default (`PREFETCH_BYTES = 0`) until a whole step measures faster with it. The
kernel is in kernels/l2_prefetch_triton.py, imported only when a prefetch is launched,
so the model's import pulls in no Triton.

Invariants: the weight is contiguous and 16-byte aligned (a torch allocation); only
whole 16-byte units are prefetched; launched only where `pdl.use_pdl` holds (Hopper
or later, not the interpreter), since both the bulk prefetch and the launch order need
sm_90.
"""

from __future__ import annotations

import torch

PREFETCH_BYTES = 0  # bytes of the next weight to warm (0: off); capped by the weight's size


def prefetch_bytes(weight: torch.Tensor) -> int:
    """How much of weight `prefetch_weight` warms: PREFETCH_BYTES capped by its size, in
    whole 16-byte units."""
    return min(PREFETCH_BYTES, weight.numel() * weight.element_size()) // 16 * 16


def prefetch_weight(weight: torch.Tensor) -> None:
    """Start pulling the first `prefetch_bytes(weight)` of weight into L2 (module
    docstring); a no-op off Hopper, under the interpreter, or with PREFETCH_BYTES 0."""
    nbytes = prefetch_bytes(weight)
    if nbytes == 0 or not weight.is_cuda:
        return
    from shunter.kernels.l2_prefetch_triton import l2_prefetch_triton

    l2_prefetch_triton(weight, nbytes)
