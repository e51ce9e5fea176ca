"""ModelConfig: the shape and flavour of a decoder-only model, independent of where it came from
(HF `config.json` or GGUF metadata, parsed in `worker.loading.config`, or a preset)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet

# Families: "llama" (dense), "qwen3" (dense, q/k norm), "qwen3_5" (hybrid DeltaNet + gated attention).
FAMILIES = ("llama", "qwen3", "qwen3_5")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    # HF rope_parameters beyond theta (rope_type "llama3" / "linear" with their factors); None = default.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Per layer: FULL_ATTENTION or LINEAR_ATTENTION; empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; supported: {FAMILIES}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must name every layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_attention_layers and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")

    # Flavour of the family -------------------------------------------------------------------

    @property
    def qk_norm(self) -> bool:
        """RMSNorm of each query and key head before rotary (Qwen3, Qwen3.5)."""
        return self.family in ("qwen3", "qwen3_5")

    @property
    def attn_output_gate(self) -> bool:
        """Qwen3.5 gated attention: q_proj also yields a per-channel sigmoid gate on the output."""
        return self.family == "qwen3_5"

    @property
    def norm_unit_offset(self) -> bool:
        """Qwen3.5 RMSNorm scales by (1 + weight)."""
        return self.family == "qwen3_5"

    # Derived shapes ----------------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def num_parameters(self) -> int:
        """Parameter count of the text model (embeddings and head included)."""
        h, d = self.hidden_size, self.head_dim
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        mlp = 3 * h * self.intermediate_size
        q_out = self.num_attention_heads * d * (2 if self.attn_output_gate else 1)
        attention = (
            h * (q_out + 2 * self.num_key_value_heads * d) + self.num_attention_heads * d * h
        )
        attention += 2 * d if self.qk_norm else 0
        if self.attention_bias:
            attention += q_out + 2 * self.num_key_value_heads * d + h
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        nv = self.linear_num_value_heads
        deltanet = h * (self.conv_dim + self.linear_value_dim + 2 * nv)  # in_proj qkv, z, b, a
        deltanet += (
            self.conv_dim * self.linear_conv_kernel_dim + 2 * nv + self.linear_value_head_dim
        )
        deltanet += self.linear_value_dim * h  # out_proj
        per_layer = mlp + 2 * h
        total = embed + h
        for kind in self.layer_types:
            total += per_layer + (attention if kind == FULL_ATTENTION else deltanet)
        return total

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
