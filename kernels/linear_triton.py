"""Matrix-vector projection y = x @ W^T (+ b) for a few rows as one Triton kernel (the
GPU path of kernels/linear.py at decode batch sizes), with the operation before it
folded into its operand load: SwiGLU (the MLP's down projection) or RMSNorm with the
residual add (the qkv and gate/up projections after a layer's norms).

Theory of operation: at a handful of rows a projection only streams its weight, so
the kernel is a bandwidth kernel, not a tensor-core one. Programs split N into blocks
of BLOCK_N weight rows; each walks the K axis in BLOCK_K steps, loading a
[BLOCK_N, BLOCK_K] tile of W (contiguous along K, so every load is coalesced) and
multiplying it elementwise into one float32 [BLOCK_N, BLOCK_K] accumulator per row
(up to four, in W's register layout), summed over K once at the end (no per-step
reductions). A plain x is read straight into W's layout, so that loop moves nothing
through shared memory; a prologue's operand is computed once per row and step as a
[BLOCK_K] vector and broadcast over the tile. The tile of step
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

Epilogue (`gate_up_swiglu_gemv_triton`, one row): W is the MLP's [2N, K] gate|up weight
and a program takes weight row n of each half, so it holds gate[n] and up[n] and
stores silu(gate[n]) * up[n]: the gate/up projection and the SwiGLU in one launch,
with the GEMV's tiles and summation order and kernels/silu_mul.py's roundings, so the
result equals the two kernels' bit for bit. No program re-reads anything.

Invariants: W is [N, K] with a contiguous K axis (an nn.Linear weight); x, residual
and the norm weight have a contiguous last axis; M <= MAX_ROWS; y has x's dtype.
bfloat16 and float16 are what it is for; float32 runs too (interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import pdl_args, pdl_enter, use_pdl

MAX_ROWS = 4  # rows per program, all of a decode step's: W is read once
# The weight loads' L2 eviction policy ("" the default, "evict_first", "evict_last"): a
# step reads each weight once, so "evict_first" might keep them from displacing the
# activations and the KV in L2. Measured on an H200, a bs=1 step ran 0.987x with it
# (BENCHMARKS.md), so the default stays.
WEIGHT_EVICTION = ""
SMALL_K_TILE = (1, 4)  # (rows, warps) of a program for K <= 4096 (K in one tile)
LONG_K_TILE = (1, 512, 4)  # (rows, BLOCK_K, warps) beyond

PLAIN, SILU_MUL, RMSNORM, ADD_RMSNORM = 0, 1, 2, 3  # the prologue
_PLAIN, _SILU_MUL, _RMSNORM, _ADD_RMSNORM = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2),
                                              tl.constexpr(3))  # in kernels  # fmt: skip


@triton.jit
def _store_row(y_ptr, b_ptr, acc, rn, n_ok, row, M, y_row_stride, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * y_row_stride + rn,
        y.to(y_ptr.dtype.element_ty),
        mask=n_ok & (rn * 0 + row < M),
    )


@triton.jit
def _operand(x_ptr, res_ptr, norm_w_ptr, row, k0, zero, kz, rk, M, K, x_row_stride,
             res_row_stride, rstd, PROLOGUE: tl.constexpr):  # fmt: skip
    """Row `row`'s operand over columns k0 .. k0 + BLOCK_K, in float32, shaped to
    broadcast against W's [BLOCK_N, BLOCK_K] tile. A plain x is loaded straight into
    W's layout (the programs' rows of a column read one address, served by L1); a
    prologue is computed once as a [BLOCK_K] vector, rounded as its own kernel rounds."""
    x_row = x_ptr + row * x_row_stride
    if PROLOGUE == _PLAIN:
        ok = ((k0 + rk) < K)[None, :] & (kz + row < M)
        op = tl.load(x_row + k0 + zero + rk[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        ok = ((k0 + rk) < K) & (rk * 0 + row < M)
        if PROLOGUE == _SILU_MUL:  # x is [M, 2K]: gate | up
            g = tl.load(x_row + k0 + rk, mask=ok, other=0.0)
            u = tl.load(x_row + K + k0 + rk, mask=ok, other=0.0)
            gf = g.to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
            xv = (act * u.to(tl.float32)).to(g.dtype)
        else:  # (add +) RMSNorm
            s = tl.load(x_row + k0 + rk, mask=ok, other=0.0)
            if PROLOGUE == _ADD_RMSNORM:
                r = tl.load(res_ptr + row * res_row_stride + k0 + rk, mask=ok, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
            normed = (s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32)
            nw = tl.load(norm_w_ptr + k0 + rk, mask=ok, other=0.0).to(tl.float32)
            xv = (normed * nw).to(s.dtype)
        op = xv.to(tl.float32)[None, :]
    return op


@triton.jit
def _row_rstd(rstd, rm, row):
    """Row `row`'s entry of the [BLOCK_M] rstd vector, as a scalar."""
    return tl.sum(tl.where(rm == row, rstd, 0.0), 0)


