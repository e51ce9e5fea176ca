"""Int8 codes of an int4 GEMV's input (`reference.int4_mma_x8`), written by the kernel before it.

On CPU: the triton norms and output gate (interpreter) write the reference's codes and scales
beside outputs equal to their plain forms; with `TOKENMILL_INT4_X8` on, a tiny hybrid int4 model
in the int4-mma layout feeds its decode rows' projections codes (the reference product of codes),
its logits within x's rounding of the 16-bit activations' and its prefill untouched. The GEMV on
int8 tensor cores is checked against the same codes in tests/worker/test_int4_mma.py (`-m gpu`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.worker.model_driver import ModelDriver
from tests.worker.numerics import rel_err
from worker.kernels import ops, reference
from worker.kernels.cuda import int4_mma
from worker.models import build_random
from worker.models.int4 import MMA, Int4Linear, quantize_int4
from worker.models.presets import TINY_QWEN3_5

pytestmark = pytest.mark.usefixtures("one_thread")


def same_codes(got: reference.X8, values: torch.Tensor) -> None:
    want = reference.int4_mma_x8(values.reshape(got.codes.shape[0], -1))
    assert got.codes.dtype == torch.int8 and got.dtype == values.dtype
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("rows", [1, 3])
def test_norms_write_the_codes_of_their_output(rows: int) -> None:
    from worker.kernels.triton import norm

    torch.manual_seed(0)
    x, res = torch.randn(rows, 384).bfloat16(), torch.randn(rows, 384).bfloat16()
    w = torch.randn(384).bfloat16() * 0.2
    out, total, x8 = norm.add_rms_norm_x8(x, res, w, 1e-6, True)
    plain, plain_total = norm.add_rms_norm(x, res, w, 1e-6, True)
    assert torch.equal(out, plain) and torch.equal(total, plain_total)
    same_codes(x8, out)
    out, x8 = norm.rms_norm_x8(x, w, 1e-6, True)
    assert torch.equal(out, norm.rms_norm(x, w, 1e-6, True))
    same_codes(x8, out)
    # the DeltaNet's gated norm: rows of heads, codes of tokens [T, H * D]
    heads, gate = torch.randn(rows, 3, 128).bfloat16(), torch.randn(rows, 3, 128).bfloat16()
    out, x8 = norm.gated_rms_norm_x8(heads, gate, w[:128], 1e-6)
    assert torch.equal(out, norm.gated_rms_norm(heads, gate, w[:128], 1e-6))
    assert tuple(x8.codes.shape) == (rows, 384) and tuple(x8.scales.shape) == (rows, 3)
    same_codes(x8, out)


def test_the_output_gate_writes_the_codes_of_its_output() -> None:
    from worker.kernels.triton.activations import sigmoid_mul, sigmoid_mul_x8

    torch.manual_seed(1)
    x = torch.randn(2, 1280).bfloat16() * 4  # two column blocks of 1,024, the second ragged
    gate = torch.randn(2, 2 * 1280).bfloat16().view(2, 5, 512)[..., :256]  # q|gate's strided half
    out, x8 = sigmoid_mul_x8(x, gate)
    assert torch.equal(out, sigmoid_mul(x, gate))
    same_codes(x8, out)
    x[0, :128] = 0  # a zero group: scale 0, codes 0
    out, x8 = sigmoid_mul_x8(x, gate)
    assert x8.scales[0, 0] == 0 and not x8.codes[0, :128].any()


def test_a_launch_of_its_own_writes_the_codes() -> None:
    from worker.kernels.triton.x8 import quantize_x8

    torch.manual_seed(2)
    act = (torch.randn(3, 1408) * 2).bfloat16()  # the down projection's input, 11 groups
    same_codes(quantize_x8(act), act)
    same_codes(quantize_x8(act[:, :1280]), act[:, :1280])  # a strided view


def test_rows_off_the_group_size_are_refused() -> None:
    from worker.kernels.triton import norm

    with pytest.raises(ValueError, match="multiple of 128"):
        norm.rms_norm_x8(torch.randn(2, 96), torch.ones(96), 1e-6, False)


@pytest.fixture(params=[False, True], ids=["norm-fed", "and-down"])
def x8_on(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The int8 products on; and-down: the MLP's down projection's too (its own launch)."""
    int4_mma.set_x8(True, request.param)
    try:
        yield request.param
    finally:
        int4_mma.set_x8(False)


def mma_model() -> Any:
    """A tiny hybrid int4 model (every projection's K a multiple of 128) in the int4-mma layout,
    repacked on CPU as the engine repacks on a GPU."""
    model = quantize_int4(build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=3))
    model.fuse_projections()
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear) and m.mma_layout_supported()[0]:
            m.to_mma_layout(gate_up=name.endswith("gate_up_proj"))
    return model


