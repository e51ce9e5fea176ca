"""Gated DeltaNet (Qwen3.5/3.6 linear-attention layers): projections, a depthwise causal conv over
q|k|v with a rolling conv state, the gated delta rule with an fp32 recurrent state per sequence,
and a gated RMSNorm on the output. Weight names follow Hugging Face's Qwen3_5GatedDeltaNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.batch import BatchMetadata
from worker.kernels import ops
from worker.models.attention import num_prefill_tokens
from worker.models.cache import DeltaNetState
from worker.models.config import ModelConfig


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = nv = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.conv_dim = config.conv_dim
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)  # output gate
        self.in_proj_b = nn.Linear(h, nv, bias=False)  # beta (write strength) logits
        self.in_proj_a = nn.Linear(h, nv, bias=False)  # decay time-step logits
        # Only a weight holder ([C, 1, K] as in HF checkpoints); the conv runs through ops.
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            config.linear_conv_kernel_dim,
            groups=self.conv_dim,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.empty(nv))
        self.A_log = nn.Parameter(torch.empty(nv))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def forward(
        self, hidden: torch.Tensor, meta: BatchMetadata, state: DeltaNetState
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        mixed = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(tokens, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(hidden))
        # Log decay per value head: -exp(A_log) * softplus(a + dt_bias), in fp32 (<= 0).
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)

        split, p = num_prefill_tokens(meta), meta.num_prefills
        weight = self.conv1d.weight.squeeze(1)
        conv_parts, rule_parts = [], []
        if p:
            conv_parts.append(
                ops.causal_conv1d_prefill(
                    mixed[:split],
                    weight,
                    None,
                    meta.cu_seqlens[: p + 1],
                    state.conv_state,
                    meta.state_slots[:p],
                    meta.has_initial_state[:p],
                )
            )
        if meta.num_seqs > p:
            conv_parts.append(
                ops.causal_conv1d_update(
                    mixed[split:], weight, None, state.conv_state, meta.state_slots[p:]
                )
            )
        mixed = conv_parts[0] if len(conv_parts) == 1 else torch.cat(conv_parts)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)

        scale = self.head_k_dim**-0.5
        if p:
            rule_parts.append(
                ops.gated_delta_rule_prefill(
                    q[:split],
                    k[:split],
                    v[:split],
                    g[:split],
                    beta[:split],
                    meta.cu_seqlens[: p + 1],
                    state.recurrent_state,
                    meta.state_slots[:p],
                    meta.has_initial_state[:p],
                    scale,
                    True,
                )
            )
        if meta.num_seqs > p:
            rule_parts.append(
                ops.gated_delta_rule_decode(
                    q[split:],
                    k[split:],
                    v[split:],
                    g[split:],
                    beta[split:],
                    state.recurrent_state,
                    meta.state_slots[p:],
                    scale,
                    True,
                )
            )
        out = rule_parts[0] if len(rule_parts) == 1 else torch.cat(rule_parts)
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(tokens, self.value_dim))
