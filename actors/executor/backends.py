"""Which attention kernels a runner uses: the backend of every step, and the kernels of
its all-decode steps.

`resolve_backend` turns --attention-backend into what this device, dtype and head size
can run ("auto": flashinfer on CUDA when it imports and supports them, else triton;
torch on a CPU). `decode_backend_for` picks the kernels of an all-decode step from
that backend and --decode-attention-backend: under flashinfer, "auto" hands decode
batches of up to TRITON_DECODE_MAX_BS entries to the Triton split-KV kernel, which
was measured faster (BENCHMARKS.md); prefill and extend steps keep the backend's own
kernels. Both are pure functions of their arguments (the flashinfer import aside): the
runner resolves its backend once at construction and asks for a decode step's kernels
by batch size, and tests check the tables directly.
"""

from __future__ import annotations

import torch


def resolve_backend(
    name: str, device: torch.device, dtype: torch.dtype, head_dim: int = 128
) -> str:
    """The attention backend a runner uses for `name` ("auto" resolved: flashinfer on
    CUDA when it imports and supports the dtype and head size, else triton;
    ValueError for a CUDA backend off CUDA or flashinfer where it cannot run)."""
    if device.type != "cuda":
        if name in ("triton", "flashinfer"):
            raise ValueError(f"attention backend {name!r} needs a CUDA device")
        return "torch"
    if name not in ("auto", "flashinfer"):
        return name
    from shunter.kernels import attention_flashinfer as fi

    why = None
    if dtype not in fi.SUPPORTED_DTYPES:
        why = f"bf16 or fp16, not {dtype}"
    elif head_dim not in fi.SUPPORTED_HEAD_DIMS:
        why = f"head_dim in {fi.SUPPORTED_HEAD_DIMS}, not {head_dim}"
    elif not fi.flashinfer_available():
        why = "flashinfer to import"
    if why is None:
        return "flashinfer"
    if name == "flashinfer":
        raise ValueError(f"attention backend flashinfer needs {why}")
    return "triton"


# Under flashinfer, an all-decode batch of at most this many entries decodes with the
# Triton split-KV kernel when decode_attention_backend is "auto". Measured on an H200
# (Llama-3.1-8B bf16, one run per backend, BENCHMARKS.md): Triton's decode step is
# faster at every batch measured, 1 (128-token context) and 2 to 256 (1024-token
# contexts), by 2-7%; larger batches are unmeasured and keep flashinfer's kernel.
TRITON_DECODE_MAX_BS = 256


def decode_backend_for(backend: str, requested: str, batch_size: int) -> str:
    """The kernels ("torch", "triton" or "flashinfer") of an all-decode step of
    `batch_size` entries, for a runner of attention `backend` (resolved) given
    decode_attention_backend `requested`. ValueError for flashinfer decode without the
    flashinfer backend (a CPU runner refuses any non-auto request at construction)."""
    if requested == "flashinfer" and backend != "flashinfer":
        raise ValueError(
            "--decode-attention-backend flashinfer needs --attention-backend flashinfer "
            f"(this runner's is {backend})"
        )
    if backend != "flashinfer":
        return backend
    if requested != "auto":
        return requested
    return "triton" if batch_size <= TRITON_DECODE_MAX_BS else "flashinfer"
