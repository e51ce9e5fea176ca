"""The TurboQuant codec (worker/kvcache/turboquant.py): rotation, Lloyd-Max codebook, packing,
and the mean squared error of unit vectors against the paper's figures (arXiv 2504.19874)."""

from __future__ import annotations

import math

import pytest
import torch

from worker.kvcache import turboquant as tq

D = 256

# The paper's D_mse for b = 1..4 (Theorem 1's table): 0.36, 0.117, 0.03, 0.009. Its 3-bit figure
# is rounded from 0.0345, the error of Max's 8-level Gaussian quantizer (1 - 2/pi = 0.363 at 1
# bit), so the 3-bit check is against 0.0345.
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.0345, 4: 0.009}


def unit_vectors(n: int, dim: int = D, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def test_rotation_is_orthogonal_and_matches_its_matrix():
    x = torch.randn(7, 3, D)
    m = tq.rotation_matrix(D)
    assert torch.allclose(m @ m.T, torch.eye(D), atol=1e-5)
    assert torch.allclose(tq.rotate(x), x @ m, atol=1e-5)
    assert torch.allclose(tq.unrotate(tq.rotate(x)), x, atol=1e-5)
    q, k = torch.randn(5, D), torch.randn(5, D)
    inner = (tq.rotate(q) * tq.rotate(k)).sum(-1)
    assert torch.allclose(inner, (q * k).sum(-1), rtol=1e-4, atol=1e-4)
    # the sign flips matter: the plain Hadamard matrix would map e_0 to a constant vector
    assert not torch.allclose(tq.rotate(torch.eye(D)[0]), torch.full((D,), D**-0.5))


def test_fwht_is_the_hadamard_matrix():
    h = torch.tensor([[1.0]])
    while h.shape[0] < 16:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(4, 16)
    assert torch.allclose(tq.fwht(x), x @ h, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        tq.fwht(torch.randn(3, 12))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_is_symmetric_and_sorted(bits: int):
    centroids, bounds = tq.codebook(D, bits)
    assert centroids.shape == (1 << bits,) and bounds.shape == ((1 << bits) - 1,)
    assert (centroids.diff() > 0).all() and (bounds.diff() > 0).all()
    assert torch.allclose(centroids, -centroids.flip(0), atol=1e-6)
    # boundaries sit halfway between neighbouring centroids (the nearest-centroid rule)
    assert torch.allclose(bounds, (centroids[1:] + centroids[:-1]) / 2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_unit_vector_mse_matches_the_paper(bits: int):
    x = unit_vectors(4000)
    x_hat = tq.decode(tq.encode(x, bits), bits, D)
    measured = (x - x_hat).pow(2).sum(-1).mean().item()
    assert abs(measured - PAPER_MSE[bits]) <= 0.1 * PAPER_MSE[bits], measured
    assert abs(tq.expected_unit_mse(D, bits) - PAPER_MSE[bits]) <= 0.1 * PAPER_MSE[bits]
    # and below the paper's upper bound sqrt(3) pi / 2 * 4^-b
    assert measured < math.sqrt(3) * math.pi / 2 * 4.0**-bits


def test_more_bits_less_error_and_norms_kept():
    x = torch.randn(500, D) * 7
    errors = []
    for bits in (1, 2, 3, 4):
        enc = tq.encode(x, bits)
        assert enc.codes.dtype == torch.uint8 and enc.codes.shape == (500, D * bits // 8)
        assert torch.allclose(enc.norms.float(), x.norm(dim=-1), rtol=1e-3)
        errors.append(((tq.decode(enc, bits, D) - x).norm() / x.norm()).item())
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.11


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pack_roundtrip(bits: int):
    codes = torch.randint(0, 1 << bits, (3, 2, D))
    packed = tq.pack_codes(codes, bits)
    assert packed.shape == (3, 2, tq.packed_bytes(D, bits))
    assert torch.equal(tq.unpack_codes(packed, bits, D), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_a_folded_code_is_its_sign_and_magnitude(bits: int):
    """Stored codes: the top bit the sign, the low bits a magnitude of the lower half."""
    centroids, _ = tq.codebook(256, bits)
    codes = torch.arange(1 << bits)
    folded = tq.fold_codes(codes, bits)
    assert torch.equal(tq.fold_codes(folded, bits), codes)  # an involution
    half = 1 << (bits - 1)
    sign = torch.where(folded >= half, -1.0, 1.0)
    assert torch.equal(centroids[codes], sign * centroids[folded % half])


def test_pack_layout_is_an_lsb_first_bit_stream():
    # 3-bit codes 1..8 (mod 8): coordinate 2 straddles bytes 0 and 1
    codes = torch.tensor([[5, 3, 6, 1, 7, 0, 2, 4]])
    packed = tq.pack_codes(codes, 3)
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert packed[0].tolist() == [(stream >> (8 * j)) & 0xFF for j in range(3)]
    assert tq.pack_codes(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]


def test_bytes_per_vector():
    assert tq.bytes_per_vector(256, 4) == 130 and tq.bytes_per_vector(256, 3) == 98
    with pytest.raises(ValueError, match="bits"):
        tq.codebook(D, 5)
