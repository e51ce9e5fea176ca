"""Test doubles for the engine: a fake CausalLM obeying docs/worker-contract.md, and a tokenizer.

The fake's next token is a deterministic function of the whole context, computed from BOTH
of its caches: a per-sequence running hash kept in a state slot (like DeltaNet's recurrent
state) and the sum of the context's tokens read back through the paged KV cache. Both pools
start filled with garbage and are never cleaned, so a wrong slot mapping, block table, state
slot, has_initial_state or position changes the tokens, and `next_token` (plain Python over the
token list) is the reference any engine run must reproduce.
"""

from __future__ import annotations

import time

import torch

from worker.engine.batch import BatchMetadata

VOCAB = 97
_PRIME = 1_000_003
_GARBAGE = 123_457


def _mix(h: int, token: int) -> int:
    return (h * 31 + token + 1) % _PRIME


def _token_from(h: int, kv_sum: int, num_tokens: int) -> int:
    return (h + 7 * kv_sum + num_tokens) % VOCAB


def next_token(tokens: list[int]) -> int:
    """The reference: the fake model's greedy next token after `tokens`."""
    h = 0
    for t in tokens:
        h = _mix(h, t)
    return _token_from(h, sum(tokens), len(tokens))


def greedy_reference(prompt: list[int], max_tokens: int, stop_ids: frozenset[int] = frozenset()):
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if t in stop_ids:
            break
    return out


class FakeCache:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, device) -> None:
        self.block_size = block_size
        self.kv = torch.full((num_blocks, block_size), _GARBAGE, dtype=torch.int64, device=device)
        self.state = torch.full((num_state_slots,), _GARBAGE, dtype=torch.int64, device=device)

    def kv_bytes_per_token(self) -> int:
        return 8

    def state_bytes_per_sequence(self) -> int:
        return 8


class FakeCausalLM(torch.nn.Module):
    """Set `fail_on_step` to make forward raise (a failing device step), `step_delay` (seconds)
    to make steps slow."""

    def __init__(self, step_delay: float = 0.0) -> None:
        super().__init__()
        self.step_delay = step_delay
        self.steps = 0
        self.fail_on_step: int | None = None
        self.batches: list[BatchMetadata] = []

    def allocate_cache(
        self, num_blocks, block_size, num_state_slots, kv_dtype, device, state_dtype=None
    ):
        return FakeCache(num_blocks, block_size, num_state_slots, device)

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, cache: FakeCache):
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_on_step == self.steps:
            raise RuntimeError("device fell over")
        self.batches.append(meta)
        _check_layout(input_ids, meta)
        cache.kv.view(-1)[meta.slot_mapping] = input_ids  # write before read, like attention
        out = torch.zeros(input_ids.shape[0], dtype=torch.int64)
        cu = meta.cu_seqlens.tolist()
        for b in range(meta.num_seqs):
            slot = int(meta.state_slots[b])
            h = int(cache.state[slot]) if bool(meta.has_initial_state[b]) else 0
            ctx = int(meta.context_lens[b])
            pos = torch.arange(ctx)
            table = meta.block_tables[b].long()
            context = cache.kv.view(-1)[
                table[pos // cache.block_size] * cache.block_size + pos % cache.block_size
            ]
            kv_sums = torch.cumsum(context, 0)
            for i in range(cu[b], cu[b + 1]):
                h = _mix(h, int(input_ids[i]))
                p = int(meta.positions[i])
                out[i] = _token_from(h, int(kv_sums[p]), p + 1)
            cache.state[slot] = h
        # Hidden = logits: the chosen token stands out, the rest vary so sampling has choices.
        ramp = torch.sin(torch.arange(VOCAB, dtype=torch.float32)[None, :] * (out[:, None] % 7 + 1))
        return ramp + 5.0 * torch.nn.functional.one_hot(out, VOCAB).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()


def _check_layout(input_ids: torch.Tensor, meta: BatchMetadata) -> None:
    """The invariants of BatchMetadata that the contract states."""
    b, t = meta.num_seqs, input_ids.shape[0]
    assert meta.context_lens.dtype == torch.int32 and meta.context_lens.shape == (b,)
    assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.shape == (b + 1,)
    assert meta.positions.dtype == torch.int64 and meta.positions.shape == (t,)
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.shape == (t,)
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape[0] == b
    assert meta.state_slots.dtype == torch.int64 and meta.has_initial_state.dtype == torch.bool
    assert meta.logits_indices.tolist() == [c - 1 for c in meta.cu_seqlens[1:].tolist()]
    assert sum(meta.query_lens) == t == int(meta.cu_seqlens[-1])
    for i, q in enumerate(meta.query_lens):
        last = int(meta.positions[int(meta.cu_seqlens[i + 1]) - 1])
        assert last + 1 == int(meta.context_lens[i])
        if i >= meta.num_prefills:  # decodes: one token on top of existing state
            assert q == 1 and bool(meta.has_initial_state[i])
    # padding rows of a padded decode step (context 1 on top of nothing) share the runner's
    # scratch slot and scratch block; real rows never share
    real = [i for i in range(b) if not _is_padding(meta, i)]
    assert len({int(meta.state_slots[i]) for i in real}) == len(real)
    real_tokens = [int(meta.cu_seqlens[i]) for i in real] if meta.num_prefills == 0 else range(t)
    assert len({int(meta.slot_mapping[i]) for i in real_tokens}) == len(real_tokens)


def _is_padding(meta: BatchMetadata, row: int) -> bool:
    return (
        row >= meta.num_prefills
        and int(meta.context_lens[row]) == 1
        and int(meta.positions[int(meta.cu_seqlens[row])]) == 0
    )


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); 256 is EOS. Multi-byte characters span tokens."""

    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
