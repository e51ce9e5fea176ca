"""CausalLM: one decoder-only model class for every family (Llama, Qwen3, Qwen3.5/3.6 hybrid).

Parameter names follow Hugging Face (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`model.layers.N.linear_attn.in_proj_qkv`, `model.norm`, `lm_head`), so safetensors checkpoints
load by name. Tokens are flat (varlen): forward takes input_ids [T] with a BatchMetadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.batch import BatchMetadata
from worker.models.attention import Attention
from worker.models.cache import (
    AttentionCache,
    DeltaNetState,
    KVStaging,
    ModelCache,
    StagedAttentionCache,
)
from worker.models.config import FULL_ATTENTION, ModelConfig
from worker.models.deltanet import GatedDeltaNet
from worker.models.int4 import QuantizationConfig
from worker.models.layers import MLP, HostEmbedding, Linear, RMSNorm, RotaryTables


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_attention = config.layer_types[layer] == FULL_ATTENTION
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        if self.is_attention:
            self.self_attn = Attention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.mlp = MLP(config)

    def fuse_projections(self) -> None:
        if self.is_attention:
            self.self_attn.fuse_projections()
        else:
            self.linear_attn.fuse_projections()
        self.mlp.fuse_projections()

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: BatchMetadata,
        cache: AttentionCache | StagedAttentionCache | DeltaNetState,
        rotary: RotaryTables,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it). The residual add of each
        sub-layer happens in the next norm (`add_forward`): the stream is `hidden + residual`,
        or `hidden` alone for the first layer (residual None). A norm whose next projection
        runs on int8 codes (`takes_x8`: int4 decode rows) writes them beside its output."""
        rows = hidden.shape[0]
        mixer = self.self_attn if self.is_attention else self.linear_attn
        mixed, residual, x8 = self.input_layernorm.feed(hidden, residual, mixer.takes_x8(rows))
        if isinstance(cache, DeltaNetState):
            mixed = self.linear_attn(mixed, meta, cache, x8)
        else:
            mixed = self.self_attn(mixed, meta, cache, rotary, x8)
        mixed, residual, x8 = self.post_attention_layernorm.feed(
            mixed, residual, self.mlp.takes_x8(rows)
        )
        return self.mlp(mixed, x8), residual


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # an nn.Embedding, or a HostEmbedding once its table moved to host memory
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.rotary = RotaryTables(config)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        # A tied head reads the embedding matrix (see `head_weight`), so it cannot come untied.
        # An untied head may be swapped for an FP8 or int4 one (worker.models.fp8 / int4).
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Per-module precisions once quantized (worker.models.int4); None: as built.
        self.quantization_config: QuantizationConfig | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_table().dtype

    def embedding_table(self) -> torch.Tensor:
        """The token embedding table [vocab, hidden], on the GPU or in host memory."""
        table = self.model.embed_tokens.weight
        assert isinstance(table, torch.Tensor)
        return table

    @property
    def device(self) -> torch.device:
        # the final norm's: the embedding table may live in host memory (`embeddings_to_host`)
        return self.model.norm.weight.device

    @torch.no_grad()
    def embeddings_to_host(self) -> None:
        """Move the token embedding table to pinned host memory (`HostEmbedding`), off the GPU.
        Refused for a tied LM head, which multiplies by the whole table every step."""
        if self.lm_head is None:
            raise ValueError(
                "embeddings on the host: this model's LM head is tied to the embedding table, "
                "which every step reads whole on the GPU"
            )
        if self.device.type != "cuda":
            raise ValueError(f"embeddings on the host: the model runs on {self.device}, not a GPU")
        if not isinstance(self.model.embed_tokens, HostEmbedding):
            self.model.embed_tokens = HostEmbedding(self.embedding_table())

    def head_weight(self) -> torch.Tensor:
        if self.lm_head is None:
            return self.embedding_table()
        weight = self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary tables) after materialising on a device."""
        self.model.rotary.reset()

    def allocate_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        kv_dtype: torch.dtype,
        device: torch.device | str,
        state_dtype: torch.dtype = torch.float32,
        staging: KVStaging | None = None,
    ) -> ModelCache:
        """`num_blocks` KV pages per full-attention layer; with `staging`, these are the recent
        pool of a StagedAttentionCache beside its compressed pool."""
        c = self.config
        if staging is not None:
            attention = {i for i, kind in enumerate(c.layer_types) if kind == FULL_ATTENTION}
            if not set(staging.layer_bits) <= attention:
                raise ValueError(
                    f"kv_staging names layers {sorted(set(staging.layer_bits) - attention)}, "
                    f"which are not full-attention layers of this model ({sorted(attention)})"
                )
        layers: list[AttentionCache | StagedAttentionCache | DeltaNetState] = []
        for index, kind in enumerate(c.layer_types):
            if kind == FULL_ATTENTION and staging is not None:
                layers.append(
                    StagedAttentionCache.allocate(
                        num_blocks,
                        staging.num_compressed_blocks,
                        block_size,
                        c.num_key_value_heads,
                        c.head_dim,
                        *staging.bits_of(index),
                        kv_dtype,
                        device,
                    )
                )
            elif kind == FULL_ATTENTION:
                shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
                layers.append(
                    AttentionCache(
                        torch.zeros(shape, dtype=kv_dtype, device=device),
                        torch.zeros(shape, dtype=kv_dtype, device=device),
                    )
                )
            else:
                recurrent = (
                    num_state_slots,
                    c.linear_num_value_heads,
                    c.linear_key_head_dim,
                    c.linear_value_head_dim,
                )
                conv = (num_state_slots, c.conv_dim, c.linear_conv_kernel_dim - 1)
                layers.append(
                    DeltaNetState(
                        torch.zeros(recurrent, dtype=state_dtype, device=device),
                        torch.zeros(conv, dtype=self.dtype, device=device),
                    )
                )
        return ModelCache(block_size, num_blocks, num_state_slots, layers)

    def forward(
        self, input_ids: torch.Tensor, meta: BatchMetadata, cache: ModelCache
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (after the final norm) of the fed tokens."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer, layer_cache in zip(self.model.layers, cache.layers, strict=True):
            hidden, residual = layer(hidden, residual, meta, layer_cache, self.model.rotary)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return self.model.norm.add_forward(hidden, residual)[0]

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Concatenate sibling projections (attention q|k|v, DeltaNet qkv|z|b|a, MLP gate|up) so
        each runs as one GEMM. Call after loading and after any FP8 swap: checkpoint names stop
        matching parameter names once fused."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.head_weight()).float()


def build_empty(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """The model with uninitialised weights allocated directly on `device` (no host copy)."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False).eval()
    model.reset_buffers()
    return model


