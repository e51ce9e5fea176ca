"""Models from GGUF files (llama.cpp's format): config from the metadata, weights dequantised
(F32, F16, BF16, Q8_0, Q4_0/Q4_1 and the other ggml types `gguf.quants` knows) into our model.
Architectures: `llama` (q/k rows permuted back from llama.cpp's rotary layout) and `qwen3`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from worker.models.causal_lm import CausalLM, build_empty
from worker.models.config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUPPORTED_ARCHS = ("llama", "qwen3")


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_name_to_param(name: str) -> str:
    stem, _, leaf = name.rpartition(".")  # leaf: weight / bias
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{leaf}"
    return f"{_GLOBAL_NAMES[stem]}.{leaf}"


def config_from_gguf(reader: GGUFReader, name: str = "") -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {_SUPPORTED_ARCHS}"
        )
    hidden = field(reader, f"{arch}.embedding_length")
    heads = field(reader, f"{arch}.attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens"))
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=arch,
        name=name or field(reader, "general.name", arch),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=field(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=field(reader, f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10_000.0)),
        max_position_embeddings=field(reader, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves each head's rotary halves (HF keeps halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@torch.no_grad()
def load_gguf_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """Dequantise every tensor of a GGUF file into a model allocated on `device`."""
    reader = GGUFReader(str(path))
    config = config_from_gguf(reader, name=Path(path).stem)
    model = build_empty(config, device, dtype)
    params = dict(model.named_parameters())
    missing = set(params)
    for tensor in reader.tensors:
        target = gguf_name_to_param(tensor.name)
        weight = dequantize(tensor.data, tensor.tensor_type)
        if config.family == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            weight = _unpermute_rotary_rows(weight, config.num_attention_heads)
        elif config.family == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            weight = _unpermute_rotary_rows(weight, config.num_key_value_heads)
        param = params[target]
        param.copy_(torch.from_numpy(np.array(weight, copy=True)).reshape(param.shape))
        missing.discard(target)
    if missing:
        raise KeyError(f"GGUF file lacks {sorted(missing)[:8]}")
    return model
