"""The int4 weight kernels (worker/kernels/triton/int4_gemm.py) against their plain-PyTorch
references: the decode GEMV (one K range, split K with in-launch arrival counters, stream-K),
the fused gate|up + silu*mul GEMV, and the prefill path's dequantize kernel + GEMM. On CPU they
run under the triton interpreter at small shapes; with `-m gpu` compiled at the Qwen3.6-27B
shapes. Agreement is by relative error, except the dequantized weight, which must be exact."""

from __future__ import annotations

import pytest
import torch

from tests.worker.numerics import rel_err
from tests.worker.triton_env import GPU, needs_cuda
from worker.kernels import ops, reference
from worker.kernels.triton import int4_gemm
from worker.kernels.triton.fp8_gemm import _arrivals, _workspaces
from worker.kernels.triton.int4_gemm import (
    Int4Tiling,
    int4_dequantize,
    int4_gemv,
    int4_gemv_silu_mul,
    int4_linear,
    int4_linear_silu_mul,
)
from worker.models.int4 import Int4Tensors, quantize_rtn

pytestmark = pytest.mark.usefixtures("one_thread")


def int4_weight(n: int, k: int, group: int, symmetric: bool, device: str) -> Int4Tensors:
    return quantize_rtn(torch.randn(n, k, device=device) * 0.02, group, symmetric)


def exact_linear(x: torch.Tensor, q: Int4Tensors, bias: torch.Tensor | None) -> torch.Tensor:
    """x times the fp32 dequantized weight in fp32 (the reference rounds the weight to x's dtype)."""
    w = reference.int4_dequantize(q.qweight, q.scales, q.mins, q.group_size)
    out = x.float() @ w.T
    return out if bias is None else out + bias.float()


def assert_rearmed(device: torch.device) -> None:
    """Split and stream-K launches leave their arrival counters and workspace zero."""
    counters = _arrivals.get(device)
    assert counters is None or counters.count_nonzero() == 0
    workspace = _workspaces.get(device)
    assert workspace is None or workspace.count_nonzero() == 0


def check_gemv(
    m: int,
    n: int,
    k: int,
    group: int,
    symmetric: bool,
    tiling: Int4Tiling | None,
    with_bias: bool,
    device: str,
) -> None:
    q = int4_weight(n, k, group, symmetric, device)
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16() if with_bias else None
    calls = 2 if tiling is None or tiling.splits > 1 or tiling.stream_k else 1
    for _ in range(calls):  # again: the first call must have re-armed the counters
        out = int4_gemv(x, q.qweight, q.scales, q.mins, group, bias, tiling)
        assert out.shape == (m, n) and out.dtype == x.dtype
        ref = reference.int4_linear(x, q.qweight, q.scales, q.mins, group, bias)
        assert rel_err(out, ref) < 1e-2
        # the kernel applies the exact weight: only its bf16 output rounding differs
        assert rel_err(out, exact_linear(x, q, bias)) < 6e-3
    assert_rearmed(x.device)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "symmetric", "tiling", "with_bias"),
    [
        (1, 40, 256, 128, True, Int4Tiling(16, 128, 1), False),  # one K range per program
        (3, 40, 256, 64, False, Int4Tiling(16, 64, 2), True),  # affine, split K, bias
        (8, 48, 256, 32, True, Int4Tiling(16, 128, 2), False),  # a step of 4 groups
        (8, 40, 256, 128, True, Int4Tiling(16, 64, 2), False),  # a group over 2 steps
        (16, 40, 576, 128, True, Int4Tiling(16, 128, 3), True),  # ragged K (SmolLM2's 576)
        (8, 40, 576, 128, False, Int4Tiling(32, 128, 1), False),  # ragged K, N % BN != 0
        (33, 40, 256, 64, True, Int4Tiling(16, 64, 2), False),  # 64-row block
        (3, 40, 256, 128, True, None, False),  # the default tiling
        # stream-K (4 "SMs" under the interpreter): ranges that start and end mid-tile
        (5, 70, 512, 128, False, Int4Tiling(16, 128, 1, stream_k=3), False),
        (8, 96, 512, 64, True, Int4Tiling(32, 128, 1, stream_k=1), True),
        (3, 40, 576, 128, True, Int4Tiling(16, 128, 1, stream_k=2), False),  # ragged K
        # x's even/odd columns split in registers; the weight re-interleaved for one dot
        (8, 40, 256, 128, False, Int4Tiling(16, 128, 1, x_mode=1), False),
        (8, 40, 256, 64, True, Int4Tiling(16, 128, 2, x_mode=2), False),
    ],
)
def test_int4_gemv_matches_reference(m, n, k, group, symmetric, tiling, with_bias) -> None:
    torch.manual_seed(m * n + k + group)
    check_gemv(m, n, k, group, symmetric, tiling, with_bias, "cpu")


