"""Named model shapes: the full Qwen3.6-27B text path (random weights for speed work) and tiny
configs of each family for CPU tests and benchmarks that must finish in seconds."""

from __future__ import annotations

from typing import Any

from worker.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig


def _every_fourth_full(num_layers: int) -> tuple[str, ...]:
    return tuple(
        FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(num_layers)
    )


# Qwen3.6-27B (same text architecture as Qwen3.5-27B): 64 layers, 48 Gated DeltaNet + 16 gated
# attention; matches transformers' Qwen3_5TextConfig semantics (full_attention_interval 4,
# partial_rotary_factor 0.25). 26.9 B parameters.
QWEN3_6_27B = ModelConfig(
    family="qwen3_5",
    name="qwen3.6-27b",
    vocab_size=248_320,
    hidden_size=5120,
    intermediate_size=17_408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=262_144,
    tie_word_embeddings=False,
    layer_types=_every_fourth_full(64),
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)

# The shape the tiny configs share: small enough for CPU tests, every op still exercised.
_TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
)

TINY_QWEN3_5 = QWEN3_6_27B.replace(
    name="tiny-qwen3.5",
    **_TINY_SHAPE,
    layer_types=_every_fourth_full(4),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)

TINY_LLAMA = ModelConfig(
    family="llama",
    name="tiny-llama",
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    **_TINY_SHAPE,
)

PRESETS = {c.name: c for c in (QWEN3_6_27B, TINY_QWEN3_5, TINY_LLAMA)}
