"""Weights from Hugging Face safetensors checkpoints (one file or sharded with an index),
memory-mapped and copied tensor by tensor into a model already allocated on its device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from worker.loading.config import load_hf_config
from worker.models.causal_lm import CausalLM, build_empty

# Checkpoint prefixes of parts we do not serve (vision tower, multi-token-prediction head).
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
# Multimodal Qwen3.5 checkpoints nest the language model one level deeper.
_RENAMED_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."))


def checkpoint_name_to_param(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor, or None if we skip it."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


@torch.no_grad()
def load_safetensors_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint into the model (cast to the model's dtype); every
    model parameter must be found exactly once."""
    params = dict(model.named_parameters())
    missing = set(params)
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = checkpoint_name_to_param(name)
                if target is None or (target == "lm_head.weight" and model.lm_head is None):
                    continue
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                tensor = f.get_tensor(name)
                param = params[target]
                if tensor.shape != param.shape:
                    raise ValueError(
                        f"{name}: checkpoint {tuple(tensor.shape)} != model {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                missing.discard(target)
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:8]} ({len(missing)} tensors)")


def load_hf_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> CausalLM:
    """A model from a Hugging Face checkpoint directory (config.json + safetensors); a quantized
    one goes to `worker.loading.quantized` (built on meta, never 16-bit on the device)."""
    from worker.loading.quantized import is_quantized_checkpoint, load_quantized_model

    if is_quantized_checkpoint(path):
        return load_quantized_model(path, device, dtype)
    model = build_empty(load_hf_config(path), device, dtype)
    load_safetensors_weights(model, path)
    return model