@triton.jit
def _gemv_rows(x_ptr, res_ptr, norm_w_ptr, w, w_tile, b_ptr, y_ptr, rn, rk, n_ok, M, K,
               x_row_stride, res_row_stride, y_row_stride, r0, r1, r2, r3,
               PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_EVICT: tl.constexpr):  # fmt: skip
    """The main loop: one [BLOCK_N, BLOCK_K] float32 accumulator per row (up to four)
    in W's register layout, so the weight stream keeps its 16-byte loads and the
    registers stay at what one row needs; r0..r3: the rows' rstd (RMSNorm)."""
    zero = (rn * 0)[:, None]
    kz = (rk * 0)[None, :]  # row masks as tensors (a scalar bool is no mask)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        nxt = k0 + BLOCK_K + rk
        w_next = tl.load(w_tile + k0 + BLOCK_K, mask=n_ok[:, None] & (nxt < K)[None, :], other=0.0,
                         eviction_policy=W_EVICT)  # fmt: skip
        wf = w.to(tl.float32)
        acc0 += wf * _operand(x_ptr, res_ptr, norm_w_ptr, 0, k0, zero, kz, rk, M, K,
                              x_row_stride, res_row_stride, r0, PROLOGUE)  # fmt: skip
        if BLOCK_M > 1:
            acc1 += wf * _operand(x_ptr, res_ptr, norm_w_ptr, 1, k0, zero, kz, rk, M, K,
                                  x_row_stride, res_row_stride, r1, PROLOGUE)  # fmt: skip
        if BLOCK_M > 2:
            acc2 += wf * _operand(x_ptr, res_ptr, norm_w_ptr, 2, k0, zero, kz, rk, M, K,
                                  x_row_stride, res_row_stride, r2, PROLOGUE)  # fmt: skip
            acc3 += wf * _operand(x_ptr, res_ptr, norm_w_ptr, 3, k0, zero, kz, rk, M, K,
                                  x_row_stride, res_row_stride, r3, PROLOGUE)  # fmt: skip
        w = w_next
    _store_row(y_ptr, b_ptr, acc0, rn, n_ok, 0, M, y_row_stride, HAS_BIAS)
    if BLOCK_M > 1:
        _store_row(y_ptr, b_ptr, acc1, rn, n_ok, 1, M, y_row_stride, HAS_BIAS)
    if BLOCK_M > 2:
        _store_row(y_ptr, b_ptr, acc2, rn, n_ok, 2, M, y_row_stride, HAS_BIAS)
        _store_row(y_ptr, b_ptr, acc3, rn, n_ok, 3, M, y_row_stride, HAS_BIAS)


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
    W_EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_tile = w_ptr + rn.to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    w = tl.load(w_tile, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0, eviction_policy=W_EVICT)
    pdl_enter(USE_PDL)
    if PROLOGUE >= _RMSNORM:  # each row's rstd, and program 0 writes the residual stream
        x_rows = x_ptr + rm[:, None] * x_row_stride
        res_rows = res_ptr + rm[:, None] * res_row_stride
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
        r0 = _row_rstd(rstd, rm, 0)
        r1 = _row_rstd(rstd, rm, 1)
        r2 = _row_rstd(rstd, rm, 2)
        r3 = _row_rstd(rstd, rm, 3)
    else:
        r0 = 1.0
        r1 = 1.0
        r2 = 1.0
        r3 = 1.0
    _gemv_rows(x_ptr, res_ptr, norm_w_ptr, w, w_tile, b_ptr, y_ptr, rn, rk, n_ok, M, K,
               x_row_stride, res_row_stride, y_row_stride, r0, r1, r2, r3,
               PROLOGUE, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, W_EVICT)  # fmt: skip


