"""Gated DeltaNet (Qwen3.5/3.6 linear-attention layers): projections, a depthwise causal conv over
q|k|v with a rolling conv state, the gated delta rule with an fp32 recurrent state per sequence,
and a gated RMSNorm on the output. Weight names follow Hugging Face's Qwen3_5GatedDeltaNet."""

from __future__ import annotations

import os

import torch
from torch import nn

from worker.engine.batch import BatchMetadata
from worker.kernels import ops
from worker.kernels.reference import X8
from worker.models.attention import num_prefill_tokens
from worker.models.cache import DeltaNetState
from worker.models.config import ModelConfig
from worker.models.layers import Linear, fusable, fuse_linears, project, takes_x8

# Whether a decode step's DeltaNet gates form their b|a logits in the conv update's launch
# (`ops.conv_update_with_ba_gates`) where b|a is a 16-bit projection of its own beside int4
# qkv|z (two formats, two launches), instead of a 16-bit GEMV launched beside qkv|z: "1" on; off
# by default until measured on the GPU. `set_ba_in_conv` flips it at run time (graphs captured
# before keep what they captured). Up to BA_IN_CONV_ROWS rows: each row's programs read the
# whole b|a weight (1 MB at the 27B shape, from L2 after the first), which the GEMV reads once.
BA_IN_CONV_SWITCH = "TOKENMILL_GDN_BA_IN_CONV"
BA_IN_CONV_ROWS = 16
_ba_in_conv = {"on": os.environ.get(BA_IN_CONV_SWITCH, "0") == "1"}


def set_ba_in_conv(on: bool) -> None:
    _ba_in_conv["on"] = on


