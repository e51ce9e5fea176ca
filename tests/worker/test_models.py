"""Our models against Hugging Face transformers: random-weight tiny configs of each family are saved
with save_pretrained, loaded through our loader, and must give the same logits (relative error)
and the same greedy tokens, alone and in a batch whose sequences join and leave mid-way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.model_driver import DrivenSequence, ModelDriver
from worker.loading.config import config_from_hf, load_hf_config
from worker.loading.safetensors import checkpoint_name_to_param, load_hf_model
from worker.models import build_empty, build_random
from worker.models.presets import QWEN3_6_27B, TINY_LLAMA, TINY_QWEN3_5

transformers = pytest.importorskip("transformers")

VOCAB = 128
LOGITS_REL_ERR = 1e-4  # fp32 on both sides; observed ~1e-6


def _hf_config(family: str) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(
            **common,
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    if family == "llama":  # tied head, Llama 3 rope scaling, biased attention
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(
            **common,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters=rope,
            attention_bias=True,
        )
    return transformers.Qwen3Config(**common, num_hidden_layers=2, tie_word_embeddings=False)


_HF_CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(scope="module", params=["qwen3_5", "llama", "qwen3"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any]:
    """(transformers model, our model loaded from its saved checkpoint), fp32."""
    family = request.param
    torch.manual_seed(0)
    hf = getattr(transformers, _HF_CLASSES[family])(_hf_config(family)).eval()
    with torch.no_grad():  # make norms, biases and gates non-trivial so their semantics matter
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp(family)
    # Qwen3 is written in shards, to exercise the index.
    hf.save_pretrained(path, max_shard_size="100KB" if family == "qwen3" else "1GB")
    if family == "qwen3":
        assert (path / "model.safetensors.index.json").exists()
    return hf, load_hf_model(path, "cpu", torch.float32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def check_against_hf(hf: Any, seq: DrivenSequence) -> None:
    """Every logits vector we produced equals transformers' full forward over the final tokens,
    and every generated token is the argmax of transformers' logits before it."""
    ref = hf(torch.tensor([seq.tokens])).logits[0]
    for pos, logits in seq.logits.items():
        assert rel_err(logits, ref[pos]) < LOGITS_REL_ERR, f"position {pos}"
    for pos in range(seq.prompt_len, len(seq.tokens)):
        assert seq.tokens[pos] == int(ref[pos - 1].argmax()), f"greedy token at {pos}"


def test_prefill_and_64_decode_steps_match_transformers(pair: tuple[Any, Any]) -> None:
    hf, ours = pair
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = ModelDriver(ours).generate(prompt, 64)
    assert len(seq.logits) == 64
    check_against_hf(hf, seq)
    # transformers' own incremental generation (its cache paths) gives the same greedy text.
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert out[0, len(prompt) :].tolist() == seq.generated


def test_batch_with_chunked_prefill_and_sequences_joining_and_leaving(
    pair: tuple[Any, Any],
) -> None:
    hf, ours = pair
    gen = torch.Generator().manual_seed(2)
    prompts = {
        i: torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        for i, n in enumerate([9, 21, 1, 6])
    }
    driver = ModelDriver(ours, num_blocks=48, block_size=4, num_slots=3)
    finished: dict[int, DrivenSequence] = {}
    # step -> sequences that join at that step; sequence -> tokens to generate before leaving
    joins = {0: [0], 2: [1], 4: [2], 12: [3]}
    budget = {0: 8, 1: 14, 2: 20, 3: 10}
    for step in range(40):
        for s in joins.get(step, []):
            driver.add(s, prompts[s])  # sequence 3 reuses sequence 0's freed slot and blocks
        active = list(driver.seqs)
        if not active:
            break
        driver.greedy_step(active, prefill_chunk=8)  # sequence 1's prompt spans three steps
        for s in active:
            if len(driver.seqs[s].generated) >= budget[s]:
                finished[s] = driver.remove(s)
    assert sorted(finished) == [0, 1, 2, 3]
    for s, seq in finished.items():
        assert len(seq.generated) == budget[s]
        check_against_hf(hf, seq)


def test_fp8_kv_cache_stays_close(pair: tuple[Any, Any]) -> None:
    hf, ours = pair
    prompt = list(range(3, 40))
    seq = ModelDriver(ours, kv_dtype=torch.float8_e4m3fn).generate(prompt, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens])).logits[0]
    errs = [rel_err(logits, ref[pos]) for pos, logits in seq.logits.items()]
    assert max(errs) < 0.2
    assert max(errs) > 1e-6  # the cache really was fp8


def test_config_parsing_matches_transformers_defaults() -> None:
    hf = transformers.Qwen3_5TextConfig(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    parsed = config_from_hf(hf.to_dict(), name=QWEN3_6_27B.name)
    assert parsed == QWEN3_6_27B
    assert parsed.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert len(parsed.full_attention_layers) == 16 and len(parsed.linear_attention_layers) == 48
    assert parsed.rotary_dim == 64
    assert round(parsed.num_parameters() / 1e9, 1) == 26.9
    # The multimodal wrapper nests the text config; parsing it gives the same text model.
    wrapped = transformers.Qwen3_5Config(text_config=hf.to_dict()).to_dict()
    assert config_from_hf(wrapped, name=QWEN3_6_27B.name) == QWEN3_6_27B


def test_parameter_count_matches_transformers(pair: tuple[Any, Any], tmp_path: Path) -> None:
    hf, ours = pair
    hf_count = sum(p.numel() for p in hf.parameters())  # tied weights count once
    assert ours.config.num_parameters() == hf_count == sum(p.numel() for p in ours.parameters())
    hf.config.save_pretrained(tmp_path)
    assert load_hf_config(tmp_path) == ours.config.replace(name=tmp_path.name)


def test_multimodal_checkpoint_names_map_to_the_text_model() -> None:
    assert (
        checkpoint_name_to_param("model.language_model.layers.3.linear_attn.A_log")
        == "model.layers.3.linear_attn.A_log"
    )
    assert checkpoint_name_to_param("model.visual.blocks.0.attn.qkv.weight") is None
    assert checkpoint_name_to_param("mtp.layers.0.mlp.up_proj.weight") is None
    assert checkpoint_name_to_param("lm_head.weight") == "lm_head.weight"


def test_full_size_cache_sizes_on_meta() -> None:
    model = build_empty(QWEN3_6_27B, "meta", torch.bfloat16)
    cache = model.allocate_cache(16, 16, 8, torch.float8_e4m3fn, "meta")
    assert cache.kv_bytes_per_token() == 16 * 2 * 4 * 256  # 32 KiB in FP8
    recurrent = 48 * 48 * 128 * 128 * 4  # 144 MiB fp32
    conv = 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2
    assert cache.state_bytes_per_sequence() == recurrent + conv
    assert sum(p.numel() for p in model.parameters()) == QWEN3_6_27B.num_parameters()


@pytest.mark.parametrize("config", [TINY_QWEN3_5, TINY_LLAMA], ids=lambda c: c.name)
def test_build_random_generates_on_device(config: Any) -> None:
    a = build_random(config, "cpu", torch.bfloat16, seed=3)
    b = build_random(config, "cpu", torch.bfloat16, seed=3)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    seq = ModelDriver(a, block_size=16).generate(list(range(1, 30)), 3)
    assert all(torch.isfinite(v).all() for v in seq.logits.values())
