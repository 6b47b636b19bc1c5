"""Timing-only stubs for `shunter bench executor`: what each group of a decode step's
short kernels costs, found by timing the step with that group replaced by a stand-in
that launches next to nothing.

Theory of operation: STUB is a setting (ops/bench_settings.py), so `bench ab` compares
groups as variants of one bench (`--variant norm="ops.bench_stub.STUB='norm'"`). It
names comma-separated groups; `apply` rebinds, in this process only, the functions
the model calls for them:
- attn: a decode-only step's attention chain (rope with the KV store, split-KV
  attention, merge) returns the rotated-to-be q unchanged (`o = q`);
- norm: the add+RMSNorm in front of a projection returns its input twice (the
  residual stream is not updated);
- silu: the SwiGLU returns the gate half.
Every projection keeps its shapes, so each GEMV still streams its whole weight; the
difference in step time from the unstubbed run is the group's cost in the chain as
captured (launch, latency and whatever PDL does not hide). The tokens a stubbed step
samples mean nothing: a stubbed run needs --skip-hf and records `stubbed` in its
config.
"""

from __future__ import annotations

STUB = ""  # comma-separated groups to stub: attn, norm, silu (module docstring)
GROUPS = ("attn", "norm", "silu")


def groups() -> list[str]:
    """The groups STUB names, checked (ValueError naming an unknown one)."""
    names = [g.strip() for g in STUB.split(",") if g.strip()]
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise ValueError(f"ops.bench_stub.STUB: unknown group(s) {unknown}; known: {GROUPS}")
    return names


def apply() -> list[str]:
    """Stub the groups STUB names in this process; the groups stubbed."""
    names = groups()
    if "attn" in names:
        from shunter.actors.executor.models import llama

        def attention_as_q(qk, v, rope, k_cache, v_cache, slots, num_heads, *rest):
            return qk[:, :num_heads]

        llama.attention_decode_rope_store = attention_as_q
    if "norm" in names:
        from shunter.kernels import linear

        linear.fused_add_rmsnorm = lambda x, residual, weight, eps: (x, x)
    if "silu" in names:
        from shunter.kernels import linear

        linear.silu_mul = lambda x: x[:, : x.shape[1] // 2]
    return names
