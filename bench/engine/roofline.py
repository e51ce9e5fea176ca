"""The roofline section: device-to-device copy bandwidth, and the decode-step floor = the bytes
a batch-8 step must move (weights + DeltaNet state read and written) / that bandwidth."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import cuda_time


def roofline(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    n = (1 << 30) if args.device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=args.device)
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=20, warmup=3)
    bandwidth = 2 * n / seconds  # bytes read + written
    params = config.num_parameters()
    state = state_bytes_per_seq(config)
    batch = args.concurrency
    rows = {}
    for name, weight_bytes in (("bf16", 2 * params), ("fp8", params)):
        step_bytes = weight_bytes + 2 * batch * state  # state read and written
        step_s = step_bytes / bandwidth
        rows[name] = {
            "weight_bytes": weight_bytes,
            "step_bytes": step_bytes,
            "decode_step_ms": step_s * 1e3,
            "decode_tok_s": batch / step_s,
        }
    return {"copy_bandwidth_gb_s": bandwidth / 1e9, "batch": batch, "configs": rows}


def state_bytes_per_seq(config: Any, value_bytes: int = 2) -> int:
    """Recurrent state bytes per sequence; the engine's default pool holds bf16 (run 11 on; fp32
    before: twice this)."""
    c = config
    layers = len(c.linear_attention_layers)
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    recurrent *= value_bytes
    return layers * recurrent
