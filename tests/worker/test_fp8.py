"""FP8 weights (per-output-channel e4m3) against 16-bit: the quantizer, the Fp8Linear swap on a
tiny hybrid model (reference path, CPU), and the triton kernels behind `ops.fp8_linear` and the
graph-safe KV write under the interpreter."""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from worker.engine.sequence import SamplingParams  # noqa: E402
from worker.kernels import reference  # noqa: E402
from worker.models import build_random  # noqa: E402
from worker.models.fp8 import FP8, Fp8Linear, quantize_fp8, quantize_weight  # noqa: E402
from worker.models.presets import PRESETS  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def test_quantize_weight_per_channel():
    torch.manual_seed(0)
    # channels of very different magnitude: per-channel scales keep each one accurate
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]
    q, scale = quantize_weight(w, rows_per_chunk=16)
    assert q.dtype == FP8 and scale.shape == (64,)
    assert torch.allclose(q.float().abs().amax(1), torch.full((64,), 448.0))
    deq = q.float() * scale[:, None]
    per_channel = ((deq - w).norm(dim=1) / w.norm(dim=1)).max().item()
    assert per_channel < 0.04  # e4m3: 3 mantissa bits, ~2-3% rms error


def prefill_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    engine = LLMEngine(
        model,
        None,
        EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64),
    )
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    batch = engine.scheduler.schedule()
    ids, meta = engine.runner.prepare(batch)
    with torch.inference_mode():
        return engine.runner._logits(ids, meta)


def test_fp8_model_matches_bf16_within_bound():
    config = PRESETS["tiny-qwen3.5"]
    model = build_random(config, "cpu", torch.bfloat16, seed=5)
    fp8 = quantize_fp8(copy.deepcopy(model))
    linears = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    # every projection: 3 DeltaNet layers x 5, 1 attention x 4, 4 MLPs x 3, and the head
    assert len(linears) == 3 * 5 + 4 + 4 * 3 + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in fp8.modules())
    weights = sum(p.numel() * p.element_size() for p in fp8.parameters())
    assert weights < 0.6 * sum(p.numel() * p.element_size() for p in model.parameters())
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    ref, out = prefill_logits(model, prompts), prefill_logits(fp8, prompts)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 0.15  # ~3% per e4m3 projection, compounded over the depth


def test_w8a16_kernel_matches_reference():
    from worker.kernels.triton.fp8_gemm import w8a16

    torch.manual_seed(1)
    q, scale = quantize_weight(torch.randn(48, 96) * 0.02)
    bias = torch.randn(48)
    for rows in (3, 20):  # the decode (one row block) and prefill tilings
        x = torch.randn(rows, 96)
        out = w8a16(x, q, scale, bias)
        assert rel_err(out, reference.fp8_linear(x, q, scale, bias)) < 1e-5
    # split K (decode): partials over 3 ranges of K, then the reduce kernel scales and adds bias
    q, scale = quantize_weight(torch.randn(40, 600) * 0.02)
    x = torch.randn(5, 600)
    for split_k, bias in ((3, None), (2, torch.randn(40))):
        out = w8a16(x, q, scale, bias, split_k=split_k)
        assert rel_err(out, reference.fp8_linear(x, q, scale, bias)) < 1e-5


def test_decode_splits_fill_the_gpu():
    from worker.kernels.triton.fp8_gemm import decode_splits

    assert decode_splits(248_320, 5120) == 1  # the head: 3,880 column tiles already
    assert decode_splits(5120, 17_408) == 7  # down: 80 tiles -> 560 programs
    assert decode_splits(48, 5120) == 20  # one tile: as many splits as K steps


def test_quantize_rows_per_token():
    from worker.kernels.triton.fp8_gemm import quantize_rows

    torch.manual_seed(2)
    x = torch.randn(5, 300) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 0.5])[:, None]
    q, scales = quantize_rows(x)
    assert q.dtype == FP8 and scales.shape == (5, 1)
    torch.testing.assert_close(scales.flatten(), x.abs().amax(1) / 448.0)
    assert rel_err(q.float() * scales, x) < 0.06


def test_write_kv_cache_kernel_matches_reference():
    from worker.kernels.triton.kv_cache import write_kv_cache

    torch.manual_seed(3)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, -1, 2])  # a negative slot is skipped
    caches = [torch.zeros(4, 2, 2, 8) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == 2 * 2 * 8


def test_quantize_rows_rounds_as_torch_casts_to_e4m3() -> None:
    """Per-token e4m3 on CPU (the interpreter) has the bits of torch's cast: values that round
    up into the next binade keep their carry."""
    from worker.kernels.triton.fp8_gemm import quantize_rows

    torch.manual_seed(0)
    x = torch.randn(37, 300).bfloat16()
    q, scales = quantize_rows(x)
    want_scales = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    assert torch.equal(scales, want_scales)
    want = (x.float() / want_scales).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
