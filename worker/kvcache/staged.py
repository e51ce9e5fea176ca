"""A full-attention layer over staged pages (worker/models/cache.py StagedAttentionCache), and the
executor's half of restaging (the block manager decides which pages move; this re-encodes them).

The rotation is folded into the layer, not the pages: q, k and v are rotated once per head as
they are projected (`ops.rotate_qkv`, one launch for the three), recent pages store rotated
FP8, compressed pages rotated codes, and the attention output (a softmax-weighted sum of
rotated values) is un-rotated once per head, with the layer's gate (`ops.unrotate_sigmoid_mul`).
No page is ever rotated back on read.
"""

from __future__ import annotations

import torch

from worker.engine.batch import BatchMetadata, index_on
from worker.kernels import ops
from worker.models.cache import StagedAttentionCache


def to_rotated(x: torch.Tensor, cache: StagedAttentionCache) -> torch.Tensor:
    """x [..., D] in the cache's rotated basis, in x's dtype (a 16-bit GEMM where the rotation
    is exact in 16 bits, else through fp32)."""
    r = cache.rotation_for(x.dtype)
    return x @ r if r is not None else (x.float() @ cache.rotation).to(x.dtype)


def from_rotated(y: torch.Tensor, cache: StagedAttentionCache) -> torch.Tensor:
    r = cache.rotation_for(y.dtype)
    return y @ r.T if r is not None else (y.float() @ cache.rotation.T).to(y.dtype)


def staged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    meta: BatchMetadata,
    cache: StagedAttentionCache,
    scale: float,
) -> torch.Tensor:
    """Write this step's k, v [T, Hkv, D] into their (recent) pages and attend q [T, Hq, D]
    (after rotary) over each sequence's mixed pages: prefill chunks first, then decodes, as
    BatchMetadata orders them. Returns [T, Hq * D] in q's dtype and basis, times sigmoid(gate)
    where the layer has a gate [T, Hq, D]. Where the rotation is exact in the heads' 16-bit
    dtype, q, k and v enter the pages' basis in one launch and the output leaves it in the
    gate's (four GEMMs a layer, 2.6 us each on one H200, were most of the staged decode step's
    extra time)."""
    r = cache.rotation_for(q.dtype)
    if r is not None:
        q_rot, k_rot, v_rot = ops.rotate_qkv(q, k, v, r)
    else:
        q_rot, k_rot, v_rot = (to_rotated(x, cache) for x in (q, k, v))
    ops.write_kv_cache(
        k_rot,
        v_rot,
        cache.k_cache,
        cache.v_cache,
        meta.slot_mapping,
        cache.k_scale,
        cache.v_scale,
    )
    p = meta.num_prefills
    split = sum(meta.query_lens[:p])
    parts = []
    if p:
        parts.append(
            ops.staged_attention_prefill(
                q_rot[:split],
                cache,
                meta.cu_seqlens[: p + 1],
                meta.context_lens[:p],
                meta.block_tables[:p],
                meta.positions[:split],
                scale,
            )
        )
    if len(meta.query_lens) > p:
        parts.append(
            ops.staged_attention_decode(
                q_rot[split:], cache, meta.context_lens[p:], meta.block_tables[p:], scale
            )
        )
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    if r is not None:
        return ops.unrotate_sigmoid_mul(out, gate, r)
    out = from_rotated(out, cache).reshape(out.shape[0], -1)
    return out if gate is None else ops.sigmoid_mul(out, gate)


def restage(
    caches: list[StagedAttentionCache], moves: list[tuple[int, int]], device: torch.device | str
) -> None:
    """Re-encode the (recent block, compressed block id) pairs `BlockManager.restage` returned,
    in every staged layer: one launch per layer for the whole step's pages."""
    if not moves or not caches:
        return
    recent_blocks = caches[0].num_recent_blocks
    # one copy: the recent blocks, then the compressed pool indices, each row contiguous and
    # int32 as the re-encode kernel reads them (no conversion launches per layer)
    values = [r for r, _ in moves] + [c - recent_blocks for _, c in moves]
    src, dst = index_on(device, values, torch.int32).view(2, -1)
    for cache in caches:
        ops.turboquant_restage(cache, src, dst)
