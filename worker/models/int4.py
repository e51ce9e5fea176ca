"""Int4 weights with group-wise fp16 scales (docs/worker-contract.md, "Int4 weights").

The layout, shared by the quantizer, the checkpoint loaders and the kernels:
- `qweight` uint8 [N, K / 2]: byte j of row n holds k = 2j in its low nibble and k = 2j + 1 in
  its high nibble (unsigned codes 0..15). Row-major, so a kernel's [BN, BK / 2] tile is BN runs
  of BK / 2 contiguous bytes: 16-byte vector loads.
- `scales` fp16 [N, ceil(K / group_size)], one per group of `group_size` consecutive k.
- `mins` fp16 of the same shape, or None. Symmetric groups (None): w = (q - 8) * s.
  Affine groups: w = q * s + m, which GGUF Q4_1 stores as is and GPTQ's (q - z) * s maps onto
  with m = -z * s; GGUF Q4_0 is symmetric with group 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class Int4Tensors:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 (K even) -> packed uint8 [N, K / 2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even K, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K / 2] -> uint8 codes [N, K]."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(*qweight.shape[:-1], -1)


@torch.no_grad()
def quantize_rtn(
    weight: torch.Tensor, group_size: int = 128, symmetric: bool = True
) -> Int4Tensors:
    """Round-to-nearest int4 of a [N, K] weight, per group of `group_size` k (the last group may
    be shorter). Symmetric, as GGUF Q4_0: s = (the group's largest-magnitude
    value) / -8, so that value is code 0 exactly and the other side reaches 7 |s| (s may be
    negative). Affine: s = (max - min) / 15, m = min."""
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.zeros(n, groups * group_size, dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.float()
    g = padded.view(n, groups, group_size)
    if symmetric:
        # pad columns are zero, so they never raise a group's amax
        idx = g.abs().argmax(dim=-1, keepdim=True)
        extreme = g.gather(-1, idx).squeeze(-1)
        extreme = torch.where(extreme.abs() < 1e-10, torch.full_like(extreme, 1e-10), extreme)
        scales = (extreme / -8.0).to(SCALE_DTYPE)
        s = scales.float().unsqueeze(-1)
        codes = ((g / s).round() + 8).clamp(0, 15)
        mins = None
    else:
        real = torch.arange(groups * group_size, device=weight.device).view(groups, group_size) < k
        lo = torch.where(real, g, torch.inf).amin(dim=-1)
        hi = torch.where(real, g, -torch.inf).amax(dim=-1)
        scales = ((hi - lo).clamp_min(1e-10) / 15.0).to(SCALE_DTYPE)
        mins = lo.to(SCALE_DTYPE)
        s = scales.float().unsqueeze(-1)
        codes = ((g - mins.float().unsqueeze(-1)) / s).round().clamp(0, 15)
    qweight = pack_int4(codes.view(n, -1)[:, :k].to(torch.uint8))
    return Int4Tensors(qweight, scales, mins, group_size)
