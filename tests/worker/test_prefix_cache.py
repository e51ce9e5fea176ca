"""Prefix caching: shared KV blocks and DeltaNet state checkpoints must never change greedy
outputs, and cached_tokens must be exactly the prompt tokens that were not computed."""

from __future__ import annotations

import random

import pytest
import torch

from tests.worker.engine_fakes import VOCAB, FakeCache, FakeCausalLM, greedy_reference
from tests.worker.helpers import small_engine
from tests.worker.test_structured import tokenizer  # noqa: F401 (fixture)
from worker.engine.block_manager import BlockManager
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams, Sequence
from worker.engine.state_slots import StateCheckpoints

GREEDY = SamplingParams(temperature=0, max_tokens=8)


class CheckpointCache(FakeCache):
    """The fake's cache with copyable state slots, like ModelCache's DeltaNet layers."""

    def copy_state_slots(self, pairs):
        for src, dst in pairs:
            self.state[dst] = self.state[src]


class CheckpointFake(FakeCausalLM):
    def allocate_cache(
        self, num_blocks, block_size, num_state_slots, kv_dtype, device, state_dtype=None
    ):
        return CheckpointCache(num_blocks, block_size, num_state_slots, device)


def make_engine(model=None, **config) -> tuple[LLMEngine, FakeCausalLM]:
    model = model or CheckpointFake()
    caching = dict(max_model_len=128, enable_prefix_caching=True, prefix_checkpoint_blocks=2)
    return small_engine(model, **(caching | config)), model


def fed_tokens(model: FakeCausalLM) -> int:
    return sum(sum(m.query_lens) for m in model.batches)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY):
    [out] = engine.generate([prompt], params)
    return out


def test_off_by_default_and_from_env(monkeypatch):
    assert EngineConfig().enable_prefix_caching is False
    monkeypatch.setenv("TOKENMILL_ENGINE_PREFIX_CACHING", "1")
    assert EngineConfig.from_env().enable_prefix_caching is True
    engine, model = make_engine(enable_prefix_caching=False)
    system = tokens(21, 0)
    for i in range(3):
        out = run_one(engine, system + [i, i + 1])
        assert out.usage.cached_tokens == 0
    assert engine.block_manager.num_cached_blocks == 0


def test_shared_system_prompt_resumes_at_deepest_checkpoint():
    engine, model = make_engine()
    system = tokens(21, 1)  # 5 full blocks; checkpoints every 2 blocks: at 8 and 16 tokens
    first = run_one(engine, system + [1, 2, 3, 4, 5])
    assert first.usage.cached_tokens == 0
    assert first.new_token_ids == greedy_reference(system + [1, 2, 3, 4, 5], 8)
    for i in range(3):
        prompt = system + tokens(3 + i, 10 + i)
        before = fed_tokens(model)
        out = run_one(engine, prompt)
        assert out.new_token_ids == greedy_reference(prompt, 8)
        assert out.usage.cached_tokens == 16
        # the prompt minus what was skipped, plus one token per decode step
        assert fed_tokens(model) - before == len(prompt) - 16 + 7


def test_same_outputs_with_and_without_the_cache_under_concurrency():
    system = tokens(30, 2)
    prompts = [system[: 5 + 3 * i] + tokens(i % 5 + 1, 100 + i) for i in range(9)] + [system] * 3
    params = SamplingParams(temperature=0, max_tokens=10)
    results = {}
    for on in (False, True):
        engine, model = make_engine(enable_prefix_caching=on, max_num_batched_tokens=16)
        outs = []
        for start in range(0, len(prompts), 3):  # waves, so later waves find cached prefixes
            outs += engine.generate(prompts[start : start + 3], params)
        results[on] = [o.new_token_ids for o in outs]
        fed = fed_tokens(model)
        cached = sum(o.usage.cached_tokens for o in outs)
        if not on:
            fed_off = fed
            assert cached == 0
    for prompt, got in zip(prompts, results[True], strict=True):
        assert got == greedy_reference(prompt, 10)
    assert results[True] == results[False]
    assert cached > 0 and fed_off - fed == cached


