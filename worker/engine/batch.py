"""Metadata of one forward step, handed from the runner (decide side) to the model (execute side).

Built by `worker.engine.runner` from a plain-Python `ScheduledBatch`; the layout is the contract in
docs/worker-contract.md. Tokens of all sequences are flat (varlen): prefill chunks first, then
single-token decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchMetadata:
    seq_ids: list[int]  # B sequences, prefill chunks first, then decodes
    num_prefills: int  # the first num_prefills entries are prefill chunks (query_len >= 1)
    query_lens: list[int]  # tokens fed this step per sequence
    context_lens: torch.Tensor  # [B] int32: tokens in the KV cache for the sequence AFTER this step
    cu_seqlens: (
        torch.Tensor
    )  # [B+1] int32: offsets of each sequence's tokens in the flat token axis
    positions: torch.Tensor  # [T] int64 absolute positions of the fed tokens
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (lengths from context_lens)
    state_slots: torch.Tensor  # [B] int64: DeltaNet recurrent/conv state slot of each sequence
    has_initial_state: torch.Tensor  # [B] bool: False for a sequence's first chunk (zero the state)
    logits_indices: torch.Tensor  # [B] int64 index in T of each sequence's last fed token

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_decodes(self) -> int:
        return len(self.seq_ids) - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def index_on(
    device: torch.device | str, values: list[int], dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """`values` as an index tensor on `device`, from pinned memory on a GPU: a copy from
    pageable memory would make the host wait for the forward queued before it (overlapped
    decode queues the next step's work behind it)."""
    index = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)
