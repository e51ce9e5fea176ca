"""Overlapped decode: the host settles step N-1 and launches step N+1 while step N runs, the
GPU feeding step N's tokens to step N+1 itself. Every request must get exactly the tokens, text,
finish reason and usage of the synchronous engine: stops (tokens, EOS, strings, max_tokens,
context length) apply one step late, and the token computed past a stop is never emitted nor
counted. The fake model (tokens checkable in plain Python) runs the padded decode path here."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.worker.engine_fakes import (
    VOCAB,
    ByteTokenizer,
    FakeCausalLM,
    greedy_reference,
)
from tests.worker.helpers import SMALL_ENGINE, random_prompts, small_engine
from worker.engine.engine import EngineConfig, LLMEngine, RequestOutput
from worker.engine.sequence import FinishReason, SamplingParams

# max_num_seqs <= 4: padded decode adds at most one padding row, which the fake's layout
# checks (distinct state slots and KV slots per row) accept.
DEFAULTS: dict[str, Any] = SMALL_ENGINE | dict(max_model_len=96, pad_decode=True)


def make_engine(overlap: bool, tokenizer: Any = None, **config: Any) -> LLMEngine:
    engine = LLMEngine(
        FakeCausalLM(), tokenizer, EngineConfig(**(DEFAULTS | config), overlap_decode=overlap)
    )
    assert engine.overlap_decode is overlap
    return engine


def counting_launches(engine: LLMEngine) -> list[int]:
    """Wrap the runner's launch_forward; the list grows by one per overlapped launch."""
    launches: list[int] = []
    inner = engine.runner.launch_forward

    def launch(batch: Any) -> Any:
        launches.append(len(batch.decodes))
        return inner(batch)

    engine.runner.launch_forward = launch  # type: ignore[method-assign]
    return launches


Script = list[tuple[int, str, Any]]  # (step, "add" | "abort", payload)


def serve(engine: LLMEngine, script: Script) -> dict[str, RequestOutput]:
    """Run a script of adds (prompt, params) and aborts (index of an added request) at given
    step numbers; every request's outputs merged into one, with per-step deltas checked."""
    ids: list[str] = []
    merged: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests() or any(s >= step for s, _, _ in script):
        for at, kind, payload in script:
            if at != step:
                continue
            if kind == "add":
                ids.append(engine.add_request(*payload))
            else:
                engine.abort(ids[payload])
        for out in engine.step():
            acc = merged.get(out.request_id)
            assert acc is None or not acc.finished, "output after the final one"
            if acc is None:
                merged[out.request_id] = out
                acc = out
            else:
                acc.new_token_ids = acc.new_token_ids + out.new_token_ids
                acc.text += out.text
                acc.finished, acc.finish_reason = out.finished, out.finish_reason
                acc.usage = out.usage
            # metering: what a request was told it used is what it was sent, at every step
            assert acc.usage.completion_tokens == len(acc.new_token_ids)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.state_slots.num_free == engine.config.max_num_seqs
    return {i: merged[i] for i in ids}


def summary(outputs: dict[str, RequestOutput]) -> list[tuple[Any, ...]]:
    return [
        (o.new_token_ids, o.text, o.finish_reason, o.usage.completion_tokens, o.finished)
        for o in outputs.values()
    ]


def both(script: Script, tokenizer: Any = None, **config: Any) -> list[tuple[Any, ...]]:
    """Serve `script` synchronously and overlapped; they must agree. Returns the outputs."""
    sync = summary(serve(make_engine(False, tokenizer, **config), script))
    engine = make_engine(True, tokenizer, **config)
    launches = counting_launches(engine)
    overlapped = summary(serve(engine, script))
    assert overlapped == sync
    assert launches, "no step was overlapped"
    return overlapped


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_greedy_outputs_and_counts_match_the_reference_with_joins_and_length_stops():
    rng = random.Random(5)
    script: Script = [
        (rng.randrange(0, 30), "add", (p, greedy(rng.randint(1, 18)))) for p in prompts(10, seed=5)
    ]
    script.sort(key=lambda s: s[0])
    outs = both(script)
    for (_, _, (prompt, params)), (tokens, _, reason, used, _) in zip(script, outs, strict=True):
        assert tokens == greedy_reference(prompt, params.max_tokens)
        assert reason is FinishReason.LENGTH and used == params.max_tokens


