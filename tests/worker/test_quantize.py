"""`tokenmill quantize` end to end on tiny random checkpoints (HF safetensors + config.json),
its refusal of bad input without leaving half-written output, GPTQ against round-to-nearest on a
layer with correlated inputs, and the perplexity helper against token-by-token decoding."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.worker.model_driver import ModelDriver
from tokenmill.cli import main as tokenmill
from worker.kernels.reference import int4_dequantize
from worker.models import build_random
from worker.models.config import ModelConfig
from worker.models.int4 import quantize_rtn, unpack_int4
from worker.models.presets import TINY_LLAMA, TINY_QWEN3_5
from worker.quantize import checkpoint as checkpoint_module
from worker.quantize.checkpoint import CheckpointError, hf_config_from_model_config
from worker.quantize.cli import partial_path, quantize_checkpoint
from worker.quantize.gptq import dequantize, gptq_quantize
from worker.quantize.perplexity import (
    calibration_text,
    held_out_text,
    negative_log_likelihood,
    perplexity,
)
from worker.quantize.scheme import Scheme

# SmolLM2's K = 576 is 4.5 groups of 128: the tiny models get a ragged last group too.
TINY_SHAPE: dict[str, Any] = {"hidden_size": 192, "intermediate_size": 320}


def _qwen35_hf_config(c: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.partial_rotary_factor,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "layer_types": list(c.layer_types),
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
    }


def _byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE without merges (256 ids): any text encodes, ids fit a 512 vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))


def write_checkpoint(directory: Path, family: str, shards: int = 2) -> dict[str, torch.Tensor]:
    """A random bf16 checkpoint of a tiny preset in HF layout, split over `shards` files with an
    index; returns its tensors."""
    base = TINY_LLAMA if family == "llama" else TINY_QWEN3_5
    config = base.replace(**TINY_SHAPE)
    model = build_random(config, "cpu", torch.bfloat16, seed=1)
    tensors = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    directory.mkdir(parents=True)
    hf = hf_config_from_model_config(config) if family == "llama" else _qwen35_hf_config(config)
    (directory / "config.json").write_text(json.dumps(hf))
    _byte_tokenizer(directory)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map |= {n: file for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def read_output(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def no_leftovers(dst: Path) -> bool:
    return not partial_path(dst).exists() and not (dst.parent / f".{dst.name}.old").exists()


# The CLI end to end ---------------------------------------------------------------------------


def test_cli_rtn_tiny_llama(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "out" / "w4"
    tensors = write_checkpoint(src, "llama")
    assert tokenmill(["quantize", str(src), str(dst), "--scheme", "w4-g128", "--quiet"]) == 0

    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "format", "group_size", "symmetric", "method")} == {
        "quant_method": "tokenmill",
        "format": "int4-nibble-v1",
        "group_size": 128,
        "symmetric": True,
        "method": "rtn",
    }
    linears = {n[: -len(".weight")] for n, t in tensors.items() if t.dim() == 2} - {
        "model.embed_tokens"
    }
    assert qc["modules"] == dict.fromkeys(sorted(linears), "int4")  # tied head: no lm_head
    assert (dst / "tokenizer.json").exists() and (dst / "tokenizer_config.json").exists()

    out = read_output(dst)
    for prefix in linears:
        w = tensors[prefix + ".weight"]
        n, k = w.shape
        qweight, scales = out[prefix + ".qweight"], out[prefix + ".scales"]
        assert qweight.dtype == torch.uint8 and qweight.shape == (n, k // 2)
        assert scales.dtype == torch.float16 and scales.shape == (n, math.ceil(k / 128))
        assert prefix + ".mins" not in out and prefix + ".weight" not in out
        back = int4_dequantize(qweight, scales, None, 128)
        # steps are at most amax / 8: values round to within half a step, except that the side
        # opposite the group's extreme stops at 7 steps (up to one step off)
        step = w.float().abs().amax(dim=1, keepdim=True) / 8
        err = (back - w.float()).abs()
        assert (err <= step * 1.001 + 1e-4).all()
        assert (err <= step * 0.501 + 1e-4).float().mean() > 0.99
    expected_16bit = {n for n in tensors if n[: -len(".weight")] not in linears}
    assert expected_16bit <= set(out)
    for name in expected_16bit:
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], tensors[name])
    assert no_leftovers(dst)


def test_cli_rtn_tiny_qwen35_asym_fp8_head(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    tensors = write_checkpoint(src, "qwen3_5", shards=3)
    argv = ["quantize", str(src), str(dst), "--scheme", "w4-g128-asym", "--quiet"]
    assert tokenmill(argv) == 0
    modules = json.loads((dst / "config.json").read_text())["quantization_config"]["modules"]
    out = read_output(dst)

    assert modules["lm_head"] == "fp8"
    head = tensors["lm_head.weight"].float()
    assert out["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert out["lm_head.weight_scale"].dtype == torch.float32
    assert out["lm_head.weight_scale"].shape == (head.shape[0],)
    back = out["lm_head.weight"].float() * out["lm_head.weight_scale"][:, None]
    assert (back - head).abs().max() <= 0.07 * head.abs().max()  # e4m3: 3 mantissa bits

    deltanet = "model.layers.0.linear_attn"
    for leaf in ("in_proj_qkv", "in_proj_z", "out_proj"):
        assert modules[f"{deltanet}.{leaf}"] == "int4"
        assert out[f"{deltanet}.{leaf}.mins"].dtype == torch.float16
    for kept in ("in_proj_a", "in_proj_b", "conv1d"):
        assert f"{deltanet}.{kept}" not in modules
        assert out[f"{deltanet}.{kept}.weight"].dtype == torch.bfloat16
    assert out[f"{deltanet}.A_log"].dtype == torch.bfloat16
    assert modules["model.layers.3.self_attn.q_proj"] == "int4"
    assert "model.embed_tokens" not in modules
    # affine groups reproduce each group's min and max exactly (up to fp16)
    w = tensors["model.layers.3.mlp.down_proj.weight"].float()
    p = "model.layers.3.mlp.down_proj"
    back = int4_dequantize(out[p + ".qweight"], out[p + ".scales"], out[p + ".mins"], 128)
    assert torch.allclose(back[:, 256:].amax(dim=1), w[:, 256:].amax(dim=1), rtol=2e-3, atol=1e-4)
    assert no_leftovers(dst)


def test_cli_gptq_tiny_qwen35(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    tensors = write_checkpoint(src, "qwen3_5")
    argv = [
        *("quantize", str(src), str(dst), "--method", "gptq"),
        *("--calibration-tokens", "512", "--quiet"),
    ]
    assert tokenmill(argv) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "gptq"
    out = read_output(dst)
    # GPTQ moves codes off round-to-nearest where inputs correlate; the DeltaNet projections
    # are calibrated too
    for prefix in ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.3.mlp.down_proj"):
        rtn = quantize_rtn(tensors[prefix + ".weight"], 128, True)
        assert not torch.equal(out[prefix + ".qweight"], rtn.qweight)
        assert out[prefix + ".qweight"].shape == rtn.qweight.shape


def test_existing_output_is_refused_unless_forced(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    write_checkpoint(src, "llama")
    dst.mkdir()
    (dst / "keep").write_text("x")
    assert tokenmill(["quantize", str(src), str(dst), "--quiet"]) == 2
    assert (dst / "keep").exists()
    assert tokenmill(["quantize", str(src), str(dst), "--quiet", "--force"]) == 0
    assert not (dst / "keep").exists() and (dst / "config.json").exists()
    assert no_leftovers(dst)


# Bad input leaves nothing behind ----------------------------------------------------------------


def test_missing_shard_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    write_checkpoint(src, "llama")
    (src / "model-00002-of-00002.safetensors").unlink()
    assert tokenmill(["quantize", str(src), str(dst), "--quiet"]) == 2
    assert "missing shard" in capsys.readouterr().err
    assert not dst.exists() and no_leftovers(dst)


@pytest.mark.parametrize("damage", ["truncated", "unknown", "partial", "no-config"])
def test_bad_checkpoint_fails_cleanly(tmp_path: Path, damage: str) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    tensors = write_checkpoint(src, "llama", shards=1)
    shard = src / "model-00001-of-00001.safetensors"
    index = src / "model.safetensors.index.json"
    expected = {
        "truncated": "unreadable",
        "unknown": "unknown tensors",
        "partial": "partial checkpoint",
        "no-config": "no config.json",
    }[damage]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "no-config":
        (src / "config.json").unlink()
    else:
        index.unlink()
        if damage == "unknown":
            tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(4, 4)
        else:
            del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=expected):
        quantize_checkpoint(src, dst, Scheme(), progress=False)
    assert not dst.exists() and no_leftovers(dst)


def test_interrupted_run_leaves_no_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    write_checkpoint(src, "llama")
    calls = {"n": 0}
    real = checkpoint_module.quantize_rtn

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # Ctrl-C halfway through the tensors
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "quantize_rtn", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, dst, Scheme(), progress=False)
    assert not dst.exists() and no_leftovers(dst)

    # an interrupted --force run keeps the checkpoint it would have replaced
    monkeypatch.setattr(checkpoint_module, "quantize_rtn", real)
    quantize_checkpoint(src, dst, Scheme(), progress=False)
    before = read_output(dst)
    calls["n"] = 0
    monkeypatch.setattr(checkpoint_module, "quantize_rtn", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, dst, Scheme(symmetric=False), force=True, progress=False)
    after = read_output(dst)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert no_leftovers(dst)


def test_stale_partial_directory_is_replaced(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "w4"
    write_checkpoint(src, "llama")
    partial_path(dst).mkdir()
    (partial_path(dst) / "junk.safetensors").write_text("from a killed run")
    quantize_checkpoint(src, dst, Scheme(), progress=False)
    assert not (dst / "junk.safetensors").exists() and no_leftovers(dst)


def test_scheme_names() -> None:
    assert Scheme.parse("w4-g128") == Scheme(128, True)
    assert Scheme.parse("w4-g64-asym", "int4") == Scheme(64, False, "int4")
    for bad in ("w4", "w8-g128", "w4-g127", "w4-g128-sym-x"):
        with pytest.raises(ValueError):
            Scheme.parse(bad)
    s = Scheme()
    assert s.kind("model.layers.0.mlp.down_proj.weight", (8, 16)) == "int4"
    assert s.kind("model.layers.0.linear_attn.in_proj_a.weight", (8, 16)) is None
    assert s.kind("model.layers.0.linear_attn.conv1d.weight", (8, 1, 4)) is None
    assert s.kind("model.layers.0.input_layernorm.weight", (16,)) is None
    assert s.kind("model.embed_tokens.weight", (32, 16)) is None
    assert s.kind("lm_head.weight", (32, 16)) == "fp8"
    assert Scheme(lm_head="bf16").kind("lm_head.weight", (32, 16)) is None


# GPTQ -------------------------------------------------------------------------------------------


def _correlated_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [96, 320] (ragged last group at 128) and inputs [4096, 320] that mix a few
    latent factors, with some channels far larger than others (as LLM activations have)."""
    gen = torch.Generator().manual_seed(seed)
    k = 320
    latent = torch.randn(4096, 32, generator=gen)
    x = latent @ torch.randn(32, k, generator=gen) + 0.1 * torch.randn(4096, k, generator=gen)
    x *= torch.exp(torch.randn(k, generator=gen))
    w = torch.randn(96, k, generator=gen) * 0.02
    return w, x


