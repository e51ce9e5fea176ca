"""Shared by the kernel tests: how close a kernel's output is to its reference, and the random
paged KV caches the attention kernels read."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; a non-finite output fails the test outright."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def paged_cache(
    lengths: list[int], hkv: int, dim: int, block_size: int, width: int, device: str, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """Random caches and block tables with the blocks of each sequence scattered: bf16, or FP8
    with per-tensor scales; the caches, the tables and the K and V scales."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, count in enumerate(needed):
        tables[b, :count] = torch.tensor(perm[:count], dtype=torch.int32)
        perm = perm[count:]
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, device=device).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, device=device).bfloat16()
    k_scale, v_scale = 1.0, 1.0
    if fp8:
        k_scale, v_scale = 0.02, 0.03
        k_cache = (k_cache.float() / k_scale).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / v_scale).to(torch.float8_e4m3fn)
    return k_cache, v_cache, tables.to(device), k_scale, v_scale
