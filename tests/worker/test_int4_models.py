"""Int4 weights in the models (reference ops, CPU): Int4Linear, the default scheme
(`quantize_int4`) on tiny hybrid Qwen3.5 and Llama models against their 16-bit originals, the
fusions (DeltaNet's mixed-precision qkv|z + b|a), the 27B payload computed on meta tensors, and
the torch runtime's `quantize: w4`."""

from __future__ import annotations

import copy
import gc
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from tests.worker.helpers import generate_greedy
from tests.worker.model_driver import ModelDriver
from tests.worker.numerics import rel_err
from worker.backends.torch_runtime import TorchRuntimeBackend
from worker.models import build_random
from worker.models.causal_lm import CausalLM
from worker.models.fp8 import Fp8Linear
from worker.models.int4 import (
    Int4Linear,
    QuantizationConfig,
    pack_int4,
    quantize_int4,
    unpack_int4,
    use_mma_kernels,
    weight_bytes,
)
from worker.models.layers import Linear, fusable, fuse_linears
from worker.models.presets import QWEN3_6_27B, TINY_LLAMA, TINY_QWEN3_5

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8]]
# RTN int4 is ~9% rms error per projection; random tiny models amplify it over the depth:
# observed 0.19-0.23 (Llama) and 0.32-0.42 (Qwen3.5) on the logits at groups 32-128. A
# mis-paired nibble (k = 2j and 2j + 1 swapped) scrambles every weight: observed 1.2-1.4.
QUANT_REL_ERR = 0.6


def prefill_logits(model: CausalLM, prompts: list[list[int]] = PROMPTS) -> torch.Tensor:
    """Logits at every prompt position, the prompts prefilled together in one step."""
    driver = ModelDriver(model, num_blocks=16, block_size=4)
    for i, p in enumerate(prompts):
        driver.add(i, p)
    driver.step({i: len(p) for i, p in enumerate(prompts)})
    driver2 = ModelDriver(model, num_blocks=16, block_size=4)
    rows = []
    for i, p in enumerate(prompts):  # every position: one token at a time (decode path too)
        driver2.add(i, p)
        for _ in p:
            driver2.step({i: 1})
        rows += [driver2.seqs[i].logits[t] for t in range(len(p))]
    last = torch.stack([driver.seqs[i].logits[len(p) - 1] for i, p in enumerate(prompts)])
    return torch.cat([last, torch.stack(rows)])


def dequantized_copy(model: CausalLM) -> CausalLM:
    """The 16-bit model a quantized one stands for: each Int4Linear / Fp8Linear replaced by a
    Linear holding its dequantized weight."""
    out = copy.deepcopy(model)
    for name, m in list(out.named_modules()):
        if isinstance(m, Int4Linear | Fp8Linear):
            if isinstance(m, Int4Linear):
                w = m.dequantize()
            else:
                w = m.weight.float() * m.weight_scale[:, None]
            lin = Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight = nn.Parameter(w.to(out.dtype), requires_grad=False)
            if m.bias is not None:
                lin.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, lin)
    return out


def test_int4_linear_from_linear_is_its_dequantized_product() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(200, 48, bias=True)  # K = 200: a short last group at g64
    for symmetric in (True, False):
        q = Int4Linear.from_linear(lin, group_size=64, symmetric=symmetric, rows_per_chunk=20)
        assert q.qweight.shape == (48, 100) and q.scales.shape == (48, 4)
        assert (q.mins is None) == symmetric
        x = torch.randn(5, 200)
        ref = x @ q.dequantize().t() + lin.bias
        assert rel_err(q(x), ref) < 1e-6
        assert rel_err(q.dequantize(), lin.weight) < 0.12  # RTN int4
        # silu_mul of a fused gate|up: silu of the first half times the second
        gate, up = ref.chunk(2, dim=-1)
        assert rel_err(q.silu_mul(x), torch.nn.functional.silu(gate) * up) < 1e-6
    again = Int4Linear.from_tensors(q.qweight, q.scales, q.mins, None, group_size=64)
    assert again.in_features == 200 and again.out_features == 48


