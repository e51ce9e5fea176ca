"""The decode-step fusions against their unfused forms: the one-launch FP8 GEMV (split-K summed by
the last arriving program), silu*mul, residual add + RMSNorm and the DeltaNet gates as kernels
(triton interpreter on CPU; `-m gpu` at the 27B shapes), and models whose sibling projections
were concatenated (q|k|v, qkv|z|b|a, gate|up) giving the same logits as unfused ones."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.worker.numerics import rel_err
from tests.worker.triton_env import GPU, needs_cuda
from worker.kernels import ops, reference
from worker.kernels.triton.activations import gdn_gates, silu_mul
from worker.kernels.triton.fp8_gemm import (
    DecodeTiling,
    _arrivals,
    _workspaces,
    linear_silu_mul,
    w8_gemv,
)
from worker.kernels.triton.norm import add_rms_norm
from worker.models import build_random
from worker.models.fp8 import Fp8Linear, quantize_fp8, quantize_weight
from worker.models.layers import Linear
from worker.models.presets import PRESETS

# ---------------------------------------------------------------- one-launch FP8 GEMV


def check_gemv(m: int, n: int, k: int, tiling: DecodeTiling | None, device: str) -> None:
    q, scale = quantize_weight(torch.randn(n, k, device=device) * 0.02)
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16()
    for b in (None, bias):
        for _ in range(2):  # again: the arrival counters must be re-armed by the first call
            out = w8_gemv(x, q, scale, b, tiling)
            assert out.shape == (m, n) and out.dtype == x.dtype
            assert rel_err(out, reference.fp8_linear(x, q, scale, b)) < 1e-2
    counters = _arrivals.get(x.device)
    assert counters is None or counters.count_nonzero() == 0
    workspace = _workspaces.get(x.device)  # stream-K accumulators: zeroed by each finisher
    assert workspace is None or workspace.count_nonzero() == 0


@pytest.mark.parametrize(
    ("m", "n", "k", "tiling"),
    [
        (8, 48, 128, DecodeTiling(16, 32, 1)),  # one K range: scale in the epilogue
        (5, 40, 600, DecodeTiling(16, 64, 3)),  # K not a multiple of BK, 3 splits
        (16, 70, 512, DecodeTiling(32, 128, 4)),  # N not a multiple of BN
        (8, 40, 512, DecodeTiling(16, 64, 3)),  # whole K steps, the last split shorter
        (8, 36, 1024, DecodeTiling(32, 128, 7)),  # (as 7 splits of 17,408 / 256 steps)
        (1, 33, 256, DecodeTiling(16, 64, 2, two_pass=True)),  # the w8a16 + reduce fallback
        (3, 40, 96, None),  # default tiling
        # stream-K (4 "SMs" under the interpreter): ranges that start and end mid-tile
        (8, 96, 512, DecodeTiling(32, 128, 1, stream_k=1)),  # 3 tiles: 3 programs
        (5, 70, 384, DecodeTiling(16, 128, 1, stream_k=3)),  # 5 tiles of 3 steps: 10 halves
        (8, 200, 256, DecodeTiling(16, 64, 1, stream_k=5)),  # 13 tiles over 20 programs
        (16, 33, 1024, DecodeTiling(32, 128, 1, stream_k=2)),  # N < 2 tiles, long ranges
        (8, 400, 256, DecodeTiling(16, 64, 1, stream_k=1)),  # 25 tiles over 4: 6-7 tiles a range
        # past 16 rows (TOKENMILL_FP8_GEMV_MAX_ROWS): a 32- or 64-row tile, split or not
        (32, 48, 256, DecodeTiling(16, 64, 2)),
        (40, 70, 512, DecodeTiling(32, 128, 1, stream_k=1)),  # stream-K: the plain form
        (24, 33, 256, DecodeTiling(16, 64, 2, two_pass=True)),  # two-pass: the plain form
    ],
)
def test_w8_gemv_matches_reference(m, n, k, tiling) -> None:
    torch.manual_seed(m * n + k)
    check_gemv(m, n, k, tiling, "cpu")


def block_quantized_x(x: torch.Tensor, bk: int) -> torch.Tensor:
    """x rounded as the W8A8 GEMV rounds it: e4m3 per row over each BK-column block."""
    m, k = x.shape
    pad = -k % bk
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, bk)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448.0
    rounded = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    return rounded.view(m, -1)[:, :k]


@pytest.mark.parametrize(
    ("m", "n", "k", "tiling"),
    [
        (8, 64, 512, DecodeTiling(64, 128, 1, 4, 2, act_fp8=True)),  # wgmma-sized tile
        (5, 40, 600, DecodeTiling(16, 64, 3, act_fp8=True)),  # ragged K, 3 splits, N < BN
        (8, 70, 512, DecodeTiling(32, 128, 4, act_fp8=True)),  # 4 splits
    ],
)
def test_w8a8_gemv_rounds_x_per_block_and_matches_the_emulation(m, n, k, tiling) -> None:
    torch.manual_seed(m + n + k)
    q, scale = quantize_weight(torch.randn(n, k) * 0.02)
    x = torch.randn(m, k).bfloat16()
    x[0, : k // 2] *= 50  # an outlier block: its own scale, the row's other blocks keep theirs
    out = w8_gemv(x, q, scale, None, tiling)
    emulated = reference.fp8_linear(block_quantized_x(x, tiling.bk), q, scale, None)
    # the kernel rounds ties away from zero (the emulation's cast to even) and outputs bf16
    assert rel_err(out, emulated) < 1.5e-2
    exact = reference.fp8_linear(x, q, scale, None)
    assert 5e-3 < rel_err(out, exact) < 4e-2  # x really went through e4m3, and only that


@pytest.mark.parametrize("splits", [1, 3])
def test_w8a8_gemv_with_x_quantized_per_token_matches_the_emulation(splits) -> None:
    from worker.kernels.triton.fp8_gemm import quantize_rows

    m, n, k = 48, 96, 640
    tiling = DecodeTiling(64, 128, splits, 4, 2, act_fp8=True, x_per_token=True)
    torch.manual_seed(splits)
    q, scale = quantize_weight(torch.randn(n, k) * 0.02)
    x = torch.randn(m, k).bfloat16()
    x[3] *= 40  # a loud token: its own scale, the others keep theirs
    out = w8_gemv(x, q, scale, None, tiling)
    xq, xs = quantize_rows(x)
    emulated = reference.fp8_linear((xq.float() * xs).bfloat16(), q, scale, None)
    assert rel_err(out, emulated) < 1.5e-2
    exact = reference.fp8_linear(x, q, scale, None)
    # x really went through e4m3, and only that (the interpreter's e4m3 cast truncates: ~6%
    # a value here; scaled_mm's per-token rounding measured 2.7% on the H200)
    assert 5e-3 < rel_err(out, exact) < 8e-2


@pytest.mark.parametrize("sms", [4, 132])
@pytest.mark.parametrize("per_sm", [1, 2, 3])
@pytest.mark.parametrize(("tiles", "ksteps"), [(3, 40), (40, 68), (129, 20), (272, 20), (1088, 10), (5, 1), (7, 3)])  # fmt: skip
def test_stream_k_adds_at_most_twice_into_a_tile(tiles, ksteps, sms, per_sm) -> None:
    """The ranges the stream-K kernels cut (start = pid * total // programs) put at most two
    programs' sums into any column tile, so their fp32 adds commute and the output's bits do
    not depend on which SM finishes first; and the grid never exceeds one wave."""
    from worker.kernels.triton.fp8_gemm import stream_k_programs

    programs = stream_k_programs(tiles, ksteps, sms, per_sm)
    assert 1 <= programs <= max(sms * per_sm, 1)
    total = tiles * ksteps
    touching = [0] * tiles
    for pid in range(programs):
        start, stop = pid * total // programs, (pid + 1) * total // programs
        for tile in range(start // ksteps, (stop - 1) // ksteps + 1) if stop > start else ():
            touching[tile] += 1
    assert max(touching) <= 2 and min(touching) >= 1


@pytest.mark.parametrize("m", [24, 48])
def test_decode_batches_of_17_to_64_rows_take_a_measured_wide_gemv(monkeypatch, m) -> None:
    """fp8_linear at 17-64 rows runs w8_gemv where WIDE_DECODE_TILINGS holds the (shape, row
    bucket), with that tiling."""
    from worker.kernels.triton import fp8_gemm

    n, k = 96, 512
    tiling = DecodeTiling(64, 128, 2, 4, 2, act_fp8=True)
    q, scale = quantize_weight(torch.randn(n, k) * 0.02)
    x = torch.randn(m, k).bfloat16()
    used: list[DecodeTiling | None] = []
    real = fp8_gemm.w8_gemv

    def spy(*args, **kwargs):
        used.append(args[4] if len(args) > 4 else kwargs.get("tiling"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_gemm, "w8_gemv", spy)
    monkeypatch.setitem(fp8_gemm.WIDE_DECODE_TILINGS, (n, k, fp8_gemm.wide_rows(m)), tiling)
    out = fp8_gemm.fp8_linear(x, q, scale)
    assert used == [tiling]
    emulated = reference.fp8_linear(block_quantized_x(x, tiling.bk), q, scale, None)
    assert rel_err(out, emulated) < 1.5e-2


def check_gate_up_silu_mul(
    m: int, f: int, k: int, tiling: DecodeTiling | None, fp8: bool, device: str
) -> None:
    """The fused gate|up GEMV against the projection then silu_mul (the two launches it
    replaces) and against the plain-PyTorch reference."""
    w = torch.randn(2 * f, k, device=device) * 0.02
    x = torch.randn(m, k, device=device).bfloat16()
    if fp8:
        weight, scale = quantize_weight(w)
        gate_up = w8_gemv(x, weight, scale, None, DecodeTiling(32, 64, 1))
    else:
        weight, scale = w.bfloat16(), None
        gate_up = torch.nn.functional.linear(x, weight)
    out = linear_silu_mul(x, weight, scale, None, tiling)
    assert out.shape == (m, f) and out.dtype == x.dtype
    assert rel_err(out, silu_mul(gate_up)) < 1e-2
    # the interpreter's fp32 -> bf16 cast rounds differently from torch's in ~half the cases
    bound = 1e-2 if device == "cuda" else 2e-2
    assert rel_err(out, reference.linear_silu_mul(x, weight, scale)) < bound


@pytest.mark.parametrize(
    ("m", "f", "k", "tiling", "fp8"),
    [
        (8, 48, 128, DecodeTiling(16, 32, 1), True),  # whole tiles
        (5, 40, 300, DecodeTiling(16, 64, 1), True),  # K not a multiple of BK
        (8, 70, 256, DecodeTiling(32, 64, 1), True),  # F not a multiple of BN
        (2, 20, 96, None, True),  # default tiling
        (8, 48, 128, DecodeTiling(16, 32, 1), False),  # 16-bit weights, no scales
    ],
)
def test_gate_up_gemv_forms_silu_mul_in_its_epilogue(m, f, k, tiling, fp8) -> None:
    torch.manual_seed(m + f + k)
    check_gate_up_silu_mul(m, f, k, tiling, fp8, "cpu")


def test_gate_up_silu_mul_takes_two_launches_where_measured_faster(monkeypatch) -> None:
    """Prefill rows, a bias, or a shape the sweep found faster unfused: projection + silu_mul."""
    from worker.kernels.triton import fp8_gemm

    torch.manual_seed(9)
    weight, scale = quantize_weight(torch.randn(64, 128) * 0.02)
    x = torch.randn(4, 128).bfloat16()
    launches: list = []
    monkeypatch.setattr(
        fp8_gemm, "_gemv_silu_mul_kernel", _Recorder(fp8_gemm._gemv_silu_mul_kernel, launches)
    )
    fused = fp8_gemm.linear_silu_mul(x, weight, scale)
    assert len(launches) == 1
    monkeypatch.setitem(fp8_gemm.SILU_MUL_TILINGS, (64, 128, True), None)
    unfused = fp8_gemm.linear_silu_mul(x, weight, scale)
    fp8_gemm.linear_silu_mul(torch.randn(17, 128).bfloat16(), weight, scale)  # > 16 rows
    assert len(launches) == 1  # neither launched the fused kernel
    assert rel_err(unfused, fused) < 2e-2


class _Recorder:
    """Stands in for a kernel: records each launch's grid, then launches the real kernel."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_gemv_with_16bit_weights_matches_linear() -> None:
    torch.manual_seed(7)
    w, x, bias = torch.randn(70, 512) * 0.02, torch.randn(8, 512), torch.randn(70)
    for tiling in (
        DecodeTiling(32, 128, 1),
        DecodeTiling(32, 128, 3),
        DecodeTiling(32, 128, 1, stream_k=2),
    ):
        out = w8_gemv(x, w, None, bias, tiling)
        assert rel_err(out, torch.nn.functional.linear(x, w, bias)) < 1e-5
        # waiting for the launch before only before the first write changes no bit
        assert torch.equal(w8_gemv(x, w, None, bias, tiling, beside_previous=True), out)
    with pytest.raises(ValueError):
        w8_gemv(x, w, torch.ones(70))  # a scale belongs to fp8 weights only


def test_linear_takes_the_gemv_only_for_swept_shapes(monkeypatch) -> None:
    from worker.kernels.triton import fp8_gemm

    torch.manual_seed(8)
    w, x = torch.randn(40, 256) * 0.02, torch.randn(2, 3, 256)
    monkeypatch.setitem(fp8_gemm.BF16_DECODE_TILINGS, (40, 256), DecodeTiling(16, 64, 2))
    calls = []
    real = fp8_gemm.w8_gemv
    monkeypatch.setattr(fp8_gemm, "w8_gemv", lambda *a: calls.append(1) or real(*a))
    out = fp8_gemm.linear(x, w)
    assert calls and out.shape == (2, 3, 40)
    assert rel_err(out, torch.nn.functional.linear(x, w)) < 1e-5
    calls.clear()
    fp8_gemm.linear(torch.randn(17, 256), w)  # more than 16 rows: F.linear
    fp8_gemm.linear(x, torch.randn(41, 256))  # a shape the sweep did not choose: F.linear
    assert not calls


def test_fp8_linear_routes_decode_rows_to_the_gemv(monkeypatch) -> None:
    from worker.kernels.triton import fp8_gemm

    calls = []

    def gemv(x, weight, scale, bias):
        calls.append(tuple(x.shape))
        return torch.zeros(x.shape[0], weight.shape[0])

    monkeypatch.setattr(fp8_gemm, "w8_gemv", gemv)
    out = fp8_gemm.fp8_linear(torch.randn(2, 4, 8), torch.zeros(3, 8), torch.ones(3))
    assert calls == [(8, 8)] and out.shape == (2, 4, 3)  # [2, 4] rows flattened: one launch


# ---------------------------------------------------------------- elementwise fusions


def test_silu_mul_matches_reference() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 300).bfloat16() * 3
    wide = torch.randn(5, 700).bfloat16()  # rows strided: a view of a wider output
    for inp in (x, wide[:, :600]):
        out = silu_mul(inp)
        assert out.shape == (5, 300)
        assert rel_err(out, reference.silu_mul(inp)) < 1e-2