@triton.jit
def _two_row_sums(x_ptr, t1, t2, ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_PDL: tl.constexpr, W_EVICT: tl.constexpr):  # fmt: skip
    """x [K] dotted with two sets of BLOCK_N weight rows, whose [BLOCK_N, BLOCK_K] tile
    pointers at k = 0 are t1 and t2 (rows masked by ok): float32 [BLOCK_N] each, summed
    as the GEMV sums. The first tiles load before the PDL wait (the epilogue kernels'
    shared main loop)."""
    rk = tl.arange(0, BLOCK_K)
    m = ok[:, None] & (rk < K)[None, :]
    w1 = tl.load(t1, mask=m, other=0.0, eviction_policy=W_EVICT)
    w2 = tl.load(t2, mask=m, other=0.0, eviction_policy=W_EVICT)
    pdl_enter(USE_PDL)
    zero = tl.zeros((BLOCK_N, 1), dtype=tl.int32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m = ok[:, None] & ((k0 + BLOCK_K + rk) < K)[None, :]
        w1_next = tl.load(t1 + k0 + BLOCK_K, mask=m, other=0.0, eviction_policy=W_EVICT)
        w2_next = tl.load(t2 + k0 + BLOCK_K, mask=m, other=0.0, eviction_policy=W_EVICT)
        op = tl.load(x_ptr + k0 + zero + rk[None, :], mask=((k0 + rk) < K)[None, :], other=0.0)
        op = op.to(tl.float32)
        acc1 += w1.to(tl.float32) * op
        acc2 += w2.to(tl.float32) * op
        w1 = w1_next
        w2 = w2_next
    return tl.sum(acc1, axis=1), tl.sum(acc2, axis=1)


@triton.jit
def _gemv_swiglu_kernel(x_ptr, w_ptr, y_ptr, N, K, w_row_stride, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                        W_EVICT: tl.constexpr):  # fmt: skip
    """One row x [K]: y[n] = silu(g[n]) * u[n] for g, u = x @ W[n]^T, x @ W[N + n]^T,
    each rounded to y's dtype as the GEMV stores it, then rounded as silu_mul does."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    g_tile = w_ptr + rn.to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    u_tile = w_ptr + (rn + N).to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    g, u = _two_row_sums(x_ptr, g_tile, u_tile, n_ok, K, BLOCK_N, BLOCK_K, USE_PDL, W_EVICT)
    dt = y_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + rn, (act * u).to(dt), mask=n_ok)


def gemv_config(n: int, k: int, prologue: int = PLAIN) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [n, k] weight. A plain load takes one weight
    row per program: for K up to 4096 the row in one tile (the loop is a single step
    and every program's whole read is in flight at once), for longer K 512-wide steps
    (many short programs per SM). Measured on an H200 with Llama-3.1-8B's bs=1
    projections (BENCHMARKS.md), against the 4 x 512 tiles used before: qkv 1.23x,
    o 1.07x, down 1.10x, the bs=1 step 1.034x. A prologue re-reads the activations in
    every program, so those take 16-row blocks (a quarter of the programs, a quarter
    of the re-reads)."""
    if prologue != PLAIN:
        return 16, 512 if k >= 512 else triton.next_power_of_2(max(k, 16)), 8
    if k <= 4096:
        return SMALL_K_TILE[0], triton.next_power_of_2(max(k, 16)), SMALL_K_TILE[1]
    return LONG_K_TILE


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
    eviction: str | None = None,
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
        num_warps=warps,
        W_EVICT=WEIGHT_EVICTION if eviction is None else eviction,
        **pdl_args(pdl),
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
    eviction: str | None = None,
) -> torch.Tensor:
    """x [M, K] (or [M, 2K] gate|up with silu_mul) @ weight[N, K]^T (+ bias) -> [M, N].
    `eviction`: the weight loads' policy (default WEIGHT_EVICTION)."""
    prologue = SILU_MUL if silu_mul else PLAIN
    return _launch(x, weight, bias, prologue, config=config, pdl=pdl, eviction=eviction)[0]


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


def gate_up_swiglu_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """silu_mul(x @ weight^T) for one row: x [1, K], weight [2N, K] (gate | up) -> [1, N],
    in one launch (the module docstring's epilogue)."""
    assert x.dim() == 2 and weight.dim() == 2
    n2, k = weight.shape
    if x.shape[0] != 1 or x.shape[1] != k or n2 % 2:
        raise ValueError(f"gate_up_swiglu: x {tuple(x.shape)} must be one row of K and weight "
                         f"{tuple(weight.shape)} [2N, K]")  # fmt: skip
    assert x.stride(1) == 1 and weight.stride(1) == 1
    n = n2 // 2
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block_n, block_k, warps = config or gemv_config(n2, k)
    pdl = use_pdl(x) if pdl is None else pdl
    _gemv_swiglu_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, W_EVICT=WEIGHT_EVICTION, **pdl_args(pdl),
    )  # fmt: skip
    return y