def decode_logits(model: Any) -> torch.Tensor:
    """[2 sequences, 4 steps, vocab]: the prompts' last logits, then 3 decode steps of 2 rows
    fed fixed tokens (the same inputs whatever the logits)."""
    driver = ModelDriver(model, num_blocks=16, block_size=4)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2]]
    for i, p in enumerate(prompts):
        driver.add(i, p)
    driver.step({i: len(p) for i, p in enumerate(prompts)})  # prefill: 21 rows, past 16
    for token in (11, 12, 13):
        for i in range(len(prompts)):
            driver.seqs[i].tokens.append(token + i)
        driver.step({0: 1, 1: 1})
    return torch.stack(
        [torch.stack([seq.logits[p] for p in sorted(seq.logits)]) for seq in driver.seqs.values()]
    )


def test_decode_rows_feed_their_projections_codes(
    x8_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = mma_model()
    int4_mma.set_x8(False)
    want = decode_logits(model)
    int4_mma.set_x8(True, x8_on)
    calls: list[tuple[int, ...]] = []
    linear, gate_up = ops.int4_mma_linear_x8, ops.int4_mma_linear_silu_mul_x8

    def record(x8: reference.X8, qweight: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(tuple(x8.codes.shape))
        return linear(x8, qweight, *rest)

    def record_gate_up(x8: reference.X8, qweight: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(tuple(x8.codes.shape))
        return gate_up(x8, qweight, *rest)

    monkeypatch.setattr(ops, "int4_mma_linear_x8", record)
    monkeypatch.setattr(ops, "int4_mma_linear_silu_mul_x8", record_gate_up)
    got = decode_logits(model)
    layers = model.config.num_hidden_layers
    # every layer: its input projection, its output projection and gate|up (and down), at 2
    # decode rows each step; the prefill's 21 rows take none
    per_layer = 4 if x8_on else 3
    assert len(calls) == 3 * per_layer * layers and all(shape[0] == 2 for shape in calls)
    assert all(layer.mlp.gate_up_proj.layout == MMA for layer in model.model.layers)
    assert torch.equal(got[:, 0], want[:, 0])  # the prefill step's: computed without codes
    err = rel_err(got[:, 1:], want[:, 1:])
    assert 0 < err < 0.05  # x's rounding to int8 per 128, through 4 layers of random weights


GPU = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@GPU
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_producers_feed_the_int8_gemv_27b(rows: int) -> None:
    """A W4 decode step's producers at the 27B shapes write codes the int8 GEMV takes: the
    input norm into the DeltaNet's qkv|z (its tuned tiling) and gate|up (the persistent ring,
    paired tiles), the gated norm into the out projection, the output gate into o."""
    from worker.kernels.triton import activations, norm
    from worker.models.int4 import quantize_rtn

    if not int4_mma.available(torch.device("cuda"))[0]:
        pytest.skip(int4_mma.available(torch.device("cuda"))[1])
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = quantize_rtn(torch.randn(n, k, device=dev) * 0.02, 128, True)
        words, scales = reference.int4_mma_pack(q.qweight, q.scales)
        return words, scales, reference.int4_dequantize(q.qweight, q.scales, None, 128)

    def check(x8: reference.X8, x: torch.Tensor, w: tuple[torch.Tensor, ...], tiling: tuple[int, ...]) -> None:  # fmt: skip
        same_values = reference.int4_mma_x8_values(x8.codes, x8.scales)
        # x's int8 rounding per 128 columns: ~0.5% of a normed row, 1.3-1.4% of the gated
        # norm's product with silu(gate), whose tails set the scale
        assert rel_err(same_values, x.float().reshape(same_values.shape)) < 2e-2
        got = int4_mma.gemv_x8(x8.codes, x8.scales, w[0], w[1], 128, int4_mma.MmaTiling(*tiling))
        assert rel_err(got.float(), same_values @ w[2].T) < 1e-2

    h, res = torch.randn(rows, 5120, device=dev, dtype=bf16), torch.randn(rows, 5120, device=dev, dtype=bf16)  # fmt: skip
    normed, _, x8 = norm.add_rms_norm_x8(h, res, torch.randn(5120, device=dev) * 0.1, 1e-6, True)
    check(x8, normed, weight(16384, 5120), (2, 4, 1, 3, 9))
    heads = torch.randn(rows, 48, 128, device=dev, dtype=bf16)
    out, x8 = norm.gated_rms_norm_x8(heads, torch.randn_like(heads), torch.ones(128, device=dev), 1e-6)  # fmt: skip
    check(x8, out, weight(5120, 6144), (2, 8, 1, 3, 9))
    attn = torch.randn(rows, 6144, device=dev, dtype=bf16)
    gated, x8 = activations.sigmoid_mul_x8(attn, torch.randn(rows, 24, 256, device=dev, dtype=bf16))  # fmt: skip
    check(x8, gated, weight(5120, 6144), (2, 8, 2, 3, 10))