@pytest.mark.parametrize("unit_offset", [True, False])
def test_add_rms_norm_matches_reference(unit_offset: bool) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(7, 96).bfloat16(), torch.randn(7, 96).bfloat16() * 4
    weight = torch.randn(96).bfloat16() * 0.2
    normed, total = add_rms_norm(x, residual, weight, 1e-6, unit_offset)
    ref_normed, ref_total = reference.add_rms_norm(x, residual, weight, 1e-6, unit_offset)
    # the stream: the bf16 sum (the interpreter's bf16 cast truncates: within one ulp)
    assert torch.allclose(total.float(), ref_total.float(), rtol=2**-7, atol=0)
    assert rel_err(normed, ref_normed) < 1e-2


def test_sigmoid_mul_reads_the_gate_in_place() -> None:
    from worker.kernels.triton.activations import sigmoid_mul

    torch.manual_seed(9)
    qg = torch.randn(4, 3, 2 * 16).bfloat16() * 3  # per head [query | gate], as q_proj yields
    gate = qg[..., 16:]
    x = torch.randn(4, 3 * 16).bfloat16()
    out = sigmoid_mul(x, gate)
    assert rel_err(out, reference.sigmoid_mul(x, gate)) < 1e-2
    assert rel_err(sigmoid_mul(x, gate.reshape(4, 48)), reference.sigmoid_mul(x, gate)) < 1e-2


