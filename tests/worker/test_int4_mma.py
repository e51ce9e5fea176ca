"""The int4-mma layout and kernels (worker/kernels/cuda/int4_mma.cu).

On CPU: the layout round-trips; a plain-PyTorch emulation of what each lane of the CUDA kernel
does (decode its 16-byte quad with the kernel's bit operations, place the values where
mma.sync m16n8k16 reads them, take x's operands from the kernel's addresses) reproduces the
reference product, so the fragment order in the .cu and the packer agree; Int4Linear in the mma
layout (the reference op here) answers as the nibble layout does. With `-m gpu`: the compiled
GEMV at every row-count class and tiling, and the dequantization, against the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.worker.numerics import rel_err
from worker.kernels import ops, reference
from worker.models.int4 import MMA, NIBBLE, Int4Linear, quantize_rtn, use_mma_kernels

GPU = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_codes(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = quantize_rtn(torch.randn(n, k, generator=gen) * 0.02, 128, True)
    return q.qweight, q.scales


@pytest.mark.parametrize(("n", "k"), [(16, 64), (32, 192), (48, 320)])
def test_pack_round_trips(n: int, k: int) -> None:
    qweight, scales = random_codes(n, k)
    words, mma_scales = reference.int4_mma_pack(qweight, scales)
    assert words.dtype == torch.int32 and tuple(words.shape) == (n // 16, k // 64, 32, 4)
    assert tuple(mma_scales.shape) == (n // 16, scales.shape[1], 16)
    back_q, back_s = reference.int4_mma_unpack(words, mma_scales)
    assert torch.equal(back_q, qweight) and torch.equal(back_s, scales)


def test_pack_refuses_ragged_shapes() -> None:
    qweight, scales = random_codes(24, 64)
    with pytest.raises(ValueError, match="N % 16"):
        reference.int4_mma_pack(qweight, scales)


def emulate_kernel(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, gc: int) -> torch.Tensor:  # fmt: skip
    """y [M <= 8, N] computed as the CUDA kernel's lanes do, one m16n8k16 product at a time."""
    m, k = x.shape
    tiles, chunks = words.shape[:2]
    y = torch.zeros(m, 16 * tiles, dtype=torch.float64)
    xs = torch.zeros(8, k, dtype=torch.float64)
    xs[:m] = x.double()
    w = (
        words.view(torch.uint8).view(tiles, chunks, 32, 4, 4).to(torch.int64)
    )  # [rt, c, lane, i, byte]
    for rt in range(tiles):
        for grp in range(-(-chunks // gc)):
            part = torch.zeros(16, 8, dtype=torch.float64)
            for c in range(grp * gc, min(chunks, (grp + 1) * gc)):
                for i in range(4):
                    a = torch.zeros(16, 16, dtype=torch.float64)  # mma rows x mma k
                    b = torch.zeros(16, 8, dtype=torch.float64)  # mma k x tokens
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        bytes_ = w[rt, c, lane, i]
                        word = int(sum(int(bytes_[j]) << (8 * j) for j in range(4)))
                        for j in range(4):  # A register j: (w >> 4j) & 0x000f000f
                            pair = (word >> (4 * j)) & 0x000F000F
                            lo, hi = (pair & 0xF) - 8, ((pair >> 16) & 0xF) - 8
                            row = g + 8 * (j & 1)
                            col = 2 * t + 8 * (j >> 1)
                            a[row, col], a[row, col + 1] = lo, hi
                        # B registers: x's 4 contiguous values at the kernel's address
                        base = c * 64 + 8 * t + 32 * (i >> 1) + 4 * (i & 1)
                        b[2 * t, g], b[2 * t + 1, g] = xs[g, base], xs[g, base + 1]
                        b[2 * t + 8, g], b[2 * t + 9, g] = xs[g, base + 2], xs[g, base + 3]
                    part += a @ b
            s = scales[rt, grp].double()  # [16] rows of the tile
            y[:, rt * 16 : rt * 16 + 16] += (part * s[:, None]).T[:m]
    return y


@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 16, 128, 128), (5, 32, 256, 64), (8, 16, 192, 128)]
)
def test_lane_emulation_matches_reference(m: int, n: int, k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(1)
    q = quantize_rtn(torch.randn(n, k, generator=gen) * 0.02, group, True)
    x = torch.randn(m, k, generator=gen)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    got = emulate_kernel(x, words, mma_scales, group // 64)
    want = x.double() @ reference.int4_dequantize(q.qweight, q.scales, None, group).double().T
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_int4_linear_in_mma_layout_answers_as_nibble() -> None:
    layer = Int4Linear.from_linear(nn.Linear(128, 48, bias=False).bfloat16(), 64)
    x = torch.randn(3, 128).bfloat16()
    want, want_act = layer(x), layer.silu_mul(x)  # a fused gate|up of 2 x 24 rows
    weight = layer.dequantize()
    layer.to_mma_layout()
    assert layer.layout == MMA and tuple(layer.qweight.shape) == (3, 2, 32, 4)
    assert torch.equal(layer(x), want)
    assert torch.equal(layer.silu_mul(x), want_act) and want_act.shape == (3, 24)
    assert torch.equal(layer.dequantize(), weight)
    layer.to_mma_layout()  # a second call keeps the layout
    assert torch.equal(layer(x), want)


def test_affine_and_small_groups_keep_the_nibble_layout() -> None:
    affine = Int4Linear.from_linear(nn.Linear(128, 32), 128, symmetric=False)
    assert not affine.mma_layout_supported()[0]
    g32 = Int4Linear.from_linear(nn.Linear(128, 32), 32)
    assert not g32.mma_layout_supported()[0]
    with pytest.raises(ValueError, match="multiple of 64"):
        g32.to_mma_layout()


def test_ctypes_signatures_match_the_source() -> None:
    """ctypes cannot check a call against the C prototype: compare them here."""
    import ctypes
    import re

    from worker.kernels.cuda import int4_mma

    source = int4_mma.SOURCE.read_text()
    for name, argtypes in int4_mma.SIGNATURES.items():
        params = re.search(rf"int {name}\(([^)]*)\)", source)
        assert params is not None, name
        kinds = [ctypes.c_void_p if "*" in p else ctypes.c_int for p in params.group(1).split(",")]
        assert kinds == argtypes, name


def test_cpu_models_keep_the_nibble_layout() -> None:
    """On CPU the registry picks the reference for int4_mma_linear: nothing is repacked."""
    model = nn.Sequential(Int4Linear.from_linear(nn.Linear(128, 32), 128))
    assert ops.select("int4_mma_linear", torch.device("cpu"), torch.bfloat16).name == "reference"
    assert use_mma_kernels(model, torch.bfloat16, 8) == 0
    assert model[0].layout == NIBBLE


def test_the_kernel_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.kernels.cuda import int4_mma

    monkeypatch.setenv("TOKENMILL_INT4_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="auto, mma or triton"):
        int4_mma.kernel_choice()
    monkeypatch.setenv("TOKENMILL_INT4_KERNEL", "triton")
    assert int4_mma.available(torch.device("cpu")) == (False, "TOKENMILL_INT4_KERNEL=triton")


# --- compiled, on a GPU ----------------------------------------------------------------------------


@GPU
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 13, 16, 24, 64])
@pytest.mark.parametrize(("n", "k"), [(256, 512), (5120, 6144), (34816, 5120)])
@pytest.mark.parametrize(
    "tiling",
    [
        None,
        (1, 4, 1, 2, 0),
        (2, 8, 3, 2, 0),
        (2, 4, 2, 4, 1),
        (1, 8, 1, 4, 1),
        (2, 8, 1, 2, 2),
        (2, 4, 3, 4, 2),
        (2, 8, 3, 2, 3),
        (1, 4, 2, 4, 3),
        (4, 8, 1, 2, 2),
        (4, 2, 2, 2, 2),
        (1, 2, 1, 2, 0),
        (4, 8, 2, 4, 4),
        (2, 4, 1, 3, 4),
        (1, 8, 2, 6, 4),
        (4, 4, 3, 2, 4),
    ],
)
def test_gemv_on_gpu(m: int, n: int, k: int, tiling: tuple[int, int, int, int, int] | None) -> None:
    from worker.kernels.cuda import int4_mma

    torch.manual_seed(0)
    q = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    x = torch.randn(m, k, device="cuda").bfloat16()
    t = None if tiling is None else int4_mma.MmaTiling(*tiling)
    got = int4_mma.gemv(x, words, mma_scales, 128, t)
    want = x.float() @ reference.int4_dequantize(q.qweight, q.scales, None, 128).T
    assert rel_err(got.float(), want) < 1e-2
    ws, arrivals = int4_mma._workspaces.get(x.device), int4_mma._arrivals.get(x.device)
    assert ws is None or ws.count_nonzero() == 0
    assert arrivals is None or arrivals.count_nonzero() == 0


@GPU
@needs_cuda
@pytest.mark.parametrize("tiling", [(4, 4, 4, 4, 2), (2, 8, 3, 2, 0), (2, 4, 2, 4, 1)])
def test_split_k_gives_the_same_bits_every_run(tiling: tuple[int, int, int, int, int]) -> None:
    """K split over CTAs: each part has its own workspace slot, summed in part order, so the
    output does not depend on which CTA finished first (greedy decoding repeats itself)."""
    from worker.kernels.cuda import int4_mma

    torch.manual_seed(0)
    n, k = 5120, 17408
    q = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    x = torch.randn(8, k, device="cuda").bfloat16()
    t = int4_mma.MmaTiling(*tiling)
    first = int4_mma.gemv(x, words, mma_scales, 128, t)
    for _ in range(20):
        assert torch.equal(int4_mma.gemv(x, words, mma_scales, 128, t), first)


@GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_and_prefill_on_gpu(dtype: torch.dtype) -> None:
    from worker.kernels.cuda import int4_mma

    q = quantize_rtn(torch.randn(512, 1024, device="cuda") * 0.02, 128, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    want = reference.int4_dequantize(q.qweight, q.scales, None, 128)
    assert torch.equal(int4_mma.dequantize(words, mma_scales, 128, dtype), want.to(dtype))
    x = torch.randn(300, 1024, device="cuda", dtype=dtype)
    got = int4_mma.int4_mma_linear(x, words, mma_scales, 128)
    assert rel_err(got.float(), x.float() @ want.T) < 1e-2


def test_e4m3_channel_scales_follow_the_rows_of_the_mma_scales() -> None:
    """The FP8 prefill's scale per output channel, read from the mma layout's [N / 16, G, 16]
    scales: each channel's largest |int4 value| (8 x its largest group scale) maps to 448."""
    from worker.kernels.cuda import int4_mma

    qweight, scales = random_codes(48, 320)
    _, mma_scales = reference.int4_mma_pack(qweight, scales)
    want = scales.float().abs().amax(dim=1) * (8 / 448)
    torch.testing.assert_close(int4_mma.e4m3_channel_scales(mma_scales), want, rtol=0, atol=0)


@GPU
@needs_cuda
def test_e4m3_dequantize_and_prefill_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton import int4_gemm

    q = quantize_rtn(torch.randn(512, 1024, device="cuda") * 0.02, 128, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    w8, channel = int4_mma.dequantize_e4m3(words, mma_scales, 128)
    codes = torch.stack((q.qweight & 0xF, q.qweight >> 4), dim=-1).reshape(512, 1024).float() - 8
    group_scales = q.scales.float().repeat_interleave(128, dim=1)
    want = (codes * (group_scales * (1.0 / channel)[:, None])).to(torch.float8_e4m3fn)
    assert torch.equal(w8.view(torch.uint8), want.view(torch.uint8))  # the same fp32 products
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    exact = x.float() @ reference.int4_dequantize(q.qweight, q.scales, None, 128).T
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "fp8")
    got = int4_mma.int4_mma_linear(x, words, mma_scales, 128)
    assert 1e-3 < rel_err(got.float(), exact) < 6e-2  # e4m3's rounding, x per token
