"""Warm-up covers every kernel specialization class the scheduler can form (CPU, fake model):
what the GPU would otherwise compile while a wave of requests waits."""

from __future__ import annotations

import random

import pytest

from tests.worker.engine_fakes import VOCAB, FakeCausalLM, greedy_reference
from worker.engine.engine import EngineConfig, LLMEngine, specialization_classes
from worker.engine.sequence import SamplingParams
from worker.kernels.triton import _launch

SHAPES = [
    dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128),
    dict(block_size=16, max_num_seqs=5, max_num_batched_tokens=256, max_model_len=768),
]


def make_engine(**config) -> tuple[LLMEngine, FakeCausalLM]:
    model = FakeCausalLM()
    return LLMEngine(model, None, EngineConfig(pad_decode=True, **config)), model


def eager_classes(model: FakeCausalLM) -> set[tuple[str, int, int]]:
    # decode-only steps replay the padded (CUDA-graph) buffers captured at start
    return set().union(*(specialization_classes(m) for m in model.batches if m.num_prefills))


def serve_random_traffic(engine: LLMEngine, seed: int) -> None:
    """Arrivals between steps, prompts from 1 token to the context limit, mixed output lengths:
    the compositions a served engine meets."""
    rng = random.Random(seed)
    c = engine.config
    for _ in range(40):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 5])):
            if engine.num_requests >= 3 * c.max_num_seqs:
                break
            prompt_len = rng.choice([1, 2, 15, 16, 17, rng.randint(1, c.max_model_len // 2)])
            room = c.max_model_len - prompt_len
            params = SamplingParams(
                temperature=0, max_tokens=rng.randint(1, max(1, min(room, 40))), ignore_eos=True
            )
            engine.add_request([rng.randrange(VOCAB) for _ in range(prompt_len)], params)
        for _ in range(rng.randint(1, 4)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("shape", SHAPES, ids=["small", "load-point-like"])
def test_warm_up_covers_the_classes_served_traffic_forms(shape):
    warmed_engine, warmed_model = make_engine(**shape)
    warmed_engine.warm_up()
    warmed = eager_classes(warmed_model)
    served: set[tuple[str, int, int]] = set()
    for seed in range(3):
        engine, model = make_engine(**shape)
        serve_random_traffic(engine, seed)
        served |= eager_classes(model)
    assert served, "the traffic formed no eager step"
    assert served <= warmed, f"not warmed up: {sorted(served - warmed)}"
    # mixed steps of several widths were really served (the check is not vacuous)
    assert len({cls for cls in served if cls[0] == "seqs" and cls[1] and cls[2]}) >= 3
    # and short steps in both wide-GEMV row buckets (17-32 and 33-64 tokens)
    assert {("gemm_rows", 32, 0), ("gemm_rows", 64, 0)} <= served


def test_warm_up_leaves_the_engine_empty_and_serving():
    engine, model = make_engine(**SHAPES[0])
    free_blocks = engine.block_manager.num_free_blocks
    run = engine.warm_up()
    assert "1x64+0" in run and "5x12+0" in run and "3x19+5" in run
    assert not engine.has_unfinished_requests() and engine.num_requests == 0
    assert engine.block_manager.num_free_blocks == free_blocks
    assert engine.scheduler.state_slots.num_free == 8
    [out] = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))
    assert out.new_token_ids == greedy_reference([5, 6, 7], 12)


def test_warm_up_does_not_grow_with_the_context_limit():
    """No context length is a specialization class (the decode attention's split count follows
    the batch), so a 262K-token limit warms up the same short steps as a 768-token one."""
    short, _ = make_engine(**SHAPES[1])
    long_shape = {**SHAPES[1], "max_model_len": 262_144}
    long, _ = make_engine(**long_shape)
    assert long.warm_up() == short.warm_up()


def test_warm_up_is_on_for_cuda_only_unless_set(monkeypatch):
    assert EngineConfig.from_env().warm_up is None
    engine, _ = make_engine(**SHAPES[0])
    assert engine.config.warm_up is False  # CPU: no kernel compiles
    monkeypatch.setenv("TOKENMILL_ENGINE_WARM_UP", "1")
    assert EngineConfig.from_env().warm_up is True
    monkeypatch.setenv("TOKENMILL_ENGINE_WARM_UP", "0")
    assert EngineConfig.from_env().warm_up is False


def test_per_step_sizes_are_not_specialized():
    from worker.kernels.triton import conv1d, delta_rule, fp8_gemm, paged_attention

    assert fp8_gemm._gemv_kernel.per_step == ["M", "splits"]
    assert "num_seqs" in paged_attention._prefill_kernel.per_step
    assert "stride_bt" in paged_attention._prefill_kernel.per_step
    assert "num_splits" in paged_attention._decode_partition_kernel.per_step
    assert "num_seqs" in conv1d._conv_prefill_kernel.per_step
    assert "num_seqs" in delta_rule._wy_prepare_kernel.per_step
    assert _launch.compiles() >= 0