def test_norms_read_strided_heads_in_place() -> None:
    from worker.kernels.triton.norm import gated_rms_norm, rms_norm

    torch.manual_seed(10)
    fused = torch.randn(3, 5 * 32 + 7).bfloat16()  # [T, H*D + more]: heads as a strided view
    heads = fused[:, : 5 * 32].view(3, 5, 32)
    weight = torch.randn(32).bfloat16() * 0.2
    out = rms_norm(heads, weight, 1e-6, True)
    assert out.shape == (3, 5, 32) and out.is_contiguous()
    assert rel_err(out, reference.rms_norm(heads, weight, 1e-6, True)) < 1e-2
    x = torch.randn(3, 5, 32).bfloat16()
    out = gated_rms_norm(x, heads, weight, 1e-6)
    assert rel_err(out, reference.gated_rms_norm(x, heads, weight, 1e-6)) < 1e-2


def test_gdn_gates_match_reference() -> None:
    torch.manual_seed(2)
    ab = torch.randn(6, 2 * 12 + 4).bfloat16() * 8  # strided rows, wide range (softplus tails)
    a, b = ab[:, :12], ab[:, 12:24]
    A_log, dt_bias = torch.rand(12).add(0.1).log(), torch.randn(12)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    ref_g, ref_beta = reference.gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    assert rel_err(g, ref_g) < 1e-5 and rel_err(beta, ref_beta) < 1e-2


