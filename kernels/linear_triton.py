"""Matrix-vector projection y = x @ W^T (+ b) for a few rows as one Triton kernel (the
GPU path of kernels/linear.py at decode batch sizes), with the operation before it
folded into its operand load: SwiGLU (the MLP's down projection) or RMSNorm with the
residual add (the qkv and gate/up projections after a layer's norms).

Theory of operation: at a handful of rows a projection only streams its weight, so
the kernel is a bandwidth kernel, not a tensor-core one. Programs split N into blocks
of BLOCK_N weight rows; each walks the K axis in BLOCK_K steps, loading a
[BLOCK_N, BLOCK_K] tile of W (contiguous along K, so every load is coalesced) and
multiplying it elementwise into float32 accumulators summed over K once at the end
(no per-step reductions). A plain projection keeps one [BLOCK_N, BLOCK_K] accumulator
per row (up to four) in W's register layout and reads x straight into that layout, so
its loop moves nothing through shared memory; with a prologue the operand is computed
as [BLOCK_M, BLOCK_K] and meets W in a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator. The tile of step
i + 1 is requested before step i's multiply, and the first tile before the kernel
waits on the one launched ahead of it (programmatic dependent launch: the weights do
not depend on it), so a program always has a tile in flight and the weight stream of
one projection starts while the previous kernel drains.

Prologues, computed per program from the activations (which stay in L2 across the
grid):
- SILU_MUL: x is the [M, 2K] gate|up activation; the operand is silu(gate) * up,
  rounded as kernels/silu_mul.py rounds it.
- RMSNORM: the operand is rmsnorm(s) * norm_w with s = x, or with a residual
  s = round(x + residual) (fused add); each program first takes the mean square of s
  over K, then normalizes its tiles as kernels/rmsnorm.py orders the roundings.
  Program 0 writes s to a new tensor (the layer's residual stream; x and residual
  are left as they are, since other programs still read them).

Invariants: W is [N, K] with a contiguous K axis (an nn.Linear weight); x, residual
and the norm weight have a contiguous last axis; M <= MAX_ROWS; y has x's dtype.
bfloat16 and float16 are what it is for; float32 runs too (interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import use_pdl

MAX_ROWS = 4  # rows per program, all of a decode step's: W is read once

PLAIN, SILU_MUL, RMSNORM, ADD_RMSNORM = 0, 1, 2, 3  # the prologue
_PLAIN, _SILU_MUL, _RMSNORM, _ADD_RMSNORM = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2),
                                              tl.constexpr(3))  # in kernels  # fmt: skip


@triton.jit
def _plain_row(y_ptr, b_ptr, acc, rn, n_ok, row, M, y_row_stride, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * y_row_stride + rn,
        y.to(y_ptr.dtype.element_ty),
        mask=n_ok & (rn * 0 + row < M),
    )


@triton.jit
def _gemv_plain(x_ptr, w, w_tile, b_ptr, y_ptr, rn, rk, n_ok, M, K, x_row_stride, y_row_stride,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """The main loop without a prologue. x is read straight into W's tile layout (every
    program row of a column reads the same address, served by L1), so the loop keeps
    16-byte weight loads and moves nothing through shared memory; one accumulator per
    row (up to four) keeps the registers at what one row needs."""
    zero = (rn * 0)[:, None]
    kz = (rk * 0)[None, :]  # row masks as tensors (a scalar bool is no mask)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        nxt = k0 + BLOCK_K + rk
        w_next = tl.load(w_tile + k0 + BLOCK_K, mask=n_ok[:, None] & (nxt < K)[None, :], other=0.0)
        wf = w.to(tl.float32)
        xk = x_ptr + k0 + zero + rk[None, :]
        k_ok = ((k0 + rk) < K)[None, :]
        acc0 += wf * tl.load(xk, mask=k_ok, other=0.0).to(tl.float32)
        if BLOCK_M > 1:
            x1 = tl.load(xk + x_row_stride, mask=k_ok & (kz + 1 < M), other=0.0)
            acc1 += wf * x1.to(tl.float32)
        if BLOCK_M > 2:
            x2 = tl.load(xk + 2 * x_row_stride, mask=k_ok & (kz + 2 < M), other=0.0)
            x3 = tl.load(xk + 3 * x_row_stride, mask=k_ok & (kz + 3 < M), other=0.0)
            acc2 += wf * x2.to(tl.float32)
            acc3 += wf * x3.to(tl.float32)
        w = w_next
    _plain_row(y_ptr, b_ptr, acc0, rn, n_ok, 0, M, y_row_stride, HAS_BIAS)
    if BLOCK_M > 1:
        _plain_row(y_ptr, b_ptr, acc1, rn, n_ok, 1, M, y_row_stride, HAS_BIAS)
    if BLOCK_M > 2:
        _plain_row(y_ptr, b_ptr, acc2, rn, n_ok, 2, M, y_row_stride, HAS_BIAS)
        _plain_row(y_ptr, b_ptr, acc3, rn, n_ok, 3, M, y_row_stride, HAS_BIAS)


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    x_row_stride,
    res_row_stride,
    res_out_row_stride,
    w_row_stride,
    y_row_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_tile = w_ptr + rn.to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    w = tl.load(w_tile, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PROLOGUE == _PLAIN:  # one [BLOCK_N, BLOCK_K] accumulator per row, in W's layout
        _gemv_plain(x_ptr, w, w_tile, b_ptr, y_ptr, rn, rk, n_ok, M, K, x_row_stride,
                    y_row_stride, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        x_rows = x_ptr + rm[:, None] * x_row_stride
        res_rows = res_ptr + rm[:, None] * res_row_stride
        if PROLOGUE >= _RMSNORM:
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xm = m_ok[:, None] & ((k0 + rk) < K)[None, :]
                s = tl.load(x_rows + k0 + rk[None, :], mask=xm, other=0.0)
                if PROLOGUE == _ADD_RMSNORM:
                    r = tl.load(res_rows + k0 + rk[None, :], mask=xm, other=0.0)
                    s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
                    if pid == 0:
                        out_rows = res_out_ptr + rm[:, None] * res_out_row_stride
                        tl.store(out_rows + k0 + rk[None, :], s, mask=xm)
                sf = s.to(tl.float32)
                ss += tl.sum(sf * sf, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            nxt = k0 + BLOCK_K + rk
            w_next = tl.load(
                w_tile + k0 + BLOCK_K, mask=n_ok[:, None] & (nxt < K)[None, :], other=0.0
            )
            xm = m_ok[:, None] & k_ok[None, :]
            if PROLOGUE == _SILU_MUL:
                g = tl.load(x_rows + k0 + rk[None, :], mask=xm, other=0.0)
                u = tl.load(x_rows + K + k0 + rk[None, :], mask=xm, other=0.0)
                gf = g.to(tl.float32)
                act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
                xv = (act * u.to(tl.float32)).to(g.dtype)
            else:  # (add +) RMSNorm
                s = tl.load(x_rows + k0 + rk[None, :], mask=xm, other=0.0)
                if PROLOGUE == _ADD_RMSNORM:
                    r = tl.load(res_rows + k0 + rk[None, :], mask=xm, other=0.0)
                    s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
                normed = (s.to(tl.float32) * rstd[:, None]).to(s.dtype).to(tl.float32)
                nw = tl.load(norm_w_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                xv = (normed * nw[None, :]).to(s.dtype)
            acc += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
            w = w_next
        y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_out = y_ptr + rm[:, None] * y_row_stride + rn[None, :]
        tl.store(y_out, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv_config(n: int, k: int, prologue: int = PLAIN) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [n, k] weight: 4 x 512 tiles of W keep the
    short projections (4096-6144 rows) several programs deep on every SM; a prologue
    re-reads the activations in every program, so those take 16-row blocks (a quarter
    of the programs, a quarter of the re-reads)."""
    block_k = 512 if k >= 512 else triton.next_power_of_2(max(k, 16))
    if prologue != PLAIN:
        return 16, block_k, 8
    return 4, block_k, 4


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prologue: int,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and weight.dim() == 2
    m = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != (2 * k if prologue == SILU_MUL else k):
        raise ValueError(f"linear: x has {x.shape[1]} columns, weight {tuple(weight.shape)}"
                         f"{' (silu_mul: x must be 2*K)' if prologue == SILU_MUL else ''}")  # fmt: skip
    assert m <= MAX_ROWS, f"the GEMV kernel takes <= {MAX_ROWS} rows, got {m}"
    assert x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = None
    if prologue == ADD_RMSNORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        res_out = torch.empty_like(x)
    if prologue >= RMSNORM:
        assert norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if m == 0 or n == 0:
        if res_out is not None:
            torch.add(x, residual, out=res_out)
        return y, res_out
    block_n, block_k, warps = config or gemv_config(n, k, prologue)
    pdl = use_pdl(x) if pdl is None else pdl
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else y,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        res_out.stride(0) if res_out is not None else 0,
        weight.stride(0),
        y.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        launch_pdl=pdl,
        num_warps=warps,
    )
    return y, res_out


def linear_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (or [M, 2K] gate|up with silu_mul) @ weight[N, K]^T (+ bias) -> [M, N]."""
    prologue = SILU_MUL if silu_mul else PLAIN
    return _launch(x, weight, bias, prologue, config=config, pdl=pdl)[0]


def norm_linear_gemv_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s) * norm_weight) @ weight^T (+ bias) and s, where s = x + residual
    (rounded to x's dtype) or x when residual is None. x and residual are unchanged."""
    prologue = ADD_RMSNORM if residual is not None else RMSNORM
    y, res_out = _launch(x, weight, bias, prologue, residual, norm_weight, eps, config, pdl)
    return y, res_out if res_out is not None else x
