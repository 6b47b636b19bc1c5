"""The Triton kernels whose variants CI cannot run compile for Hopper (sm_90) on a
machine without a GPU: Triton's own front end, its GPU passes and the ptxas it ships
build each variant, so a variant only the device would run (the decode kernel's
in-split merge and rope + store, the GEMV's prologues) cannot reach the device
broken by a compile error. Interpreter tests check what they compute; this checks
that they build, and that the in-split merge's ticket is one acquire-release atomic
of one thread between CTA barriers."""

from __future__ import annotations

import importlib
import itertools
import os
import sys

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

if "nvidia" not in getattr(triton.backends, "backends", {}):
    pytest.skip("this Triton has no NVIDIA backend", allow_module_level=True)

HOPPER = GPUTarget("cuda", 90, 32)
# Loaded afresh without TRITON_INTERPRET, which the CPU kernel tests set before they
# import these modules (their kernels are then interpreted functions, which do not
# compile); the modules they share are put back after.
FRESH = ("shunter.kernels.pdl", "shunter.kernels.attention_decode_merge_triton",
         "shunter.kernels.attention_decode_triton", "shunter.kernels.linear_triton")  # fmt: skip


@pytest.fixture(scope="module")
def kernels():
    import shunter.kernels as package

    saved = {n: sys.modules.pop(n, None) for n in FRESH}
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        fresh = {n.rsplit(".", 1)[1]: importlib.import_module(n) for n in FRESH}
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
        for n, mod in saved.items():
            short = n.rsplit(".", 1)[1]
            if mod is None:
                sys.modules.pop(n, None)
                if hasattr(package, short):
                    delattr(package, short)
            else:
                sys.modules[n] = mod
                setattr(package, short, mod)
    return fresh


def _compile(fn, pointers: dict[str, str], consts: dict, num_warps: int = 4):
    """Compile `fn` with `consts` as constexprs; pointer arguments typed by `pointers`,
    the rest int32 (float32 where named so)."""
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn, sig, constexprs=consts)
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps})


DECODE_POINTERS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "idx_ptr": "*i32", "rows_ptr": "*i64",
    "lens_ptr": "*i32", "out_ptr": "*bf16", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
    "ticket_ptr": "*i32", "new_k_ptr": "*bf16", "new_v_ptr": "*bf16", "new_slot_ptr": "*i64",
    "cs_ptr": "*fp32", "scale": "fp32",
}  # fmt: skip


@pytest.mark.parametrize(("rope", "merge", "direct", "window"),
                         [v for v in itertools.product((False, True), repeat=4)
                          if not (v[1] and v[2])])  # fmt: skip
def test_decode_split_kernel_variants_build_for_hopper(kernels, rope, merge, direct, window):
    consts = dict(HAS_WINDOW=window, HAS_ROWS=True, DIRECT=direct, MERGE_IN_SPLIT=merge,
                  ROPE_STORE=rope, IEEE=False, UPCAST=False, BLOCK_G=16, BLOCK_N=64,
                  BLOCK_D=128, USE_PDL=True)  # fmt: skip
    k = _compile(kernels["attention_decode_triton"]._decode_split_kernel, DECODE_POINTERS, consts)
    ptx = k.asm["ptx"]
    tickets = [ln for ln in ptx.splitlines() if "atom.global" in ln]
    if merge:  # one add (acq_rel, gpu scope) and one reset, each predicated to a thread
        assert len(tickets) == 2 and "acq_rel.add" in tickets[0] and "exch" in tickets[1]
        assert all(t.strip().startswith("@%p") for t in tickets)
        assert "ld.global.cg" in ptx  # the partials are read past L1
    else:
        assert not tickets


def test_decode_merge_kernel_builds_for_hopper(kernels):
    pointers = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "lens_ptr": "*i32",
                "out_ptr": "*bf16"}  # fmt: skip
    consts = dict(HAS_WINDOW=False, BLOCK_N=64, BLOCK_S=128, BLOCK_D=128, USE_PDL=True)
    _compile(kernels["attention_decode_merge_triton"].decode_merge_kernel, pointers, consts)


@pytest.mark.parametrize("prologue", ["PLAIN", "SILU_MUL", "ADD_RMSNORM"])
def test_gemv_kernel_configs_build_for_hopper(kernels, prologue):
    lt = kernels["linear_triton"]
    prologue = getattr(lt, prologue)
    pointers = {n: "*bf16" for n in ("x_ptr", "res_ptr", "norm_w_ptr", "res_out_ptr", "w_ptr",
                                     "b_ptr", "y_ptr")}  # fmt: skip
    pointers["eps"] = "fp32"
    k = 14336 if prologue == lt.SILU_MUL else 4096
    block_n, block_k, warps = lt.gemv_config(4096, k, prologue)
    consts = dict(PROLOGUE=prologue, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=block_n,
                  BLOCK_K=block_k, USE_PDL=True)  # fmt: skip
    _compile(lt._gemv_kernel, pointers, consts, num_warps=warps)