def test_new_ops_prefer_triton_on_cuda() -> None:
    for op in ("add_rms_norm", "silu_mul", "sigmoid_mul", "gdn_gates", "apply_rotary", "qk_norm_rotary", "linear"):  # fmt: skip
        assert ops.select(op, torch.device("cpu"), torch.bfloat16).name == "reference"
        assert ops.select(op, torch.device("cuda"), torch.bfloat16).name == f"triton.{op}"
    fused = "qk_norm_rotary_write_kv"  # an attention op: the cache's dtype counts too
    assert ops.select(fused, torch.device("cpu"), torch.bfloat16, torch.float8_e4m3fn).name == (
        "reference"
    )
    assert ops.select(fused, torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn).name == (
        f"triton.{fused}"
    )


# ---------------------------------------------------------------- fused projections


def logits_of(model, tokens: int = 6) -> torch.Tensor:
    from tests.worker.helpers import small_engine
    from worker.engine.sequence import SamplingParams

    engine = small_engine(model, max_num_seqs=2, max_model_len=32, fuse_projections=False)
    engine.add_request(list(range(3, 3 + tokens)), SamplingParams(temperature=0, max_tokens=1))
    ids, meta = engine.runner.prepare(engine.scheduler.schedule())
    with torch.inference_mode():
        return engine.runner._logits(ids, meta)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-llama"])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_projections_give_the_same_logits(preset: str, fp8: bool) -> None:
    config = PRESETS[preset]
    model = build_random(config, "cpu", torch.float32, seed=3)
    if fp8:
        quantize_fp8(model)
    params = sum(p.numel() for p in model.parameters())
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    fused.fuse_projections()  # idempotent
    assert sum(p.numel() for p in fused.parameters()) == params
    layer = fused.model.layers[0]
    linear = Fp8Linear if fp8 else Linear
    assert isinstance(layer.mlp.gate_up_proj, linear) and layer.mlp.gate_proj is None
    mixer = layer.self_attn if layer.is_attention else layer.linear_attn
    assert isinstance(getattr(mixer, "qkv_proj", None) or mixer.in_proj_qkvzba, linear)
    assert rel_err(logits_of(fused), logits_of(model)) < 1e-5


