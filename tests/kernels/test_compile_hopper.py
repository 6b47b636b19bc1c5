"""The Triton kernels whose variants CI cannot run compile for Hopper (sm_90) on a
machine without a GPU: Triton's own front end, its GPU passes and the ptxas it ships
build each variant, so a variant only the device would run (the decode kernel's
in-split merge and rope + store, the GEMV's prologues and epilogues) cannot reach the device
broken by a compile error. Interpreter tests check what they compute; this checks
that they build, and that the in-split merge's ticket is one acquire-release atomic
of one thread between CTA barriers.

The compiles run in a child process (this file run as a script) without
TRITON_INTERPRET: the CPU kernel tests set it before importing the kernel modules,
whose functions are then interpreted ones, which do not compile. The child prints one
JSON line: per variant, its error or the facts read off its PTX."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

DECODE_VARIANTS = [v for v in itertools.product((False, True), repeat=4) if not (v[1] and v[2])]
GEMV_PROLOGUES = ["PLAIN", "SILU_MUL", "ADD_RMSNORM"]
# (dtype, bytes, sliding window, one split writing the output)
SPLIT_EXTEND_VARIANTS = [(d, e, w, s) for d, e in (("bf16", 2), ("fp32", 4))
                         for w in (False, True) for s in (False, True)]  # fmt: skip
DECODE_POINTERS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "idx_ptr": "*i32", "rows_ptr": "*i64",
    "lens_ptr": "*i32", "out_ptr": "*bf16", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
    "ticket_ptr": "*i32", "new_k_ptr": "*bf16", "new_v_ptr": "*bf16", "new_slot_ptr": "*i64",
    "cs_ptr": "*fp32", "scale": "fp32",
}  # fmt: skip


def _compile(fn, pointers: dict[str, str], consts: dict, num_warps: int = 4) -> str:
    """PTX of `fn` for sm_90 with `consts` as constexprs; pointer arguments typed by
    `pointers`, the rest int32."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn, sig, constexprs=consts)
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps}).asm["ptx"]


def _facts(ptx: str) -> dict:
    lines = [ln.strip() for ln in ptx.splitlines()]
    tickets = [ln for ln in lines if "atom.global" in ln]
    pdl = [ln.split()[0].rstrip(";") for ln in lines if ln.startswith("griddepcontrol")]
    policies = sorted({ln.split()[0] for ln in lines if ln.startswith("createpolicy")})
    return {"tickets": tickets, "cg_loads": "ld.global.cg" in ptx, "pdl": pdl,
            "policies": policies}  # fmt: skip


def _run(name: str, build) -> tuple[str, dict]:
    try:
        return name, _facts(build())
    except Exception as e:  # reported per variant, asserted in the parent
        return name, {"error": f"{type(e).__name__}: {e}"[:2000]}


