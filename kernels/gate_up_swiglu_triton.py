"""The MLP's gate/up projection with the SwiGLU in its epilogue, as one Triton GEMM:
y = silu(x @ W_gate^T) * (x @ W_up^T) (the GPU path of kernels/gate_up_swiglu.py).

Theory of operation: a tensor-core GEMM over output tiles [BLOCK_M, BLOCK_N] of the
[M, inter] activation. W is the fused [2 * inter, K] gate_up weight (gate rows, then
up rows), so a program holds two float32 accumulators, one for its gate columns n
and one for the up columns inter + n, and feeds both from each [BLOCK_M, BLOCK_K]
tile of x: the K loop is one GEMM of width 2 * BLOCK_N. Tiles move through tensor
descriptors (TMA on Hopper; out-of-bounds rows and columns read as zeros and are
not written), pipelined over NUM_STAGES. Programs are grouped GROUP_M row tiles at a
time along M, so the weight tiles a group reads stay in L2 across it. The epilogue
takes silu(gate) * up from the float32 accumulators and rounds once to x's dtype,
so the [M, 2 * inter] gate_up output is neither written nor read back.

Invariants: x [M, K] and W [2 * inter, K] have a contiguous K axis, and their starts
and rows are 16-byte aligned (`tma_ready`, as TMA needs); y is a new contiguous [M, inter] tensor
in x's dtype. bfloat16 and float16 are what it is for; float32 runs too (interpreter
tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shunter.kernels.gate_up_swiglu import tma_ready

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): a 128 x (2 x 128) tile
# for two warpgroups. With BLOCK_K 64 triton 3.6 serializes its wgmma instructions on
# sm_90 (ptxas C7515: each waits for the last); with 128 and two stages they overlap.
CONFIG = (128, 128, 128, 8, 8, 2)
CONFIG_FP32 = (64, 64, 32, 8, 4, 2)  # float32 tiles take twice the shared memory


@triton.jit
def _gate_up_swiglu_kernel(
    x_desc, w_desc, y_desc, M, inter, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(inter, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        off_k = k * BLOCK_K
        a = x_desc.load([off_m, off_k])  # [BLOCK_M, BLOCK_K]
        w_gate = w_desc.load([off_n, off_k])  # [BLOCK_N, BLOCK_K]
        w_up = w_desc.load([inter + off_n, off_k])
        if IEEE:  # float32 operands: full-precision dots, not TF32
            acc_gate = tl.dot(a, w_gate.T, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, w_up.T, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, w_gate.T, acc_gate)
            acc_up = tl.dot(a, w_up.T, acc_up)
    # in a last, partial column block the gate tile reaches into W's up rows and the
    # up tile past W's end (zeros): those columns are >= inter, which the store drops
    y = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    y_desc.store([off_m, off_n], y.to(y_desc.dtype))


def gate_up_swiglu_triton(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...] | None = None
) -> torch.Tensor:
    """x [M, K] and the fused gate_up weight [2 * inter, K] -> [M, inter]. config:
    (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), by default CONFIG
    (CONFIG_FP32 for float32)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"gate_up_swiglu: x {list(x.shape)} and weight {list(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"gate_up_swiglu: x {x.dtype} on {x.device}, weight {weight.dtype} "
                         f"on {weight.device}")  # fmt: skip
    m, k = x.shape
    inter = weight.shape[0] // 2
    if not (tma_ready(x) and tma_ready(weight)):
        raise ValueError("gate_up_swiglu needs contiguous K rows, 16-byte aligned")
    if (weight.shape[0] // 2 * x.element_size()) % 16:
        raise ValueError("gate_up_swiglu needs 16-byte aligned output rows (inter)")
    y = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return y
    fp32 = x.dtype == torch.float32
    config = config or (CONFIG_FP32 if fp32 else CONFIG)
    block_m, block_n, block_k, group_m, num_warps, num_stages = config
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    y_desc = TensorDescriptor.from_tensor(y, [block_m, block_n])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(inter, block_n),)
    _gate_up_swiglu_kernel[grid](
        x_desc, w_desc, y_desc, m, inter, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        NUM_STAGES=num_stages, IEEE=fp32, num_warps=num_warps,
    )  # fmt: skip
    return y