def test_int4_linear_rejects_scales_of_the_wrong_shape() -> None:
    qweight = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales"):
        Int4Linear.from_tensors(qweight, torch.zeros(8, 2, dtype=torch.float16), group_size=32)
    with pytest.raises(ValueError, match="uint8"):
        Int4Linear.from_tensors(qweight.int(), torch.zeros(8, 4, dtype=torch.float16), None)


def test_quantize_int4_scheme_and_precisions() -> None:
    model = build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=3)
    q = quantize_int4(copy.deepcopy(model))
    qc = q.quantization_config
    assert isinstance(qc, QuantizationConfig)
    assert qc.modules["lm_head"] == "fp8" and isinstance(q.lm_head, Fp8Linear)
    layer0: Any = q.model.layers[0].linear_attn
    assert isinstance(layer0.in_proj_qkv, Int4Linear) and isinstance(layer0.in_proj_z, Int4Linear)
    assert type(layer0.in_proj_a) is Linear and type(layer0.in_proj_b) is Linear
    assert "model.layers.0.linear_attn.in_proj_a" not in qc.modules
    assert qc.modules["model.layers.3.self_attn.q_proj"] == "int4"
    assert q.model.embed_tokens.weight.dtype == torch.float32  # embeddings, norms, conv: 16-bit
    # 3 DeltaNet layers x 3 (qkv, z, out), 1 attention x 4, 4 MLPs x 3
    assert sum(v == "int4" for v in qc.modules.values()) == 3 * 3 + 4 + 4 * 3
    assert QuantizationConfig.from_json(qc.to_json()) == qc
    sizes = weight_bytes(q)
    assert sizes["total"] == sum(p.numel() * p.element_size() for p in q.parameters())
    assert sizes["int4"] > 0 and sizes["fp8"] == 512 * 128 + 4 * 512
    with pytest.raises(ValueError, match="fuse_projections"):
        m2 = copy.deepcopy(model)
        m2.fuse_projections()
        quantize_int4(m2)


def test_quantize_int4_frees_each_16bit_weight() -> None:
    model = build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=3)
    mlp: Any = model.model.layers[0].mlp
    ref = weakref.ref(mlp.up_proj.weight)
    del mlp
    quantize_int4(model)
    gc.collect()
    assert ref() is None  # gone while the model lives: no list of the old modules kept


@pytest.mark.parametrize("config", [TINY_QWEN3_5, TINY_LLAMA], ids=lambda c: c.name)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "affine"])
def test_w4_logits_against_16bit(config, symmetric: bool) -> None:
    model = build_random(config, "cpu", torch.float32, seed=5)
    q = quantize_int4(copy.deepcopy(model), group_size=64, symmetric=symmetric)
    ref, out = prefill_logits(model), prefill_logits(q)
    # exactly the dequantized weights' model (the int4 path adds no error of its own) ...
    assert rel_err(out, prefill_logits(dequantized_copy(q))) < 1e-5
    # ... which is a close approximation of the original
    err = rel_err(out, ref)
    assert 1e-3 < err < QUANT_REL_ERR
    # negative control: the bound catches a nibble order mix-up
    for m in q.modules():
        if isinstance(m, Int4Linear):
            codes = unpack_int4(m.qweight)
            m.qweight.copy_(pack_int4(codes.view(codes.shape[0], -1, 2).flip(-1).reshape_as(codes)))
    assert rel_err(prefill_logits(q), ref) > QUANT_REL_ERR


@pytest.mark.parametrize("config", [TINY_QWEN3_5, TINY_LLAMA], ids=lambda c: c.name)
def test_fused_int4_projections_equal_unfused(config) -> None:
    model = quantize_int4(build_random(config, "cpu", torch.float32, seed=7), lm_head="int4")
    unfused = prefill_logits(model)
    model.fuse_projections()
    layer: Any
    for layer in model.model.layers:
        assert isinstance(layer.mlp.gate_up_proj, Int4Linear)
        if layer.is_attention:
            assert isinstance(layer.self_attn.qkv_proj, Int4Linear)
        else:  # int4 qkv|z and 16-bit b|a: two projections
            mixer = layer.linear_attn
            assert mixer.in_proj_qkvzba is None and isinstance(mixer.in_proj_qkvz, Int4Linear)
            assert type(mixer.in_proj_ba) is Linear and mixer.in_proj_ba.out_features == 8
    assert rel_err(prefill_logits(model), unfused) < 1e-5