def ba_in_conv_enabled() -> bool:
    return _ba_in_conv["on"]


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)

    def forward_x8(self, x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, X8]:
        """`forward`, and its output rows [T, H * D] as int8 codes for the projection after."""
        return ops.gated_rms_norm_x8(x, gate, self.weight, self.eps)


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
        self.in_proj_qkv: nn.Module | None = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z: nn.Module | None = Linear(h, self.value_dim, bias=False)  # output gate
        self.in_proj_b: nn.Module | None = Linear(h, nv, bias=False)  # beta logits
        self.in_proj_a: nn.Module | None = Linear(h, nv, bias=False)  # decay time-step logits
        self.in_proj_qkvzba: nn.Module | None = None  # the four as one GEMM (fuse_projections)
        # ... or two when b|a keep a different format from qkv|z (int4 qkv|z, 16-bit b|a)
        self.in_proj_qkvz: nn.Module | None = None
        self.in_proj_ba: nn.Module | None = None
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
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def _parts(self) -> list[nn.Module]:
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        if any(p is None for p in parts):
            raise RuntimeError("the input projections were fused")
        return [p for p in parts if p is not None]

    def fuse_projections(self) -> None:
        """qkv|z|b|a as one projection when the four share a format; else qkv|z and b|a as two
        (int4 codes and 16-bit weights cannot share a GEMM); a pair that still differs stays
        unfused."""
        if self.in_proj_qkv is None:
            return  # already fused
        parts = self._parts()
        if fusable(parts):
            self.in_proj_qkvzba = fuse_linears(parts)
        elif fusable(parts[:2]) and fusable(parts[2:]):
            self.in_proj_qkvz, self.in_proj_ba = fuse_linears(parts[:2]), fuse_linears(parts[2:])
        else:
            return
        self.in_proj_qkv = self.in_proj_z = self.in_proj_b = self.in_proj_a = None

    def takes_x8(self, rows: int) -> bool:
        """Whether the input projection runs on int8 codes of the input (int4 qkv|z)."""
        return self.in_proj_qkvzba is None and takes_x8(self.in_proj_qkvz, rows)

    def ba_in_conv(self, rows: int, num_prefills: int) -> bool:
        """Whether a step's gates form their b|a logits in the conv update's launch: a
        decode-only step of at most BA_IN_CONV_ROWS rows, b|a a 16-bit projection of its own,
        and the switch on (`set_ba_in_conv`)."""
        return (
            ba_in_conv_enabled()
            and num_prefills == 0
            and 0 < rows <= BA_IN_CONV_ROWS
            and self.in_proj_qkvz is not None
            and type(self.in_proj_ba) is Linear
        )

    def project(
        self, hidden: torch.Tensor, x8: X8 | None = None, ba: bool = True
    ) -> tuple[torch.Tensor | None, ...]:
        """(q|k|v before the conv, z, b, a): one GEMM (or two) split by views once fused; x8:
        hidden's int8 codes, for qkv|z (`takes_x8`; b|a reads hidden). `ba=False`: b and a are
        left to the conv update's launch (`ba_in_conv`) and come back None."""
        nv = self.num_v_heads
        if self.in_proj_qkvzba is not None:
            sizes = [self.conv_dim, self.value_dim, nv, nv]
            return tuple(self.in_proj_qkvzba(hidden).split(sizes, dim=-1))
        if self.in_proj_qkvz is not None and self.in_proj_ba is not None:
            qkvz = project(self.in_proj_qkvz, hidden, x8)
            mixed, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
            if not ba:
                return mixed, z, None, None
            # hidden comes from before qkv|z's launch: the 16-bit b|a may run beside it
            proj = self.in_proj_ba
            ba_out = proj.beside_previous(hidden) if isinstance(proj, Linear) else proj(hidden)
            b, a = ba_out.split([nv, nv], dim=-1)
            return mixed, z, b, a
        return tuple(p(hidden) for p in self._parts())

    def forward(
        self,
        hidden: torch.Tensor,
        meta: BatchMetadata,
        state: DeltaNetState,
        x8: X8 | None = None,
    ) -> torch.Tensor:
        """x8: hidden's int8 codes, written for the input projection (`takes_x8`)."""
        tokens = hidden.shape[0]
        split, p = num_prefill_tokens(meta), meta.num_prefills
        ba_in_conv = self.ba_in_conv(tokens, p)
        mixed, z, b, a = self.project(hidden, x8, ba=not ba_in_conv)
        assert mixed is not None and z is not None
        z = z.view(tokens, self.num_v_heads, self.head_v_dim)
        weight = self.conv1d.weight.squeeze(1)
        conv_parts, rule_parts = [], []
        # beta = sigmoid(b); log decay per value head g = -exp(A_log) * softplus(a + dt_bias),
        # in fp32 (<= 0); a decode-only step gets them from the conv update's launch (and with
        # `ba_in_conv` their logits b|a too)
        if ba_in_conv:
            assert isinstance(self.in_proj_ba, Linear)
            mixed, g, beta = ops.conv_update_with_ba_gates(
                mixed,
                weight,
                state.conv_state,
                meta.state_slots,
                hidden,
                self.in_proj_ba.weight,
                self.A_log,
                self.dt_bias,
            )
            conv_parts.append(mixed)
        elif p == 0:
            assert a is not None and b is not None
            mixed, g, beta = ops.conv_update_with_gates(
                mixed, weight, state.conv_state, meta.state_slots, a, b, self.A_log, self.dt_bias
            )
            conv_parts.append(mixed)
        else:
            assert a is not None and b is not None
            g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
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
        if p and meta.num_seqs > p:
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
                    # before it: the conv, or the prefill of other sequences' slots
                    early_state=True,
                )
            )
        out = rule_parts[0] if len(rule_parts) == 1 else torch.cat(rule_parts)
        # [T, Hv, Dv] both: z stays a strided view of the fused projection (read in place)
        out = out.view(tokens, self.num_v_heads, self.head_v_dim)
        if takes_x8(self.out_proj, tokens):
            return project(self.out_proj, None, self.norm.forward_x8(out, z)[1])
        return self.out_proj(self.norm(out, z).reshape(tokens, self.value_dim))
