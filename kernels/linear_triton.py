"""Skinny matmul y = x @ W^T (+ b) for a few rows as one Triton kernel (the GPU path
of kernels/linear.py at decode batch sizes), with an optional SwiGLU prologue.

Theory of operation: at a handful of rows a projection is a matrix-vector product
bound by reading W once, so the kernel streams W at full bandwidth and treats x as
a tiny operand. Programs split N into blocks of BLOCK_N weight rows; each walks the
whole K axis in BLOCK_K steps, loading a [BLOCK_N, BLOCK_K] tile of W (contiguous
along K, so every load is coalesced) and the matching [16, BLOCK_K] tile of x
(rows past M masked to zero), and accumulates the [16, BLOCK_N] product in float32
with one tensor-core dot per step. No split-K: the grid is N / BLOCK_N programs,
which fills the machine at the model's projection widths, and each output element
is written once without atomics.

With SILU_MUL, x is the fused [M, 2K] gate|up activation of the MLP and the loaded
tile is silu(gate) * up, rounded as `kernels/silu_mul.py` rounds it (silu rounded to
the dtype, then the product), so `silu_mul_linear` equals silu_mul then linear
without writing the [M, K] activation out.

Invariants: W is [N, K] with a contiguous K axis (an nn.Linear weight); x's last axis
is contiguous; M <= MAX_ROWS; y has x's dtype. bfloat16 and float16 are what it is for
(float32 runs too, with exact float32 dots, for the interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 16  # one tensor-core tile of rows


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    x_row_stride,
    w_row_stride,
    y_row_stride,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_tile = w_ptr + rn.to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    x_tile = x_ptr + rm[:, None] * x_row_stride + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        w = tl.load(w_tile + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xm = m_ok[:, None] & k_ok[None, :]
        if SILU_MUL:
            g = tl.load(x_tile + k0, mask=xm, other=0.0)
            u = tl.load(x_tile + K + k0, mask=xm, other=0.0)
            gf = g.to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
            x = (act * u.to(tl.float32)).to(g.dtype)
        else:
            x = tl.load(x_tile + k0, mask=xm, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None] * y_row_stride + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a [n, k] weight. Narrow blocks
    keep the grid many programs deep at the short projections (4096 rows: 256
    programs for 132 SMs on an H200, several resident per SM), so no SM idles through
    a last partial wave; the widest projections take twice the rows per program."""
    return (32 if n >= 32768 else 16), (256 if k >= 256 else 128), 4, 4


def linear_skinny_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (or [M, 2K] gate|up with silu_mul) @ weight[N, K]^T (+ bias) -> [M, N]."""
    assert x.dim() == 2 and weight.dim() == 2
    m = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"linear: x has {x.shape[1]} columns, weight {tuple(weight.shape)}"
                         f"{' (silu_mul: x must be 2*K)' if silu_mul else ''}")  # fmt: skip
    assert m <= MAX_ROWS, f"linear_skinny_triton takes <= {MAX_ROWS} rows, got {m}"
    assert x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_n, block_k, warps, stages = config or skinny_config(n, k)
    pdl = use_pdl(x)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl,
        launch_pdl=pdl,
        num_warps=warps,
        num_stages=stages,
    )
    return y