def test_engine_fuses_projections_by_default() -> None:
    from worker.engine.engine import EngineConfig, LLMEngine

    model = build_random(PRESETS["tiny-qwen3.5"], "cpu", torch.float32, seed=4)
    LLMEngine(model, None, EngineConfig(block_size=4, max_num_seqs=2, max_model_len=32))
    assert all(layer.mlp.gate_up_proj is not None for layer in model.model.layers)


# ---------------------------------------------------------------- GPU, at the 27B shapes


@GPU
@needs_cuda
@pytest.mark.parametrize(
    ("n", "k"), [(34816, 5120), (5120, 17408), (16480, 5120), (5120, 6144), (14336, 5120)]
)
def test_gpu_w8_gemv_27b(n: int, k: int) -> None:
    torch.manual_seed(0)
    check_gemv(8, n, k, None, "cuda")


@GPU
@needs_cuda
def test_gpu_gemv_beside_previous_reads_its_input_complete() -> None:
    """The DeltaNet b|a chain of a W4 decode step in a CUDA graph under PDL: a norm writes h,
    a long GEMV reads it, and the 16-bit b|a GEMV (split K, as tuned) reads h beside that GEMV.
    Every replay with a new input gives b|a of that input's h, and so does a GEMV after it that
    reads the long GEMV's output (b|a's late wait covers it)."""
    torch.manual_seed(0)
    device, bf16 = torch.device("cuda"), torch.bfloat16
    x_in = torch.empty(8, 5120, device=device, dtype=bf16)
    norm = torch.rand(5120, device=device, dtype=bf16) + 0.5
    long_w = torch.randn(16384, 5120, device=device, dtype=bf16) * 0.02
    ba_w = torch.randn(96, 5120, device=device, dtype=bf16) * 0.02
    after_w = torch.randn(64, 16384, device=device, dtype=bf16) * 0.02

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        h = ops.rms_norm(x_in, norm, 1e-6, False)
        mid = w8_gemv(h, long_w, None, None, DecodeTiling(64, 256, 1))
        ba = w8_gemv(h, ba_w, None, None, DecodeTiling(32, 256, 20), beside_previous=True)
        return ba, w8_gemv(mid, after_w, None, None, DecodeTiling(32, 256, 4))

    x_in.copy_(torch.randn_like(x_in))
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba, after = step()
    for _ in range(30):
        x_in.copy_(torch.randn_like(x_in))
        graph.replay()
        h = reference.rms_norm(x_in, norm, 1e-6, False)
        assert rel_err(ba.float(), (h.float() @ ba_w.float().T)) < 1e-2
        mid = h.float() @ long_w.float().T
        assert rel_err(after.float(), mid @ after_w.float().T) < 2e-2