def check_silu_mul(
    m: int,
    f: int,
    k: int,
    group: int,
    symmetric: bool,
    tiling: Int4Tiling | None,
    with_bias: bool,
    device: str,
) -> None:
    q = int4_weight(2 * f, k, group, symmetric, device)
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(2 * f, device=device).bfloat16() if with_bias else None
    out = int4_gemv_silu_mul(x, q.qweight, q.scales, q.mins, group, bias, tiling)
    assert out.shape == (m, f) and out.dtype == x.dtype
    ref = reference.int4_linear_silu_mul(x, q.qweight, q.scales, q.mins, group, bias)
    # the interpreter's fp32 -> bf16 cast (three roundings here) truncates where torch rounds
    assert rel_err(out, ref) < (1e-2 if device == "cuda" else 2e-2)
    assert_rearmed(x.device)


@pytest.mark.parametrize(
    ("m", "f", "k", "group", "symmetric", "tiling", "with_bias"),
    [
        (1, 24, 256, 64, True, Int4Tiling(16, 64, 1), False),
        (8, 40, 576, 128, False, Int4Tiling(16, 128, 2), True),  # ragged K, split, bias
        (16, 20, 256, 32, True, None, False),  # the default tiling, F % BN != 0
        (33, 24, 256, 128, False, Int4Tiling(16, 128, 2, x_mode=1), False),
    ],
)
def test_int4_gate_up_gemv_forms_silu_mul(m, f, k, group, symmetric, tiling, with_bias) -> None:
    torch.manual_seed(m + f + k + group)
    check_silu_mul(m, f, k, group, symmetric, tiling, with_bias, "cpu")


@pytest.mark.parametrize(
    ("n", "k", "group", "symmetric"), [(40, 576, 128, True), (33, 512, 32, False)]
)
def test_dequantize_kernel_is_exact(n: int, k: int, group: int, symmetric: bool) -> None:
    torch.manual_seed(n + k)
    q = int4_weight(n, k, group, symmetric, "cpu")
    ref = reference.int4_dequantize(q.qweight, q.scales, q.mins, group)
    w, scale = int4_dequantize(q.qweight, q.scales, q.mins, group, torch.float32)
    assert scale is None and torch.equal(w, ref)
    # 16-bit: the exact value rounded once (the interpreter's cast truncates: within one ulp)
    w16, _ = int4_dequantize(q.qweight, q.scales, q.mins, group, torch.bfloat16)
    ulp = ref.abs() * 2.0**-7
    assert ((w16.float() - ref).abs() <= ulp).all()
    # e4m3 with per-channel scales: every channel's extreme fits, ~3 mantissa bits of error
    w8, scale = int4_dequantize(q.qweight, q.scales, q.mins, group, torch.float8_e4m3fn)
    assert scale is not None and scale.shape == (n,)
    assert w8.float().abs().amax() <= 448
    assert rel_err(w8.float() * scale[:, None], ref) < 4e-2


