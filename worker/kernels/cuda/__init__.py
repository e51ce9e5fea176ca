"""CUDA C++ kernels, for what Triton does not express (the int4 GEMV's loads in mma fragment
order, the staged-KV decode's codes decoded straight into mma fragments). Built with nvcc on first use (`build.py`); importing this package registers them with
`worker.kernels.ops`, each with the reason it can or cannot run here."""

from __future__ import annotations

import torch

from worker.kernels import ops
from worker.kernels.cuda import int4_mma, staged_decode


def _int4_mma_supported(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"needs bf16/fp16 activations, got {dtype}"
    return int4_mma.available(device)


ops.register(
    "int4_mma_linear", int4_mma.int4_mma_linear, _int4_mma_supported, name="cuda.int4_mma_linear"
)
ops.register(
    "int4_mma_linear_silu_mul",
    int4_mma.int4_mma_linear_silu_mul,
    _int4_mma_supported,
    name="cuda.int4_mma_gate_up_silu_mul",
)
ops.register(
    "int4_mma_linear_of_silu_mul",
    int4_mma.int4_mma_linear_of_silu_mul,
    _int4_mma_supported,
    name="cuda.int4_mma_linear_of_silu_mul",
)


def _int4_mma_x8_supported(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    if dtype != torch.bfloat16:
        return False, f"int8 products write bf16, asked for {dtype}"
    return int4_mma.available(device)


ops.register(
    "int4_mma_linear_x8",
    int4_mma.int4_mma_linear_x8,
    _int4_mma_x8_supported,
    name="cuda.int4_mma_linear_x8",
)
ops.register(
    "int4_mma_linear_silu_mul_x8",
    int4_mma.int4_mma_linear_silu_mul_x8,
    _int4_mma_x8_supported,
    name="cuda.int4_mma_gate_up_silu_mul_x8",
)
# above the Triton kernel (priority 10), which still takes the shapes this one does not
ops.register(
    "staged_attention_decode",
    staged_decode.staged_attention_decode,
    staged_decode.available,
    priority=20,
    name="cuda.staged_decode",
)