@GPU
@needs_cuda
def test_gpu_gate_up_silu_mul_27b() -> None:
    torch.manual_seed(0)
    check_gate_up_silu_mul(8, 17408, 5120, None, True, "cuda")  # the MLP's gate|up, fp8
    check_gate_up_silu_mul(8, 17408, 5120, None, False, "cuda")  # and bf16


@pytest.mark.parametrize("rotary_dim", [8, 32])
def test_apply_rotary_matches_reference(rotary_dim: int) -> None:
    from worker.kernels.triton.rotary import apply_rotary

    torch.manual_seed(5)
    qg = torch.randn(5, 3, 2 * 32).bfloat16()  # strided heads: a query half of q|gate
    x = qg[..., :32]
    positions = torch.tensor([0, 7, 3, 100, 41])
    angles = torch.outer(torch.arange(128.0), 1.0 / 1e4 ** (torch.arange(0, rotary_dim, 2) / 32))
    tables = (angles.cos(), angles.sin())
    out = apply_rotary(x, positions, tables, rotary_dim)
    ref = reference.apply_rotary(x, positions, tables, rotary_dim)
    assert out.shape == x.shape and out.is_contiguous()
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # passed through


def check_qk_norm_rotary(
    tokens: int, hq: int, hk: int, dim: int, rotary_dim: int, unit_offset: bool, gated: bool,
    device: str,
) -> None:  # fmt: skip
    from worker.kernels.triton.rotary import qk_norm_rotary

    torch.manual_seed(6)
    q_width = hq * dim * (2 if gated else 1)
    # strided heads, as the fused projection gives them: q (and its gate) then k then v
    fused = torch.randn(tokens, q_width + 2 * hk * dim, device=device).bfloat16() * 3
    q_part = fused[:, :q_width]
    q = q_part.view(tokens, hq, 2 * dim)[..., :dim] if gated else q_part.view(tokens, hq, dim)
    k = fused[:, q_width : q_width + hk * dim].view(tokens, hk, dim)
    q_w = torch.randn(dim, device=device).bfloat16() * 0.3
    k_w = torch.randn(dim, device=device).bfloat16() * 0.3
    positions = torch.randint(0, 128, (tokens,), device=device)
    freqs = 1.0 / 1e4 ** (torch.arange(0, rotary_dim, 2, device=device) / rotary_dim)
    angles = torch.outer(torch.arange(128.0, device=device), freqs)
    tables = (angles.cos(), angles.sin())
    args = (1e-6, unit_offset, positions, tables, rotary_dim)
    got_q, got_k = qk_norm_rotary(q, k, q_w, k_w, *args)
    want_q, want_k = reference.qk_norm_rotary(q, k, q_w, k_w, *args)
    assert got_q.shape == (tokens, hq, dim) and got_k.shape == (tokens, hk, dim)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    # two roundings to bf16 (the norm's, the rotation's), each up to an ulp under the
    # interpreter, which truncates where the GPU rounds to nearest
    assert rel_err(got_q, want_q) < 2e-2 and rel_err(got_k, want_k) < 2e-2
    # the unrotated channels are rms_norm's own output
    plain = reference.rms_norm(k, k_w, 1e-6, unit_offset)
    assert rel_err(got_k[..., rotary_dim:], plain[..., rotary_dim:]) < 1e-2
    # k normed with q's weight instead (the two programs' arguments crossed) is far off
    assert rel_err(got_k, reference.qk_norm_rotary(q, k, k_w, q_w, *args)[1]) > 0.1
    v = fused[:, q_width + hk * dim :].view(tokens, hk, dim)
    check_qk_norm_rotary_write_kv(q, k, v, q_w, k_w, args, got_q, got_k)


