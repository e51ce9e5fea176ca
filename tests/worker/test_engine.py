"""The engine end to end with a fake model whose tokens can be checked in plain Python."""

from __future__ import annotations

import random

import pytest
import torch

from tests.worker.engine_fakes import (
    VOCAB,
    ByteTokenizer,
    FakeCausalLM,
    greedy_reference,
    next_token,
)
from tests.worker.helpers import generate_counting_preemptions, random_prompts
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import FinishReason, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def make_engine(tokenizer=None, **config) -> tuple[LLMEngine, FakeCausalLM]:
    model = FakeCausalLM()
    defaults = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return LLMEngine(model, tokenizer, EngineConfig(**(defaults | config))), model


def test_reference_is_the_fake_models_rule():
    assert next_token([1, 2, 3]) == next_token([1, 2, 3])
    assert len({next_token([i]) for i in range(VOCAB)}) > 10


def test_one_sequence_matches_reference():
    engine, _ = make_engine()
    [out] = engine.generate([[5, 6, 7]], GREEDY)
    assert out.new_token_ids == greedy_reference([5, 6, 7], 12)
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens) == (
        3,
        12,
        0,
    )
    assert out.metrics.ttft is not None and 0 <= out.metrics.ttft <= out.metrics.e2e


def test_chunked_prefill_splits_long_prompts_and_mixes_decodes():
    engine, model = make_engine(max_num_batched_tokens=8, max_num_seqs=3)
    prompts = random_prompts(5, 1, 40, seed=1)
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.new_token_ids == greedy_reference(prompt, 12)
    assert all(sum(m.query_lens) <= 8 for m in model.batches)
    assert any(m.num_prefills and m.num_decodes for m in model.batches)  # mixed steps happened
    # A 40-token prompt cannot fit one 8-token step, so some prefill resumed on cached state.
    assert any(bool(m.has_initial_state[i]) for m in model.batches for i in range(m.num_prefills))


def test_preemption_recomputes_and_keeps_outputs_exact():
    # 12 blocks of 4 tokens = 48 slots for 4 sequences that each want up to 30 tokens.
    engine, _ = make_engine(num_kv_blocks=12, max_model_len=48, max_num_batched_tokens=16)
    prompts = random_prompts(6, 6, 14, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16)
    outputs, preempted = generate_counting_preemptions(engine, prompts, params, 12)
    assert preempted > 0
    for tokens, prompt in zip(outputs, prompts, strict=True):
        assert tokens == greedy_reference(prompt, 16)
    assert engine.block_manager.num_free_blocks == 12
    assert engine.scheduler.state_slots.num_free == 4


def test_requests_join_and_leave_mid_way():
    engine, _ = make_engine(max_num_seqs=3, max_num_batched_tokens=10)
    rng = random.Random(3)
    expected, got, pending = {}, {}, random_prompts(12, 1, 20, seed=3)
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            prompt = pending.pop()
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 15))
            rid = engine.add_request(prompt, params)
            expected[rid], got[rid] = greedy_reference(prompt, params.max_tokens), []
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got == expected


