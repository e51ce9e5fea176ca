"""Models of the torch runtime: one CausalLM for Llama, Qwen3 and Qwen3.5/3.6 hybrid."""

from worker.models.cache import AttentionCache, DeltaNetState, ModelCache
from worker.models.causal_lm import CausalLM, build_empty, build_random
from worker.models.config import ModelConfig

__all__ = [
    "AttentionCache",
    "CausalLM",
    "DeltaNetState",
    "ModelCache",
    "ModelConfig",
    "build_empty",
    "build_random",
]
