"""Building blocks shared by every family: RMSNorm, rotary tables, the gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import ops
from worker.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm; `unit_offset` scales by (1 + weight) as Qwen3.5 does (weights centred on zero)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary channels (fp32), with Llama 3 / linear scaling applied."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported")
    return inv_freq


class RotaryTables(nn.Module):
    """cos/sin tables [max_positions, rotary_dim / 2] in fp32 for `ops.apply_rotary`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary_dim = config.rotary_dim
        half = config.rotary_dim // 2
        self.cos = nn.Buffer(torch.empty(config.max_position_embeddings, half), persistent=False)
        self.sin = nn.Buffer(torch.empty(config.max_position_embeddings, half), persistent=False)
        if not self.cos.is_meta:
            self.reset()

    def reset(self) -> None:
        """(Re)compute the tables on their device (after `to_empty`, say)."""
        inv_freq = rope_inv_freq(self.config).to(self.cos.device)
        positions = torch.arange(self.cos.shape[0], device=self.cos.device, dtype=torch.float)
        angles = torch.outer(positions, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
