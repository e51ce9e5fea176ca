"""Store k, v of the fed tokens into the paged caches: one program per token, no host sync (the
reference's masked indexing syncs), so it runs inside a captured decode graph. Negative slots are
skipped; FP8 caches store value / scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel, pdl_wait


@kernel
def _write_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_k,
    stride_v,
    inv_k_scale,
    inv_v_scale,
    ROW: tl.constexpr,
    BR: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot >= 0:
        cols = tl.arange(0, BR)
        mask = cols < ROW
        dst = slot.to(tl.int64) * ROW + cols
        kr = tl.load(k + token * stride_k + cols, mask=mask, other=0.0).to(tl.float32)
        vr = tl.load(v + token * stride_v + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(k_cache + dst, (kr * inv_k_scale).to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, (vr * inv_v_scale).to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v [T, Hkv, D] (rows contiguous per token) into caches [num_blocks, block_size, Hkv, D]."""
    tokens, heads, dim = k.shape
    inv_k_scale, inv_v_scale = inverse_scales(k_cache, v_cache, k_scale, v_scale)
    k, v = k.reshape(tokens, heads * dim), v.reshape(tokens, heads * dim)
    if k.stride(1) != 1 or v.stride(1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        inv_k_scale,
        inv_v_scale,
        ROW=heads * dim,
        BR=triton.next_power_of_2(heads * dim),
        num_warps=4,
    )


def inverse_scales(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float
) -> tuple[float, float]:
    """What a kernel writing k and v into these caches multiplies them by: 1 / scale for fp8
    caches, 1 for 16-bit ones. Refuses caches that are not contiguous."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if k_cache.dtype.itemsize == 1:
        return 1.0 / k_scale, 1.0 / v_scale
    return 1.0, 1.0
