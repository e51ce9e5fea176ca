"""ModelCache: the per-layer device memory a model reads and writes across steps — paged KV for
full-attention layers (plain, or staged: recent pages + TurboQuant-coded pages), slot pools of
recurrent and conv state for DeltaNet layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: float = 1.0  # FP8 caches hold value / scale
    v_scale: float = 1.0


@dataclass(frozen=True)
class KVStaging:
    """How a model allocates staged full-attention KV (worker/kvcache/): a compressed pool of
    `num_compressed_blocks` pages beside the recent pool, K and V codes of these bit widths."""

    num_compressed_blocks: int
    k_bits: int = 4
    v_bits: int = 3
    # model layer index -> (K bits, V bits) of the layers staged at widths of their own
    layer_bits: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    def bits_of(self, layer: int) -> tuple[int, int]:
        return self.layer_bits.get(layer, (self.k_bits, self.v_bits))


@dataclass
class StagedAttentionCache:
    """One full-attention layer's KV in two page pools (worker/engine/block_manager.py: block
    ids below `num_recent_blocks` are recent pages, the rest compressed pages, id minus
    num_recent_blocks). Every vector is stored in the rotated basis of
    `worker.kvcache.turboquant` (x @ rotation): recent pages as FP8 (value / scale), compressed
    pages as TurboQuant codes + fp16 norms, so attention over either kind only needs the
    rotated query, and the output (a sum of rotated values) is un-rotated once per head."""

    k_cache: torch.Tensor  # [num_recent_blocks, block_size, Hkv, D] (fp8 e4m3, or 16-bit)
    v_cache: torch.Tensor
    k_codes: torch.Tensor  # uint8 [num_compressed_blocks, block_size, Hkv, D * k_bits / 8]
    k_norms: torch.Tensor  # fp16 [num_compressed_blocks, block_size, Hkv]
    v_codes: torch.Tensor
    v_norms: torch.Tensor
    k_bits: int
    v_bits: int
    k_centroids: torch.Tensor  # fp32 [2^k_bits], ascending
    v_centroids: torch.Tensor
    rotation: torch.Tensor  # fp32 [D, D]: rotated = x @ rotation, x = rotated @ rotation.T
    k_scale: float = 1.0
    v_scale: float = 1.0
    # the rotation in a 16-bit dtype, where that is exact: entries are +-1/sqrt(D), a power of
    # two when D is a power of 4 (64, 256), so a 16-bit GEMM (fp32 accumulation) rotates as the
    # fp32 one does, on tensor cores and without the casts (one H200, the 27B load point: the
    # fp32 rotations and their casts took 0.73 ms of a 9.58 ms step)
    rotations: dict[torch.dtype, torch.Tensor | None] = field(default_factory=dict, repr=False)
    # the codebooks' decision bounds (midpoints of adjacent centroids), K's then V's, made once:
    # a restage launch would otherwise add four small kernels a layer to build them
    bounds: list[torch.Tensor] = field(default_factory=list, repr=False)

    def rotation_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The rotation in `dtype` when that is a 16-bit dtype it is exact in, else None."""
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        if dtype not in self.rotations:
            r = self.rotation.to(dtype)
            self.rotations[dtype] = r if torch.equal(r.float(), self.rotation) else None
        return self.rotations[dtype]

    def decision_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K's and V's codebook bounds: a code is the number of bounds below its value."""
        if not self.bounds:
            self.bounds = [(c[1:] + c[:-1]) / 2 for c in (self.k_centroids, self.v_centroids)]
        return self.bounds[0], self.bounds[1]

    @classmethod
    def allocate(
        cls,
        num_recent_blocks: int,
        num_compressed_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        k_bits: int = 4,
        v_bits: int = 3,
        kv_dtype: torch.dtype = torch.float8_e4m3fn,
        device: torch.device | str = "cpu",
    ) -> StagedAttentionCache:
        from worker.kvcache import turboquant as tq

        recent = (num_recent_blocks, block_size, num_kv_heads, head_dim)
        norms = (num_compressed_blocks, block_size, num_kv_heads)

        def codes(bits: int) -> torch.Tensor:
            shape = (*norms, tq.packed_bytes(head_dim, bits))
            return torch.zeros(shape, dtype=torch.uint8, device=device)

        return cls(
            torch.zeros(recent, dtype=kv_dtype, device=device),
            torch.zeros(recent, dtype=kv_dtype, device=device),
            codes(k_bits),
            torch.zeros(norms, dtype=torch.float16, device=device),
            codes(v_bits),
            torch.zeros(norms, dtype=torch.float16, device=device),
            k_bits,
            v_bits,
            tq.codebook(head_dim, k_bits, device)[0],
            tq.codebook(head_dim, v_bits, device)[0],
            tq.rotation_matrix(head_dim, device),
        )

    @property
    def num_recent_blocks(self) -> int:
        return self.k_cache.shape[0]

    @property
    def num_compressed_blocks(self) -> int:
        return self.k_codes.shape[0]

    def recent_bytes_per_token(self) -> int:
        return 2 * self.k_cache[0, 0].numel() * self.k_cache.element_size()

    def compressed_bytes_per_token(self) -> int:
        return sum(
            t[0, 0].numel() * t.element_size()
            for t in (self.k_codes, self.k_norms, self.v_codes, self.v_norms)
        )

    def total_bytes(self) -> int:
        tensors = (self.k_cache, self.v_cache, self.k_codes, self.k_norms, self.v_codes)
        return sum(t.numel() * t.element_size() for t in (*tensors, self.v_norms))


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
    layers: list[AttentionCache | StagedAttentionCache | DeltaNetState]  # indexed by layer

    def attention(self, layer: int) -> AttentionCache:
        entry = self.layers[layer]
        assert isinstance(entry, AttentionCache), f"layer {layer} is not full attention"
        return entry

    def deltanet(self, layer: int) -> DeltaNetState:
        entry = self.layers[layer]
        assert isinstance(entry, DeltaNetState), f"layer {layer} is not a DeltaNet layer"
        return entry

    @property
    def has_recurrent_state(self) -> bool:
        """Whether any layer keeps DeltaNet state (a dense model's cache has none)."""
        return any(isinstance(e, DeltaNetState) for e in self.layers)

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every DeltaNet layer's recurrent and conv state of slot `src` into slot `dst`,
        for each (src, dst) in order (prefix caching's state checkpoints)."""
        if not pairs:
            return
        srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
        # Independent copies (no slot written twice or read after it is written) go as one
        # gather + scatter per tensor: a batch of tail checkpoints costs a fixed number of
        # launches, not 2 per layer per copy.
        batched = len(pairs) > 1 and len(set(dsts)) == len(dsts) and not set(dsts) & set(srcs)
        index = None
        for e in self.layers:
            if not isinstance(e, DeltaNetState):
                continue
            if batched:
                if index is None:
                    device = e.recurrent_state.device
                    index = (
                        torch.tensor(srcs, dtype=torch.int64).to(device, non_blocking=True),
                        torch.tensor(dsts, dtype=torch.int64).to(device, non_blocking=True),
                    )
                for t in (e.recurrent_state, e.conv_state):
                    t.index_copy_(0, index[1], t.index_select(0, index[0]))
                continue
            for src, dst in pairs:
                e.recurrent_state[dst].copy_(e.recurrent_state[src])
                e.conv_state[dst].copy_(e.conv_state[src])

    def staged(self) -> list[StagedAttentionCache]:
        """The staged full-attention layers (empty unless the cache was allocated staged)."""
        return [e for e in self.layers if isinstance(e, StagedAttentionCache)]

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all full-attention layers (in a recent
        page, for staged layers)."""
        return sum(
            2 * e.k_cache[0, 0].numel() * e.k_cache.element_size()
            for e in self.layers
            if isinstance(e, AttentionCache | StagedAttentionCache)
        )

    def compressed_kv_bytes_per_token(self) -> int:
        """Bytes one token occupies across all staged layers in a compressed page."""
        return sum(e.compressed_bytes_per_token() for e in self.staged())

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
            elif isinstance(e, StagedAttentionCache):
                tensors += [e.k_cache, e.v_cache, e.k_codes, e.k_norms, e.v_codes, e.v_norms]
            else:
                tensors += [e.recurrent_state, e.conv_state]
        return sum(t.numel() * t.element_size() for t in tensors)