EMBEDDINGS_OPTIONS = ("auto", "device", "host")


def place_embeddings(model: CausalLM, setting: str, quantize: str | None) -> str:
    """Put the embedding table where `setting` says ("device", "host" or "auto") and return where
    it went. "auto": in host memory for int4 weights on a GPU with an untied LM head (on one
    H200 the W4 27B then holds 12.92 instead of 15.28 GiB of weights, at the same load-point
    speed: 811.8 against 792.9 tok/s, 2 repeats each), else on the device."""
    if setting not in EMBEDDINGS_OPTIONS:
        raise ValueError(f"embeddings={setting!r}: expected one of {EMBEDDINGS_OPTIONS}")
    if setting == "auto":
        fits = quantize == "w4" and model.device.type == "cuda" and model.lm_head is not None
        setting = "host" if fits else "device"
    if setting == "host":
        model.embeddings_to_host()
    return setting


@torch.no_grad()
def build_random(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> CausalLM:
    """Random weights at the config's shape, generated on `device` (fine for speed work: values
    do not change the work done, and they are scaled to keep activations finite)."""
    model = build_empty(config, device, dtype)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            param.uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias"):
            param.fill_(1.0)
        elif "norm" in name:  # (1 + w) norms start at zero, plain scales at one
            param.fill_(
                0.0
                if config.norm_unit_offset and not name.endswith("linear_attn.norm.weight")
                else 1.0
            )
        elif leaf == "bias":
            param.zero_()
        elif "conv1d" in name:
            bound = config.linear_conv_kernel_dim**-0.5
            param.uniform_(-bound, bound, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    return model