def test_partial_block_and_short_prefixes():
    engine, _ = make_engine()
    # 10 shared tokens: 2 full blocks, one checkpoint (at 8); the partial third block is not
    # shared
    shared = tokens(10, 3)
    run_one(engine, shared + [1, 1, 1])
    out = run_one(engine, shared + [2, 2, 2])
    assert out.usage.cached_tokens == 8
    assert out.new_token_ids == greedy_reference(shared + [2, 2, 2], 8)
    # a prefix shorter than the checkpoint spacing: its one full block has KV but no state
    short = tokens(6, 4)
    run_one(engine, short + [3])
    out = run_one(engine, short + [4])
    assert out.usage.cached_tokens == 0
    assert out.new_token_ids == greedy_reference(short + [4], 8)


def test_whole_prompt_is_never_matched():
    engine, model = make_engine(prefix_checkpoint_blocks=1)
    prompt = tokens(16, 5)  # exactly 4 blocks
    run_one(engine, prompt)
    before = fed_tokens(model)
    out = run_one(engine, prompt)
    assert out.usage.cached_tokens == 12  # the last block is computed again for the logits
    assert fed_tokens(model) - before == 4 + 7
    assert out.new_token_ids == greedy_reference(prompt, 8)


def test_salts_do_not_share():
    engine, _ = make_engine(prefix_checkpoint_slots=8)  # room for every salt's checkpoints
    prompt = tokens(20, 6)
    a = SamplingParams(temperature=0, max_tokens=8, cache_salt="tenant-a")
    b = SamplingParams(temperature=0, max_tokens=8, cache_salt="tenant-b")
    assert run_one(engine, prompt, a).usage.cached_tokens == 0
    out_b = run_one(engine, prompt, b)
    assert out_b.usage.cached_tokens == 0
    assert run_one(engine, prompt, GREEDY).usage.cached_tokens == 0  # no salt: its own space
    out = run_one(engine, prompt, a)
    assert out.usage.cached_tokens == 16
    assert out.new_token_ids == out_b.new_token_ids == greedy_reference(prompt, 8)


def test_evictions_under_a_small_pool_keep_outputs_exact():
    # 12 blocks, 4 checkpoints: every new prompt must evict cached blocks and checkpoints
    engine, _ = make_engine(num_kv_blocks=12, max_model_len=40, max_num_seqs=2)
    prompts = [tokens(18, 20 + i % 5) + [i] for i in range(15)]
    for prompt in prompts:
        out = run_one(engine, prompt)
        assert out.new_token_ids == greedy_reference(prompt, 8)
        assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_evicted > 0
    assert len(engine.scheduler.checkpoints) <= 4