def test_the_16bit_ba_runs_beside_the_int4_qkvz(monkeypatch: pytest.MonkeyPatch) -> None:
    """b|a reads the same hidden as qkv|z, launched just before it: it is asked to run beside
    that launch (on a GPU, `w8_gemv` waits for it only before writing)."""
    from worker.kernels import ops

    model = quantize_int4(build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=7))
    model.fuse_projections()
    calls: list[tuple[int, bool]] = []
    linear = ops.linear

    def recorded(x, weight, bias=None, beside_previous=False):  # type: ignore[no-untyped-def]
        calls.append((weight.shape[0], beside_previous))
        return linear(x, weight, bias, beside_previous)

    monkeypatch.setattr(ops, "linear", recorded)
    prefill_logits(model)
    deltanet_layers = sum(not layer.is_attention for layer in model.model.layers)
    beside = calls.count((8, True))  # one b|a per DeltaNet layer and forward
    assert beside > 0 and beside % deltanet_layers == 0 and (8, False) not in calls


def test_fusable_refuses_mixed_formats() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(64, 16, bias=False), nn.Linear(64, 16, bias=False)
    g32, g64 = Int4Linear.from_linear(a, 32), Int4Linear.from_linear(b, 64)
    assert fusable([a, b]) and fusable([g32, Int4Linear.from_linear(b, 32)])
    assert not fusable([g32, g64])  # group sizes differ
    assert not fusable([g32, Int4Linear.from_linear(b, 32, symmetric=False)])
    assert not fusable([g32, b]) and not fusable([Fp8Linear.from_linear(a), g32])
    with pytest.raises(TypeError):
        fuse_linears([g32, b])
    fused = fuse_linears([g32, Int4Linear.from_linear(b, 32)])
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        fused(x), torch.cat([g32(x), Int4Linear.from_linear(b, 32)(x)], -1), rtol=0, atol=0
    )


def test_an_engine_serves_the_int4_model_greedy_as_unfused() -> None:
    from worker.engine.engine import EngineConfig, LLMEngine
    from worker.engine.sequence import SamplingParams

    model = quantize_int4(build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=9))
    expected = ModelDriver(model, num_blocks=16, block_size=4).generate(PROMPTS[0], 6).generated
    engine = LLMEngine(  # fuses the projections
        model,
        None,
        EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
    )
    mixer: Any = model.model.layers[0].linear_attn
    assert mixer.in_proj_qkvz is not None
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    assert out == expected


def _meta_27b(lm_head: str | None) -> dict[str, int]:
    with torch.device("meta"):
        model = CausalLM(QWEN3_6_27B)
    model.to(torch.bfloat16)
    quantize_int4(model, lm_head=lm_head)
    assert all(p.is_meta for p in model.parameters())
    return weight_bytes(model)


def test_the_27b_int4_payload() -> None:
    c = QWEN3_6_27B
    h, v = c.hidden_size, c.vocab_size
    default, int4_head = _meta_27b("fp8"), _meta_27b("int4")
    # analytically: 0.5 byte per int4 weight + 2 bytes per group of 128; fp8 head 1 + 4 / h
    head_params = v * h
    nv = c.linear_num_value_heads
    int4_params = c.num_parameters() - 2 * v * h  # all but embeddings and head ...
    int4_params -= len(c.linear_attention_layers) * (2 * h * nv)  # ... and in_proj_a/b
    small = (
        h
        + len(c.layer_types) * 2 * h
        + len(c.full_attention_layers) * 2 * c.head_dim
        + len(c.linear_attention_layers)
        * (c.conv_dim * c.linear_conv_kernel_dim + 2 * nv + c.linear_value_head_dim)
    )  # norms, conv, A_log, dt_bias: 16-bit, not linear layers
    int4_params -= small
    assert default["int4"] == int4_params // 2 + int4_params // 128 * 2
    assert default["fp8"] == head_params + 4 * v
    gib = 2**30
    # measured: 15.28 GiB with the fp8 head (over the 15.0 GiB target), 14.71 with an int4 head
    assert 15.0 * gib < default["total"] < 15.4 * gib
    assert int4_head["total"] <= 15.0 * gib
    assert int4_head["fp8"] == 0


