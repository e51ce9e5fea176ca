"""Long contexts: the context limit from the model's config, the KV pool from a memory budget
(not max_num_seqs x max_model_len), refusals with numbers, and admission, chunked prefill and
preemption on a pool far smaller than every sequence at full length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.worker.engine_fakes import FakeCausalLM, greedy_reference
from tests.worker.helpers import generate_counting_preemptions, random_prompts
from worker.engine.engine import (
    ContextLengthExceeded,
    EngineConfig,
    LLMEngine,
    check_kv_pool,
    kv_budget_bytes,
)
from worker.engine.sequence import SamplingParams


class ConfiguredFake(FakeCausalLM):
    """The fake model with a config that names its positions (or none at all)."""

    def __init__(self, positions: int | None) -> None:
        super().__init__()
        if positions is not None:
            self.__dict__["config"] = SimpleNamespace(max_position_embeddings=positions)


def fake_model(positions: int | None) -> FakeCausalLM:
    return ConfiguredFake(positions)


def engine(positions: int | None = 4096, **config) -> LLMEngine:
    defaults = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    return LLMEngine(fake_model(positions), None, EngineConfig(**(defaults | config)))


def test_context_limit_comes_from_the_model_unless_lowered():
    assert engine(positions=1000, kv_cache_bytes=1 << 20).config.max_model_len == 1000
    assert engine(positions=1000, max_model_len=300).config.max_model_len == 300
    assert engine(positions=None, num_kv_blocks=2000).config.max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len=2000 is past .*=1000"):
        engine(positions=1000, max_model_len=2000)


def test_byte_budget_sizes_the_pool_not_seqs_times_length():
    # the fake model's KV costs 8 bytes per token: 4 MiB = 524288 tokens = 131072 blocks of 4,
    # whatever max_num_seqs x max_model_len would say (4 x 262144 tokens)
    e = engine(positions=262_144, kv_cache_bytes=4 << 20)
    assert e.block_manager.num_blocks == (4 << 20) // (8 * 4)
    assert e.config.max_model_len == 262_144 and e.block_manager.num_blocks * 4 < 4 * 262_144


def test_a_pool_smaller_than_one_maximal_sequence_is_refused_with_numbers():
    with pytest.raises(ValueError) as err:
        engine(positions=262_144, kv_cache_bytes=1 << 20, max_model_len=200_000)
    message = str(err.value)
    for number in ("kv_cache_bytes=1048576", "32768 blocks", "131072 tokens", "200000", "50000"):
        assert number in message, message
    with pytest.raises(ValueError, match=r"num_kv_blocks=10\).* 40 tokens"):
        engine(num_kv_blocks=10, max_model_len=64)


def test_gpu_budget_is_a_fraction_of_free_memory_less_the_state():
    assert kv_budget_bytes(100 << 30, 0.9, 3 << 30) == int(90 << 30) - (3 << 30)
    assert kv_budget_bytes(1 << 30, 0.5, 2 << 30) == 0
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_fraction"):
            kv_budget_bytes(1 << 30, bad, 0)
    with pytest.raises(
        ValueError, match=r"32\.00 MiB at 32768 bytes per token; it needs 8\.00 GiB"
    ):
        check_kv_pool(64, 16, 262_144, 32768, "test")


def test_from_env_reads_the_memory_fraction(monkeypatch):
    monkeypatch.setenv("TOKENMILL_ENGINE_GPU_MEMORY_FRACTION", "0.75")
    assert EngineConfig.from_env().gpu_memory_fraction == 0.75


def test_a_prompt_that_can_never_fit_says_context_length_exceeded():
    e = engine(max_model_len=40, num_kv_blocks=100)
    with pytest.raises(ContextLengthExceeded) as err:
        e.add_request(list(range(45)))
    assert err.value.code == "context_length_exceeded"
    assert (err.value.prompt_tokens, err.value.max_model_len) == (45, 40)
    assert "40 tokens" in str(err.value) and "45 tokens" in str(err.value)
    assert isinstance(err.value, ValueError)  # callers catching ValueError keep working
    e.add_request(list(range(39)))  # one token of room: accepted


def test_a_full_pool_still_admits_chunks_and_preempts_exactly():
    # max_model_len 96 but the pool holds 100 tokens: any one sequence fits, four long ones
    # cannot run together, so the scheduler queues, chunks and preempts by recompute
    e = engine(max_model_len=96, kv_cache_bytes=8 * 100, max_num_batched_tokens=16)
    assert e.block_manager.num_blocks == 25
    prompts = random_prompts(6, 20, 60, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30)
    outputs, preemptions = generate_counting_preemptions(e, prompts, params, 25)
    assert preemptions > 0
    for tokens, prompt in zip(outputs, prompts, strict=True):
        assert tokens == greedy_reference(prompt, min(30, 96 - len(prompt)))
    assert e.block_manager.num_free_blocks == 25


def test_the_step_budget_defaults_to_4096_tokens_and_yields_to_the_operator():
    """4,096 tokens a step whatever the weights (int4 included: half that split the load
    point's prefill waves), unless the operator sets one."""
    import torch

    from worker.engine.config import DEFAULT_STEP_TOKENS
    from worker.models import build_random
    from worker.models.int4 import quantize_int4
    from worker.models.presets import TINY_QWEN3_5

    assert DEFAULT_STEP_TOKENS == 4096
    sizing = dict(block_size=16, max_num_seqs=2, num_kv_blocks=64, max_model_len=256)
    model = build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=0)
    assert LLMEngine(model, None, EngineConfig(**sizing)).config.max_num_batched_tokens == 4096
    w4 = quantize_int4(build_random(TINY_QWEN3_5, "cpu", torch.float32, seed=0), 64)
    engine_w4 = LLMEngine(w4, None, EngineConfig(**sizing))
    assert engine_w4.config.max_num_batched_tokens == 4096
    assert engine_w4.scheduler.max_num_batched_tokens == 4096
    chosen = LLMEngine(w4, None, EngineConfig(max_num_batched_tokens=1024, **sizing))
    assert chosen.config.max_num_batched_tokens == 1024
    assert chosen.scheduler.max_num_batched_tokens == 1024