def test_preemption_of_sequences_holding_shared_blocks():
    engine, _ = make_engine(num_kv_blocks=16, max_model_len=48, max_num_batched_tokens=16)
    system = tokens(17, 7)
    warm = run_one(engine, system + [0])
    assert warm.usage.cached_tokens == 0
    prompts = [system + tokens(3, 30 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = engine.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.new_token_ids == greedy_reference(prompt, 16)
        assert out.usage.cached_tokens == 16
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16


def test_a_cache_without_copyable_state_never_resumes():
    engine, _ = make_engine(model=FakeCausalLM())
    prompt = tokens(20, 8)
    run_one(engine, prompt)
    out = run_one(engine, prompt)
    assert out.usage.cached_tokens == 0
    assert out.new_token_ids == greedy_reference(prompt, 8)


# --- multi-turn conversations: the next turn resumes after the previous answer -----------------


def resume_bound(prompt: list[int], answer: list[int], block_size: int = 4) -> int:
    """Where a next turn (prompt + answer + more) resumes: the previous sequence computed every
    token but its answer's last (sampled, never fed), rounded down to a block boundary."""
    return (len(prompt) + len(answer) - 1) // block_size * block_size


def converse(engine: LLMEngine, conversations: list[list[list[int]]], params: SamplingParams):
    """Each turn's prompts (history + the next user turn) at once; per turn (prompts, outputs)."""
    history: list[list[int]] = [[] for _ in conversations]
    turns = []
    for turn in range(len(conversations[0])):
        prompts = [h + c[turn] for h, c in zip(history, conversations, strict=True)]
        outs = engine.generate(prompts, params)
        turns.append((prompts, outs))
        history = [p + list(o.new_token_ids) for p, o in zip(prompts, outs, strict=True)]
    return turns


@pytest.mark.parametrize("overlap", [False, True])
def test_next_turn_resumes_after_the_previous_answer(overlap):
    # a 19-token first prompt and 10-token answers: 28 tokens computed, a block boundary
    # (4-token blocks) where no spacing checkpoint (every 8 tokens) sits
    system = tokens(14, 40)
    turns = [system + tokens(5, 41), tokens(5, 42), tokens(7, 43)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    pad = dict(pad_decode=True, overlap_decode=True) if overlap else {}
    results = {}
    for on in (False, True):
        engine, _ = make_engine(enable_prefix_caching=on, **pad)
        assert engine.overlap_decode is overlap
        results[on] = converse(engine, [turns], params)
    previous = None
    for (prompts, outs), (_, outs_off) in zip(results[True], results[False], strict=True):
        [prompt], [out], [off] = prompts, outs, outs_off
        assert out.new_token_ids == off.new_token_ids == greedy_reference(prompt, 10)
        assert off.usage.cached_tokens == 0
        if previous is None:
            assert out.usage.cached_tokens == 0
        else:
            assert prompt[: len(previous[0]) + 10] == previous[0] + previous[1]
            assert out.usage.cached_tokens == resume_bound(*previous)
        previous = (prompt, out.new_token_ids)
    assert [o.usage.cached_tokens for _, [o] in results[True]] == [0, 28, 40]


def test_a_tail_at_the_prompt_end_serves_a_short_answer():
    # a 16-token prompt (a block boundary, not a spacing one: every 12 tokens) and a 2-token
    # answer: 17 computed; the deepest boundary is the prompt's end, where its last chunk ended
    engine, _ = make_engine(prefix_checkpoint_blocks=3)
    prompt = tokens(16, 44)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = run_one(engine, prompt, params)
    follow = prompt + first.new_token_ids + tokens(3, 45)
    out = run_one(engine, follow, params)
    assert out.usage.cached_tokens == 16 == resume_bound(prompt, first.new_token_ids)
    assert out.new_token_ids == greedy_reference(follow, 2)


@pytest.mark.parametrize(
    "num_conversations, num_kv_blocks, max_num_seqs, exact",
    [
        # turn 3 outgrows the KV pool (preemption); turns start with the previous ones' blocks
        # cached, and checkpoints are overwritten (4 slots: 2 tails, 2 keyed), yet each turn's
        # tail survives until the next: every turn resumes exactly at its bound
        (2, 18, 2, True),
        # 6 conversations through 22 blocks and 4 checkpoint slots: most prefixes are evicted
        (6, 22, 3, False),
    ],
)
def test_conversations_under_preemption_and_eviction_keep_outputs_exact(
    num_conversations, num_kv_blocks, max_num_seqs, exact
):
    conversations = [
        [tokens(9, 50 + c)] + [tokens(3, 60 + 3 * c + t) for t in range(2)]
        for c in range(num_conversations)
    ]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    sizes = dict(num_kv_blocks=num_kv_blocks, max_model_len=64, max_num_seqs=max_num_seqs)
    results = {}
    for on in (False, True):
        engine, _ = make_engine(
            enable_prefix_caching=on, prefix_checkpoint_slots=4, max_num_batched_tokens=16, **sizes
        )
        results[on] = converse(engine, conversations, params)
        assert engine.block_manager.num_used_blocks == 0
        if on:
            checkpoints = engine.scheduler.checkpoints
            assert checkpoints.num_held == 0  # every tail keyed or given back
            assert checkpoints.num_evicted > 0 and engine.block_manager.num_evicted > 0
    preempted = 0
    for turn, ((prompts, outs), (_, outs_off)) in enumerate(
        zip(results[True], results[False], strict=True)
    ):
        for c, (prompt, out, off) in enumerate(zip(prompts, outs, outs_off, strict=True)):
            assert out.new_token_ids == off.new_token_ids == greedy_reference(prompt, 9)
            preempted += out.metrics.num_preemptions
            if turn:
                before_prompt, before = results[True][turn - 1][0][c], results[True][turn - 1][1][c]
                bound = resume_bound(before_prompt, before.new_token_ids)
                assert (
                    out.usage.cached_tokens == bound if exact else out.usage.cached_tokens <= bound
                )
    assert preempted > 0


@pytest.mark.usefixtures("one_thread")
def test_tiny_hybrid_conversations_resume_after_their_answers():
    from worker.models import build_random

    config = presets.PRESETS["tiny-qwen3.5"]
    model = build_random(config, "cpu", torch.float64, seed=2)
    rng = random.Random(3)

    def some(n: int) -> list[int]:
        return [rng.randrange(config.vocab_size) for _ in range(n)]

    system = some(11)
    conversations = [[system + some(2 + c), some(3), some(4)] for c in range(2)]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    sizes = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=40)
    results = {}
    for on in (False, True):
        engine, _ = make_engine(model, **sizes, enable_prefix_caching=on)
        results[on] = converse(engine, conversations, params)
    for turn, ((_, outs), (_, outs_off)) in enumerate(
        zip(results[True], results[False], strict=True)
    ):
        for c, (out, off) in enumerate(zip(outs, outs_off, strict=True)):
            assert out.new_token_ids == off.new_token_ids
            if turn:
                before_prompt, before = results[True][turn - 1][0][c], results[True][turn - 1][1][c]
                assert out.usage.cached_tokens == resume_bound(before_prompt, before.new_token_ids)
            else:  # run side by side: the system prompt is not cached yet
                assert out.usage.cached_tokens == 0


# --- the block manager and the checkpoint pool --------------------------------------------------


def seq(seq_id: int, prompt: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, str(seq_id), prompt, SamplingParams(cache_salt=salt))


def test_blocks_are_shared_refcounted_and_evicted_least_recently_used():
    bm = BlockManager(num_blocks=6, block_size=2, prefix_caching=True)
    a = seq(0, [1, 2, 3, 4, 5])
    bm.grow(a, 5)
    a.num_computed_tokens = 3  # the second block is not all computed: not shared yet
    bm.register(a)
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = 5
    bm.register(a)
    assert bm.num_cached_blocks == 2  # the third block is partial: never registered
    b = seq(1, [1, 2, 3, 4, 9])
    blocks, hashes = bm.match(b, b.num_tokens - 1)
    assert blocks == a.block_table[:2]
    bm.acquire(b, blocks, hashes)
    bm.grow(b, 5)
    assert bm.num_used_blocks == 4
    bm.free(a)
    assert bm.num_used_blocks == 3  # the shared blocks are still held by b
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    c = seq(2, [7] * 12)
    bm.grow(c, 10)  # 5 blocks: 4 free ones, then one cached block is evicted
    assert bm.num_evicted == 1 and bm.num_cached_blocks == 1
    # the deeper block went first: [1, 2] still matches, [1, 2, 3, 4] no longer does
    d = seq(3, [1, 2, 3, 4, 5])
    assert len(bm.match(d, 4)[0]) == 1
    bm.grow(c, 12)
    assert bm.num_cached_blocks == 0 and len(bm.match(d, 4)[0]) == 0
    with pytest.raises(RuntimeError):
        bm.grow(c, 14)


def test_salted_blocks_do_not_match():
    bm = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    a = seq(0, [1, 2, 3], salt="x")
    bm.grow(a, 3)
    a.num_computed_tokens = 3
    bm.register(a)
    assert bm.match(seq(1, [1, 2, 3], salt="y"), 2)[0] == []
    assert bm.match(seq(2, [1, 2, 3]), 2)[0] == []
    assert bm.match(seq(3, [1, 2, 3], salt="x"), 2)[0] == a.block_table[:1]


def test_checkpoint_pool_is_lru_with_its_own_budget():
    pool = StateCheckpoints(first=5, num_slots=2)
    assert pool.put(11) == 5 and pool.put(12) == 6
    assert pool.put(11) is None  # already there
    assert pool.get(11) == 5  # 11 is now the most recently used
    assert pool.put(13) == 6  # overwrites 12
    assert 12 not in pool and pool.get(13) == 6 and len(pool) == 2


def test_tail_checkpoints_are_held_then_keyed():
    pool = StateCheckpoints(first=10, num_slots=4)
    assert pool.max_held == 2
    assert pool.put(1) == 10 and pool.put(2) == 11
    a, b = pool.hold(), pool.hold()
    assert {a, b} == {12, 13} and pool.hold() is None  # at most half the pool is held
    assert pool.put(3) == 10  # keyed ones are overwritten LRU first; held ones never
    assert pool.put(4) == 11 and pool.put(5) == 10 and pool.num_held == 2
    pool.bind(a, 6)
    assert pool.get(6) == a and pool.num_held == 1 and len(pool) == 3
    pool.bind(b, 5)  # 5 has a checkpoint already: b goes back free
    assert pool.num_held == 0 and pool.get(5) == 10
    assert pool.hold() == b
    pool.release(b)
    assert pool.num_held == 0 and pool.put(7) == b and 4 in pool
    # a pool of one slot has no room for tails
    assert StateCheckpoints(first=0, num_slots=1).hold() is None


# --- real tiny models ---------------------------------------------------------------------------

presets = pytest.importorskip("worker.models.presets")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-llama"])
def test_tiny_models_greedy_outputs_match_without_the_cache(preset):
    from worker.models import build_random

    config = presets.PRESETS[preset]
    model = build_random(config, "cpu", torch.float64, seed=1)
    rng = random.Random(0)
    system = [rng.randrange(config.vocab_size) for _ in range(19)]
    prompts = [system + [rng.randrange(config.vocab_size) for _ in range(2 + i)] for i in range(4)]
    prompts += [system[:6] + [1, 2]]  # shorter than the checkpoint spacing (8 tokens)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sizes = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=24)
    results = {}
    for on in (False, True):
        engine, _ = make_engine(model, **sizes, enable_prefix_caching=on)
        outs = [engine.generate([p], params)[0] for p in prompts]
        results[on] = ([o.new_token_ids for o in outs], [o.usage.cached_tokens for o in outs])
    assert results[True][0] == results[False][0]
    assert results[False][1] == [0] * 5
    hybrid = preset == "tiny-qwen3.5"
    # 19 shared tokens: 4 full blocks; the hybrid resumes at its checkpoint at 16 tokens too
    assert results[True][1] == [0, 16, 16, 16, 0 if hybrid else 4]


def test_overlapped_decode_registers_only_settled_tokens():
    # Padded, overlapped decode feeds tokens the host has not read yet: blocks holding one are
    # registered only once it settles, and a later prompt continuing the output still matches.
    engine, _ = make_engine(pad_decode=True, overlap_decode=True, prefix_checkpoint_slots=8)
    assert engine.overlap_decode
    prompt = tokens(13, 9)
    first = run_one(engine, prompt)
    assert first.new_token_ids == greedy_reference(prompt, 8)
    follow = prompt + first.new_token_ids + [5]  # a next turn: prompt, answer, more
    out = run_one(engine, follow)
    assert out.new_token_ids == greedy_reference(follow, 8)
    # the first request's tail checkpoint: 13 + 8 - 1 = 20 tokens computed (its last token was
    # sampled, never fed), a block boundary reached while decoding with a token in flight
    assert out.usage.cached_tokens == 20
    # but the KV blocks of the answer's settled tokens are registered and match
    blocks, _ = engine.block_manager.match(Sequence(99, "x", follow, GREEDY), len(follow) - 1)
    assert len(blocks) >= 4


def test_the_backend_salts_the_prefix_cache_by_tenant(tokenizer) -> None:  # noqa: F811
    """Through the worker's backend: a tenant's second request reuses its first one's blocks;
    another tenant's same prompt reuses nothing."""
    import asyncio

    from tests.worker.test_structured import NoiseLM
    from tests.worker.test_tool_calls import request
    from worker import protocol as p
    from worker.backends.torch_runtime import TorchRuntimeBackend
    from worker.engine.async_engine import AsyncLLMEngine

    backend = TorchRuntimeBackend("unused", max_model_len=2048)

    class CheckpointNoiseLM(NoiseLM):  # its state slots copyable, as the real models' are
        def allocate_cache(self, num_blocks, block_size, num_state_slots, kv_dtype, device, **kw):
            return CheckpointCache(num_blocks, block_size, num_state_slots, device)

    model = CheckpointNoiseLM(tokenizer.vocab_size, next(iter(tokenizer.eos_token_ids)))
    config = EngineConfig(
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        enable_prefix_caching=True,
        prefix_checkpoint_blocks=1,
    )
    backend.engine = AsyncLLMEngine(LLMEngine(model, tokenizer, config))
    backend.tokenizer = tokenizer
    prompt = [p.ChatMessage("user", "tell me about the weather in Rome " * 12)]

    async def cached(tenant: str, rid: str) -> int:
        sampling = p.SamplingParams(temperature=0, max_tokens=2)
        req = request(request_id=rid, tenant_id=tenant, messages=prompt, sampling=sampling)
        return [x async for x in backend.generate(req)][-1].cached_tokens

    async def run() -> tuple[int, int, int]:
        try:
            return await cached("t-a", "r1"), await cached("t-a", "r2"), await cached("t-b", "r3")
        finally:
            await backend.close()

    first, again, other = asyncio.run(run())
    assert first == 0 and again > 0 and other == 0


@pytest.mark.parametrize(
    "pairs",
    [[(0, 3)], [(0, 3), (1, 4), (2, 5)], [(0, 3), (3, 4)], [(0, 3), (1, 3)]],
    ids=["one", "batched", "chained", "same-destination"],
)
def test_model_cache_copies_state_slots_in_order(pairs):
    from worker.models import build_random

    model = build_random(presets.PRESETS["tiny-qwen3.5"], "cpu", torch.float32, seed=0)
    cache = model.allocate_cache(2, 4, 6, torch.float32, "cpu", state_dtype=torch.float32)
    states = [e for e in cache.layers if hasattr(e, "recurrent_state")]
    assert states
    for e in states:
        e.recurrent_state.copy_(torch.randn_like(e.recurrent_state))
        e.conv_state.copy_(torch.randn_like(e.conv_state))
    expected = []
    for e in states:  # the reference: one copy after another
        r, c = e.recurrent_state.clone(), e.conv_state.clone()
        for src, dst in pairs:
            r[dst], c[dst] = r[src], c[src]
        expected.append((r, c))
    cache.copy_state_slots(pairs)
    for e, (r, c) in zip(states, expected, strict=True):
        assert torch.equal(e.recurrent_state, r) and torch.equal(e.conv_state, c)


@pytest.mark.parametrize(
    "scale",
    [pytest.param(1, marks=pytest.mark.slow, id="full-size"), pytest.param(4, id="quarter")],
)
def test_the_multi_turn_bench_reports_its_bound(scale):
    """bench/engine/multi_turn.py's workload through the engine config it runs on the GPU (16
    conversations x 6 turns, 16-token blocks): the reported cached fraction is exactly the
    bench's `reachable` (nothing evicted), each turn 16 tokens short of the shared prefix."""
    from bench.engine import multi_turn as bench

    system, users = bench.workload(VOCAB, seed=0, scale=scale)
    ckpt = bench.CHECKPOINT_BLOCKS // scale
    config = EngineConfig(
        block_size=bench.BLOCK,
        max_num_seqs=bench.CONVERSATIONS,
        max_num_batched_tokens=8192,
        max_model_len=16_384,
        enable_prefix_caching=True,
        prefix_checkpoint_blocks=ckpt,
        prefix_checkpoint_slots=4 * bench.CONVERSATIONS,
    )
    engine = LLMEngine(CheckpointFake(), None, config)
    point = bench.run(engine, system, users, bench.OUTPUT // scale, ckpt)
    assert point["reported_cached_fraction"] == point["reachable_fraction"]
    prompts = sum(
        len(system) + t * (len(users[0][0]) + bench.OUTPUT // scale) + len(users[0][0])
        for t in range(1, bench.TURNS)
    )
    short = bench.BLOCK * (bench.TURNS - 1) / prompts
    assert point["shared_fraction"] - point["reachable_fraction"] == pytest.approx(short)
    if scale == 1:
        assert point["shared_fraction"] == pytest.approx(0.8857, abs=1e-4)
        assert point["reported_cached_fraction"] == pytest.approx(0.8821, abs=1e-4)