def test_abort_running_and_waiting_frees_everything():
    engine, _ = make_engine(max_num_seqs=1)
    running = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
    waiting = engine.add_request([4, 5], SamplingParams(temperature=0, max_tokens=50))
    first = engine.step()
    assert [o.request_id for o in first] == [running]
    assert engine.abort(running) and engine.abort(waiting)
    assert not engine.abort(running)  # already gone
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {
        running: FinishReason.CANCELLED,
        waiting: FinishReason.CANCELLED,
    }
    assert all(o.finished for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.state_slots.num_free == 1


def test_stop_token_ids_and_eos():
    prompt = [9, 8, 7]
    ref = greedy_reference(prompt, 12)
    stop = ref[4]
    engine, _ = make_engine(eos_token_ids=[stop])
    [out] = engine.generate([prompt], GREEDY)
    assert out.new_token_ids == ref[: ref.index(stop) + 1]
    assert out.finish_reason is FinishReason.STOP
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out.new_token_ids == ref
    engine, _ = make_engine()
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    [out] = engine.generate([prompt], params)
    assert out.new_token_ids[-1] == stop and out.finish_reason is FinishReason.STOP


def test_text_deltas_and_stop_strings():
    tokenizer = ByteTokenizer()
    prompt = [40, 41, 42, 43]
    ref = greedy_reference(prompt, 30)
    full_text = tokenizer.decode(ref)
    engine, _ = make_engine(tokenizer)
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30))
    assert out.text == full_text
    stop = full_text[10:13]
    cut = full_text.index(stop)
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    assert out.text == full_text[:cut] and out.finish_reason is FinishReason.STOP
    assert len(out.new_token_ids) == len(full_text[: cut + len(stop)].encode())


def test_text_prompt_is_encoded():
    tokenizer = ByteTokenizer()
    engine, _ = make_engine(tokenizer)
    [out] = engine.generate(["hi!"], GREEDY)
    assert out.new_token_ids == greedy_reference(list(b"hi!"), 12)
    assert out.usage.prompt_tokens == 3


def test_max_model_len_limits_prompt_and_output():
    engine, _ = make_engine(max_model_len=16)
    with pytest.raises(ValueError, match="at most 16"):
        engine.add_request(list(range(16)))
    [out] = engine.generate([list(range(10))], SamplingParams(temperature=0, max_tokens=100))
    assert len(out.new_token_ids) == 6 and out.finish_reason is FinishReason.LENGTH


def test_config_must_fit_one_full_sequence():
    with pytest.raises(ValueError, match="cannot hold"):
        make_engine(num_kv_blocks=3, max_model_len=128)


def test_kv_budget_in_bytes_sizes_the_cache():
    engine, _ = make_engine(kv_cache_bytes=8 * 4 * 100)  # fake: 8 bytes per token, 4 per block
    assert engine.block_manager.num_blocks == 100


def test_failing_step_ends_its_sequences_and_the_engine_goes_on():
    engine, model = make_engine()
    model.fail_on_step = 2
    a = engine.add_request([1, 2], SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(a, FinishReason.ERROR)]
    assert "device fell over" in (outs[0].error or "")
    [out] = engine.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=5))
    assert out.new_token_ids == greedy_reference([3, 4], 5)


def test_seeded_sampling_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=20, seed=1234)
    engine, _ = make_engine()
    [alone] = engine.generate([[1, 2, 3]], params)
    others = random_prompts(3, 2, 9, seed=4)
    crowd = engine.generate(
        [*others, [1, 2, 3]], [SamplingParams(temperature=1.0, max_tokens=20)] * 3 + [params]
    )
    assert crowd[-1].new_token_ids == alone.new_token_ids
    [other_seed] = engine.generate(
        [[1, 2, 3]], SamplingParams(temperature=1.5, top_p=0.95, max_tokens=20, seed=99)
    )
    assert other_seed.new_token_ids != alone.new_token_ids
    # Sampling really samples: temperature 1.5 departs from the greedy path.
    assert alone.new_token_ids != greedy_reference([1, 2, 3], 20)


def test_duplicate_request_id_is_refused():
    engine, _ = make_engine()
    engine.add_request([1], request_id="r1")
    with pytest.raises(ValueError, match="already"):
        engine.add_request([2], request_id="r1")


