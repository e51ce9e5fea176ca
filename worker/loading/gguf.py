"""Models from GGUF files (llama.cpp's format): config from the metadata, weights dequantised
(F32, F16, BF16, Q8_0, Q4_0/Q4_1 and the other ggml types `gguf.quants` knows) into our model,
or Q4_0 / Q4_1 linear weights kept in 4 bits (`native_int4`).
Architectures: `llama` (q/k rows permuted back from llama.cpp's rotary layout) and `qwen3`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from torch import nn

from worker.models.causal_lm import CausalLM
from worker.models.config import ModelConfig
from worker.models.int4 import INT4, Int4Linear, Int4Tensors, QuantizationConfig, pack_int4

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


# GGUF's 4-bit block types that map exactly onto Int4Linear (group 32): bytes per 32-value block.
_Q4_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


def gguf_q4_to_int4(data: np.ndarray, kind: GGMLQuantizationType, k: int) -> Int4Tensors:
    """A Q4_0 / Q4_1 tensor's blocks (uint8 [N, K / 32 * block bytes]) in our layout, exactly.
    A block is fp16 d (Q4_1: then fp16 m) and 16 bytes whose low nibbles are the block's values
    0..15 and high nibbles values 16..31 (ours pairs k = 2j, 2j + 1 in one byte, so the codes
    are re-paired). Q4_0: w = (q - 8) d, our symmetric groups; Q4_1: w = q d + m, our affine."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, k // 32, _Q4_BLOCK_BYTES[kind])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, -1))
    mins = None
    if kind == GGMLQuantizationType.Q4_1:
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, -1))
    qs = torch.from_numpy(blocks[..., -16:].copy())
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(n, k)
    return Int4Tensors(pack_int4(codes), d, mins, 32)


def _native_int4_modules(reader: GGUFReader, model: CausalLM) -> dict[str, GGMLQuantizationType]:
    """Our module paths of the linear weights stored as Q4_0 / Q4_1 (tied embeddings are
    embeddings, not linear layers, and are dequantised)."""
    out = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in _Q4_BLOCK_BYTES or not tensor.name.endswith(".weight"):
            continue
        path = gguf_name_to_param(tensor.name)[: -len(".weight")]
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, nn.Linear) and module.in_features % 32 == 0:
            out[path] = tensor.tensor_type
    return out


@torch.no_grad()
def load_gguf_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    native_int4: bool = False,
) -> CausalLM:
    """Every tensor of a GGUF file into a model allocated on `device`: dequantised to `dtype`,
    or with `native_int4`, the Q4_0 / Q4_1 linear weights kept in 4 bits as Int4Linear (group
    32, the file's own codes and scales, bit-exact: the same weights as dequantising).

    Off by default: dequantised weights run as plain 16-bit GEMMs everywhere (on a CPU the
    reference int4 op dequantises on every call) and match transformers' GGUF loader exactly.
    Serving in 4 bits (`quantize: w4` on the torch runtime) turns it on: re-quantizing the
    dequantised weights would add a second rounding, while the file's codes add none."""
    reader = GGUFReader(str(path))
    config = config_from_gguf(reader, name=Path(path).stem)
    with torch.device("meta"):
        model = CausalLM(config)
    model.to(dtype=dtype)
    native = _native_int4_modules(reader, model) if native_int4 else {}
    for module_path, kind in native.items():
        linear = model.get_submodule(module_path)
        assert isinstance(linear, nn.Linear)
        bias_dtype = None if linear.bias is None else linear.bias.dtype
        symmetric = kind == GGMLQuantizationType.Q4_0
        parent, _, child = module_path.rpartition(".")
        setattr(
            model.get_submodule(parent),
            child,
            Int4Linear.empty(linear.out_features, linear.in_features, 32, symmetric, bias_dtype),
        )
    model = model.to_empty(device=device)
    model.requires_grad_(False).eval()
    model.reset_buffers()
    params = dict(model.named_parameters())
    missing = set(params)
    for tensor in reader.tensors:
        target = gguf_name_to_param(tensor.name)
        rows_of = None
        if config.family == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            rows_of = config.num_attention_heads
        elif config.family == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            rows_of = config.num_key_value_heads
        module_path, _, leaf = target.rpartition(".")
        if leaf == "weight" and module_path in native:
            module = model.get_submodule(module_path)
            assert isinstance(module, Int4Linear)
            t = gguf_q4_to_int4(tensor.data, tensor.tensor_type, module.in_features)
            for name, value in (("qweight", t.qweight), ("scales", t.scales), ("mins", t.mins)):
                if value is None:
                    continue
                if rows_of is not None:  # a row permutation: codes and group scales alike
                    value = torch.from_numpy(_unpermute_rotary_rows(value.numpy(), rows_of))
                getattr(module, name).copy_(value)
                missing.discard(f"{module_path}.{name}")
            continue
        weight = dequantize(tensor.data, tensor.tensor_type)
        if rows_of is not None:
            weight = _unpermute_rotary_rows(weight, rows_of)
        param = params[target]
        param.copy_(torch.from_numpy(np.array(weight, copy=True)).reshape(param.shape))
        missing.discard(target)
    if missing:
        raise KeyError(f"GGUF file lacks {sorted(missing)[:8]}")
    if native:
        modules = {module_path: INT4 for module_path in native}
        symmetric = all(kind == GGMLQuantizationType.Q4_0 for kind in native.values())
        model.quantization_config = QuantizationConfig(modules, 32, symmetric, "rtn")
    return model
