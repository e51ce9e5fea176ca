"""Token embedding rows gathered by a kernel, from a table on the GPU or in pinned host memory.

A pinned host tensor's address is valid on the GPU (unified addressing), so the same kernel reads
the rows over PCIe without a copy or a host sync, inside a captured decode graph: a decode step
reads T x H x 2 bytes of a table it no longer holds (the 27B's 2.37 GiB, `HostEmbedding`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel, pdl_wait


@kernel
def _embedding_kernel(out, ids, table, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    row = tl.load(ids + t).to(tl.int64)
    tl.store(out + t * H + cols, tl.load(table + row * H + cols, mask=mask), mask=mask)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of `table` [V, H] (contiguous; on ids' GPU or pinned host memory)."""
    host = ids.device.type == "cuda" and table.device.type == "cpu"
    if not table.is_contiguous() or (host and not table.is_pinned()):
        raise ValueError("the embedding table must be contiguous, on ids' GPU or pinned")
    tokens, hidden = ids.shape[0], table.shape[1]
    out = torch.empty((tokens, hidden), dtype=table.dtype, device=ids.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _embedding_kernel[(tokens, triton.cdiv(hidden, block))](
            out, ids, table, hidden, BLOCK=block, num_warps=4
        )
    return out
