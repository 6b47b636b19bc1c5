"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

Theory of operation: on Hopper and later, a kernel launched with PDL may be scheduled
while the kernel before it in the stream is still running. `pdl_enter`, the first
thing such a kernel does, waits (griddepcontrol.wait) until every grid it depends on
has finished and its writes are visible, then lets the next PDL kernel be scheduled
(griddepcontrol.launch_dependents). Results are unchanged; what overlaps is the next
kernel's launch and start-up with this kernel's work, which matters where a decode
step is hundreds of short kernels. flashinfer's attention kernels take part the same
way (its `enable_pdl`, on by default on these devices), and captured CUDA graphs keep
the programmatic edges.

Invariants: every kernel launched with `launch_pdl=True` calls `pdl_enter` before it
reads or writes memory another kernel touches; `use_pdl` is False off CUDA, below
compute capability 9 and under the Triton interpreter (which has no such instruction).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