def test_backend_accepts_w4_and_its_head_options() -> None:
    TorchRuntimeBackend(model_path="random:tiny-qwen3_5", quantize="w4", quantize_lm_head="int4")
    with pytest.raises(ValueError, match="quantize_lm_head"):
        TorchRuntimeBackend(model_path="random:tiny-qwen3_5", quantize="w4", quantize_lm_head="x")


async def test_w4_random_model_serves_a_request() -> None:
    backend = TorchRuntimeBackend(model_path="random:tiny-qwen3_5", quantize="w4", max_model_len=64)
    await backend.start()
    try:
        model = backend.engine.engine.model
        assert isinstance(model.lm_head, Fp8Linear)
        assert isinstance(model.model.layers[0].mlp.gate_up_proj, Int4Linear)
        progress = await generate_greedy(backend, "river stone light north", 5)
        assert progress[-1].finish_reason in ("length", "stop")
        assert 1 <= progress[-1].completion_tokens <= 5
    finally:
        await backend.close()


@pytest.mark.parametrize("config", [TINY_QWEN3_5, TINY_LLAMA], ids=lambda c: c.name)
def test_fused_model_in_the_mma_layout_answers_as_nibble(config) -> None:
    """The engine repacks after fusing (worker.models.int4.use_mma_kernels): every layer the
    mma kernels take gives the same logits from the int4-mma layout (the reference op here)."""
    model = quantize_int4(build_random(config, "cpu", torch.float32, seed=3), 64, lm_head="int4")
    model.fuse_projections()
    want = prefill_logits(model)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    taken = [m for m in layers if m.mma_layout_supported()[0]]
    assert taken and len(taken) >= len(layers) // 2
    for layer in taken:
        layer.to_mma_layout()
    assert torch.equal(prefill_logits(model), want)