@pytest.mark.parametrize(("symmetric", "act_order"), [(True, False), (False, False), (True, True)])
def test_gptq_beats_rtn_on_correlated_inputs(symmetric: bool, act_order: bool) -> None:
    w, x = _correlated_layer()
    h = x.T @ x
    rtn = dequantize(quantize_rtn(w, 128, symmetric))
    gptq = dequantize(gptq_quantize(w, h, 128, symmetric, act_order=act_order))
    ref = x @ w.T
    err_rtn = torch.linalg.norm(ref - x @ rtn.T)
    err_gptq = torch.linalg.norm(ref - x @ gptq.T)
    assert err_gptq < 0.6 * err_rtn, (float(err_gptq), float(err_rtn))


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(symmetric: bool) -> None:
    """With H = I no error has anywhere to go: the codes and scales are RTN's, so both share
    one grid (the one `int4_dequantize` reads)."""
    w, _ = _correlated_layer(1)
    q = gptq_quantize(w, torch.eye(w.shape[1]), 128, symmetric)
    r = quantize_rtn(w, 128, symmetric)
    assert torch.equal(q.scales, r.scales)
    if symmetric:
        assert q.mins is None and r.mins is None
    else:
        assert q.mins is not None and r.mins is not None and torch.equal(q.mins, r.mins)
    assert torch.equal(unpack_int4(q.qweight), unpack_int4(r.qweight))


