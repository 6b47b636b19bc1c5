"""Rotary position embedding (half-rotated "neox" layout, as HF Llama), with Llama 3.1
and linear frequency scaling.

Theory of operation: dimension i of a head (i < D/2) is paired with i + D/2 and the
pair is rotated by angle pos * inv_freq[i]. `rope_cos_sin_cache` precomputes
cos/sin for positions [0, max_pos) as one [max_pos, D] float32 table (cos in the
first half, sin in the second); `apply_rope` looks rows up by position. The table
is computed exactly as HF computes its angles (float32 position * float32 inv_freq),
so float32 results agree with HF bit for bit.

Dispatch: `rope_gather` runs once per step and `rope_rotate` once per layer. On the
CPU (the torch path, `*_torch`) the gather expands the table rows into cos and signed
sin tensors and the rotation returns a new tensor. On CUDA the gather hands back
(positions, cos_sin_cache) untouched and the rotation is the Triton kernel of
kernels/rope_triton.py (imported on first use), which looks the rows up itself and
rotates x IN PLACE (returning x), e.g. the q and k heads of the fused projection seen
as one [T, H + Hkv, D] view. The CUDA gather does not check positions against the
table (that would wait for the GPU); its callers keep them in range (ModelRunner
validates them on the host).
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: object | None = None,
    freq_factors: list[float] | None = None,
) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies. `scaling` is a RopeScaling (or None);
    `freq_factors` (llama.cpp's rope_freqs tensor) divide the frequencies one by one."""
    idx = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32)
    inv_freq = 1.0 / (theta ** (idx / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq
    kind = scaling.rope_type
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    factor, lo, hi = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / lo
    high_freq_wavelen = old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    theta: float,
    scaling: object | None = None,
    freq_factors: list[float] | None = None,
) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos of the angles in [:, :D/2], sin in [:, D/2:]."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
    pos = torch.arange(max_pos, dtype=torch.int64).to(torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's formulation: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]  # [T, D]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([-x2, x1], dim=-1)

    qf, kf = q.float(), k.float()
    return (
        (qf * cos + rot(qf) * sin).to(q.dtype),
        (kf * cos + rot(kf) * sin).to(k.dtype),
    )


def rope_gather(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per step: the per-step rope operands for `rope_rotate`: (positions,
    cos_sin_cache) on CUDA, else `rope_gather_torch`'s (cos, sin_signed)."""
    if cos_sin_cache.is_cuda:
        return positions, cos_sin_cache
    return rope_gather_torch(cos_sin_cache, positions)


def rope_rotate(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any row stride, last axis contiguous) by the operands (a, b)
    of `rope_gather`: on CUDA in place (returns x), else a new tensor."""
    if x.is_cuda:
        from shunter.kernels.rope_triton import rope_rotate_triton

        return rope_rotate_triton(x, a, b)
    return rope_rotate_torch(x, a, b)


def rope_gather_torch(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per step: (cos, sin_signed), each [T, 1, D] float32, for positions [T]
    int64: cos = [c, c], sin_signed = [-s, s], so that a rotation is
    x * cos + swap_halves(x) * sin_signed."""
    if positions.numel() and int(positions.max()) >= cos_sin_cache.shape[0]:
        raise ValueError(
            f"position {int(positions.max())} beyond the rope table ({cos_sin_cache.shape[0]})"
        )
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)  # [T, D]: c | s
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([-cs[:, half:], cs[:, half:]], -1)[:, None, :]
    return cos, sin


def rope_rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any row stride, last axis contiguous) by the angles of
    `rope_gather_torch`; returns a new contiguous tensor of x's dtype. Each half is
    x1*c + x2*(-s) and x2*c + x1*s with separate roundings, which is bit for bit
    HF's x*cos + rotate_half(x)*sin."""
    if x.dtype != torch.float32:
        return rope_rotate_torch(x.float(), cos, sin).to(x.dtype)
    out = x * cos
    out += torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
    return out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] at positions [T] int64; returns new tensors.
    cos_sin_cache: [max_pos, D] float32 from `rope_cos_sin_cache` (on q's device)."""
    if q.is_cuda:  # the kernel rotates in place: rotate copies
        return rope_rotate(q.clone(), positions, cos_sin_cache), rope_rotate(
            k.clone(), positions, cos_sin_cache
        )
    cos, sin = rope_gather_torch(cos_sin_cache, positions)
    return rope_rotate_torch(q, cos, sin), rope_rotate_torch(k, cos, sin)
