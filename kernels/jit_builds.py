"""A record of the Triton kernels this process builds, and how long each took.

Theory of operation: Triton builds a kernel the first time the process launches it with
a new shape class (its constexprs and the specializations of its integer and pointer
arguments), from its disk cache when that holds it, else by compiling it (a second or
more). A build inside a request holds every request in the engine meanwhile, so the
executor's shell wants to see each one. `install` sets Triton's hooks around a build
(`knobs.runtime.jit_cache_hook` before, `jit_post_compile_hook` after; a hook already
set is kept and called first), and `drain` hands over the builds since the last call:
(kernel name, milliseconds). The executor drains once after its warm-up (the builds
that warm-up did) and after every step, logging each build a step caused.

Invariants: the hooks only observe (the pre-build hook returns None, so Triton never
skips a build because of it); without Triton's knobs (an older Triton, or the CPU
interpreter, which builds nothing) `install` returns False and `drain` stays empty.
Process-wide state, read only by the executor's shell, never by a core.
"""

from __future__ import annotations

import time
from typing import Any

_started: dict[Any, int] = {}  # a build's key -> perf_counter_ns when it began
_builds: list[tuple[str, float]] = []  # (kernel, ms) not yet drained
_installed = False


def _name(kw: dict[str, Any]) -> str:
    """ "kernel(NAME=value, ...)": the function's own name and its constexprs (Triton keys
    them by argument path, (index,), named here from the function's parameters)."""
    fn = kw.get("fn")
    name = getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[", 1)[0]
    params = [p.name for p in getattr(getattr(fn, "jit_function", None), "params", [])]
    consts = (kw.get("compile") or {}).get("constants") or {}
    shown = []
    for path, v in consts.items():
        i = path[0] if isinstance(path, tuple) and len(path) == 1 else None
        if isinstance(i, int) and i < len(params) and isinstance(v, (bool, int, str)):
            shown.append(f"{params[i]}={v}")
    name = name.rsplit(".", 1)[-1]
    return f"{name}({', '.join(shown)})" if shown else name


def _before(prev: Any):
    def hook(**kw: Any) -> None:
        if prev is not None:
            prev(**kw)
        _started[kw.get("key")] = time.perf_counter_ns()
        return None  # never skip the build

    return hook


def _after(prev: Any):
    def hook(**kw: Any) -> Any:
        out = prev(**kw) if prev is not None else None
        t0 = _started.pop(kw.get("key"), None)
        ms = (time.perf_counter_ns() - t0) / 1e6 if t0 is not None else 0.0
        _builds.append((_name(kw), ms))
        return out

    return hook


def install() -> bool:
    """Set the hooks (once per process); False where this Triton has none to set."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = getattr(knobs, "runtime", None)
    if rt is None or not hasattr(rt, "jit_post_compile_hook") or not hasattr(rt, "jit_cache_hook"):
        return False
    rt.jit_cache_hook = _before(rt.jit_cache_hook)
    rt.jit_post_compile_hook = _after(rt.jit_post_compile_hook)
    _installed = True
    return True


def drain() -> list[tuple[str, float]]:
    """The builds since the last call: (kernel, milliseconds), oldest first."""
    if not _builds:  # every step asks; almost every step built nothing
        return []
    out = list(_builds)
    del _builds[: len(out)]
    return out