def check_qk_norm_rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    args: tuple,
    got_q: torch.Tensor,
    got_k: torch.Tensor,
) -> None:
    """The same launch writing k and v into paged caches (16-bit, and fp8 with scales) stores
    exactly what qk_norm_rotary's k then write_kv_cache store, and gives the same q."""
    from worker.kernels.triton.kv_cache import write_kv_cache
    from worker.kernels.triton.rotary import qk_norm_rotary_write_kv

    tokens, hk, dim = k.shape
    slots = torch.randperm(4 * tokens, device=k.device)[:tokens]
    slots[tokens // 2] = -1  # a padding row: skipped
    for dtype, scales in ((torch.bfloat16, (1.0, 1.0)), (torch.float8_e4m3fn, (0.5, 2.0))):
        caches = [torch.zeros(tokens, 4, hk, dim, device=k.device, dtype=dtype) for _ in range(4)]
        got = qk_norm_rotary_write_kv(q, k, v, q_w, k_w, *args, *caches[:2], slots, *scales)
        write_kv_cache(got_k, v, *caches[2:], slots, *scales)
        assert torch.equal(got, got_q)
        assert torch.equal(caches[0].float(), caches[2].float())  # k
        assert torch.equal(caches[1].float(), caches[3].float())  # v
        assert caches[0].float().abs().sum() > 0 and caches[1].float().abs().sum() > 0
        want = reference.qk_norm_rotary_write_kv(
            q, k, v, q_w, k_w, *args, *[c.clone().zero_() for c in caches[:2]], slots, *scales
        )
        assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize(
    ("hq", "hk", "dim", "rotary_dim", "unit_offset", "gated"),
    [
        (6, 2, 64, 16, True, True),  # Qwen3.5's shape class: gated q, partial rotary
        (3, 1, 32, 32, False, False),  # Qwen3's: plain norm weights, full rotary
        (5, 5, 48, 24, True, False),  # heads and dims off the powers of two
    ],
)
def test_qk_norm_rotary_matches_reference(
    hq: int, hk: int, dim: int, rotary_dim: int, unit_offset: bool, gated: bool
) -> None:
    check_qk_norm_rotary(5, hq, hk, dim, rotary_dim, unit_offset, gated, "cpu")


@GPU
@needs_cuda
@pytest.mark.parametrize("tokens", [8, 4096])
def test_gpu_qk_norm_rotary_27b(tokens: int) -> None:
    check_qk_norm_rotary(tokens, 24, 4, 256, 64, True, True, "cuda")


# ------------------------------------- the down projection of silu(gate) * up, rounded in one pass


@pytest.mark.parametrize(("m", "f"), [(5, 200), (3, 4096 + 40)])  # one block / two blocks a row
def test_silu_mul_quantize_rows_has_the_bits_of_quantize_rows_of_silu_mul(m, f) -> None:
    from worker.kernels.triton.fp8_gemm import quantize_rows, silu_mul_quantize_rows

    torch.manual_seed(f)
    y = (torch.randn(m, 2 * f) * 3).bfloat16()
    y[1, f + 7] = 300.0  # a loud up column: that row's scale follows it
    q, scales = silu_mul_quantize_rows(y)
    want_q, want_scales = quantize_rows(silu_mul(y))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, f) and scales.shape == (m, 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(("m", "f"), [(4, 64), (2, 4096 + 32)])
def test_silu_mul_quantize_rows_reads_paired_tiles_in_place(m, f) -> None:
    """An int4-mma gate|up output alternates 16 gate and 16 up columns: the fused rounding
    reads them as `silu_mul(y, paired=16)` does (the e4m3 prefill's down projection)."""
    from worker.kernels.triton.fp8_gemm import quantize_rows, silu_mul_quantize_rows

    torch.manual_seed(f)
    y = (torch.randn(m, 2 * f) * 3).bfloat16()
    y[0, 16 + 5] = 300.0  # a loud up column (pair 0's up half): row 0's scale follows it
    q, scales = silu_mul_quantize_rows(y, paired=16)
    want_q, want_scales = quantize_rows(silu_mul(y, paired=16))
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    unpaired, _ = silu_mul_quantize_rows(y)
    assert not torch.equal(unpaired.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize(
    ("m", "wide"),
    [
        (8, None),  # decode rows: the 16-bit activation, then the GEMV
        (40, DecodeTiling(32, 128, 2, 4, 2, act_fp8=True, x_per_token=True)),  # wide GEMV too
        (40, None),  # 17-64 rows without a wide tiling: w8a16, no codes to take
        (80, None),  # scaled_mm's rows: the codes
    ],
)
def test_fp8_down_projection_of_silu_mul_takes_the_codes_past_the_decode_rows(
    monkeypatch, m, wide
) -> None:
    from worker.kernels.triton import fp8_gemm

    n, f = 48, 320
    torch.manual_seed(m)
    q, scale = quantize_weight(torch.randn(n, f) * 0.02)
    y = torch.randn(2, m // 2, 2 * f).bfloat16()
    if wide is not None:
        monkeypatch.setitem(fp8_gemm.WIDE_DECODE_TILINGS, (n, f, fp8_gemm.wide_rows(m)), wide)
    fused: list[int] = []
    real = fp8_gemm.silu_mul_quantize_rows
    monkeypatch.setattr(
        fp8_gemm, "silu_mul_quantize_rows", lambda rows: fused.append(1) or real(rows)
    )
    out = fp8_gemm.fp8_linear_of_silu_mul(y, q, scale)
    assert out.shape == (2, m // 2, n) and out.dtype == y.dtype
    assert len(fused) == int(m > 64)
    unfused = fp8_gemm.fp8_linear(silu_mul(y), q, scale)
    # the same codes and scales as the GEMM would have rounded itself
    assert torch.equal(out, unfused)
    assert rel_err(out, reference.fp8_linear_of_silu_mul(y, q, scale)) < 8e-2
    monkeypatch.setattr(fp8_gemm, "FP8_FUSED_SILU_QUANT", False)
    fused.clear()
    assert torch.equal(fp8_gemm.fp8_linear_of_silu_mul(y, q, scale), unfused)
    assert not fused


@pytest.mark.parametrize("tokens", [8, 40, 80])
def test_an_fp8_mlp_past_the_decode_rows_hands_gate_up_output_to_the_down_projection(
    monkeypatch, tokens
) -> None:
    from worker.models.layers import MLP

    config = PRESETS["tiny-qwen3.5"]
    torch.manual_seed(tokens)
    mlp = MLP(config)
    quantize_fp8(mlp)
    mlp.fuse_projections()
    assert isinstance(mlp.down_proj, Fp8Linear) and isinstance(mlp.gate_up_proj, Fp8Linear)
    x = torch.randn(tokens, config.hidden_size)
    calls: list[str] = []
    of_silu_mul = mlp.down_proj.of_silu_mul
    monkeypatch.setattr(mlp.down_proj, "of_silu_mul", lambda y: calls.append("of") or of_silu_mul(y))  # fmt: skip
    out = mlp(x)
    assert calls == (["of"] if tokens > 64 else [])
    # the same as the activation formed first (the references on a CPU)
    want = mlp.down_proj(reference.silu_mul(mlp.gate_up_proj(x)))
    assert torch.equal(out, want)