@pytest.mark.parametrize("config", [TINY_QWEN3_5, TINY_LLAMA], ids=lambda c: c.name)
def test_mma_layout_pairs_gate_up_tiles_with_the_same_logits(
    config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`use_mma_kernels` where the registry picks the CUDA kernel (pretended here; the ops
    stay the references): each MLP's gate|up gets paired tiles (gate, up, gate, ...) for the
    GEMV's silu(gate) * up epilogue, and the logits are those of the nibble layout."""
    from worker.kernels import ops
    from worker.kernels.cuda.int4_mma import KERNEL_SWITCH

    model = quantize_int4(build_random(config, "cpu", torch.float32, seed=3), 64, lm_head="int4")
    model.fuse_projections()
    want = prefill_logits(model)
    select = ops.select

    def cuda_chosen(
        op: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> ops.Implementation:
        impl = select(op, device, dtype, kv_dtype)
        return replace(impl, name="cuda.int4_mma_linear") if op == "int4_mma_linear" else impl

    monkeypatch.setattr(ops, "select", cuda_chosen)
    monkeypatch.delenv(KERNEL_SWITCH, raising=False)
    assert use_mma_kernels(model, torch.float32, 8) > 0
    gate_ups = [layer.mlp.gate_up_proj for layer in model.model.layers]
    assert all(isinstance(g, Int4Linear) and g.gate_up_paired for g in gate_ups)
    others = [m for m in model.modules() if isinstance(m, Int4Linear) and m not in gate_ups]
    assert others and not any(m.gate_up_paired for m in others)
    assert torch.equal(prefill_logits(model), want)


def batch_logits(model: CausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt's last logits after one prefill step of all of them, then the logits of
    one decode step of all of them (a row each)."""
    driver = ModelDriver(model, num_blocks=64, block_size=4, num_slots=len(prompts))
    for i, p in enumerate(prompts):
        driver.add(i, p)
    driver.step({i: len(p) for i, p in enumerate(prompts)})
    last = [driver.seqs[i].logits[len(p) - 1] for i, p in enumerate(prompts)]
    for i in range(len(prompts)):
        driver.seqs[i].tokens.append(int(last[i].argmax()))
    driver.step({i: 1 for i in range(len(prompts))})
    decoded = [driver.seqs[i].logits[len(p)] for i, p in enumerate(prompts)]
    return torch.stack(last + decoded)


def test_decode_steps_form_ba_in_the_conv_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `set_ba_in_conv` on, a decode step's DeltaNet layers take the gates' b|a logits from
    the conv update's launch (no b|a GEMV at decode rows), with the two-launch path's logits;
    a prefill step keeps the GEMV."""
    from worker.kernels import ops
    from worker.models import deltanet

    model = quantize_int4(build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=7))
    model.fuse_projections()
    want = batch_logits(model, PROMPTS)
    calls: list[tuple[str, int]] = []
    linear, conv_update = ops.linear, ops.conv_update_with_ba_gates

    def recorded_linear(x, weight, bias=None, beside_previous=False):  # type: ignore[no-untyped-def]
        if weight.shape[0] == 8:  # b|a
            calls.append(("gemv", x.shape[0]))
        return linear(x, weight, bias, beside_previous)

    def recorded_conv_update(x, *rest):  # type: ignore[no-untyped-def]
        calls.append(("conv update", x.shape[0]))
        return conv_update(x, *rest)

    monkeypatch.setattr(ops, "linear", recorded_linear)
    monkeypatch.setattr(ops, "conv_update_with_ba_gates", recorded_conv_update)
    deltanet.set_ba_in_conv(True)
    try:
        got = batch_logits(model, PROMPTS)
    finally:
        deltanet.set_ba_in_conv(False)
    layers = sum(not layer.is_attention for layer in model.model.layers)
    prefill_rows = sum(len(p) for p in PROMPTS)
    assert sorted(calls) == sorted(
        [("gemv", prefill_rows)] * layers + [("conv update", len(PROMPTS))] * layers
    )
    assert torch.equal(got[: len(PROMPTS)], want[: len(PROMPTS)])  # the prefill step's
    assert rel_err(got, want) < 1e-5  # the decode step's: the same sums, in fp32 either way


def test_w4a8_paths_in_the_model_round_only_x(monkeypatch) -> None:
    """Tiny Qwen3.5 at g128: a 100-row prefill through the W4A8 GEMM and a 20-row decode step
    through the W4A8 GEMV give the logits of the exact int4 model with each int4 layer's input
    rounded to e4m3 per token, and nothing else (random tiny layers amplify that rounding to
    ~0.4 of the logits, so it is emulated, not bounded)."""
    from worker.kernels import ops
    from worker.kernels.triton import int4_gemm

    model = build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=7)
    q = quantize_int4(model, group_size=128, symmetric=True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (5,), generator=gen).tolist() for _ in range(20)]
    exact = batch_logits(q, prompts)

    def e4m3_rows(_: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
        return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale,)

    int4 = [m for m in q.modules() if isinstance(m, Int4Linear)]
    hooks = [m.register_forward_pre_hook(e4m3_rows) for m in int4]
    emulated = batch_logits(q, prompts)
    for h in hooks:
        h.remove()
    select = ops.select
    kernels = {"int4_linear": "int4_linear", "int4_linear_silu_mul": "int4_linear_silu_mul"}

    def triton_int4(
        op: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> ops.Implementation:  # the triton kernels under the interpreter, as on a GPU
        impl = select(op, device, dtype, kv_dtype)
        return replace(impl, fn=getattr(int4_gemm, kernels[op])) if op in kernels else impl

    monkeypatch.setattr(ops, "select", triton_int4)
    assert rel_err(batch_logits(q, prompts), exact) < 1e-5  # the default paths: no rounding
    monkeypatch.setattr(int4_gemm, "INT4_PREFILL", "w4a8")
    monkeypatch.setattr(int4_gemm, "INT4_W4A8_ROWS", 17)
    calls: list[str] = []
    for name in ("w4a8_gemm", "w4a8_wide"):
        real = getattr(int4_gemm, name)
        monkeypatch.setattr(
            int4_gemm,
            name,
            lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw),
        )
    w4a8 = batch_logits(q, prompts)
    assert {"w4a8_gemm", "w4a8_wide"} <= set(calls)
    assert rel_err(w4a8, emulated) < 1e-2 < rel_err(w4a8, exact)
