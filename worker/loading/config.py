"""ModelConfig from a Hugging Face `config.json` (Llama, Qwen3, Qwen3.5/3.6 text or its
multimodal wrapper, whose text part sits under `text_config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

_FAMILY_BY_MODEL_TYPE = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
}


class UnsupportedModel(ValueError):
    pass


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def config_from_hf(raw: dict[str, Any], name: str = "") -> ModelConfig:
    model_type = raw.get("model_type", "")
    if model_type not in _FAMILY_BY_MODEL_TYPE:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported: {sorted(_FAMILY_BY_MODEL_TYPE)}"
        )
    family = _FAMILY_BY_MODEL_TYPE[model_type]
    outer = raw
    if "text_config" in raw:  # multimodal wrapper: the language model's config is nested
        raw = {**raw["text_config"]}
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
            if raw.get(key) is None and outer.get(key) is not None:
                raw[key] = outer[key]
    if raw.get("use_sliding_window"):
        raise UnsupportedModel("sliding-window attention is not supported")

    # Rope: transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10_000.0))
    # Qwen3.5 rotates a quarter of each head by default (transformers' Qwen3_5TextConfig).
    default_partial = 0.25 if family == "qwen3_5" else 1.0
    partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))
    for irrelevant in ("mrope_section", "mrope_interleaved"):  # text positions: all axes equal
        rope.pop(irrelevant, None)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}

    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    layer_types: tuple[str, ...] = ()
    if family == "qwen3_5":
        if raw.get("layer_types"):
            layer_types = tuple(raw["layer_types"])
        else:
            interval = raw.get("full_attention_interval", 4)
            layer_types = tuple(
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                for i in range(layers)
            )
    return ModelConfig(
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope or None,
        partial_rotary_factor=float(partial),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        layer_types=layer_types,
        linear_num_key_heads=raw.get("linear_num_key_heads", 0),
        linear_num_value_heads=raw.get("linear_num_value_heads", 0),
        linear_key_head_dim=raw.get("linear_key_head_dim", 0),
        linear_value_head_dim=raw.get("linear_value_head_dim", 0),
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        name=name or raw.get("_name_or_path", "") or model_type,
    )


def load_hf_config(path: str | Path) -> ModelConfig:
    """Parse `config.json` in a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return config_from_hf(json.loads(file.read_text()), name=file.parent.name)


_MODEL_TYPE_BY_FAMILY = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen3_5_text"}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face style config.json for `config` that `config_from_hf` reads back to the
    same ModelConfig: what a checkpoint written from a GGUF file or a preset carries."""
    raw: dict[str, Any] = {
        "model_type": _MODEL_TYPE_BY_FAMILY[config.family],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.partial_rotary_factor,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "_name_or_path": config.name,
    }
    if config.rope_scaling:
        raw["rope_scaling"] = dict(config.rope_scaling)
    if config.family == "qwen3_5":
        raw["layer_types"] = list(config.layer_types)
        for key in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        ):
            raw[key] = getattr(config, key)
    return raw
