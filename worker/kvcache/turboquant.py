"""TurboQuant (arXiv 2504.19874), the MSE variant: a vector x of dimension d is stored as its
norm (fp16) and b-bit codes of the coordinates of the rotated unit vector R x / |x|.

- R is a randomized Hadamard transform: fixed seeded sign flips, then the fast Walsh-Hadamard
  transform scaled by 1/sqrt(d) (orthogonal, so <R q, R k> = <q, k>).
- After a random rotation each coordinate of a unit vector follows the density
  f(t) ~ (1 - t^2)^((d - 3) / 2) on [-1, 1] (about N(0, 1/d)); the b-bit scalar quantizer is the
  Lloyd-Max quantizer of that density, computed once per (d, b) in `codebook`.
- Codes are stored folded (`fold_codes`: the upper half of the codebook mirrored, so a code's
  low b - 1 bits index the magnitudes of the lower half and its top bit is the sign) and packed
  LSB-first into a bit stream of d * b / 8 bytes: coordinate i holds bits [b i, b i + b) (a
  3-bit code may straddle two bytes). `pack_codes` / `unpack_codes`.

The expected squared error of a unit vector is d * E[(t - Q(t))^2]: 0.363, 0.118, 0.0345,
0.0095 at 1-4 bits (the paper's 0.36 / 0.117 / 0.03 / 0.009).

Everything here is plain PyTorch: the definition the Triton kernels
(`worker/kernels/triton/turboquant.py`) are tested against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

ROTATION_SEED = 0x7E5D  # one fixed rotation: every layer and head shares it
MAX_BITS = 4  # codes are decoded by table lookup; 16 centroids at most keeps the table tiny


def _check_dim(dim: int) -> None:
    if dim < 2 or dim & (dim - 1):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two dimension, got {dim}")


@functools.lru_cache(maxsize=8)
def rotation_signs(dim: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """The fixed random sign flips [dim] (fp32, +-1) applied before the Hadamard transform."""
    _check_dim(dim)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized fast Walsh-Hadamard transform over the last axis (fp32 result)."""
    dim = x.shape[-1]
    _check_dim(dim)
    lead = x.shape[:-1]
    y = x.float().reshape(-1, dim)
    h = 1
    while h < dim:
        pairs = y.view(-1, dim // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, dim)
        h *= 2
    return y.reshape(*lead, dim)


def rotate(x: torch.Tensor, seed: int = ROTATION_SEED) -> torch.Tensor:
    """R x over the last axis: sign flips, Walsh-Hadamard, / sqrt(d). fp32."""
    dim = x.shape[-1]
    signs = rotation_signs(dim, seed).to(x.device)
    return fwht(x.float() * signs) / math.sqrt(dim)


def unrotate(y: torch.Tensor, seed: int = ROTATION_SEED) -> torch.Tensor:
    """R^T y (R is orthogonal and the normalized Hadamard matrix is symmetric). fp32."""
    dim = y.shape[-1]
    signs = rotation_signs(dim, seed).to(y.device)
    return fwht(y.float()) / math.sqrt(dim) * signs


@functools.lru_cache(maxsize=8)
def _rotation_matrix_cpu(dim: int, seed: int) -> torch.Tensor:
    return rotate(torch.eye(dim), seed)


def rotation_matrix(
    dim: int, device: torch.device | str = "cpu", seed: int = ROTATION_SEED
) -> torch.Tensor:
    """M [dim, dim] fp32 with rotate(x) == x @ M and unrotate(y) == y @ M.T: on a GPU one GEMM
    applies the rotation to a whole batch of heads."""
    return _rotation_matrix_cpu(dim, seed).to(device)


# ---------------------------------------------------------------- Lloyd-Max codebook


def _coordinate_density(dim: int, points: int = 1 << 15) -> tuple[torch.Tensor, torch.Tensor]:
    """A grid over the coordinate's support and its normalized probability masses (fp64): the
    exact density (1 - t^2)^((d - 3) / 2), truncated at 14 standard deviations."""
    reach = min(1.0, 14.0 / math.sqrt(dim))
    t = torch.linspace(-reach, reach, points, dtype=torch.float64)
    log_f = 0.5 * (dim - 3) * torch.log1p(-(t * t).clamp(max=1 - 1e-12))
    w = torch.exp(log_f - log_f.max())
    return t, w / w.sum()


@functools.lru_cache(maxsize=32)
def _codebook_cpu(dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be 1..{MAX_BITS}, got {bits}")
    t, w = _coordinate_density(dim)
    levels = 1 << bits
    # start at the quantiles' midpoints, then alternate boundaries (midpoints) and centroids
    # (conditional means) until the centroids stop moving
    cdf = w.cumsum(0)
    centroids = t[
        torch.searchsorted(cdf, (torch.arange(levels) + 0.5) / levels).clamp(max=len(t) - 1)
    ]
    for _ in range(500):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cell = torch.bucketize(t, bounds)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w * t)
        updated = moment / mass.clamp_min(1e-300)
        if torch.allclose(updated, centroids, rtol=0, atol=1e-9 / math.sqrt(dim)):
            centroids = updated
            break
        centroids = updated
    bounds = (centroids[1:] + centroids[:-1]) / 2
    cell = torch.bucketize(t, bounds)
    mse = float((w * (t - centroids[cell]) ** 2).sum()) * dim
    # the boundaries as the kernels form them: midpoints of the fp32 centroids
    c32 = centroids.float()
    return c32, (c32[1:] + c32[:-1]) / 2, mse


def codebook(
    dim: int, bits: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [2^b], boundaries [2^b - 1]) fp32, ascending: the Lloyd-Max quantizer of one
    coordinate of a randomly rotated unit vector in dimension `dim`."""
    centroids, bounds, _ = _codebook_cpu(dim, bits)
    return centroids.to(device), bounds.to(device)


def expected_unit_mse(dim: int, bits: int) -> float:
    """E |u - decode(encode(u))|^2 for a unit vector u under the codebook's own density."""
    return _codebook_cpu(dim, bits)[2]


# ---------------------------------------------------------------- bit packing


def packed_bytes(dim: int, bits: int) -> int:
    if dim * bits % 8:
        raise ValueError(f"{dim} coordinates of {bits} bits do not fill whole bytes")
    return dim * bits // 8


def fold_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Centroid indices <-> their stored form (an involution): an index c in the upper half,
    c >= h = 2^(b-1), becomes c ^ (h - 1). With the symmetric codebook (c[2^b - 1 - i] =
    -c[i]) the stored code's low b - 1 bits then index the magnitudes c[0..h) and its top bit
    is the sign, so a decoder takes both off the bits as they are, with no mirror per code."""
    half = 1 << (bits - 1)
    return codes ^ ((codes >> (bits - 1)) * (half - 1))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., d] (integers < 2^bits) -> uint8 [..., d * bits / 8], LSB-first bit stream."""
    dim = codes.shape[-1]
    nbytes = packed_bytes(dim, bits)
    shifts = torch.arange(bits, device=codes.device)
    stream = (codes.long().unsqueeze(-1) >> shifts) & 1  # [..., d, bits]: bit b*i + j
    stream = stream.reshape(*codes.shape[:-1], nbytes, 8)
    weights = 1 << torch.arange(8, device=codes.device)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `pack_codes`: uint8 [..., d * bits / 8] -> int64 codes [..., d]."""
    bit = (packed.long().unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1
    bit = bit.reshape(*packed.shape[:-1], dim, bits)
    return (bit << torch.arange(bits, device=packed.device)).sum(-1)


# ---------------------------------------------------------------- the codec


@dataclass(frozen=True)
class Encoded:
    codes: torch.Tensor  # uint8 [..., d * bits / 8], folded codes packed
    norms: torch.Tensor  # fp16 [...]


def quantize_rotated(y: torch.Tensor, bits: int) -> Encoded:
    """Encode vectors already in the rotated basis (y = R x): norm, then each coordinate of
    y / |y| to its nearest centroid."""
    dim = y.shape[-1]
    yf = y.float()
    norms = yf.norm(dim=-1)
    unit = yf / norms.clamp_min(1e-30).unsqueeze(-1)
    _, bounds = codebook(dim, bits, y.device)
    codes = torch.bucketize(unit, bounds)
    return Encoded(pack_codes(fold_codes(codes, bits), bits), norms.to(torch.float16))


def dequantize_rotated(encoded: Encoded, bits: int, dim: int) -> torch.Tensor:
    """The rotated-basis vectors [..., d] (fp32) the codes stand for: centroid * norm."""
    centroids, _ = codebook(dim, bits, encoded.codes.device)
    values = centroids[fold_codes(unpack_codes(encoded.codes, bits, dim), bits)]
    return values * encoded.norms.float().unsqueeze(-1)


def encode(x: torch.Tensor, bits: int) -> Encoded:
    """TurboQuant-MSE of each vector x [..., d]: rotate, then `quantize_rotated`."""
    return quantize_rotated(rotate(x), bits)


def decode(encoded: Encoded, bits: int, dim: int) -> torch.Tensor:
    """x_hat [..., d] (fp32): the centroids un-rotated, times the norm."""
    return unrotate(dequantize_rotated(encoded, bits, dim))


def bytes_per_vector(dim: int, bits: int) -> int:
    """Stored bytes of one encoded vector: packed codes + an fp16 norm."""
    return packed_bytes(dim, bits) + 2
