"""The plane-word int4 decode GEMVs (worker/kernels/triton/int4_gemv.py) against the plain-PyTorch
reference, under the triton interpreter at small shapes: the repack is lossless, and each form
(tensor-core dots per plane or per pair plane, the weight as either operand; CUDA-core FMA) agrees by relative error, with
symmetric and affine groups smaller than, equal to and larger than a plane block, bias, and K
split across programs (arrival counters re-armed). With `-m gpu`, at the Qwen3.6-27B shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tests.worker.numerics import rel_err  # noqa: E402
from worker.kernels import reference  # noqa: E402
from worker.kernels.triton.fp8_gemm import _arrivals  # noqa: E402
from worker.kernels.triton.int4_gemv import (  # noqa: E402
    PlaneTiling,
    int4_plane_gemv,
    pack_planes,
    supports,
    unpack_planes,
)
from worker.models.int4 import pack_int4, quantize_rtn  # noqa: E402

GPU = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("pairs", [False, True])
def test_plane_packing_is_lossless_and_places_each_k(pairs: bool) -> None:
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    qweight = pack_int4(codes)
    words = pack_planes(qweight, pairs)
    assert words.dtype == torch.int32 and words.shape == (3, 32)
    assert torch.equal(unpack_planes(words, pairs), qweight)
    # the documented position of k: block b, word w, nibble p
    nibbles = torch.stack([(words >> (4 * p)) & 0xF for p in range(8)], dim=-1)  # [3, 32, 8]
    for k in (0, 1, 17, 63, 64, 127, 128, 200, 255):
        b, r = divmod(k, 128)
        if pairs:
            j, rest = divmod(r, 32)
            w, h = divmod(rest, 2)
            p = j + 4 * h
        else:
            p, w = divmod(r, 16)
        assert torch.equal(nibbles[:, 16 * b + w, p].to(torch.uint8), codes[:, k])


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "symmetric", "mode", "tiling", "with_bias"),
    [
        (1, 40, 256, 128, True, "dot", PlaneTiling(16, 1, 1), False),
        (3, 40, 512, 64, False, "dot", PlaneTiling(16, 2, 2), True),  # affine, split, 2 blocks
        (16, 40, 384, 256, True, "dot", None, False),  # a group over 2 blocks, default tiling
        (1, 40, 256, 128, True, "pairs", PlaneTiling(16, 1, 1), False),
        (8, 48, 256, 32, True, "pairs", PlaneTiling(16, 1, 2), False),  # 4 groups per block
        (5, 40, 512, 128, False, "pairs", PlaneTiling(32, 2, 2), True),  # N % BN != 0
        (16, 40, 384, 256, False, "pairs", None, False),
        (1, 40, 256, 128, True, "pairs-xa", PlaneTiling(16, 1, 1), False),
        (5, 40, 512, 128, False, "pairs-xa", PlaneTiling(32, 2, 2), True),
        (16, 40, 384, 256, True, "pairs-xa", None, False),
        (1, 40, 256, 128, True, "halves", PlaneTiling(16, 1, 1), False),
        (3, 40, 512, 64, False, "halves", PlaneTiling(16, 2, 2), True),
        (16, 48, 256, 32, True, "halves", None, False),
        (1, 40, 256, 128, True, "halves-biased", PlaneTiling(16, 1, 1), False),
        (5, 40, 512, 128, False, "halves-biased", PlaneTiling(32, 2, 2), True),
        (16, 40, 384, 256, True, "halves-biased", None, False),
        (1, 40, 256, 128, True, "fma", PlaneTiling(16, 1, 1), False),
        (2, 40, 512, 128, False, "fma", PlaneTiling(16, 1, 3), True),  # ragged splits
        (4, 48, 256, 32, True, "fma", PlaneTiling(16, 1, 2), False),
        (3, 40, 256, 64, False, "fma", PlaneTiling(16, 1, 1), True),
        (3, 40, 384, 256, False, "fma", None, False),
    ],
)
def test_plane_gemv_matches_reference(m, n, k, group, symmetric, mode, tiling, with_bias) -> None:
    torch.manual_seed(m * n + k + group)
    check(m, n, k, group, symmetric, mode, tiling, with_bias, "cpu")


def check(
    m: int,
    n: int,
    k: int,
    group: int,
    symmetric: bool,
    mode: str,
    tiling: PlaneTiling | None,
    with_bias: bool,
    device: str,
) -> None:
    q = quantize_rtn(torch.randn(n, k, device=device) * 0.02, group, symmetric)
    words = pack_planes(q.qweight, pairs=mode != "dot" and mode != "fma")
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16() if with_bias else None
    for _ in range(2):  # again: the first call must have re-armed the counters
        out = int4_plane_gemv(x, words, q.scales, q.mins, group, bias, mode, tiling)
        assert out.shape == (m, n) and out.dtype == x.dtype
        ref = reference.int4_linear(x, q.qweight, q.scales, q.mins, group, bias)
        assert rel_err(out, ref) < 1e-2
    counters = _arrivals.get(x.device)
    assert counters is None or counters.count_nonzero() == 0


def test_plane_gemv_refuses_what_it_cannot_step_through() -> None:
    assert supports(5120, 128) and supports(17408, 128, pairs=True)
    assert not supports(576, 128)  # K not in whole 128-k blocks
    assert not supports(256, 16, pairs=True)  # a pair slice (32 k) would span two groups
    q = quantize_rtn(torch.randn(8, 256) * 0.02, 128, True)
    x = torch.randn(17, 256).bfloat16()
    with pytest.raises(ValueError, match="at most 16 rows"):
        int4_plane_gemv(x, pack_planes(q.qweight), q.scales, None, 128)
    with pytest.raises(ValueError, match="mode"):
        int4_plane_gemv(x[:2], pack_planes(q.qweight), q.scales, None, 128, mode="wgmma")


SHAPES_27B = [(34816, 5120), (5120, 17408), (14336, 5120), (5120, 6144), (16384, 5120)]


@GPU
@needs_cuda
@pytest.mark.parametrize(("n", "k"), SHAPES_27B)
def test_gpu_plane_gemv_27b(n: int, k: int) -> None:
    torch.manual_seed(n + k)
    for mode in ("dot", "pairs", "pairs-xa", "halves", "halves-biased", "fma"):
        for m in (1, 4) if mode == "fma" else (1, 8, 16):
            check(m, n, k, 128, True, mode, None, False, "cuda")
        check(2, n, k, 128, False, mode, None, True, "cuda")


def test_variants_benchmark_smoke_runs_on_cpu(tmp_path) -> None:
    """bench/kernels/int4_variants.py --smoke: every variant checked and timed, the JSON written."""
    from bench.kernels import int4_variants

    out = tmp_path / "variants.json"
    report = int4_variants.main(
        ["--smoke", "--shapes", "smoke b", "--rows", "2", "--out", str(out), "--budget-s", "120"]
    )
    rows = report["shapes"]["smoke b"]["by_m"][2]
    names = {r["variant"] for r in rows}
    modes = ("dot", "pairs", "pairs-xa", "halves", "halves-biased", "fma")
    assert {"today", "copy"} | {f"planes-{m}/default" for m in modes} <= names
    assert all(r.get("ok", True) and "error" not in r for r in rows)
    assert out.exists()
