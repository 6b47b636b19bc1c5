"""One-row projection y = x @ W^T with the weight streamed through shared memory, its
first tiles requested before the kernel waits on the one launched ahead of it.

Theory of operation: at one row a projection only streams its weight, and in a decode
step the projections alternate with short kernels (norms, rope, attention) whose
latency leaves the memory idle. Under programmatic dependent launch a projection's
programs are resident while the kernel before it still runs, and its weight depends
on nothing, so every weight byte a program can hold before its wait is a byte of
that idle time used. kernels/linear_triton.py holds one tile in registers (about
64 KB an SM); here Triton's software pipeliner turns the weight loads of a K loop
into asynchronous copies into shared memory, STAGES - 1 tiles ahead, and its
prologue (the first STAGES - 1 tiles) comes before the wait, which sits inside the
loop's first step as one pure instruction whose result x's addresses take (Triton
3.9's pipeliner leaves a loop with a side effect in it unpipelined). The activation x is written by the kernel before, so it must not
be pipelined ahead of the wait: it is read with an inline-assembly load the
pipeliner leaves in place (the interpreter, which has no such instruction and no
PDL, reads it plainly).

Off by default (kernels/linear.DEEP_GEMV) until it is timed on a device: compiled
for sm_90a with Triton 3.6, the default tile (4 rows x 512, 8 stages, 4 warps) takes
40 registers and 28 KB of shared memory, so 7 programs an SM hold 196 KB of weight
in flight before their wait, against 64 KB for the register GEMV's 8 programs; every
asynchronous copy of the prologue comes before griddepcontrol.wait in its PTX.

Invariants: W is [N, K] with a contiguous K axis; x is one contiguous row of K; y
has x's dtype. Results equal kernels/linear_triton.py's within float32 summation
order (another tile width, another order).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import pdl_args, use_pdl

CONFIG = (4, 512, 8, 4)  # BLOCK_N, BLOCK_K, STAGES, num_warps
X_AHEAD = True  # read x a K step ahead of its use (its L2 latency off the step's path)


@triton.jit
def _load_x(ptr, ASM: tl.constexpr):
    """x's elements at ptr, as bfloat16/float16/float32, kept out of the pipeliner."""
    if ASM:
        if ptr.dtype.element_ty == tl.float32:
            return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptr],
                                             dtype=tl.float32, is_pure=False, pack=1)  # fmt: skip
        return tl.inline_asm_elementwise("ld.global.b16 $0, [$1];", "=h,l", [ptr],
                                         dtype=ptr.dtype.element_ty, is_pure=False, pack=1)  # fmt: skip
    return tl.load(ptr)


@triton.jit
def _wait_at_first_step(k0, USE_PDL: tl.constexpr):
    """0, after waiting on the grid before this one at the loop's first step (k0 == 0)
    and letting the next be scheduled (pdl.pdl_enter's order). One pure instruction
    whose result the x loads' addresses take, so the pipeliner sees no side effect in
    the loop (a Triton 3.9 pipeliner leaves such a loop alone) and nothing reading x
    can move ahead of it."""
    if USE_PDL == 2:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.eq.s32 p, $1, 0; @p griddepcontrol.launch_dependents; "
            "@p griddepcontrol.wait; mov.u32 $0, 0; }",
            "=r,r", [k0], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    elif USE_PDL:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.eq.s32 p, $1, 0; @p griddepcontrol.wait; "
            "@p griddepcontrol.launch_dependents; mov.u32 $0, 0; }",
            "=r,r", [k0], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    else:
        return k0 * 0


@triton.jit
def _x_step(x_ptr, k0, rk, K, ASM: tl.constexpr):
    """x[k0 : k0 + BLOCK_K] in float32, zero past K."""
    x = _load_x(x_ptr + tl.minimum(k0 + rk, K - 1), ASM)
    return tl.where((k0 + rk) < K, x.to(tl.float32), 0.0)


@triton.jit
def _deep_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, w_row_stride, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr,
                      ASM: tl.constexpr, X_AHEAD: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_tile = w_ptr + rn.to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    x = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_tile + k0, mask=n_ok[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        xs = x_ptr + _wait_at_first_step(k0, USE_PDL)
        if X_AHEAD:  # the next step's x requested now, used a step later
            if k0 == 0:
                x = _x_step(xs, 0, rk, K, ASM)
            x_next = _x_step(xs, k0 + BLOCK_K, rk, K, ASM)
        else:
            x = _x_step(xs, k0, rk, K, ASM)
            x_next = x
        acc += w.to(tl.float32) * x[None, :]
        x = x_next
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


def deep_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    config: tuple[int, int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T -> [1, N] (the module docstring's kernel)."""
    assert x.dim() == 2 and weight.dim() == 2
    n, k = weight.shape
    if x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(
            f"deep_gemv: x {tuple(x.shape)} must be one row of K, weight {tuple(weight.shape)}"
        )
    assert x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block_n, block_k, stages, warps = config or CONFIG
    pdl = use_pdl(x) if pdl is None else pdl
    _deep_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        ASM=x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1", X_AHEAD=X_AHEAD,
        num_warps=warps,
        **pdl_args(pdl),
    )  # fmt: skip
    return y
