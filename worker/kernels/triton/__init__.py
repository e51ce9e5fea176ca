"""Triton kernels for the hybrid (Gated DeltaNet + gated attention) and dense models.

Importing this package registers each kernel with `worker.kernels.ops` (the registry imports it
lazily). Each kernel matches its plain-PyTorch reference in `worker.kernels.reference`; the tests
in tests/worker/test_triton_kernels.py check that under the triton interpreter on CPU, and at the
27B shapes on a GPU (`-m gpu`); bench/kernels/triton_kernels.py times them against their byte
counts.
"""

from __future__ import annotations

import torch

from worker.kernels import ops
from worker.kernels.triton.activations import gdn_gates, sigmoid_mul, sigmoid_mul_x8, silu_mul
from worker.kernels.triton.conv1d import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    conv_update_with_ba_gates,
    conv_update_with_gates,
)
from worker.kernels.triton.delta_rule import gated_delta_rule_decode, gated_delta_rule_prefill
from worker.kernels.triton.embedding import embedding
from worker.kernels.triton.fp8_gemm import (
    fp8_linear,
    fp8_linear_of_silu_mul,
    linear,
    linear_silu_mul,
)
from worker.kernels.triton.int4_gemm import int4_linear, int4_linear_silu_mul
from worker.kernels.triton.kv_cache import write_kv_cache
from worker.kernels.triton.norm import (
    add_rms_norm,
    add_rms_norm_x8,
    gated_rms_norm,
    gated_rms_norm_x8,
    rms_norm,
    rms_norm_x8,
)
from worker.kernels.triton.paged_attention import paged_attention_decode, paged_attention_prefill
from worker.kernels.triton.rotary import apply_rotary, qk_norm_rotary, qk_norm_rotary_write_kv
from worker.kernels.triton.x8 import quantize_x8

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def cuda_attention(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """The paged attention kernel: CUDA, 16-bit queries, a 16-bit or fp8 e4m3 cache."""
    ok, reason = ops.cuda_only(device, dtype, kv_dtype)
    if not ok:
        return ok, reason
    if dtype not in (torch.bfloat16, torch.float16) or (kv_dtype or dtype) not in _KV_DTYPES:
        return False, f"needs bf16/fp16 queries and a bf16/fp16/fp8-e4m3 cache, got {kv_dtype}"
    return True, f"CUDA, {kv_dtype or dtype} cache"


def cuda_half(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """FP8 weight GEMMs: CUDA with 16-bit activations (w8a16 dots in fp16, scaled_mm out bf16)."""
    ok, reason = ops.cuda_only(device, dtype, kv_dtype)
    if not ok:
        return ok, reason
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"needs bf16/fp16 activations, got {dtype}"
    return True, f"CUDA, {dtype} activations"


ops.register("embedding", embedding, ops.cuda_only, name="triton.embedding")
ops.register("rms_norm", rms_norm, ops.cuda_only, name="triton.rms_norm")
ops.register("add_rms_norm", add_rms_norm, ops.cuda_only, name="triton.add_rms_norm")
ops.register("gated_rms_norm", gated_rms_norm, ops.cuda_only, name="triton.gated_rms_norm")
ops.register("apply_rotary", apply_rotary, ops.cuda_only, name="triton.apply_rotary")
ops.register("qk_norm_rotary", qk_norm_rotary, ops.cuda_only, name="triton.qk_norm_rotary")
ops.register(
    "qk_norm_rotary_write_kv",
    qk_norm_rotary_write_kv,
    cuda_attention,
    name="triton.qk_norm_rotary_write_kv",
)
ops.register("rms_norm_x8", rms_norm_x8, ops.cuda_only, name="triton.rms_norm_x8")
ops.register("add_rms_norm_x8", add_rms_norm_x8, ops.cuda_only, name="triton.add_rms_norm_x8")
ops.register("gated_rms_norm_x8", gated_rms_norm_x8, ops.cuda_only, name="triton.gated_rms_norm_x8")
ops.register("sigmoid_mul_x8", sigmoid_mul_x8, ops.cuda_only, name="triton.sigmoid_mul_x8")
ops.register("quantize_x8", quantize_x8, ops.cuda_only, name="triton.quantize_x8")
ops.register("silu_mul", silu_mul, ops.cuda_only, name="triton.silu_mul")
ops.register("sigmoid_mul", sigmoid_mul, ops.cuda_only, name="triton.sigmoid_mul")
ops.register("gdn_gates", gdn_gates, ops.cuda_only, name="triton.gdn_gates")
ops.register("causal_conv1d_update", causal_conv1d_update, name="triton.causal_conv1d_update")
ops.register("conv_update_with_gates", conv_update_with_gates, name="triton.conv_update_with_gates")
ops.register(
    "conv_update_with_ba_gates", conv_update_with_ba_gates, name="triton.conv_update_with_ba_gates"
)
ops.register("causal_conv1d_prefill", causal_conv1d_prefill, name="triton.causal_conv1d_prefill")
ops.register("gated_delta_rule_decode", gated_delta_rule_decode, name="triton.gdn_decode")
ops.register("gated_delta_rule_prefill", gated_delta_rule_prefill, name="triton.gdn_chunked")
ops.register(
    "paged_attention_decode", paged_attention_decode, cuda_attention, name="triton.paged_decode"
)
ops.register(
    "paged_attention_prefill", paged_attention_prefill, cuda_attention, name="triton.paged_prefill"
)
ops.register("write_kv_cache", write_kv_cache, cuda_attention, name="triton.write_kv_cache")
ops.register("fp8_linear", fp8_linear, cuda_half, name="triton.fp8_linear")
ops.register(
    "fp8_linear_of_silu_mul",
    fp8_linear_of_silu_mul,
    cuda_half,
    name="triton.silu_mul_quantize_rows+fp8_linear",
)
ops.register("linear", linear, cuda_half, name="triton.linear")
ops.register("linear_silu_mul", linear_silu_mul, cuda_half, name="triton.gate_up_silu_mul_gemv")
ops.register("int4_linear", int4_linear, cuda_half, name="triton.int4_linear")
ops.register(
    "int4_linear_silu_mul", int4_linear_silu_mul, cuda_half, name="triton.int4_gate_up_silu_mul"
)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_x8",
    "apply_rotary",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "conv_update_with_ba_gates",
    "conv_update_with_gates",
    "embedding",
    "fp8_linear",
    "fp8_linear_of_silu_mul",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "gated_rms_norm",
    "gated_rms_norm_x8",
    "gdn_gates",
    "int4_linear",
    "int4_linear_silu_mul",
    "linear",
    "linear_silu_mul",
    "paged_attention_decode",
    "paged_attention_prefill",
    "qk_norm_rotary",
    "qk_norm_rotary_write_kv",
    "quantize_x8",
    "rms_norm",
    "rms_norm_x8",
    "sigmoid_mul",
    "sigmoid_mul_x8",
    "silu_mul",
    "write_kv_cache",
]