# Perplexity and the fixed texts -----------------------------------------------------------------


def test_held_out_and_calibration_texts_are_fixed_and_disjoint() -> None:
    held, calib = held_out_text(None), calibration_text()
    assert len(held) > 100_000 and len(calib) > 2 * len(held)
    assert held_out_text(5000) == held[:5000]
    paragraphs = set(held.split("\n\n"))
    assert not paragraphs & set(calib.split("\n\n"))


@torch.no_grad()
def test_perplexity_equals_token_by_token_decoding() -> None:
    model = build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_QWEN3_5.vocab_size, (45,), generator=gen).tolist()
    window = 20  # windows 20, 20, 5: several sequences per batch, a short last one
    expected, count = 0.0, 0
    for start in range(0, len(ids), window):
        piece = ids[start : start + window]
        driver = ModelDriver(model, num_blocks=16, block_size=4, num_slots=1)
        driver.add(0, piece)
        for _ in range(len(piece) - 1):
            driver.step({0: 1})  # decode steps: each position's logits through the cache
        seq = driver.remove(0)
        for pos in range(len(piece) - 1):
            expected -= float(torch.log_softmax(seq.logits[pos], -1)[piece[pos + 1]])
            count += 1
    total, n = negative_log_likelihood(model, ids, window=window, batch_tokens=30)
    assert n == count == 19 + 19 + 4
    assert total == pytest.approx(expected, rel=1e-4)
    assert perplexity(model, ids, window=window) == pytest.approx(math.exp(expected / count))


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_rounds_groups_closer(symmetric: bool) -> None:
    """The searched scales never round a group worse than the full-range ones, and heavy tails
    (a few large weights among many small ones) make them clip."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen) ** 3  # heavy-tailed rows
    h = torch.eye(128)
    plain = dequantize(gptq_quantize(w, h, 128, symmetric))
    searched_q = gptq_quantize(w, h, 128, symmetric, clip_search=True)
    searched = dequantize(searched_q)
    err_plain = ((plain - w) ** 2).sum(dim=1)
    err_searched = ((searched - w) ** 2).sum(dim=1)
    assert (err_searched <= err_plain * (1 + 1e-5) + 1e-9).all()
    assert err_searched.sum() < 0.97 * err_plain.sum()


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_weighs_each_column_by_its_inputs(symmetric: bool) -> None:
    """With inputs of very unequal scales (H diagonal, so nothing for the column solve to move),
    the search picks the clip that rounds the loud columns finely: the output error is below
    what the weight's own error picks, row by row."""
    from worker.quantize.gptq import _codes, _dequant, _group_params

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 128, generator=gen) ** 3
    loudness = torch.exp(2.0 * torch.randn(128, generator=gen))
    weighted = dequantize(gptq_quantize(w, torch.diag(loudness), 128, symmetric, clip_search=True))
    scale, mins = _group_params(w, symmetric, clip_search=True)  # unweighted, same candidates
    m = None if mins is None else mins[:, None]
    own = _dequant(_codes(w, scale[:, None], m), scale[:, None], m)
    out_weighted = (((weighted - w) ** 2) * loudness).sum(dim=1)
    out_own = (((own - w) ** 2) * loudness).sum(dim=1)
    assert (out_weighted <= out_own * (1 + 1e-5) + 1e-9).all()
    assert out_weighted.sum() < 0.9 * out_own.sum()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@torch.no_grad()
