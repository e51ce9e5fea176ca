"""The int4-mma layout and kernels (worker/kernels/cuda/int4_mma.cu).

On CPU: the layout round-trips; a plain-PyTorch emulation of what each lane of the CUDA kernel
does (decode its 16-byte quad with the kernel's bit operations, place the values where
mma.sync m16n8k16 reads them, take x's operands from the kernel's addresses) reproduces the
reference product, so the fragment order in the .cu and the packer agree; Int4Linear in the mma
layout (the reference op here) answers as the nibble layout does. A fused gate|up in paired tiles
(gate, up, gate, ...): the pairing round-trips, the unfused way back to gate|up order gives
silu(gate) * up, and an emulation of the GEMV epilogue's pair arithmetic writes each output once
with the right pair. With `-m gpu`: the compiled GEMV at every row-count class and tiling, with
and without the silu(gate) * up epilogue, and the dequantization, against the reference."""

from __future__ import annotations

import math
from typing import Any

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


def emulate_kernel_x8(
    codes: torch.Tensor, xscales: torch.Tensor, words: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """y [M <= 8, N] as the X8 kernel's lanes compute it (int4_mma.cu chunk_products_x8 and
    close_group_x8): A registers from the weight words by a shift, an and and an xor, B
    registers as the stored x bytes, m16n8k32 int8 products summed over a group's two chunks,
    then times s_w / 16 * s_x."""
    m, k = codes.shape
    tiles, chunks = words.shape[:2]
    y = torch.zeros(m, 16 * tiles, dtype=torch.float64)
    xb = torch.zeros(8, k, dtype=torch.uint8)
    xb[:m] = codes.view(torch.uint8)
    w = words.view(torch.uint8).view(tiles, chunks, 32, 4, 4).to(torch.int64)

    def as_s8(byte: int) -> int:
        return byte - 256 if byte >= 128 else byte

    def word_of(bytes_: list[int]) -> int:
        return sum(int(v) << (8 * j) for j, v in enumerate(bytes_))

    for rt in range(tiles):
        for grp in range(chunks // 2):
            isum = torch.zeros(16, 8, dtype=torch.int64)
            for c in (2 * grp, 2 * grp + 1):
                for p in range(2):
                    a = torch.zeros(16, 32, dtype=torch.int64)  # mma rows x mma k
                    b = torch.zeros(32, 8, dtype=torch.int64)  # mma k x tokens
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        w0 = word_of(w[rt, c, lane, 2 * p].tolist())
                        w1 = word_of(w[rt, c, lane, 2 * p + 1].tolist())
                        regs = [
                            (((w0 << 4) & 0xFFFFFFFF) & 0xF0F0F0F0) ^ 0x80808080,  # a0: row g
                            (w0 & 0xF0F0F0F0) ^ 0x80808080,  # a1: row g + 8
                            (((w1 << 4) & 0xFFFFFFFF) & 0xF0F0F0F0) ^ 0x80808080,  # a2: row g
                            (w1 & 0xF0F0F0F0) ^ 0x80808080,  # a3: row g + 8
                        ]
                        for r, reg in enumerate(regs):
                            row, col = g + 8 * (r & 1), 4 * t + 16 * (r >> 1)
                            for j in range(4):
                                a[row, col + j] = as_s8((reg >> (8 * j)) & 0xFF)
                        # B registers h = 0, 1: the lane's stored bytes 8 p + 4 h + j
                        base = 64 * c + 16 * t + 8 * p
                        for h in range(2):
                            for j in range(4):
                                b[4 * t + 16 * h + j, g] = as_s8(int(xb[g, base + 4 * h + j]))
                    isum += a @ b
            sw = scales[rt, grp].double() / 16  # [16] rows of the tile
            sx = torch.zeros(8, dtype=torch.float64)
            sx[:m] = xscales[:, grp].double()
            y[:, rt * 16 : rt * 16 + 16] += (isum.double() * sw[:, None] * sx[None, :]).T[:m]
    return y


@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 128), (8, 32, 256), (5, 16, 384)])
def test_x8_lane_emulation_matches_reference(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(2)
    q = quantize_rtn(torch.randn(n, k, generator=gen) * 0.02, 128, True)
    x = torch.randn(m, k, generator=gen)
    if k > 128:
        x[0, :128] = 0  # a zero group: scale 0, codes 0
    codes, xscales, _ = reference.int4_mma_x8(x)
    assert codes.dtype == torch.int8 and tuple(xscales.shape) == (m, k // 128)
    values = reference.int4_mma_x8_values(codes, xscales)
    assert rel_err(values, x) < 1e-2  # int8 per 128 k: ~0.4% of each group's absmax
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    got = emulate_kernel_x8(codes, xscales, words, mma_scales)
    weight = reference.int4_dequantize(q.qweight, q.scales, None, 128).double()
    want = values.double() @ weight.T  # values: codes * scales rounded to fp32
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(got, x.double() @ weight.T, rtol=1e-6, atol=1e-7)


def test_x8_codes_sit_in_the_products_k_order() -> None:
    """Byte 8 p + 4 h + j of lane t's 16 holds k = 32 p + 8 t + 4 h + (0, 2, 1, 3)[j]."""
    x = torch.arange(128, dtype=torch.float32)[None, :] - 64  # code = value at scale 1
    x[0, 0] = 127  # the group's absmax: scale 1 for the first group
    x[0, 64] = -127
    codes, scales, _ = reference.int4_mma_x8(x)
    assert torch.equal(scales, torch.ones(1, 1))
    stored = codes[0].tolist()
    assert stored[:8] == [127, -62, -63, -61, -60, -58, -59, -57]  # t 0, p 0: k 0, 2, 1, 3, ...
    assert stored[16:20] == [-56, -54, -55, -53]  # t 1: k 8 + (0, 2, 1, 3)
    assert stored[8:12] == [-32, -30, -31, -29]  # t 0, p 1: k 32 + (0, 2, 1, 3)
    assert torch.equal(reference.int4_mma_x8_values(codes, scales), x)


def test_blockwise_codes_of_a_paired_gate_up_form_its_activation() -> None:
    """The W4A8 prefill's down projection rounds silu(gate) * up straight from gate|up's paired
    product: the same codes and scales as rounding `silu_mul(y, paired)`."""
    from worker.kernels.triton.activations import silu_mul
    from worker.kernels.triton.fp8_gemm import quantize_blocks

    torch.manual_seed(3)
    y = (torch.randn(5, 2 * 384) * 3).bfloat16()  # a gate|up output in pairs of 16 columns
    got_q, got_s = quantize_blocks(y, 128, 16, silu_paired=16)
    want_q, want_s = quantize_blocks(silu_mul(y, paired=16), 128, 16)
    assert got_q.shape == (16, 384) and torch.equal(got_q.float(), want_q.float())
    assert torch.equal(got_s, want_s)
    unpaired_q, _ = quantize_blocks(silu_mul(y), 128, 16)  # pairs read as halves: other values
    assert not torch.equal(got_q.float(), unpaired_q.float())


def test_int4_mlp_prefill_forms_the_activation_for_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the decode rows an int4-mma MLP hands gate|up's paired product to the down
    projection (`of_gate_up`), which forms silu(gate) * up itself: the same output as the
    activation computed first."""
    from worker.models.layers import MLP
    from worker.models.presets import TINY_QWEN3_5

    torch.manual_seed(4)
    mlp: Any = MLP(TINY_QWEN3_5)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        nn.init.normal_(lin.weight, std=0.05)
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = (
        Int4Linear.from_linear(mlp.gate_proj, 128),
        Int4Linear.from_linear(mlp.up_proj, 128),
        Int4Linear.from_linear(mlp.down_proj, 128),
    )
    mlp.fuse_projections()
    x = torch.randn(80, 128)
    want = mlp.down_proj(mlp.gate_up_proj.silu_mul(x))
    mlp.gate_up_proj.to_mma_layout(gate_up=True)
    mlp.down_proj.to_mma_layout()
    calls: list[int] = []
    op = ops.int4_mma_linear_of_silu_mul

    def record(y: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append(y.shape[-1])
        return op(y, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "int4_mma_linear_of_silu_mul", record)
    got = mlp(x)
    assert calls == [2 * TINY_QWEN3_5.intermediate_size]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert mlp(x[:8]).shape == (8, 128) and len(calls) == 1  # decode rows: the GEMV's epilogue


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
    from tests.worker.cuda_sources import check_ctypes_signatures
    from worker.kernels.cuda import int4_mma

    check_ctypes_signatures(int4_mma.SOURCE, int4_mma.SIGNATURES)


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


def paired_gate_up(f: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(nibble qweight, scales, paired mma words, paired mma scales) of a random gate|up [2F, K]."""
    qweight, scales = random_codes(2 * f, k, seed)
    words, mma_scales = reference.int4_mma_pair_tiles(*reference.int4_mma_pack(qweight, scales))
    return qweight, scales, words, mma_scales


def silu_of_pairs_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize(("f", "k"), [(16, 64), (48, 192)])
def test_paired_tiles_alternate_gate_and_up_and_round_trip(f: int, k: int) -> None:
    qweight, scales, words, mma_scales = paired_gate_up(f, k)
    back = reference.int4_mma_unpack(*reference.int4_mma_unpair_tiles(words, mma_scales))
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    # tile 2j: gate rows 16 j..16 j + 15; tile 2j + 1: the up rows of the same outputs
    rows = torch.arange(2 * f).view(2, f // 16, 16).transpose(0, 1).reshape(-1)
    paired_q, paired_s = reference.int4_mma_unpack(words, mma_scales)
    assert torch.equal(paired_q, qweight[rows]) and torch.equal(paired_s, scales[rows])
    with pytest.raises(ValueError, match="F % 16"):
        reference.int4_mma_pair_tiles(*reference.int4_mma_pack(*random_codes(48, k)))


def test_unpaired_outputs_give_silu_of_gate_and_up() -> None:
    """The unfused way (prefill, tilings the epilogue does not pair): the paired product
    reordered to gate|up, then silu_mul, is the unpaired weight's silu(gate) * up."""
    from worker.kernels.cuda import int4_mma

    qweight, scales, words, mma_scales = paired_gate_up(32, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    plain = reference.int4_linear(x, qweight, scales, None, 128)
    paired = reference.int4_mma_linear(x, words, mma_scales, 128)
    assert rel_err(reference.int4_mma_unpair_outputs(paired), plain) < 1e-6
    want = silu_of_pairs_reference(plain)
    assert rel_err(int4_mma.silu_mul_of_pairs(paired), want) < 1e-6
    assert rel_err(reference.int4_mma_linear_silu_mul(x, words, mma_scales, 128), want) < 1e-6
    assert rel_err(ops.int4_mma_linear_silu_mul(x, words, mma_scales, 128), want) < 1e-6


def test_paired_silu_mul_reads_the_pairs_in_place() -> None:
    """The activation kernel reading gate / up from alternating 16-column tiles gives the bits
    of the reorder-then-silu_mul it replaces (a prefill's [tokens, 2F] is not copied)."""
    from worker.kernels.triton.activations import silu_mul

    y = (torch.randn(3, 5 * 32, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    want = silu_mul(reference.int4_mma_unpair_outputs(y).contiguous())
    assert torch.equal(silu_mul(y, paired=16), want)
    assert torch.equal(silu_mul(y[:, :].view(3, 160)[1:], paired=16), want[1:])


def emulate_silu_epilogue(
    y: torch.Tensor, rows: int, token_groups: int, warps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, F], writes per output) from a paired-tile product y [M, 2F] as reduce_parts'
    SILU branch forms it: a row block's cells hold what the plain epilogue writes (cell
    v = (tile r, token group mt, fragment q) of lane (g, t)), and warp w takes the pairs w,
    w + W, ... (gate tile 2j's cell with up tile 2j + 1's)."""
    m, two_f = y.shape
    out = torch.zeros(m, two_f // 2, dtype=torch.float64)
    writes = torch.zeros(m, two_f // 2, dtype=torch.int64)
    r_, mt_ = rows, token_groups
    cells_per_lane, per_tile = r_ * mt_ * 4, mt_ * 4
    for rb in range(two_f // (16 * r_)):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            cells = []
            for v in range(cells_per_lane):
                q, rmt = v & 3, v >> 2
                r, mt = rmt // mt_, rmt % mt_
                row = (rb * r_ + r) * 16 + g + 8 * (q >> 1)
                tok = mt * 8 + 2 * t + (q & 1)
                cells.append(float(y[tok, row]) if tok < m else 0.0)
            for w in range(warps):
                for p in range(w, cells_per_lane // 2, warps):
                    j, rest = p // per_tile, p % per_tile
                    q, mt = rest & 3, rest >> 2
                    v = 2 * j * per_tile + rest
                    gate, up = cells[v], cells[v + per_tile]
                    row = (rb * r_ // 2 + j) * 16 + g + 8 * (q >> 1)
                    tok = mt * 8 + 2 * t + (q & 1)
                    if tok < m and row < two_f // 2:
                        out[tok, row] = gate / (1.0 + math.exp(-gate)) * up
                        writes[tok, row] += 1
    return out, writes


@pytest.mark.parametrize(  # 4 tiles per CTA take at most 16 rows (the launcher uses 2 then)
    ("m", "rows"), [(m, 2) for m in (1, 5, 8, 13, 16, 29, 32)] + [(m, 4) for m in (1, 8, 11, 16)]
)
@pytest.mark.parametrize("warps", [1, 3, 8])
def test_silu_epilogue_emulation_pairs_gate_with_up(m: int, rows: int, warps: int) -> None:
    f, k = 64, 128
    qweight, scales, words, mma_scales = paired_gate_up(f, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).double()
    w = reference.int4_dequantize(qweight, scales, None, 128).double()
    paired_w = reference.int4_dequantize(
        *reference.int4_mma_unpack(words, mma_scales), None, 128
    ).double()
    token_groups = 1 if m <= 8 else 2 if m <= 16 else 4
    out, writes = emulate_silu_epilogue(x @ paired_w.T, rows, token_groups, warps)
    assert torch.equal(writes, torch.ones_like(writes))
    torch.testing.assert_close(out, silu_of_pairs_reference(x @ w.T), rtol=1e-12, atol=1e-12)


def test_gate_up_in_paired_tiles_answers_as_nibble() -> None:
    layer = Int4Linear.from_linear(nn.Linear(128, 64, bias=False).bfloat16(), 64)
    x = torch.randn(3, 128).bfloat16()
    want, want_act, weight = layer(x), layer.silu_mul(x), layer.dequantize()
    nibble = layer.nibble_tensors()
    layer.to_mma_layout(gate_up=True)
    assert layer.layout == MMA and layer.gate_up_paired
    assert torch.equal(layer(x), want)
    assert torch.equal(layer.silu_mul(x), want_act) and want_act.shape == (3, 32)
    assert torch.equal(layer.dequantize(), weight)
    assert all(torch.equal(a, b) for a, b in zip(layer.nibble_tensors(), nibble, strict=True))


def test_gate_up_pairs_only_whole_tiles_without_bias() -> None:
    """F % 16 != 0 (a tile would hold gate and up rows) or a bias: the plain order, and
    silu_mul takes the projection then the activation."""
    for linear in (nn.Linear(128, 48, bias=False), nn.Linear(128, 64, bias=True)):
        layer = Int4Linear.from_linear(linear, 64)
        x = torch.randn(2, 128)
        want = layer.silu_mul(x)
        layer.to_mma_layout(gate_up=True)
        assert layer.layout == MMA and not layer.gate_up_paired
        assert torch.equal(layer.silu_mul(x), want)


@pytest.mark.parametrize(
    ("m", "group", "k", "tuned", "launched"),
    [
        (8, 128, 5120, (2, 4, 1, 3, 9), (2, 4, 1, 3, 9)),  # the ring of whole groups, as tuned
        (8, 64, 5120, (2, 4, 1, 3, 9), (2, 4, 1, 3, 7)),  # groups of one chunk: in turn
        (8, 128, 5184, (2, 4, 1, 3, 9), (2, 4, 1, 3, 7)),  # an odd chunk count: in turn
        (16, 128, 5120, (4, 8, 1, 2, 7), (4, 8, 1, 2, 7)),  # 2 token groups still fit the ring
        (24, 128, 5120, (4, 8, 1, 2, 7), (2, 8, 1, 2, 2)),  # 4 spill it: mode 2, 2 tiles
        (64, 128, 5120, (2, 4, 2, 3, 9), (1, 4, 2, 3, 2)),  # 8: mode 2, one tile, K still split
        (8, 192, 5184, (2, 4, 3, 2, 7), (2, 4, 3, 2, 1)),  # groups found by division: cp.async
        (8, 128, 5120, (2, 4, 2, 3, 10), (2, 4, 2, 3, 10)),  # persistent: 10 groups a warp
        (8, 128, 5120, (2, 8, 2, 3, 10), (2, 8, 1, 3, 9)),  # 5 a warp: not whole turns
        (16, 64, 5120, (2, 4, 2, 3, 10), (2, 4, 1, 3, 7)),  # groups of one chunk
        (24, 128, 5120, (2, 4, 2, 3, 10), (2, 4, 1, 3, 2)),  # 4 token groups: mode 2
    ],
)
def test_tiling_for_rows_swaps_what_does_not_fit(
    m: int,
    group: int,
    k: int,
    tuned: tuple[int, int, int, int, int],
    launched: tuple[int, int, int, int, int],
) -> None:
    from worker.kernels.cuda import int4_mma

    t = int4_mma.tiling_for_rows(int4_mma.MmaTiling(*tuned), m, 34816, k, group)
    assert t == int4_mma.MmaTiling(*launched)


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
        (4, 8, 1, 2, 7),
        (2, 4, 3, 4, 7),
        (1, 2, 2, 2, 7),
        (2, 4, 1, 3, 9),
        (2, 8, 3, 3, 9),
        (1, 4, 2, 3, 9),
        (2, 4, 1, 3, 10),
        (2, 4, 4, 3, 10),
        (2, 8, 2, 3, 10),
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
@pytest.mark.parametrize(
    "tiling",
    [
        (4, 4, 4, 4, 2),
        (2, 8, 3, 2, 0),
        (2, 4, 2, 4, 1),
        (4, 4, 4, 2, 7),
        (2, 8, 2, 2, 7),
        (2, 4, 3, 3, 9),
        (2, 8, 1, 3, 10),
    ],
)
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
@pytest.mark.parametrize("m", [1, 8, 13, 16])
@pytest.mark.parametrize(
    ("n", "k", "tiling"),
    [
        (5120, 17408, (2, 8, 1, 3, 9)),  # down's tuned tiling
        (5120, 6144, (2, 8, 2, 3, 9)),  # split K
        (16384, 5120, (2, 4, 1, 3, 9)),
        (34816, 5120, (2, 4, 4, 3, 10)),  # gate|up's persistent ring
        (5120, 6144, (2, 8, 2, 3, 10)),
    ],
)
def test_gemv_x8_on_gpu(m: int, n: int, k: int, tiling: tuple[int, int, int, int, int]) -> None:
    from worker.kernels.cuda import int4_mma

    torch.manual_seed(0)
    q = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    codes, xscales, _ = reference.int4_mma_x8(torch.randn(m, k, device="cuda"))
    t = int4_mma.MmaTiling(*tiling)
    got = int4_mma.gemv_x8(codes, xscales, words, mma_scales, 128, t)
    x = reference.int4_mma_x8_values(codes, xscales)
    want = x @ reference.int4_dequantize(q.qweight, q.scales, None, 128).T
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < 1e-2
    for _ in range(5):  # int32 sums, parts summed in order: the same bits every run
        assert torch.equal(int4_mma.gemv_x8(codes, xscales, words, mma_scales, 128, t), got)
    ws, arrivals = int4_mma._workspaces.get(x.device), int4_mma._arrivals.get(x.device)
    assert ws is None or ws.count_nonzero() == 0
    assert arrivals is None or arrivals.count_nonzero() == 0


@GPU
@needs_cuda
@pytest.mark.parametrize("tiling", [(2, 4, 4, 3, 10), (2, 4, 1, 3, 9)])
def test_gate_up_silu_mul_x8_on_gpu(tiling: tuple[int, int, int, int, int]) -> None:
    from worker.kernels.cuda import int4_mma

    f, k = 17408, 5120
    weight, scales, dense = gpu_gate_up(f, k)
    codes, xscales, _ = reference.int4_mma_x8(torch.randn(8, k, device="cuda"))
    t = int4_mma.MmaTiling(*tiling)
    got = int4_mma.gemv_x8(codes, xscales, weight, scales, 128, t, silu_mul=True)
    y = (reference.int4_mma_x8_values(codes, xscales) @ dense.T).bfloat16()
    assert got.shape == (8, f) and rel_err(got.float(), silu_of_pairs_reference(y).float()) < 2e-2


@GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_and_prefill_on_gpu(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton import int4_gemm

    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "bf16")  # the scratch; auto: the W4A8 test

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


def test_channel_scales_are_formed_once_per_weight_and_follow_its_changes() -> None:
    from worker.kernels.cuda import int4_mma

    qweight, scales = random_codes(48, 320)
    _, mma_scales = reference.int4_mma_pack(qweight, scales)
    first = int4_mma.channel_scales_of(mma_scales)
    assert int4_mma.channel_scales_of(mma_scales) is first  # kept, not formed again
    torch.testing.assert_close(first, int4_mma.e4m3_channel_scales(mma_scales), rtol=0, atol=0)
    mma_scales.mul_(2)  # changed in place: formed again from the new values
    again = int4_mma.channel_scales_of(mma_scales)
    assert again is not first
    torch.testing.assert_close(again, 2 * first, rtol=0, atol=0)
    key = id(mma_scales)
    del mma_scales
    assert key not in int4_mma._channel_scales  # dropped with its tensor
    with torch.inference_mode():  # a loaded model's scales keep no version counter
        loaded = reference.int4_mma_pack(qweight, scales)[1]
        assert int4_mma.channel_scales_of(loaded) is int4_mma.channel_scales_of(loaded)


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


@GPU
@needs_cuda
def test_w4a8_codes_and_prefill_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_INT4_PREFILL=w4a8: the codes exactly, the group scales on the fp32 sums, so
    the only rounding is x's per token: closer to the exact product than the e4m3 weights."""
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton import int4_gemm

    q = quantize_rtn(torch.randn(512, 1024, device="cuda") * 0.02, 128, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    codes = torch.stack((q.qweight & 0xF, q.qweight >> 4), dim=-1).reshape(512, 1024).float() - 8
    assert torch.equal(int4_mma.codes_e4m3(words).float(), codes)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    exact = x.float() @ reference.int4_dequantize(q.qweight, q.scales, None, 128).T
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "w4a8")
    got = int4_mma.int4_mma_linear(x, words, mma_scales, 128)
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "fp8")
    e4m3_weights = int4_mma.int4_mma_linear(x, words, mma_scales, 128)
    assert 1e-3 < rel_err(got.float(), exact) < rel_err(e4m3_weights.float(), exact)


@GPU
@needs_cuda
@pytest.mark.parametrize("rows", [300, 4096])
def test_down_of_a_paired_gate_up_on_gpu(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The W4A8 prefill's down projection forming silu(gate) * up as it rounds x: as close to
    the exact product as the activation rounded after being formed in 16 bits."""
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton import int4_gemm

    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "w4a8")
    f, k = 1024, 512
    torch.manual_seed(0)
    q = quantize_rtn(torch.randn(k, f, device="cuda") * 0.02, 128, True)  # down [K, F]
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    y = torch.randn(rows, 2 * f, device="cuda", dtype=torch.bfloat16)  # paired gate|up output
    act = int4_mma.silu_mul_of_pairs(y)
    exact = act.float() @ reference.int4_dequantize(q.qweight, q.scales, None, 128).T
    got = int4_mma.int4_mma_linear_of_silu_mul(y, words, mma_scales, 128)
    two_steps = int4_mma.int4_mma_linear(act, words, mma_scales, 128)
    assert got.shape == (rows, k) and torch.equal(got, two_steps)
    # x rounded to e4m3 per token and 128 columns: W4A8's 2.6-2.7% from the exact product
    assert rel_err(got.float(), exact) < 3.5e-2
    # the e4m3 path (TOKENMILL_INT4_PREFILL=fp8): the activation rounded per token as formed
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "fp8")
    got = int4_mma.int4_mma_linear_of_silu_mul(y, words, mma_scales, 128)
    two_steps = int4_mma.int4_mma_linear(act, words, mma_scales, 128)
    assert got.shape == (rows, k) and torch.equal(got, two_steps)
    assert rel_err(got.float(), exact) < 6e-2  # e4m3 weights and x per token


@GPU
@needs_cuda
@pytest.mark.parametrize("group", [128, 256])
def test_block_scales_from_the_codes_launch_on_gpu(group: int) -> None:
    """The W4A8 prefill's cuBLAS scales, written by the codes' launch, equal the four torch ops'
    `blockwise_scales` bit for bit, and the codes stay exact."""
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton import int4_gemm

    q = quantize_rtn(torch.randn(256, 1024, device="cuda") * 0.02, group, True)
    words, mma_scales = reference.int4_mma_pack(q.qweight, q.scales)
    codes, blocks = int4_mma.codes_and_block_scales_e4m3(words, mma_scales, group)
    want = int4_gemm.blockwise_scales(mma_scales, group, 1024, True)
    assert blocks.shape == want.shape == (256, 8) and blocks.stride() == want.stride()
    assert torch.equal(blocks, want)
    want_codes = torch.stack((q.qweight & 0xF, q.qweight >> 4), dim=-1).reshape(256, 1024)
    assert torch.equal(codes.float(), want_codes.float() - 8)


_gate_ups: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


def gpu_gate_up(f: int, k: int) -> tuple[torch.Tensor, ...]:
    """(paired words, paired scales, the fp32 weight [2F, K] in gate|up order), made once."""
    if (f, k) not in _gate_ups:
        torch.manual_seed(0)
        q = quantize_rtn(torch.randn(2 * f, k, device="cuda") * 0.02, 128, True)
        words, scales = reference.int4_mma_pair_tiles(*reference.int4_mma_pack(q.qweight, q.scales))
        _gate_ups[(f, k)] = (
            words,
            scales,
            reference.int4_dequantize(q.qweight, q.scales, None, 128),
        )
    return _gate_ups[(f, k)]


@GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64])
@pytest.mark.parametrize(("f", "k"), [(128, 512), (17408, 5120)])
@pytest.mark.parametrize(
    "tiling",
    [
        None,
        (2, 8, 1, 2, 0),
        (4, 4, 3, 2, 0),
        (2, 4, 2, 4, 1),
        (4, 8, 1, 4, 1),
        (4, 8, 1, 2, 2),
        (2, 8, 3, 4, 2),
        (4, 4, 4, 4, 2),
        (4, 8, 1, 2, 7),
        (2, 4, 3, 4, 7),
        (2, 4, 1, 3, 9),
        (2, 4, 2, 3, 10),
        (1, 8, 2, 4, 2),  # one tile per CTA: the product, then silu_mul
        (2, 8, 2, 2, 3),  # stream-K and the bulk pipeline: likewise
        (4, 8, 2, 4, 4),
    ],
)
def test_gate_up_silu_mul_on_gpu(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    m: int,
    f: int,
    k: int,
    tiling: tuple[int, int, int, int, int] | None,
) -> None:
    """silu(gate) * up from the GEMV's epilogue (2 or 4 tiles per CTA, modes 0-2, 7 and 9,
    M <= 32) or from its product (other tilings, M > 32) against the fp32 reference."""
    from worker.kernels.cuda import int4_mma

    words, scales, weight = gpu_gate_up(f, k)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    t = int4_mma.MmaTiling(*tiling) if tiling else int4_mma.default_tiling(2 * f, k, 128)
    rows = 2 if m > 16 and t.rows == 4 else t.rows
    unfused: list[int] = []
    pairs = int4_mma.silu_mul_of_pairs
    monkeypatch.setattr(int4_mma, "silu_mul_of_pairs", lambda y: unfused.append(1) or pairs(y))
    got = int4_mma.gemv(x, words, scales, 128, t, silu_mul=True)
    assert got.shape == (m, f) and got.dtype == dtype
    epilogue_modes = (*int4_mma.K_SPLIT_PRODUCT_MODES, int4_mma.PERSISTENT_MODE)
    assert bool(unfused) == (m > 32 or rows == 1 or t.mode not in epilogue_modes)
    want = silu_of_pairs_reference(x.float() @ weight.T)
    assert rel_err(got.float(), want) < 1e-2
    ws, arrivals = int4_mma._workspaces.get(x.device), int4_mma._arrivals.get(x.device)
    assert ws is None or ws.count_nonzero() == 0
    assert arrivals is None or arrivals.count_nonzero() == 0


@GPU
@needs_cuda
@pytest.mark.parametrize(
    "tiling",
    [
        (4, 4, 4, 4, 2),
        (2, 8, 3, 2, 0),
        (2, 4, 2, 4, 1),
        (4, 8, 1, 2, 7),
        (2, 4, 2, 3, 9),
        (2, 4, 2, 3, 10),
    ],
)
def test_gate_up_silu_mul_gives_the_same_bits_every_run(
    tiling: tuple[int, int, int, int, int],
) -> None:
    from worker.kernels.cuda import int4_mma

    words, scales, _ = gpu_gate_up(2560, 17408)
    x = torch.randn(8, 17408, device="cuda").bfloat16()
    t = int4_mma.MmaTiling(*tiling)
    first = int4_mma.gemv(x, words, scales, 128, t, silu_mul=True)
    for _ in range(20):
        assert torch.equal(int4_mma.gemv(x, words, scales, 128, t, silu_mul=True), first)


@GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_up_silu_mul_op_decode_and_prefill_on_gpu(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registered op: decode rows through the fused GEMV, prefill rows through the
    dequantized product reordered to gate|up."""
    from worker.kernels.triton import int4_gemm

    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "bf16")  # the dequantized product
    words, scales, weight = gpu_gate_up(128, 512)
    impl = ops.select("int4_mma_linear_silu_mul", torch.device("cuda"), dtype)
    assert impl.name == "cuda.int4_mma_gate_up_silu_mul"
    for m in (4, 300):
        x = torch.randn(2, m, 512, device="cuda", dtype=dtype)
        got = ops.int4_mma_linear_silu_mul(x, words, scales, 128)
        assert got.shape == (2, m, 128)
        assert rel_err(got.float(), silu_of_pairs_reference(x.float() @ weight.T)) < 1e-2
