"""The fixed-shape decode path (what CUDA graphs replay) run eagerly on CPU: padding a decode
batch to the captured size, with padded rows on a scratch KV block and state slot, must give the
same tokens and logits as the exactly sized step, and must never touch another sequence's state."""

from __future__ import annotations

import random

import pytest
import torch

from tests.worker.helpers import small_engine
from worker.engine.runner import padded_sizes
from worker.engine.sequence import SamplingParams

presets = pytest.importorskip("worker.models.presets")
from worker.models import build_random  # noqa: E402
from worker.models.cache import AttentionCache  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_padded_sizes():
    assert padded_sizes(1) == [1]
    assert padded_sizes(5) == [1, 2, 4, 5]
    assert padded_sizes(8) == [1, 2, 4, 8]


def serve(model, pad: bool, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    engine = small_engine(model, max_num_seqs=5, pad_decode=pad)
    assert (engine.runner.decode_inputs is not None) == pad
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:3]]  # 3 decodes pad to 4
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or len(ids) < len(prompts):
        step += 1
        if step == 4:  # join mid-way: 5 in flight, then they leave at different times
            ids += [engine.add_request(p, params) for p in prompts[3:]]
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-llama"])
def test_padded_decode_equals_unpadded(preset):
    config = presets.PRESETS[preset]
    model = build_random(config, "cpu", torch.float64, seed=3)
    rng = random.Random(1)
    prompts = [
        [rng.randrange(config.vocab_size) for _ in range(rng.randint(2, 20))] for _ in range(5)
    ]
    assert serve(model, True, prompts) == serve(model, False, prompts)


def tensors_of(layer: object) -> list[torch.Tensor]:
    return [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]


def test_padded_rows_write_only_scratch():
    config = presets.PRESETS["tiny-qwen3.5"]
    model = build_random(config, "cpu", torch.float64, seed=4)
    engine = small_engine(model, max_model_len=32, pad_decode=True)
    runner = engine.runner
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10]):
        engine.add_request(prompt, params)
    engine.step()  # prefill all three
    batch = engine.scheduler.schedule()
    assert not batch.prefills and len(batch.decodes) == 3
    used_slots = {e.seq.state_slot for e in batch.decodes}
    used_blocks = {b for e in batch.decodes for b in e.seq.block_table}
    before = [[t.clone() for t in tensors_of(layer)] for layer in runner.cache.layers]

    unpadded_ids, unpadded_meta = runner.prepare(batch)
    with torch.inference_mode():
        expected = runner._logits(unpadded_ids, unpadded_meta)
        for layer, saved in zip(runner.cache.layers, before, strict=True):  # undo that step
            for t, s in zip(tensors_of(layer), saved, strict=True):
                t.copy_(s)
        logits = runner.decode_logits(batch)  # padded to 4 rows
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)

    inputs = runner.decode_inputs
    assert inputs is not None
    for layer, saved in zip(runner.cache.layers, before, strict=True):
        is_kv = isinstance(layer, AttentionCache)
        # KV caches change only in this batch's blocks and the scratch block; state pools only
        # in this batch's slots and the scratch slot (which the padded row did write).
        scratch = inputs.scratch_block if is_kv else inputs.scratch_slot
        allowed = (used_blocks if is_kv else used_slots) | {scratch}
        for t, s in zip(tensors_of(layer), saved, strict=True):
            changed = set((t != s).flatten(1).any(1).nonzero().flatten().tolist())
            assert changed <= allowed
            assert scratch in changed


def test_fill_stages_each_table_padded_with_the_scratch_block():
    """Rows shorter than the longest table end in the scratch block; padding rows are all
    scratch; a longer table staged before in the same buffer set is overwritten up to the width."""
    from worker.engine.runner import DecodeInputs
    from worker.engine.scheduler import ScheduledBatch, ScheduledSeq
    from worker.engine.sequence import Sequence

    inputs = DecodeInputs(4, 8, 4, scratch_block=99, scratch_slot=7, device=torch.device("cpu"))

    def batch(*tables: list[int]) -> ScheduledBatch:
        decodes = []
        for i, table in enumerate(tables):
            s = Sequence(i, f"r{i}", list(range(1, 4 * len(table))), SamplingParams())
            s.block_table, s.state_slot = list(table), i
            decodes.append(ScheduledSeq(s, 4 * len(table) - 2, 1, True))
        return ScheduledBatch(step=1, decodes=decodes)

    inputs.fill(batch([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]), 2)
    inputs.fill(batch([8]), 2)  # the other buffer set
    inputs.fill(batch([10, 11, 12], [13]), 3)  # back to the first: shorter tables this time
    tables = inputs.host["block_tables"]
    assert tables[0, :3].tolist() == [10, 11, 12]
    assert tables[1, :3].tolist() == [13, 99, 99]
    assert tables[2].tolist() == [99] * 8
    assert torch.equal(inputs.device_buffers["block_tables"][:3, :3], tables[:3, :3])
