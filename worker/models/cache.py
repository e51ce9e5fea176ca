"""ModelCache: the per-layer device memory a model reads and writes across steps — paged KV for
full-attention layers, slot pools of recurrent and conv state for DeltaNet layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: float = 1.0  # FP8 caches hold value / scale
    v_scale: float = 1.0


@dataclass
class DeltaNetState:
    # [num_state_slots, Hv, dk, dv]: fp32, or 16-bit (half the bytes a decode step reads and
    # writes; kernels still compute in fp32)
    recurrent_state: torch.Tensor
    conv_state: torch.Tensor  # [num_state_slots, conv_dim, conv_kernel - 1]


@dataclass
class ModelCache:
    block_size: int
    num_blocks: int
    num_state_slots: int
    layers: list[AttentionCache | DeltaNetState]  # indexed by layer

    def attention(self, layer: int) -> AttentionCache:
        entry = self.layers[layer]
        assert isinstance(entry, AttentionCache), f"layer {layer} is not full attention"
        return entry

    def deltanet(self, layer: int) -> DeltaNetState:
        entry = self.layers[layer]
        assert isinstance(entry, DeltaNetState), f"layer {layer} is not a DeltaNet layer"
        return entry

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all full-attention layers."""
        return sum(
            2 * e.k_cache[0, 0].numel() * e.k_cache.element_size()
            for e in self.layers
            if isinstance(e, AttentionCache)
        )

    def state_bytes_per_sequence(self) -> int:
        """Bytes of DeltaNet recurrent and conv state one sequence holds across all layers."""
        return sum(
            e.recurrent_state[0].numel() * e.recurrent_state.element_size()
            + e.conv_state[0].numel() * e.conv_state.element_size()
            for e in self.layers
            if isinstance(e, DeltaNetState)
        )

    def total_bytes(self) -> int:
        tensors: list[torch.Tensor] = []
        for e in self.layers:
            if isinstance(e, AttentionCache):
                tensors += [e.k_cache, e.v_cache]
            else:
                tensors += [e.recurrent_state, e.conv_state]
        return sum(t.numel() * t.element_size() for t in tensors)
