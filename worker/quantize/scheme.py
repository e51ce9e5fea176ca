"""Which tensors of a checkpoint become int4, which FP8 and which stay 16-bit, and the
`quantization_config` a quantized checkpoint carries (docs/worker-contract.md, "Int4 weights").

The default scheme (`w4-g128`): embeddings, norms, the DeltaNet conv, the DeltaNet gate
projections `in_proj_a` / `in_proj_b` (a few rows each whose outputs go through exp/softplus and
sigmoid, so an error there is amplified, and they are too small to matter for bytes) and every
non-2-D tensor stay 16-bit; the LM head is FP8 per output channel (a 4-bit head moves
perplexity much more than any one body matrix); every other 2-D linear weight is int4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from worker.models.int4 import FP8, INT4, METHODS, QuantizationConfig

__all__ = ["BF16", "FP8", "INT4", "LM_HEAD_MODES", "METHODS", "Scheme"]

BF16 = "bf16"
LM_HEAD_MODES = (FP8, INT4, BF16)

# Leaves of 2-D weights that stay 16-bit whatever the scheme.
_KEPT_16BIT = ("embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "conv1d")


@dataclass(frozen=True)
class Scheme:
    group_size: int = 128
    symmetric: bool = True
    lm_head: str = FP8

    @classmethod
    def parse(cls, name: str, lm_head: str = FP8) -> Scheme:
        """`w4-g<group>` (symmetric), `w4-g<group>-sym` or `w4-g<group>-asym`."""
        match = re.fullmatch(r"w4-g(\d+)(-sym|-asym)?", name)
        if not match or int(match[1]) < 2 or int(match[1]) % 2:
            raise ValueError(f"unknown scheme {name!r}: expected w4-g<even group size>[-sym|-asym]")
        if lm_head not in LM_HEAD_MODES:
            raise ValueError(f"--lm-head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
        return cls(int(match[1]), match[2] != "-asym", lm_head)

    def kind(self, param: str, shape: tuple[int, ...]) -> str | None:
        """INT4, FP8 or None (16-bit) for one of our parameters (HF naming, `.weight` included)."""
        if len(shape) != 2 or not param.endswith(".weight"):
            return None
        prefix = param[: -len(".weight")]
        if prefix == "lm_head":
            mode = None if self.lm_head == BF16 else self.lm_head
            return None if mode == INT4 and shape[1] % 2 else mode
        if any(prefix.endswith(k) or f".{k}." in f".{prefix}." for k in _KEPT_16BIT):
            return None
        if "norm" in prefix.rsplit(".", 1)[-1]:
            return None
        if shape[1] % 2:  # two codes a byte: an odd K cannot be packed
            return None
        return INT4

    def quantization_config(self, method: str, modules: dict[str, str]) -> dict[str, Any]:
        """The config.json entry the loaders read (`worker.models.int4.QuantizationConfig`)."""
        qc = QuantizationConfig(dict(modules), self.group_size, self.symmetric, method)
        return dict(qc.to_json())
