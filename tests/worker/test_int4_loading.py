"""Loading int4 weights: our quantized checkpoint format (round trip against in-memory
quantization; mismatches named and refused before allocation), community GPTQ-layout
checkpoints (v1 and v2 zero points), and GGUF Q4_0 / Q4_1 blocks kept in 4 bits, with
SmolLM2's Q4_1 file served natively against its dequantized 16-bit path."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from torch import nn

from tests.worker.model_driver import ModelDriver
from tests.worker.numerics import rel_err
from tests.worker.test_int4_models import prefill_logits
from worker.loading.config import config_from_hf, config_to_hf
from worker.loading.gguf import gguf_q4_to_int4
from worker.loading.quantized import (
    CheckpointMismatch,
    gptq_to_int4,
    is_quantized_checkpoint,
    load_quantized_model,
)
from worker.models import build_random
from worker.models.causal_lm import CausalLM
from worker.models.fp8 import Fp8Linear
from worker.models.int4 import Int4Linear, quantize_int4, unpack_int4
from worker.models.layers import Linear
from worker.models.presets import QWEN3_6_27B, TINY_LLAMA, TINY_QWEN3_5
from worker.quantize.perplexity import held_out_text, perplexity, prefill_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def write_checkpoint(model: CausalLM, path: Path, shards: int = 2) -> None:
    """Our format: the quantized model's own state dict (names are already the checkpoint's
    before fusion), split over `shards` files, and config.json with its quantization_config."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    for i in range(shards):
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(path / f"model-{i:05d}-of-{shards:05d}.safetensors"))
    raw = config_to_hf(model.config)
    assert model.quantization_config is not None
    raw["quantization_config"] = model.quantization_config.to_json()
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("config", [QWEN3_6_27B, TINY_QWEN3_5, TINY_LLAMA], ids=lambda c: c.name)
def test_config_to_hf_reads_back(config) -> None:
    assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


@pytest.mark.parametrize(
    ("config", "symmetric"),
    [(TINY_QWEN3_5, True), (TINY_QWEN3_5, False), (TINY_LLAMA, True)],
    ids=["qwen3.5-sym", "qwen3.5-affine", "llama-tied"],
)
def test_checkpoint_round_trip_equals_in_memory(config, symmetric: bool, tmp_path: Path) -> None:
    model = quantize_int4(
        build_random(config, "cpu", torch.float32, seed=11), group_size=64, symmetric=symmetric
    )
    write_checkpoint(model, tmp_path)
    assert is_quantized_checkpoint(tmp_path)
    loaded = load_quantized_model(tmp_path, "cpu", torch.float32)
    assert loaded.quantization_config == model.quantization_config
    for (name, a), (name_b, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1))
    assert torch.equal(prefill_logits(loaded), prefill_logits(model))
    if not config.tie_word_embeddings:
        assert isinstance(loaded.lm_head, Fp8Linear)


def _written(tmp_path: Path) -> tuple[CausalLM, Path]:
    model = quantize_int4(build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=2), 64)
    write_checkpoint(model, tmp_path, shards=1)
    return model, tmp_path


def _rewrite(path: Path, edit: Any) -> None:
    from safetensors.torch import load_file

    file = next(path.glob("*.safetensors"))
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file))


