"""Full (softmax) attention over the paged KV cache: Llama, Qwen3 (q/k norm) and Qwen3.5 gated
attention (q/k norm with (1 + w), partial rotary, sigmoid output gate from q_proj). A staged
cache (recent + TurboQuant-coded pages) is read through `worker.kvcache.staged`."""

from __future__ import annotations

import torch
from torch import nn

from worker.engine.batch import BatchMetadata
from worker.kernels import ops
from worker.kernels.reference import X8
from worker.kvcache import staged as staged_kv
from worker.models.cache import AttentionCache, StagedAttentionCache
from worker.models.config import ModelConfig
from worker.models.layers import (
    Linear,
    RMSNorm,
    RotaryTables,
    fusable,
    fuse_linears,
    project,
    takes_x8,
)


def num_prefill_tokens(meta: BatchMetadata) -> int:
    """Tokens of the prefill chunks, which come first on the flat token axis."""
    return sum(meta.query_lens[: meta.num_prefills])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scale = d**-0.5
        self.output_gate = config.attn_output_gate
        h, bias = config.hidden_size, config.attention_bias
        # Gated attention: per head, q_proj yields [query (d) | gate (d)].
        self.q_size = self.num_heads * d * (2 if self.output_gate else 1)
        self.kv_size = self.num_kv_heads * d
        self.q_proj: nn.Module | None = Linear(h, self.q_size, bias=bias)
        self.k_proj: nn.Module | None = Linear(h, self.kv_size, bias=bias)
        self.v_proj: nn.Module | None = Linear(h, self.kv_size, bias=bias)
        self.qkv_proj: nn.Module | None = None  # q|k|v as one GEMM (fuse_projections)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config.norm_unit_offset)

    def fuse_projections(self) -> None:
        """q|k|v as one projection when all three have one format (else they stay three)."""
        if self.qkv_proj is None and fusable([self.q_proj, self.k_proj, self.v_proj]):
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None

    def takes_x8(self, rows: int) -> bool:
        """Whether the fused q|k|v projection runs on int8 codes of the input."""
        return takes_x8(self.qkv_proj, rows)

    def project(self, hidden: torch.Tensor, x8: X8 | None = None) -> tuple[torch.Tensor, ...]:
        """(q, k, v) projections: one GEMM split by views once fused (x8: hidden's int8 codes,
        written for it, `takes_x8`)."""
        if self.qkv_proj is not None:
            sizes = [self.q_size, self.kv_size, self.kv_size]
            return tuple(project(self.qkv_proj, hidden, x8).split(sizes, dim=-1))
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def heads(
        self, hidden: torch.Tensor, norms: bool = True, x8: X8 | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [T, Hq, D], k and v [T, Hkv, D] after the q/k norms (`norms`), before rotary, and
        the output gate [T, Hq, D] (None without one)."""
        tokens = hidden.shape[0]
        q, k, v = self.project(hidden, x8)
        gate = None
        if self.output_gate:
            q, gate = q.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if norms and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def forward(
        self,
        hidden: torch.Tensor,
        meta: BatchMetadata,
        cache: AttentionCache | StagedAttentionCache,
        rotary: RotaryTables,
        x8: X8 | None = None,
    ) -> torch.Tensor:
        """x8: hidden's int8 codes, written for the q|k|v projection (`takes_x8`)."""
        tokens = hidden.shape[0]
        q, k, v, gate = self.heads(hidden, norms=False, x8=x8)
        qn, kn = self.q_norm, self.k_norm
        if isinstance(cache, StagedAttentionCache):  # the gate applied with the un-rotation
            q, k = self._norm_rotary(q, k, meta, rotary)
            return self.o_proj(staged_kv.staged_attention(q, k, v, gate, meta, cache, self.scale))
        if qn is not None and kn is not None:  # built alike: one eps, one kind of scale
            # k and v go straight into the paged cache from the same launch
            q = ops.qk_norm_rotary_write_kv(
                q, k, v, qn.weight, kn.weight, qn.eps, qn.unit_offset, meta.positions,
                rotary.cos_sin(), rotary.rotary_dim, cache.k_cache, cache.v_cache,
                meta.slot_mapping, cache.k_scale, cache.v_scale,
            )  # fmt: skip
        else:
            q, k = self._norm_rotary(q, k, meta, rotary)
            ops.write_kv_cache(
                k, v, cache.k_cache, cache.v_cache, meta.slot_mapping, cache.k_scale, cache.v_scale
            )
        out = self._attend(q, meta, cache).reshape(tokens, -1)
        if gate is not None and takes_x8(self.o_proj, tokens):
            return project(self.o_proj, None, ops.sigmoid_mul_x8(out, gate)[1])
        if gate is not None:
            out = ops.sigmoid_mul(out, gate)
        return self.o_proj(out)

    def _norm_rotary(
        self, q: torch.Tensor, k: torch.Tensor, meta: BatchMetadata, rotary: RotaryTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k after the q/k norms (where the layer has them) and rotary."""
        qn, kn = self.q_norm, self.k_norm
        if qn is not None and kn is not None:  # built alike: one eps, one kind of scale
            return ops.qk_norm_rotary(
                q, k, qn.weight, kn.weight, qn.eps, qn.unit_offset, meta.positions,
                rotary.cos_sin(), rotary.rotary_dim,
            )  # fmt: skip
        q = ops.apply_rotary(q, meta.positions, rotary.cos_sin(), rotary.rotary_dim)
        k = ops.apply_rotary(k, meta.positions, rotary.cos_sin(), rotary.rotary_dim)
        return q, k

    def _attend(self, q: torch.Tensor, meta: BatchMetadata, cache: AttentionCache) -> torch.Tensor:
        split, p = num_prefill_tokens(meta), meta.num_prefills
        parts = []
        if p:
            parts.append(
                ops.paged_attention_prefill(
                    q[:split],
                    cache.k_cache,
                    cache.v_cache,
                    meta.cu_seqlens[: p + 1],
                    meta.context_lens[:p],
                    meta.block_tables[:p],
                    meta.positions[:split],
                    self.scale,
                    cache.k_scale,
                    cache.v_scale,
                )
            )
        if meta.num_seqs > p:
            parts.append(
                ops.paged_attention_decode(
                    q[split:],
                    cache.k_cache,
                    cache.v_cache,
                    meta.context_lens[p:],
                    meta.block_tables[p:],
                    self.scale,
                    cache.k_scale,
                    cache.v_scale,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