def test_runner_builds_the_contract_metadata():
    engine, _ = make_engine(block_size=4, max_num_batched_tokens=9)
    engine.add_request([1, 2, 3])  # decodes next step
    engine.add_request(list(range(10, 20)))  # 10 tokens: chunked 6 + 4
    engine.step()  # seq 0: prompt (3); seq 1: first 6 tokens
    batch = engine.scheduler.schedule()
    input_ids, meta = engine.runner.prepare(batch)
    s0, s1 = (engine._requests[r].seq for r in list(engine._requests))
    assert meta.seq_ids == [s1.seq_id, s0.seq_id] and meta.num_prefills == 1
    assert meta.query_lens == [4, 1]
    assert input_ids.tolist() == [16, 17, 18, 19, s0.output_token_ids[0]]
    assert meta.positions.tolist() == [6, 7, 8, 9, 3]
    assert meta.context_lens.tolist() == [10, 4]
    assert meta.cu_seqlens.tolist() == [0, 4, 5]
    assert meta.logits_indices.tolist() == [3, 4]
    assert meta.has_initial_state.tolist() == [True, True]
    assert meta.state_slots.tolist() == [s1.state_slot, s0.state_slot]
    t1, t0 = s1.block_table, s0.block_table
    # padded with 0 to the next power of two of the widest (3 blocks: 4)
    assert meta.block_tables.tolist() == [t1 + [0], t0 + [0, 0, 0]]
    assert meta.slot_mapping.tolist() == [
        t1[1] * 4 + 2, t1[1] * 4 + 3, t1[2] * 4, t1[2] * 4 + 1, t0[0] * 4 + 3,
    ]  # fmt: skip


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("TOKENMILL_ENGINE_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("TOKENMILL_ENGINE_KV_CACHE_BYTES", "1048576")
    config = EngineConfig.from_env(max_model_len=256)
    assert (config.max_num_seqs, config.kv_cache_bytes, config.max_model_len) == (3, 1048576, 256)
    assert config.block_size == 16
    assert config.state_dtype is None  # the model's dtype
    monkeypatch.setenv("TOKENMILL_ENGINE_STATE_DTYPE", "bfloat16")
    assert EngineConfig.from_env().state_dtype == torch.bfloat16
    monkeypatch.setenv("TOKENMILL_ENGINE_STATE_DTYPE", "fp64")
    with pytest.raises(ValueError, match="TOKENMILL_ENGINE_STATE_DTYPE"):
        EngineConfig.from_env()


def test_a_slow_step_is_logged_with_its_batch(monkeypatch, caplog):
    from worker.engine import engine as engine_module

    engine, _ = make_engine()
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
    assert "slow engine step" not in caplog.text  # the default threshold: 1 s
    monkeypatch.setattr(engine_module, "SLOW_STEP_S", 0.0)
    with caplog.at_level("WARNING", logger="worker.engine.engine"):
        engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=2))
    assert "2 prefill chunks (5 tokens) and 0 decodes" in caplog.text  # the first step
    assert "0 prefill chunks (0 tokens) and 2 decodes" in caplog.text


def test_a_slow_step_names_the_kernels_it_compiled(monkeypatch, caplog):
    """A compile seen during a slow step (triton's post-compile hook, as it calls it) is named
    in the step's warning with its specialization, so a log says which class warm-up missed."""
    from types import SimpleNamespace

    from worker.engine import engine as engine_module
    from worker.kernels.triton import _launch

    engine, _ = make_engine()
    monkeypatch.setattr(engine_module, "SLOW_STEP_S", 0.0)
    inner = engine.runner.execute

    def compiling(batch):  # type: ignore[no-untyped-def]
        _launch._count_compile(
            key=None,
            repr="_decode_kernel[num_warps=4](q: *bf16)",
            fn=SimpleNamespace(name="_decode_kernel"),
        )
        return inner(batch)

    engine.runner.execute = compiling  # type: ignore[method-assign]
    before = _launch.compiles()
    with caplog.at_level("WARNING", logger="worker.engine.engine"):
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
    assert _launch.compiles() == before + 1
    assert (
        "(1 kernel compiles; _decode_kernel: _decode_kernel[num_warps=4](q: *bf16))" in caplog.text
    )
    assert _launch.compiled_since(_launch.compiles()) == []
    _launch._count_compile(already_compiled=True)  # a cache hit is no compile
    assert _launch.compiles() == before + 1