def refuse_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, fail the test if the loader reaches allocation (`to_empty`) at all."""

    def refuse(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        raise AssertionError("allocated before the checkpoint was validated")

    monkeypatch.setattr(nn.Module, "to_empty", refuse)


QKV = "model.layers.0.linear_attn.in_proj_qkv"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.update({f"{QKV}.qweight": s[f"{QKV}.qweight"][:, :-1].contiguous()}),
            "qweight",
        ),
        (
            lambda s: s.update({f"{QKV}.scales": s[f"{QKV}.scales"].float()}),
            "scales: checkpoint dtype",
        ),
        (lambda s: s.pop("model.layers.2.mlp.down_proj.scales"), "down_proj.scales"),
        (lambda s: s.update({f"{QKV}.weight": torch.zeros(256, 128)}), f"{QKV}.weight"),
        (lambda s: s.update({"lm_head.weight": s["lm_head.weight"].half()}), "lm_head.weight"),
    ],
    ids=["shape", "dtype", "missing", "16-bit-where-int4", "fp8-dtype"],
)
def test_a_mismatched_checkpoint_names_the_tensor_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Any, message: str
) -> None:
    _, path = _written(tmp_path)
    _rewrite(path, edit)
    refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointMismatch, match=message.replace(".", r"\.")):
        load_quantized_model(path, "cpu", torch.float32)


def test_a_mismatched_quantization_config_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = _written(tmp_path)
    refuse_allocation(monkeypatch)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["group_size"] = 32  # the stored scales are for group 64
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointMismatch, match=r"in_proj_qkv\.scales"):
        load_quantized_model(path, "cpu", torch.float32)
    raw["quantization_config"]["format"] = "int4-nibble-v0"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointMismatch, match="format"):
        load_quantized_model(path, "cpu", torch.float32)
    raw["quantization_config"]["format"] = "int4-nibble-v1"
    raw["quantization_config"]["modules"]["model.layers.0.input_layernorm"] = "int4"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointMismatch, match="input_layernorm: quantized"):
        load_quantized_model(path, "cpu", torch.float32)


# --- GPTQ layout -------------------------------------------------------------------------------


def pack_gptq_int32(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Independent of the loader: element 8i + j along `dim` into bits 4j..4j+3 of word i."""
    codes = codes.to(torch.int64)
    if dim == 0:
        words = codes.view(-1, 8, codes.shape[1])
        packed = sum(words[:, j] << (4 * j) for j in range(8))
    else:
        words = codes.view(codes.shape[0], -1, 8)
        packed = sum(words[..., j] << (4 * j) for j in range(8))
    assert isinstance(packed, torch.Tensor)
    # as int32 bit patterns (words with the top nibble >= 8 are negative)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def gptq_tensors(
    weight: torch.Tensor, group_size: int, sym: bool, v1: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of a [N, K] weight (RTN codes) and the weight they stand for, computed the
    GPTQ way: w[k, n] = (q[k, n] - z[g, n]) * s[g, n]."""
    n, k = weight.shape
    g = k // group_size
    w = weight.float().view(n, g, group_size)
    if sym:
        s = (w.abs().amax(-1) / 7.5).clamp_min(1e-8)
        z = torch.full((n, g), 8, dtype=torch.int64)
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = (-lo / s).round().clamp(0, 15).long()
    s = s.half()
    q = (w / s.float()[..., None] + z[..., None]).round().clamp(0, 15).long().view(n, k)
    deq = (q.view(n, g, group_size) - z[..., None]) * s.float()[..., None]
    tensors = {
        "qweight": pack_gptq_int32(q.t().contiguous(), dim=0),  # [K / 8, N]
        "qzeros": pack_gptq_int32((z - 1 if v1 else z).t().contiguous(), dim=1),  # [G, N / 8]
        "scales": s.t().contiguous(),  # [G, N]
        "g_idx": (torch.arange(k) // group_size).to(torch.int32),
    }
    return tensors, deq.view(n, k)


def test_gptq_conversion_is_exact_for_symmetric_groups() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    for v1 in (True, False):
        t, deq = gptq_tensors(w, 64, sym=True, v1=v1)
        ours = gptq_to_int4(t["qweight"], t["qzeros"], t["scales"], 64, v1=v1)
        assert ours.mins is None  # z = 8: our symmetric groups, bit for bit
        lin = Int4Linear.from_tensors(ours.qweight, ours.scales, None, None, 64)
        assert torch.equal(lin.dequantize(), deq)
    # reading v1 zeros as v2 shifts every zero by one: caught by the symmetric check
    t, _ = gptq_tensors(w, 64, sym=True, v1=True)
    assert gptq_to_int4(t["qweight"], t["qzeros"], t["scales"], 64, v1=False).mins is not None


@pytest.mark.parametrize(
    ("family", "sym", "v1"),
    [("qwen3_5", True, True), ("llama", False, True), ("qwen3_5", False, False)],
    ids=["qwen3.5-sym-v1", "llama-affine-v1", "qwen3.5-affine-v2"],
)
def test_a_gptq_checkpoint_loads_onto_int4(tmp_path: Path, family: str, sym: bool, v1: bool):
    config = TINY_QWEN3_5 if family == "qwen3_5" else TINY_LLAMA
    model = build_random(config, "cpu", torch.float32, seed=4)
    for p in model.parameters():  # the 16-bit tensors are stored in fp16 below
        p.copy_(p.half().float())
    reference = copy.deepcopy(model)  # the 16-bit model the GPTQ tensors stand for
    state: dict[str, torch.Tensor] = {}
    for name, module in list(model.named_modules()):
        # as exporters do: projections quantized; head, embeddings, DeltaNet's b/a left 16-bit
        if not isinstance(module, nn.Linear) or name == "lm_head" or module.out_features < 64:
            continue
        tensors, deq = gptq_tensors(module.weight, 64, sym, v1)
        state.update({f"{name}.{leaf}": t for leaf, t in tensors.items()})
        target: Any = reference.get_submodule(name)
        target.weight.copy_(deq)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, nn.Identity())  # its .weight not written
    state.update({k: v.half() for k, v in model.state_dict().items()})  # 16-bit as fp16
    save_file(state, str(tmp_path / "model.safetensors"))
    raw = config_to_hf(config)
    raw["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 64,
        "sym": sym,
        "desc_act": False,
        **({} if v1 else {"checkpoint_format": "gptq_v2"}),
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_quantized_model(tmp_path, "cpu", torch.float32)
    int4 = [m for m in loaded.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == (3 * 3 + 4 + 4 * 3 if family == "qwen3_5" else 4 * 7)
    assert all(m.symmetric == sym for m in int4)
    if family == "qwen3_5":
        layer: Any = loaded.model.layers[0]
        assert type(layer.linear_attn.in_proj_a) is Linear
    # symmetric: exact; affine: our fp16 mins m = -z * s round once (~1e-4 of a weight)
    assert rel_err(prefill_logits(loaded), prefill_logits(reference)) < (1e-5 if sym else 5e-3)


def test_a_gptq_checkpoint_with_act_order_is_refused(tmp_path: Path) -> None:
    raw = config_to_hf(TINY_LLAMA)
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatch, match="desc_act"):
        load_quantized_model(tmp_path, "cpu", torch.float32)


# --- GGUF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gguf_q4_blocks_map_exactly(kind: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 128)).astype(np.float32)
    blocks = quantize(w, kind)
    t = gguf_q4_to_int4(blocks, kind, 128)
    assert (t.mins is None) == (kind == GGMLQuantizationType.Q4_0) and t.group_size == 32
    lin = Int4Linear.from_tensors(t.qweight, t.scales, t.mins, None, 32)
    assert torch.equal(lin.dequantize(), torch.from_numpy(dequantize(blocks, kind)))
    # the codes are re-paired: GGUF's byte i holds values i and i + 16 of a block
    codes = unpack_int4(t.qweight)
    assert torch.equal(codes[0, 16], torch.tensor(blocks[0, 2 + 2 * (kind == 3)] >> 4))


@pytest.mark.slow
def test_smollm2_q4_1_served_natively_matches_dequantized() -> None:
    from worker.loading import load_model
    from worker.loading.demo_model import ensure_smollm2

    path = ensure_smollm2(CACHE / "models")
    dense, tokenizer = load_model(path, "cpu", torch.float32)
    native, _ = load_model(path, "cpu", torch.float32, native_int4=True)
    int4 = {n: m for n, m in native.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 30 * 7
    assert all(not m.symmetric and m.group_size == 32 for m in int4.values())
    for name, m in int4.items():  # every weight bit for bit (q/k rows un-permuted alike)
        linear: Any = dense.get_submodule(name)
        assert torch.equal(m.dequantize(), linear.weight)
    assert native.quantization_config is not None
    assert native.quantization_config.modules["model.layers.0.mlp.down_proj"] == "int4"

    # the quantizer's fixed held-out text (stdlib docstrings), kept short for a CPU
    ids = tokenizer.encode(held_out_text(max_chars=2400))[:512]
    assert len(ids) >= 400
    with torch.no_grad():
        ppl_dense, ppl_native = perplexity(dense, ids), perplexity(native, ids)
    assert 1.0 < ppl_dense < 100.0  # a real model reading English and code
    assert abs(ppl_native / ppl_dense - 1) < 0.005

    # 256 greedy tokens of the 16-bit path; the native model predicts each of them from the same
    # prefix in one prefill (teacher forcing: a CPU runs the reference int4 op, which
    # dequantizes per call, too slowly for 256 decode steps), and a shorter free run of its own
    prompt = tokenizer.encode("The history of the printing press")
    want = ModelDriver(dense, num_blocks=24, block_size=16).generate(prompt, 256).generated
    text = prompt + want
    with torch.no_grad():
        ids_t, meta, cache = prefill_batch(native, [text])
        logits = native.compute_logits(native(ids_t, meta, cache))
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert sum(a == b for a, b in zip(predicted, want, strict=True)) >= 0.95 * 256
    got = ModelDriver(native, num_blocks=24, block_size=16).generate(prompt, 24).generated
    assert got == want[:24]
