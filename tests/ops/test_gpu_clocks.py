"""ops/gpu_clocks.py: parsing nvidia-smi's CSV line, and reading it from a real
process (a stand-in `nvidia-smi` script on PATH, since CI has no GPU)."""

from __future__ import annotations

import os
import stat

from shunter.ops import gpu_clocks


def test_parse_reads_three_numbers_and_rejects_the_rest():
    assert gpu_clocks.parse("1755, 690.12, 61\n") == {"sm_mhz": 1755.0, "power_w": 690.12,
                                                     "temp_c": 61.0}  # fmt: skip
    assert gpu_clocks.parse("1755, [N/A], 61") is None
    assert gpu_clocks.parse("1755, 690") is None
    assert gpu_clocks.parse("") is None


def _fake_smi(tmp_path, monkeypatch, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


def test_read_runs_nvidia_smi_for_the_given_gpu(tmp_path, monkeypatch):
    # echoes its arguments' GPU index as the temperature, so the -i flag is checked too
    _fake_smi(tmp_path, monkeypatch, 'for a; do case "$a" in -i=*) i=${a#-i=};; esac; done\n'
                                     'echo "1980, 121.5, $i"\necho "0, 0, 0"\n')  # fmt: skip
    assert gpu_clocks.read(3) == {"sm_mhz": 1980.0, "power_w": 121.5, "temp_c": 3.0}


def test_read_is_none_when_nvidia_smi_fails_or_is_missing(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "echo 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert gpu_clocks.read() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gpu_clocks.read() is None