def rows_of_calls(monkeypatch: pytest.MonkeyPatch, kernel: str) -> list[int]:
    """Wrap int4_gemm's `kernel`: the list gets the rows of each call."""
    rows: list[int] = []
    real = getattr(int4_gemm, kernel)

    def recording(x: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(int4_gemm, kernel, recording)
    return rows


def test_prefill_rows_dequantize_then_gemm(monkeypatch) -> None:
    """More than INT4_GEMV_MAX_ROWS rows (or a group the GEMV cannot step through): the weight
    dequantized into the per-device scratch, then one GEMM; decode rows take the GEMV."""
    torch.manual_seed(3)
    q = int4_weight(48, 576, 128, False, "cpu")
    bias = torch.randn(48).bfloat16()
    gemv_calls = rows_of_calls(monkeypatch, "int4_gemv")
    for shape in ((70, 576), (2, 20, 576), (64, 576)):
        x = torch.randn(*shape).bfloat16()
        out = int4_linear(x, q.qweight, q.scales, q.mins, 128, bias)
        assert out.shape == (*shape[:-1], 48)
        ref = reference.int4_linear(x, q.qweight, q.scales, q.mins, 128, bias)
        assert rel_err(out, ref) < 1e-2
    assert gemv_calls == [40, 64]  # 2 x 20 rows, then 64; the 70 rows went through the scratch
    assert int4_gemm._scratch[(torch.device("cpu"), "weight")].numel() >= 48 * 576 * 2
    x = torch.randn(70, 576).bfloat16()
    out = int4_linear_silu_mul(x, q.qweight, q.scales, q.mins, 128, bias)
    ref = reference.int4_linear_silu_mul(x, q.qweight, q.scales, q.mins, 128, bias)
    assert out.shape == (70, 24) and rel_err(out, ref) < 2e-2


def test_gate_up_takes_two_launches_where_measured_faster(monkeypatch) -> None:
    torch.manual_seed(4)
    q = int4_weight(48, 256, 128, True, "cpu")
    x = torch.randn(3, 256).bfloat16()
    fused = rows_of_calls(monkeypatch, "int4_gemv_silu_mul")
    ref = reference.int4_linear_silu_mul(x, q.qweight, q.scales, None, 128)
    assert rel_err(int4_linear_silu_mul(x, q.qweight, q.scales, None, 128), ref) < 2e-2
    monkeypatch.setitem(int4_gemm.INT4_SILU_MUL_TILINGS, (48, 256), None)
    assert rel_err(int4_linear_silu_mul(x, q.qweight, q.scales, None, 128), ref) < 2e-2
    assert fused == [3]  # the second call: the GEMV, then silu_mul


def test_registry_takes_the_int4_kernels_on_cuda_with_16bit_activations() -> None:
    for op, name in [
        ("int4_linear", "triton.int4_linear"),
        ("int4_linear_silu_mul", "triton.int4_gate_up_silu_mul"),
    ]:
        names = [impl.name for impl in ops.implementations(op)]
        assert names[0] == name and names[-1] == "reference"
        assert ops.select(op, torch.device("cpu"), torch.bfloat16).name == "reference"
        assert ops.select(op, torch.device("cuda"), torch.bfloat16).name == name
        assert ops.select(op, torch.device("cuda"), torch.float16).name == name
        ok, reason = ops.candidates(op, torch.device("cuda"), torch.float32)[0][1:]
        assert not ok and "bf16/fp16" in reason


# ---------------------------------------------------------------- GPU, at the 27B shapes

SHAPES_27B = [(34816, 5120), (5120, 17408), (14336, 5120), (5120, 6144), (16384, 5120)]


@GPU
@needs_cuda
@pytest.mark.parametrize(("n", "k"), SHAPES_27B)
def test_gpu_int4_linear_27b(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(n + k)
    for m in (1, 8, 16, 33):
        check_gemv(m, n, k, 128, True, None, False, "cuda")
    check_gemv(8, n, k, 128, False, None, True, "cuda")
    for symmetric in (True, False):  # fp16 activations: the fp16 form of the code conversion
        q = int4_weight(n, k, 128, symmetric, "cuda")
        xh = torch.randn(8, k, device="cuda").half()
        ref = reference.int4_linear(xh, q.qweight, q.scales, q.mins, 128)
        assert rel_err(int4_linear(xh, q.qweight, q.scales, q.mins, 128), ref) < 1e-2
    q = int4_weight(n, k, 128, True, "cuda")
    x = torch.randn(512, k, device="cuda").bfloat16()
    ref = reference.int4_linear(x, q.qweight, q.scales, None, 128)
    # prefill rows: the default (auto) takes cuBLAS's W4A8 GEMM here, x rounded to e4m3
    assert int4_gemm.prefill_path_for(x.device, 128) == "w4a8"
    assert rel_err(int4_linear(x, q.qweight, q.scales, None, 128), ref) < 4e-2
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "bf16")  # the scratch: the exact weight
    assert rel_err(int4_linear(x, q.qweight, q.scales, None, 128), ref) < 1e-2
    w, _ = int4_dequantize(q.qweight, q.scales, None, 128, torch.bfloat16)
    assert torch.equal(w, reference.int4_dequantize(q.qweight, q.scales, None, 128).bfloat16())


@GPU
@needs_cuda
def test_gpu_int4_gate_up_silu_mul_27b() -> None:
    for m in (1, 8, 16):
        check_silu_mul(m, 17408, 5120, 128, True, None, False, "cuda")


# --- W4A8 prefill: int4 codes exactly in e4m3, group scales on the fp32 sums


def e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded to e4m3 per row as `quantize_rows` rounds it."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "tiling"),
    [
        (40, 64, 256, 128, int4_gemm.W4A8Tiling(32, 32, 64, 2)),
        (7, 48, 128, 64, int4_gemm.W4A8Tiling(16, 32, 64, 1)),  # ragged M and N
        (33, 80, 384, 128, int4_gemm.W4A8Tiling(16, 64, 128, 4)),  # BK = the group
    ],
)
@pytest.mark.parametrize("mma_scales", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4a8_gemm_matches_its_reference(m, n, k, group, tiling, mma_scales, with_bias) -> None:
    torch.manual_seed(m + n)
    q = int4_weight(n, k, group, True, "cpu")
    codes = torch.stack((q.qweight & 0xF, q.qweight >> 4), dim=-1).reshape(n, k).float() - 8
    a, a_scale = e4m3_rows(torch.randn(m, k))
    bias = torch.randn(n).bfloat16() if with_bias else None
    scales = reference.int4_mma_pack(q.qweight, q.scales)[1] if mma_scales else q.scales
    got = int4_gemm.w4a8_gemm(
        a, a_scale, codes.to(torch.float8_e4m3fn), scales, group, bias,
        mma_scales=mma_scales, tiling=tiling,
    )  # fmt: skip
    want = reference.w4a8_gemm(a, a_scale, codes, q.scales, group, bias)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want.float()) < 1e-2