def test_max_model_len_stops_exactly():
    script: Script = [(0, "add", (p, greedy(100))) for p in prompts(3, seed=6)]
    for tokens, _, reason, used, _ in both(script, max_model_len=30):
        assert reason is FinishReason.LENGTH and used == len(tokens)
    # prompt + output fill the context exactly
    engine = make_engine(True, max_model_len=30)
    outs = serve(engine, script)
    for (_, _, (prompt, _)), out in zip(script, outs.values(), strict=True):
        assert len(prompt) + out.usage.completion_tokens == 30


@pytest.mark.parametrize("stop_at", [1, 2, 5])
def test_stop_tokens_and_eos_discard_the_token_computed_past_them(stop_at):
    ps = prompts(4, seed=7)
    refs = [greedy_reference(p, 20) for p in ps]
    stops = [ref[stop_at] for ref in refs]
    script: Script = [
        (0, "add", (p, greedy(20, stop_token_ids=[stop])))
        for p, stop in zip(ps, stops, strict=True)
    ]
    for (tokens, _, reason, used, _), ref, stop in zip(both(script), refs, stops, strict=True):
        assert tokens == ref[: ref.index(stop) + 1]
        assert reason is FinishReason.STOP and used == len(tokens)
    # the same through EOS, with one request ignoring it
    eos = refs[0][stop_at]
    script = [(0, "add", (p, greedy(20, ignore_eos=i == 1))) for i, p in enumerate(ps)]
    outs = both(script, eos_token_ids=[eos])
    assert outs[0][0] == refs[0][: refs[0].index(eos) + 1]
    assert outs[1][0] == refs[1] and outs[1][2] is FinishReason.LENGTH


def test_stop_strings_match_the_synchronous_text():
    tokenizer = ByteTokenizer()
    ps = prompts(4, seed=8)
    refs = [greedy_reference(p, 24) for p in ps]
    # a stop string made of two tokens from the middle of each reference (bytes < 128: ASCII)
    stops = [tokenizer.decode(ref[6:8]) for ref in refs]
    script: Script = [
        (i, "add", (p, greedy(24, stop=[stop])))
        for i, (p, stop) in enumerate(zip(ps, stops, strict=True))
    ]
    for (tokens, text, reason, used, _), stop in zip(both(script, tokenizer), stops, strict=True):
        assert reason is FinishReason.STOP and used == len(tokens)
        assert stop not in text


def test_aborts_mid_flight_count_only_what_was_sent():
    ps = prompts(4, seed=9)
    script: Script = [(0, "add", (p, greedy(30))) for p in ps]
    script += [(6, "abort", 1), (9, "abort", 2), (10, "add", (ps[0], greedy(5))), (11, "abort", 4)]
    sync = summary(serve(make_engine(False), script))
    engine = make_engine(True)
    launches = counting_launches(engine)
    outs = summary(serve(engine, script))
    assert launches
    for i, (tokens, _, reason, used, finished) in enumerate(outs):
        assert finished and used == len(tokens)
        prompt = ps[0] if i >= 4 else ps[i]
        assert tokens == greedy_reference(prompt, 30)[: len(tokens)]
        if i in (1, 2, 4):
            # an abort drops the token still in flight: at most one token fewer than a
            # synchronous engine had sent by then, and none of it counted
            assert reason is FinishReason.CANCELLED
            assert len(sync[i][0]) - 1 <= len(tokens) <= len(sync[i][0])
        else:
            assert (tokens, reason) == (sync[i][0], FinishReason.LENGTH)
    assert len(outs[1][0]) < 30 and len(outs[2][0]) < 30


