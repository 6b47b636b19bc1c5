"""The GPU's SM clock, power draw and temperature, read through `nvidia-smi`, for
benchmarks that want to see whether a series of runs slowed the chip.

A read takes a few tens of milliseconds (a process start), so callers read between
timed runs, never inside one. Where `nvidia-smi` is missing or fails, `read` returns
None and the caller reports nothing.
"""

from __future__ import annotations

import shutil
import subprocess

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
KEYS = ("sm_mhz", "power_w", "temp_c")


def parse(line: str) -> dict[str, float] | None:
    """One `--format=csv,noheader,nounits` line of FIELDS -> {sm_mhz, power_w, temp_c};
    None when it is not three numbers (a field the driver reports as N/A)."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(KEYS):
        return None
    try:
        return dict(zip(KEYS, (float(p) for p in parts), strict=True))
    except ValueError:
        return None


def read(index: int = 0) -> dict[str, float] | None:
    """The GPU `index`'s current clocks, power and temperature, or None."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits", f"-i={index}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    return parse(lines[0]) if lines else None
