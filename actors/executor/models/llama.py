"""One Llama-family decoder for every supported family, driven by ModelConfig.

Theory of operation: tokens of all entries of a step are one flat [num_tokens] axis
(no batch/padding axis); positions come with them. Each layer: RMSNorm, one fused
qkv projection (optional bias), optional per-head q/k RMSNorm (Qwen3), rope and the
store of the new K/V into the pool (one op without q/k norms; in a one-row decode
step optionally the qkv projection's epilogue, kernels/qkv_rope_store.py), paged
attention through the step's AttentionContext, output projection, fused add+RMSNorm, fused gate/up
projection, and the down projection of SiLU(gate)*up. The norms and the activation
go through the projections after them (`norm_project`, `silu_mul_linear`), so that
kernels/linear.py may fold them into a decode GEMV's operand load.
Logits are computed by the runner only for the rows it needs.
The ops (kernels/*.py) dispatch on the tensors' device: CUDA runs their Triton kernels,
where rope rotates the q/k heads in place; everything else the torch path.

Parameter names follow HF checkpoints except the fused ones: q/k/v_proj land in
`qkv_proj` and gate/up_proj in `gate_up_proj` (see `load_weights`).

Invariants: the residual stream stays in the model dtype; `lm_head` is None exactly
when embeddings are tied (logits then use `embed_tokens.weight`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shunter.actors.executor.models.attention import AttentionContext, paged_attention
from shunter.actors.executor.models.config import ModelConfig
from shunter.kernels import linear as linear_mod
from shunter.kernels import qkv_rope_store as qkv_rope_mod
from shunter.kernels.attention_decode import attention_decode, attention_decode_rope_store
from shunter.kernels.linear import gate_up_swiglu, linear, norm_linear, silu_mul_linear
from shunter.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from shunter.kernels.rope import rope_cos_sin_cache, rope_gather, rope_rotate
from shunter.kernels.rope_kv_store import rope_kv_store
from shunter.kernels.silu_mul import silu_mul


def project(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection through kernels/linear.py (the skinny decode kernel on CUDA), or
    through the module itself when models.quant swapped it for a packed one."""
    if type(mod) is nn.Linear:
        return linear(x, mod.weight, mod.bias)
    return mod(x)