def test_output_loads_and_runs_as_int4(tmp_path: Path, method: str) -> None:
    """The written checkpoint through the loaders (Int4Linear, Fp8Linear) gives the logits of
    the 16-bit model with each weight replaced by its dequantized stored value."""
    from worker.loading import load_model
    from worker.loading.safetensors import load_hf_model
    from worker.models.int4 import Int4Linear
    from worker.quantize.perplexity import prefill_batch

    src, dst = tmp_path / "src", tmp_path / "w4"
    write_checkpoint(src, "qwen3_5")
    argv = ["quantize", str(src), str(dst), "--scheme", "w4-g128-asym", "--method", method]
    assert tokenmill([*argv, "--calibration-tokens", "512", "--quiet"]) == 0

    int4_model, _ = load_model(dst, "cpu", torch.float32)
    modules = json.loads((dst / "config.json").read_text())["quantization_config"]["modules"]
    # MLPs 4 x 3, DeltaNet qkv / z / out 3 x 3, attention q / k / v / o
    assert list(modules.values()).count("int4") == 25
    assert sum(isinstance(m, Int4Linear) for m in int4_model.modules()) == 25

    reference = load_hf_model(src, "cpu", torch.float32)
    out = read_output(dst)
    params = dict(reference.named_parameters())
    for prefix, kind in modules.items():
        if kind == "int4":
            back = int4_dequantize(
                out[prefix + ".qweight"], out[prefix + ".scales"], out[prefix + ".mins"], 128
            )
        else:
            back = out[prefix + ".weight"].float() * out[prefix + ".weight_scale"][:, None]
        params[prefix + ".weight"].copy_(back)

    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for model in (int4_model, reference):
        flat, meta, cache = prefill_batch(model, [ids[:25], ids[25:]])
        logits.append(model.compute_logits(model(flat, meta, cache)))
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3)