def test_sampled_requests_run_synchronously_beside_greedy_ones():
    ps = prompts(3, seed=10)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=10)
    script: Script = [(0, "add", (ps[0], greedy(16))), (0, "add", (ps[1], greedy(16)))]
    script += [(8, "add", (ps[2], seeded))]
    outs = both(script)
    assert outs[0][0] == greedy_reference(ps[0], 16)
    assert outs[1][0] == greedy_reference(ps[1], 16)
    assert outs[2][3] == 10


def test_preemption_under_kv_pressure_keeps_outputs_exact():
    script: Script = [(0, "add", (p, greedy(16))) for p in prompts(6, seed=11)]
    outs = both(script, num_kv_blocks=24, max_model_len=48, max_num_batched_tokens=16)
    for (_, _, (prompt, _)), (tokens, *_rest) in zip(script, outs, strict=True):
        assert tokens == greedy_reference(prompt, 16)


def test_real_model_tokens_equal_with_and_without_overlap():
    presets = pytest.importorskip("worker.models.presets")
    from worker.models import build_random

    config = presets.PRESETS["tiny-qwen3.5"]
    torch.set_num_threads(1)
    ps = random_prompts(5, 2, 12, seed=12, vocab=config.vocab_size)
    results = []
    for overlap in (False, True):
        model = build_random(config, "cpu", torch.float64, seed=3)
        engine = small_engine(
            model, max_num_seqs=8, max_model_len=48, pad_decode=True, overlap_decode=overlap
        )
        script: Script = [(0, "add", (p, greedy(6 + i))) for i, p in enumerate(ps[:3])]
        script += [(3, "add", (p, greedy(7))) for p in ps[3:]]
        results.append(summary(serve(engine, script)))
    assert results[0] == results[1]


@pytest.mark.gpu
def test_gpu_graph_decode_overlapped_equals_synchronous():
    """On the GPU with CUDA graphs: the in-graph argmax and device-fed input ids give the
    tokens the synchronous path gives (same graph, host sampler)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    presets = pytest.importorskip("worker.models.presets")
    from worker.models import build_random

    config = presets.PRESETS["tiny-qwen3.5"]
    ps = random_prompts(6, 2, 30, seed=13, vocab=config.vocab_size)
    sizes = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=96)
    results = []
    for overlap in (False, True):
        model = build_random(config, "cuda", torch.bfloat16, seed=3)
        engine = LLMEngine(model, None, EngineConfig(**sizes, overlap_decode=overlap))
        assert engine.runner.graphs, engine.runner.graph_error
        launches = counting_launches(engine)
        script: Script = [(0, "add", (p, greedy(20 + i))) for i, p in enumerate(ps[:4])]
        script += [(5, "add", (p, greedy(24))) for p in ps[4:]]
        results.append(summary(serve(engine, script)))
        assert bool(launches) is overlap
    assert results[0] == results[1]


def test_step_kinds_count_how_steps_ran():
    """One prompt: a synchronous prefill, then decodes launched ahead; a second request joining
    mid-run drains the step in flight before its prefill runs synchronously."""
    engine = make_engine(True)
    launches = counting_launches(engine)
    serve(engine, [(0, "add", ([1, 2, 3], greedy(12))), (6, "add", ([4, 5], greedy(4)))])
    kinds = engine.step_kinds
    assert kinds["overlapped"] == len(launches) > 0
    assert kinds["synchronous"] >= 2  # the two prefills
    assert kinds["drained"] >= 1  # the join waited for the step in flight
    sync_engine = make_engine(False)
    serve(sync_engine, [(0, "add", ([1, 2, 3], greedy(12)))])
    assert set(sync_engine.step_kinds) == {"synchronous"}