def norm_project(
    mod: nn.Module, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mod(rmsnorm(s)), s) with s = x + residual, or x at layer 0 (residual None): a
    layer's norm and the projection after it, one kernel on the GEMV path."""
    if type(mod) is nn.Linear:
        return norm_linear(x, residual, norm.weight, norm.eps, mod.weight, mod.bias)
    h, residual = fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
    return mod(h), residual


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        qkv: torch.Tensor,  # [T, q + 2 kv]: the layer's qkv projection (norm_project)
        rope: tuple[torch.Tensor, torch.Tensor],  # rope_gather's operands, shared by layers
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.decode_only and not self.qk_norm:  # rope and store inside the decode kernel
            num_tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
            qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
            v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            i = self.layer_idx
            kv = (ctx.k_buffers[i], ctx.v_buffers[i], ctx.out_slots)
            o = attention_decode_rope_store(qk, v, rope, *kv, self.num_heads,
                                            ctx.decode_plan, self.scale)  # fmt: skip
            return self.output(o)
        return self.output(self.attend(ctx, *self.rope_store(qkv, rope, ctx)))

    def rope_store(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """What comes before attention: (q [T, H, D], k, v [T, Hkv, D], stored), q and k
        normed (Qwen3) and rotated; without q/k norms k and v are also stored in the pool
        (`stored`), by the same kernel that rotates q and k ([T, H + Hkv, D] in place)."""
        num_tokens = qkv.shape[0]
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, -1))
            return rope_rotate(q, *rope), rope_rotate(k, *rope), v, False
        i, qk = self.layer_idx, qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
        qk = rope_kv_store(qk, v, rope, ctx.k_buffers[i], ctx.v_buffers[i], ctx.out_slots,
                           self.num_heads)  # fmt: skip
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v, True

    def attend(self, ctx: AttentionContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               stored: bool, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """[T, H, D] attention over the pool (k, v stored first unless `stored`), into
        `out` when given."""
        return paged_attention(ctx, self.layer_idx, q, k, v, self.scale, stored=stored, out=out)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's [T, H, D] (or [T, H * D]) result."""
        return project(self.o_proj, o.reshape(o.shape[0], self.q_size))

    def rope_store_in_qkv(self, x: torch.Tensor, ctx: AttentionContext) -> bool:
        """Whether this decode step's qkv projection also applies rope and stores k, v
        (`forward_normed`), for the layer's input x."""
        proj = self.qkv_proj
        # The switch first: it is off by default and this runs for every layer.
        return (qkv_rope_mod.FUSE_QKV_ROPE_STORE and ctx.decode_only and not self.qk_norm
                and type(proj) is nn.Linear and qkv_rope_mod.fusable(x, proj.weight, proj.bias))  # fmt: skip

    def forward_normed(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        """The layer's attention from its normed input h (qkv, rope and the store in one
        kernel; see `rope_store_in_qkv`)."""
        i, proj = self.layer_idx, self.qkv_proj
        kv = (ctx.k_buffers[i], ctx.v_buffers[i])
        q = qkv_rope_mod.qkv_rope_store(h, proj.weight, proj.bias, rope, *kv, ctx.out_slots,
                                        self.num_heads)  # fmt: skip
        return self.output(attention_decode(q, *kv, ctx.decode_plan, self.scale))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)

    def swiglu_in_gate_up(self) -> bool:
        """Whether the layer runs gate/up and the SwiGLU as one op (`swiglu_down`)."""
        return linear_mod.FUSE_GATE_UP_SWIGLU and all(
            type(m) is nn.Linear for m in (self.gate_up_proj, self.down_proj)
        )

    def swiglu_down(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu_mul(gate_up(x))) for the normed x [T, hidden]."""
        gu = self.gate_up_proj
        return linear(gate_up_swiglu(x, gu.weight, gu.bias), self.down_proj.weight,
                      self.down_proj.bias)  # fmt: skip

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 inter], the layer's gate/up projection (norm_project)."""
        if type(self.down_proj) is nn.Linear:  # SwiGLU folded into the projection's load
            return silu_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(silu_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: this layer's input before its norm
        residual: torch.Tensor | None,  # [T, hidden]; None at layer 0
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        if attn.rope_store_in_qkv(x, ctx):
            norm = self.input_layernorm
            h, residual = fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
            h = attn.forward_normed(h, rope, ctx)
        else:
            qkv, residual = norm_project(attn.qkv_proj, self.input_layernorm, x, residual)
            h = attn(qkv, rope, ctx)
        return self.feed_forward(h, residual)

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]:  # fmt: skip
        """The layer up to its attention: (`LlamaAttention.rope_store`'s q, k, v, stored;
        the residual stream). `forward` without the fused decode paths, split where a
        piecewise graph (piecewise_graph.py) leaves attention to run eagerly."""
        qkv, residual = norm_project(self.self_attn.qkv_proj, self.input_layernorm, x, residual)
        return self.self_attn.rope_store(qkv, rope, ctx), residual

    def after_attention(
        self, o: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention's output o [T, H * D] on: (output, residual)."""
        return self.feed_forward(self.self_attn.output(o), residual)

    def feed_forward(
        self, h: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm and the MLP of the attention block's output h."""
        mlp, norm = self.mlp, self.post_attention_layernorm
        if mlp.swiglu_in_gate_up():
            x_mlp, residual = fused_add_rmsnorm(h, residual, norm.weight, norm.eps)
            return mlp.swiglu_down(x_mlp), residual
        gate_up, residual = norm_project(mlp.gate_up_proj, norm, h, residual)
        return mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cos_sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = rope_gather(cos_sin, positions)  # shared by every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output added to the residual stream and normed: [T, hidden]."""
        x, _ = fused_add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)
        return x


# HF checkpoint names of the projections fused here: (hf suffix, our suffix, shard index)
_STACKED = [
    ("self_attn.q_proj", "self_attn.qkv_proj", 0),
    ("self_attn.k_proj", "self_attn.qkv_proj", 1),
    ("self_attn.v_proj", "self_attn.qkv_proj", 2),
    ("mlp.gate_proj", "mlp.gate_up_proj", 0),
    ("mlp.up_proj", "mlp.gate_up_proj", 1),
]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._cos_sin: torch.Tensor | None = None
        self.logits_head: nn.Module | None = None  # set by models.quant for tied weights

    def cos_sin_cache(self, max_pos: int) -> torch.Tensor:
        """[>= max_pos, head_dim] float32 rope table on the model's device, grown on demand."""
        if self._cos_sin is None or self._cos_sin.shape[0] < max_pos:
            c = self.config
            size = max(max_pos, c.max_position_embeddings, 1)
            if self._cos_sin is not None:
                size = max(size, 2 * self._cos_sin.shape[0])
            dev = self.model.embed_tokens.weight.device
            self._cos_sin = rope_cos_sin_cache(
                c.head_dim, size, c.rope_theta, c.rope_scaling, c.rope_freq_factors
            ).to(dev)
        return self._cos_sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        max_pos: int | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (normed). max_pos: one past the largest position."""
        if max_pos is None:
            max_pos = int(positions.max()) + 1 if positions.numel() else 1
        return self.model(input_ids, positions, self.cos_sin_cache(max_pos), ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        if self.lm_head is not None:
            return project(self.lm_head, hidden).float()
        return linear(hidden, self.model.embed_tokens.weight).float()

    @torch.no_grad()
    def weight_by_hf_name(self, name: str) -> torch.Tensor:
        """The tensor HF's checkpoint name `name` loads into (a view of the fused one for
        q/k/v and gate/up; the embedding for a tied lm_head). KeyError when the model
        holds none by that name (packed projections hold no float weight)."""
        if name == "lm_head.weight" and self.lm_head is None:
            name = "model.embed_tokens.weight"
        slot = self._hf_slot(name, dict(self.named_parameters()))
        if slot is None:
            raise KeyError(name)
        return slot[1]

    def _hf_slot(
        self, name: str, params: dict[str, nn.Parameter]
    ) -> tuple[str, torch.Tensor] | None:
        """(our parameter's name, the view of it) that HF's tensor `name` fills; None
        when there is none."""
        c = self.config
        for hf, ours, shard in _STACKED:
            if f".{hf}." in name:
                target = name.replace(hf, ours)
                p = params.get(target)
                if p is None:
                    return None
                qkv = [c.q_size, c.kv_size, c.kv_size]
                sizes = qkv if "qkv" in ours else [c.intermediate_size] * 2
                return target, p.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        p = params.get(name)
        return None if p is None else (name, p.data)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (fusing q/k/v and gate/up).
        Returns the parameter names that were filled; raises ValueError on an unknown
        name or a shape mismatch."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            slot = self._hf_slot(name, params)
            if slot is None:
                raise ValueError(f"checkpoint tensor {name} has no place in the model")
            target, dst = slot
            _copy(name, dst, tensor)
            filled[target] = filled.get(target, 0) + 1
        expected_parts = {n: 3 if "qkv_proj" in n else 2 if "gate_up" in n else 1 for n in params}
        missing = sorted(n for n in params if filled.get(n, 0) < expected_parts[n])
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} model tensors: {shown}")
        return set(filled)


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(src.shape)}, model expects {tuple(dst.shape)}"
        )
    dst.copy_(src)
