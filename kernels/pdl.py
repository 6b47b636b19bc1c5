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

With TRIGGER_FIRST a kernel lets its dependents be scheduled before it waits itself,
so a chain of short kernels (norm, rope, attention) and the projection after them can
all be resident at once, the projection's weight loads (which depend on nothing) in
flight while the short kernels run. Correct either way: a kernel's wait returns only
once the grid before it has finished, and that grid finished only after its own wait.
Off: on an H100 the bs=1 step measured 1.008x in one comparison and 0.993x in the
next (BENCHMARKS.md), no effect beyond the runs' spread.

Invariants: every kernel launched with PDL takes its launch keywords from `pdl_args`
and calls `pdl_enter` (or waits as it does) before it reads or writes memory another
kernel touches; `use_pdl` is False off CUDA, below compute capability 9 and under the
Triton interpreter (which has no such instruction).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

TRIGGER_FIRST = False  # launch dependents before waiting (module docstring; measured no faster)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_args(on: bool) -> dict:
    """A PDL-aware kernel's launch keywords: its USE_PDL constexpr (0 off, 1 wait then
    launch dependents, 2 the other way round: TRIGGER_FIRST) and Triton's launch_pdl."""
    return {"USE_PDL": (2 if TRIGGER_FIRST else 1) if on else 0, "launch_pdl": on}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the grid before this one and let the next be scheduled (pdl_args)."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