def compile_all() -> dict[str, dict]:
    from shunter.kernels import attention_decode_merge_triton as amt
    from shunter.kernels import attention_decode_triton as adt
    from shunter.kernels import linear_triton as lt

    out = {}
    for rope, merge, direct, window in DECODE_VARIANTS:
        consts = dict(HAS_WINDOW=window, HAS_ROWS=True, DIRECT=direct, MERGE_IN_SPLIT=merge,
                      ROPE_STORE=rope, IEEE=False, UPCAST=False, BLOCK_G=16, BLOCK_N=64,
                      BLOCK_D=128, USE_PDL=True)  # fmt: skip
        name = f"decode-{rope}-{merge}-{direct}-{window}"
        out.update([_run(name, lambda c=consts: _compile(adt._decode_split_kernel,
                                                         DECODE_POINTERS, c))])  # fmt: skip
    merge_ptrs = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "lens_ptr": "*i32",
                  "out_ptr": "*bf16"}  # fmt: skip
    merge_consts = dict(HAS_WINDOW=False, BLOCK_N=64, BLOCK_S=128, BLOCK_D=128, USE_PDL=True)
    out.update([_run("merge", lambda: _compile(amt.decode_merge_kernel, merge_ptrs, merge_consts))])
    gemv_ptrs = {n: "*bf16" for n in ("x_ptr", "res_ptr", "norm_w_ptr", "res_out_ptr", "w_ptr",
                                      "b_ptr", "y_ptr")}  # fmt: skip
    gemv_ptrs["eps"] = "fp32"
    for pname in GEMV_PROLOGUES:
        prologue = getattr(lt, pname)
        k = 14336 if prologue == lt.SILU_MUL else 4096
        block_n, block_k, warps = lt.gemv_config(4096, k, prologue)
        # M=1 as the JIT specializes a one-row step's int argument equal to 1
        consts = dict(M=1, PROLOGUE=prologue, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=block_n,
                      BLOCK_K=block_k, USE_PDL=True, W_EVICT="")  # fmt: skip
        out.update([_run(f"gemv-{pname}", lambda c=consts, w=warps: _compile(
            lt._gemv_kernel, gemv_ptrs, c, num_warps=w))])  # fmt: skip
    consts = {**consts, "PROLOGUE": lt.PLAIN, "USE_PDL": 2}  # pdl.TRIGGER_FIRST
    out.update([_run("gemv-trigger-first", lambda c=consts: _compile(lt._gemv_kernel, gemv_ptrs,
                                                                     c))])  # fmt: skip
    consts = {**consts, "USE_PDL": True, "W_EVICT": "evict_first"}  # WEIGHT_EVICTION
    out.update([_run("gemv-evict-first", lambda c=consts: _compile(lt._gemv_kernel, gemv_ptrs,
                                                                   c))])  # fmt: skip
    block_n, block_k, warps = lt.gemv_config(28672, 4096)
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=True, W_EVICT="")
    out.update([_run("gemv-swiglu", lambda: _compile(lt._gemv_swiglu_kernel, gemv_ptrs, consts,
                                                     num_warps=warps))])  # fmt: skip
    from shunter.kernels import qkv_rope_store_triton as qrt

    qkv_ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "q_ptr", "kc_ptr", "vc_ptr")}
    qkv_ptrs.update(pos_ptr="*i64", slots_ptr="*i64", cs_ptr="*fp32")
    block_n, block_k, warps = lt.gemv_config(6144, 4096)
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=True, W_EVICT="")
    out.update([_run("gemv-qkv-rope-store", lambda: _compile(
        qrt._qkv_rope_store_kernel, qkv_ptrs, consts, num_warps=warps))])  # fmt: skip
    from shunter.kernels import attention_extend_split_triton as est

    for dtype, elem, window, direct in SPLIT_EXTEND_VARIANTS:
        ptrs = {**{n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
                "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "table_ptr": "*i32",
                "row_ptr": "*i64", "q_start_ptr": "*i64", "num_new_ptr": "*i64",
                "seq_len_ptr": "*i64", "scale": "fp32"}  # fmt: skip
        block_t, block_g, warps = est.split_launch(4, 128, elem)  # the 8B head shape
        consts = dict(HAS_WINDOW=window, DIRECT=direct, IEEE=dtype == "fp32", UPCAST=False,
                      BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_N=64, BLOCK_D=128)  # fmt: skip
        out.update([_run(f"split-extend-{dtype}-{window}-{direct}", lambda p=ptrs, c=consts,
                         w=warps: _compile(est._extend_split_kernel, p, c, num_warps=w))])  # fmt: skip
    consts = dict(BLOCK_S=est.MERGE_SPLITS, BLOCK_D=128)
    out.update([_run("split-extend-merge", lambda: _compile(est._extend_merge_kernel,
                                                            merge_ptrs, consts))])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def report() -> dict[str, dict]:
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("rope", "merge", "direct", "window"), DECODE_VARIANTS)
def test_decode_split_kernel_variants_build_for_hopper(report, rope, merge, direct, window):
    got = report[f"decode-{rope}-{merge}-{direct}-{window}"]
    assert "error" not in got, got.get("error")
    tickets = got["tickets"]
    if merge:  # one add (acq_rel, gpu scope) and one reset, each predicated to a thread
        assert len(tickets) == 2 and "acq_rel.add" in tickets[0] and "exch" in tickets[1]
        assert all(t.startswith("@%p") for t in tickets)
        assert got["cg_loads"]  # the partials are read past L1
    else:
        assert not tickets


def test_decode_merge_kernel_builds_for_hopper(report):
    assert "error" not in report["merge"], report["merge"].get("error")


@pytest.mark.parametrize(("dtype", "elem", "window", "direct"), SPLIT_EXTEND_VARIANTS)
def test_split_extend_kernel_variants_build_for_hopper(report, dtype, elem, window, direct):
    """The GQA-packed split extend kernel (off by default, so CI's builds are the only
    ones it gets until a device runs it) and its merge."""
    for name in (f"split-extend-{dtype}-{window}-{direct}", "split-extend-merge"):
        assert "error" not in report[name], report[name].get("error")


@pytest.mark.parametrize("prologue", [*GEMV_PROLOGUES, "swiglu", "qkv-rope-store"])
def test_gemv_kernel_configs_build_for_hopper(report, prologue):
    got = report[f"gemv-{prologue}"]
    assert "error" not in got, got.get("error")


def test_weight_eviction_policy_reaches_the_loads(report):
    """WEIGHT_EVICTION="evict_first" gives the weight loads an L2 evict-first policy;
    the default sets none."""
    assert report["gemv-evict-first"]["policies"] == ["createpolicy.fractional.L2::evict_first.b64"]
    assert report["gemv-PLAIN"]["policies"] == []


def test_pdl_modes_order_wait_and_trigger(report):
    """USE_PDL 1 waits, then lets dependents launch; 2 (pdl.TRIGGER_FIRST) the other way."""
    assert report["gemv-PLAIN"]["pdl"] == [
        "griddepcontrol.wait",
        "griddepcontrol.launch_dependents",
    ]
    assert report["gemv-trigger-first"]["pdl"] == ["griddepcontrol.launch_dependents",
                                                   "griddepcontrol.wait"]  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(compile_all()))