def test_int4_codes_are_exact_in_e4m3() -> None:
    q = int4_weight(48, 256, 128, True, "cpu")
    codes = torch.stack((q.qweight & 0xF, q.qweight >> 4), dim=-1).reshape(48, 256).float() - 8
    assert torch.equal(int4_gemm.int4_codes_e4m3(q.qweight).float(), codes)


def test_w4a8_prefill_rounds_only_the_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """INT4_PREFILL=w4a8 through `int4_linear`'s prefill rows: symmetric weights take the W4A8
    GEMM and answer within e4m3's rounding of x; affine ones keep the 16-bit scratch."""
    torch.manual_seed(3)
    x = torch.randn(80, 256).bfloat16()  # past the GEMV's 64 rows
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "w4a8")
    calls: list[int] = []
    real = int4_gemm.w4a8_gemm
    monkeypatch.setattr(int4_gemm, "w4a8_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sym = int4_weight(64, 256, 128, True, "cpu")
    got = int4_linear(x, sym.qweight, sym.scales, None, 128)
    assert calls == [1]
    assert 1e-3 < rel_err(got.float(), exact_linear(x, sym, None)) < 4e-2  # x's e4m3 rounding
    affine = int4_weight(64, 256, 128, False, "cpu")
    got = int4_linear(x, affine.qweight, affine.scales, affine.mins, 128)
    assert calls == [1] and rel_err(got.float(), exact_linear(x, affine, None)) < 1e-2


@pytest.mark.parametrize(
    ("m", "n", "k", "tiling"),
    [
        (40, 96, 512, int4_gemm.W4A8WideTiling(32, 128, 1)),
        (17, 64, 768, int4_gemm.W4A8WideTiling(32, 128, 3)),  # split K, ragged rows
        (64, 80, 256, int4_gemm.W4A8WideTiling(16, 128, 2)),
        (33, 48, 384, None),  # the default tiling
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4a8_wide_matches_its_reference(m, n, k, tiling, with_bias) -> None:
    """17-64 decode rows on the nibble layout: codes turned to e4m3 in the kernel, each BK
    block's even k against the low nibbles and odd k against the high ones."""
    torch.manual_seed(m + k)
    q = int4_weight(n, k, 128, True, "cpu")
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = int4_gemm.w4a8_wide(x, q.qweight, q.scales, 128, bias, tiling)
    a, a_scale = e4m3_rows(x)  # per element, so the kernel's reordered codes are these
    codes = torch.stack((q.qweight & 0xF, q.qweight >> 4), dim=-1).reshape(n, k).float() - 8
    want = reference.w4a8_gemm(a, a_scale, codes, q.scales, 128, bias)
    assert got.shape == (m, n) and rel_err(got.float(), want.float()) < 1e-2
    assert rel_err(got.float(), exact_linear(x, q, bias)) < 4e-2  # x's e4m3 rounding
    assert_rearmed(torch.device("cpu"))
    assert torch.equal(int4_gemm.w4a8_wide(x, q.qweight, q.scales, 128, bias, tiling), got)


def test_int4_linear_takes_w4a8_from_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_INT4_W4A8_ROWS: symmetric weights in groups of 128 take w4a8_wide from that
    many decode rows to 64; fewer rows, affine weights and prefill keep their paths."""
    monkeypatch.setattr(int4_gemm, "INT4_W4A8_ROWS", 17)
    calls: list[int] = []
    real = int4_gemm.w4a8_wide
    monkeypatch.setattr(
        int4_gemm, "w4a8_wide", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)
    )
    sym = int4_weight(64, 256, 128, True, "cpu")
    affine = int4_weight(64, 256, 128, False, "cpu")
    for m in (16, 17, 64, 65):
        x = torch.randn(m, 256).bfloat16()
        int4_linear(x, sym.qweight, sym.scales, None, 128)
        int4_linear(x, affine.qweight, affine.scales, affine.mins, 128)
    assert calls == [17, 64]
    x = torch.randn(32, 256).bfloat16()
    got = int4_linear_silu_mul(x, sym.qweight, sym.scales, None, 128)
    assert calls == [17, 64, 32]
    want = reference.silu_mul(exact_linear(x, sym, None))
    assert rel_err(got.float(), want) < 5e-2


def test_auto_prefill_takes_w4a8_only_where_the_blockwise_gemm_runs(monkeypatch) -> None:
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "auto")
    cpu = torch.device("cpu")
    assert int4_gemm.prefill_path_for(cpu, 128) == "bf16"  # no cuBLAS here
    monkeypatch.setattr(int4_gemm, "blockwise_runs", lambda device: True)
    assert int4_gemm.prefill_path_for(cpu, 128) == "w4a8"
    assert int4_gemm.prefill_path_for(cpu, 32) == "bf16"  # GGUF's groups: not 1x128 blocks
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "fp8")
    assert int4_gemm.prefill_path_for(cpu, 128) == "fp8"


def test_the_w4a8_switches_are_checked() -> None:
    assert int4_gemm.prefill_path("W4A8") == "w4a8" and int4_gemm.prefill_path("") == "auto"
    with pytest.raises(ValueError, match="TOKENMILL_INT4_PREFILL='fp4'"):
        int4_gemm.prefill_path("fp4")
    assert int4_gemm.w4a8_rows("17") == 17 and int4_gemm.w4a8_rows("0") == 0
    for bad in ("65", "-1", "many"):
        with pytest.raises(ValueError, match="0 \\(off\\) or 1-64"):
            int4_gemm.w4a8_rows(bad)


@pytest.mark.parametrize(("m", "k", "multiple"), [(5, 256, 1), (37, 384, 16), (1, 1280, 16)])
def test_quantize_blocks_rounds_each_block_of_128_on_its_own(m, k, multiple) -> None:
    """x per (token, 128 columns): the codes are x / s rounded to e4m3 (ties to even), s the
    block's amax / 448, laid out as cuBLAS's 1x128 scaling reads them; padded rows are zero."""
    from worker.kernels.triton.fp8_gemm import quantize_blocks

    torch.manual_seed(k)
    x = torch.randn(m, k).bfloat16() * torch.logspace(-2, 2, k // 128).repeat_interleave(128)
    q, s = quantize_blocks(x, 128, multiple)
    rows = -(-m // multiple) * multiple
    assert q.shape == (rows, k) and s.shape == (rows, k // 128) and s.stride() == (1, rows)
    blocks = x.float().view(m, k // 128, 128)
    want_s = blocks.abs().amax(-1) / 448.0
    assert torch.equal(s[:m], want_s)
    want_q = (blocks / want_s[..., None]).to(torch.float8_e4m3fn).view(m, k)
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))
    assert not q[m:].float().any()


@pytest.mark.parametrize("group", [128, 256])
@pytest.mark.parametrize("mma_scales", [False, True])
def test_blockwise_scales_give_each_128_columns_their_group_scale(group, mma_scales) -> None:
    n, k = 48, 512
    q = int4_weight(n, k, group, True, "cpu")
    scales = reference.int4_mma_pack(q.qweight, q.scales)[1] if mma_scales else q.scales
    got = int4_gemm.blockwise_scales(scales, group, k, mma_scales)
    assert got.shape == (n, k // 128) and got.stride() == (1, n) and got.dtype == torch.float32
    want = q.scales.float().repeat_interleave(group // 128, dim=1)
    assert torch.equal(got, want)


@GPU
@needs_cuda
@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(300, 512, 1024, 128), (4096, 34816, 5120, 128), (77, 256, 768, 256)]
)
def test_w4a8_linear_on_gpu_is_the_w4a8_product(m, n, k, group) -> None:
    """cuBLAS's blockwise GEMM (x per token and 128 columns) and the Triton W4A8 GEMM (x per
    token) both answer within x's e4m3 rounding of the exact product."""
    torch.manual_seed(n)
    q = int4_weight(n, k, group, True, "cuda")
    codes = int4_gemm.int4_codes_e4m3(q.qweight)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    exact = exact_linear(x, q, bias)
    if refusal := int4_gemm.blockwise_refusal(x.device):
        pytest.skip(f"cuBLAS's blockwise FP8 GEMM does not run here: {refusal}")
    blockwise = int4_gemm.w4a8_linear(x, codes, q.scales, group, bias, mma_scales=False)
    a, a_scale = int4_gemm.quantize_rows(x)
    per_token = int4_gemm.w4a8_gemm(a, a_scale, codes, q.scales, group, bias, mma_scales=False)
    assert blockwise.shape == (m, n) and blockwise.dtype == torch.bfloat16
    assert rel_err(blockwise.float(), exact) < 4e-2
    assert rel_err(blockwise.float(), exact) <= 1.05 * rel_err(per_token.float(), exact)


def test_the_blockwise_gemm_says_why_it_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert int4_gemm.blockwise_refusal(torch.device("cpu")) == "not a CUDA device"
    assert not int4_gemm.blockwise_runs(torch.device("cpu"))
    monkeypatch.setattr(int4_gemm, "W4A8_GEMM", "triton")
    assert "TOKENMILL_INT4_W4A8_GEMM" in int4_gemm.blockwise_refusal(torch.device("cuda", 0))
