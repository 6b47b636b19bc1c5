"""The record of Triton builds (kernels/jit_builds.py): the hooks keep a hook already
set, never ask Triton to skip a build, and hand each build over once with its kernel
name, constexprs and duration; on CUDA a new shape class of a real kernel shows up."""

from __future__ import annotations

import pytest
import torch

from shunter.kernels import jit_builds

knobs = pytest.importorskip("triton").knobs
if not hasattr(knobs.runtime, "jit_post_compile_hook"):
    pytest.skip("this Triton has no build hooks", allow_module_level=True)


class _Param:
    def __init__(self, name: str) -> None:
        self.name = name


class _JitFunction:
    params = [_Param(n) for n in ("x_ptr", "scale", "BLOCK", "DIRECT")]


class _Fn:  # Triton's JitFunctionInfo
    name = "test_module.<locals>._my_kernel"
    jit_function = _JitFunction()


@pytest.fixture
def hooks(monkeypatch):
    """Fresh hooks over a previously set pair, restored afterwards."""
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append("pre"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append("post"))
    monkeypatch.setattr(jit_builds, "_installed", False)
    monkeypatch.setattr(jit_builds, "_builds", [])
    monkeypatch.setattr(jit_builds, "_started", {})
    assert jit_builds.install()
    return seen


def _kw(key: str) -> dict:
    """The keywords Triton calls its hooks with (triton/runtime/jit.py `_call_hook`)."""
    consts = {(2,): 64, (3,): True, (1,): 0.5}  # by argument path; floats not shown
    return dict(key=key, repr="_my_kernel[num_warps=4](...)", fn=_Fn(),
                compile={"key": key, "constants": consts}, is_manual_warmup=False,
                already_compiled=False)  # fmt: skip


def test_a_build_is_recorded_once_with_its_constexprs(hooks):
    pre, post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    assert pre(**_kw("a")) is None  # never skip the build
    post(**_kw("a"))
    assert hooks == ["pre", "post"]  # the earlier hooks still run
    (name, ms), *rest = jit_builds.drain()
    assert rest == [] and name == "_my_kernel(BLOCK=64, DIRECT=True)" and ms >= 0
    assert jit_builds.drain() == []


def test_install_is_once_per_process(hooks):
    post = knobs.runtime.jit_post_compile_hook
    assert jit_builds.install()
    assert knobs.runtime.jit_post_compile_hook is post  # not wrapped twice
    post(**_kw("b"))
    assert len(jit_builds.drain()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_shape_class_of_a_real_kernel_is_recorded(monkeypatch):
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(out_ptr, VALUE: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, 16), tl.full([16], VALUE, tl.float32))

    monkeypatch.setattr(jit_builds, "_builds", [])
    jit_builds.install()
    out = torch.empty(16, device="cuda")
    _fill[(1,)](out, VALUE=3)
    _fill[(1,)](out, VALUE=3)  # built already: no second record
    torch.cuda.synchronize()
    assert [n for n, _ in jit_builds.drain()] == ["_fill(VALUE=3)"]
