"""Staged KV pages: the block manager's restaging decisions (plain Python), the references over
mixed FP8 / TurboQuant pages, the layer helper, and the Triton kernels under the interpreter
(compiled on CUDA with `-m gpu`)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.worker.numerics import rel_err  # noqa: E402
from worker.engine.block_manager import BlockManager, staged_pool_blocks  # noqa: E402
from worker.engine.sequence import SamplingParams, Sequence  # noqa: E402
from worker.kernels import reference  # noqa: E402
from worker.kernels.reference import cu_seqlens_of  # noqa: E402
from worker.models.cache import StagedAttentionCache  # noqa: E402

FP8 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def seq(i: int = 0) -> Sequence:
    return Sequence(i, f"r{i}", [1], SamplingParams())


# ---------------------------------------------------------------- decide: which pages move


def grown(bm: BlockManager, s: Sequence, tokens: int, step: int) -> Sequence:
    start = len(s.block_table) * bm.block_size
    bm.grow(s, tokens)
    bm.record_write(s, min(start, tokens), tokens, step)
    return s


def test_stale_pages_skip_anchors_window_and_fresh_writes():
    bm = BlockManager(16, 4, num_compressed_blocks=16, window_pages=3, anchor_pages=1)
    s = grown(bm, seq(), 40, step=1)  # 10 pages written at step 1 (a prefill chunk)
    assert bm.stale_pages(s, step=1) == []  # written this step: the forward has not run
    assert bm.stale_pages(s, step=2) == [1, 2, 3, 4, 5, 6]  # not page 0, not the last 3
    moves = bm.restage([s], step=2)
    assert len(moves) == 6
    assert all(bm.is_compressed(b) for b in s.block_table[1:7])
    assert not any(bm.is_compressed(b) for b in [s.block_table[0], *s.block_table[7:]])
    assert bm.num_free_blocks == 16 - 4 and bm.num_free_compressed_blocks == 10
    assert bm.restage([s], step=3) == []  # nothing new aged out


def test_restage_moves_pairs_and_frees_recent_blocks():
    bm = BlockManager(8, 2, num_compressed_blocks=4, window_pages=1, anchor_pages=0)
    s = grown(bm, seq(), 8, step=1)  # 4 pages
    before = list(s.block_table)
    moves = bm.restage([s], step=2)
    assert [m[0] for m in moves] == before[:3]
    assert [m[1] for m in moves] == s.block_table[:3] and all(m[1] >= 8 for m in moves)
    assert s.block_table[3] == before[3]
    # the freed recent blocks serve growth again, the compressed ones never do
    other = grown(bm, seq(1), 14, step=2)
    assert not any(bm.is_compressed(b) for b in other.block_table)
    bm.free(s)
    assert bm.num_free_compressed_blocks == 4 and bm.num_free_blocks == 1  # s's last page
    with pytest.raises(RuntimeError, match="twice"):
        bm._release(moves[0][1])


def test_decode_growth_ages_pages_out_one_at_a_time():
    bm = BlockManager(8, 4, num_compressed_blocks=8, window_pages=2, anchor_pages=1)
    s = grown(bm, seq(), 4, step=1)
    moved = []
    for step in range(2, 40):  # one token per step
        moved += bm.restage([s], step)
        n = step + 3
        bm.grow(s, n)
        bm.record_write(s, n - 1, n, step)
    # 42 tokens = 11 pages: page 0 anchored, the last 2 in the window, 8 compressed
    assert len(s.block_table) == 11 and len(moved) == 8
    assert [bm.is_compressed(b) for b in s.block_table] == [False] + [True] * 8 + [False] * 2
    assert bm.num_free_blocks == 8 - 3


def test_restage_stops_at_the_limit_and_when_the_compressed_pool_is_full():
    bm = BlockManager(32, 2, num_compressed_blocks=5, window_pages=1, anchor_pages=0)
    a, b = grown(bm, seq(0), 10, step=1), grown(bm, seq(1), 10, step=1)
    assert len(bm.restage([a, b], step=2, max_pages=3)) == 3
    moves = bm.restage([a, b], step=2)
    assert len(moves) == 2 and bm.num_free_compressed_blocks == 0  # a's 4th, then b's 1st
    assert sum(bm.is_compressed(x) for x in a.block_table) == 4
    assert sum(bm.is_compressed(x) for x in b.block_table) == 1
    assert bm.restage([a, b], step=3) == []  # stays FP8 until compressed blocks free up


def brute_force_stale_pages(bm: BlockManager, s: Sequence, step: int) -> list[int]:
    """`stale_pages` by its definition: every page past the anchors and before the window that
    is recent and old enough."""
    table = s.block_table
    return [
        i
        for i in range(bm.anchor_pages, len(table) - bm.window_pages)
        if not bm.is_compressed(table[i]) and step - bm.last_write_step[table[i]] >= bm.min_age
    ]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["prefill", "decode", "restage", "free"]),
            st.integers(0, 3),
            st.integers(1, 40),
        ),
        max_size=60,
    ),
    st.integers(0, 12),
    st.integers(1, 3),
)
def test_stale_pages_agree_with_their_definition(ops: list[tuple[str, int, int]], pool: int, window: int):  # fmt: skip
    """Random prefill chunks, decode tokens, restages (a small compressed pool that runs out,
    page limits) and frees of four sequences: at every step the bisection finds the pages the
    definition does."""
    bm = BlockManager(400, 4, num_compressed_blocks=pool, window_pages=window, anchor_pages=1)
    seqs = [seq(i) for i in range(4)]
    written = [0] * 4  # tokens each sequence holds
    for step, (op, who, n) in enumerate(ops, start=1):
        s = seqs[who]
        if op in ("prefill", "decode"):
            end = written[who] + (n if op == "prefill" else 1)
            if bm.num_new_blocks(s, end) > bm.num_free_blocks:
                continue
            bm.grow(s, end)
            bm.record_write(s, written[who], end, step)
            written[who] = end
        elif op == "restage":
            bm.restage(seqs, step, max_pages=n % 5 or None)
        else:
            bm.free(s)
            written[who] = 0
        for t in seqs:
            for later in (step, step + 1, step + 5):
                assert bm.stale_pages(t, later) == brute_force_stale_pages(bm, t, later)


def test_without_compressed_blocks_nothing_moves():
    bm = BlockManager(8, 2)
    s = grown(bm, seq(), 16, step=1)
    assert bm.restage([s], step=9) == [] and bm.num_free_compressed_blocks == 0


def test_staged_pool_blocks_split_a_budget():
    recent, compressed = staged_pool_blocks(10_000_000, 1000, 400, 4, 16, 256, 8, 1)
    assert recent == 4 * 10 + (16 + 4)
    assert compressed == (10_000_000 - recent * 1000) // 400
    with pytest.raises(ValueError, match="recent pages"):
        staged_pool_blocks(1000, 1000, 400, 4, 16, 256)


# ---------------------------------------------------------------- execute: references


def staged_case(
    contexts: list[int],
    compressed_fraction: float,
    hq: int = 4,
    hkv: int = 2,
    dim: int = 64,
    block_size: int = 4,
    device: str = "cpu",
    kv_dtype: torch.dtype = FP8,
    k_bits: int = 4,
    v_bits: int = 3,
    seed: int = 0,
):
    """A staged cache holding rotated K/V of random contexts, a fraction of each sequence's
    pages compressed (by the reference restage), scattered blocks; and the exact (fp32,
    unrotated) keys and values per sequence."""
    torch.manual_seed(seed)
    pages = [-(-n // block_size) for n in contexts]
    recent, comp = sum(pages) + 2, sum(pages) + 1
    cache = StagedAttentionCache.allocate(
        recent, comp, block_size, hkv, dim, k_bits, v_bits, kv_dtype, device
    )
    cache.k_scale, cache.v_scale = 0.5, 0.25
    free = torch.randperm(recent).tolist()
    tables = torch.zeros(len(contexts), max(pages) + 1, dtype=torch.int32)
    exact, moves = [], []
    next_comp = iter(torch.randperm(comp).tolist())
    for b, n in enumerate(contexts):
        k = torch.randn(n, hkv, dim, device=device) * 2
        v = torch.randn(n, hkv, dim, device=device)
        blocks = [free.pop() for _ in range(pages[b])]
        slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(n)],
            device=device,
        )
        rot = cache.rotation
        reference.write_kv_cache(
            k @ rot, v @ rot, cache.k_cache, cache.v_cache, slots, cache.k_scale, cache.v_scale
        )
        for i, block in enumerate(blocks):
            if i < round(compressed_fraction * pages[b]):
                c = next(next_comp)
                moves.append((block, c))
                blocks[i] = recent + c
        tables[b, : pages[b]] = torch.tensor(blocks)
        exact.append((k, v))
    if moves:
        src, dst = torch.tensor(moves, device=device).T
        reference.turboquant_restage(cache, src, dst)
    return cache, tables.to(device), exact


def exact_decode(q: torch.Tensor, exact, scale: float) -> torch.Tensor:
    out = []
    for b, (k, v) in enumerate(exact):
        n = k.shape[0]
        out.append(reference._attend(q[b : b + 1], k, v, torch.tensor([n - 1]), scale)[0])
    return torch.stack(out)


def test_restage_reference_encodes_what_the_recent_page_held():
    cache, tables, exact = staged_case([12], 0.0)
    k, _ = exact[0]
    block = int(tables[0, 1])
    reference.turboquant_restage(cache, torch.tensor([block]), torch.tensor([2]))
    got = reference._staged_vectors(
        cache,
        torch.full((4,), cache.num_recent_blocks + 2),
        torch.arange(4),
        value=False,
    )
    want = k[4:8] @ cache.rotation
    assert 0.03 < rel_err(got, want) < 0.15  # 4-bit codes of FP8 pages: lossy, not garbage


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_staged_decode_reference_tracks_exact_attention(fraction: float):
    cache, tables, exact = staged_case([5, 17, 9], fraction)
    scale = 64**-0.5
    q = torch.randn(3, 4, 64)
    out = reference.staged_attention_decode(
        q @ cache.rotation, cache, torch.tensor([5, 17, 9]), tables, scale
    )
    err = rel_err(out @ cache.rotation.T, exact_decode(q, exact, scale))
    # FP8 pages alone ~3%; 4-bit keys / 3-bit values add ~10-20% on random data
    assert err < (0.06 if fraction == 0 else 0.3), err


def test_staged_prefill_reference_matches_decode_on_last_rows():
    cache, tables, _ = staged_case([6, 11], 0.5)
    q = torch.randn(6 + 11, 4, 64)
    cu = cu_seqlens_of([6, 11])
    positions = torch.cat([torch.arange(6), torch.arange(11)])
    ctx = torch.tensor([6, 11])
    out = reference.staged_attention_prefill(q, cache, cu, ctx, tables, positions, 0.125)
    last = reference.staged_attention_decode(q[[5, 16]], cache, ctx, tables, 0.125)
    assert rel_err(out[[5, 16]], last) < 1e-5
    # a row only sees its prefix: row 2 equals a decode over a context of 3
    early = reference.staged_attention_decode(q[[2]], cache, ctx[:1] - 3, tables[:1], 0.125)
    assert rel_err(out[2], early[0]) < 1e-5


def test_scratch_gathers_both_kinds_of_page():
    cache, tables, _ = staged_case([7, 10], 0.5)
    keys, values, scratch_tables = reference.staged_scratch(cache, tables, torch.float32)
    q = torch.randn(2, 4, 64)
    ctx = torch.tensor([7, 10])
    via_scratch = reference.paged_attention_decode(q, keys, values, ctx, scratch_tables, 0.125)
    direct = reference.staged_attention_decode(q, cache, ctx, tables, 0.125)
    assert rel_err(via_scratch, direct) < 1e-5


# ---------------------------------------------------------------- layer helper


def test_staged_attention_layer_equals_plain_attention_without_compression():
    from worker.engine.batch import BatchMetadata
    from worker.kvcache.staged import staged_attention

    torch.manual_seed(3)
    hq, hkv, dim, bs = 4, 2, 64, 4
    prefix, chunk = 6, 5
    cache = StagedAttentionCache.allocate(8, 4, bs, hkv, dim, kv_dtype=torch.float32)
    plain_k = torch.zeros(8, bs, hkv, dim)
    plain_v = torch.zeros(8, bs, hkv, dim)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    k = torch.randn(prefix + chunk, hkv, dim)
    v = torch.randn(prefix + chunk, hkv, dim)
    q = torch.randn(prefix + chunk, hq, dim)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(prefix + chunk)])
    outs = []
    for lo, hi in ((0, prefix), (prefix, prefix + chunk)):
        meta = BatchMetadata(
            seq_ids=[0],
            num_prefills=1,
            query_lens=[hi - lo],
            context_lens=torch.tensor([hi], dtype=torch.int32),
            cu_seqlens=cu_seqlens_of([hi - lo]),
            positions=torch.arange(lo, hi),
            slot_mapping=slots[lo:hi],
            block_tables=table,
            state_slots=torch.zeros(1, dtype=torch.int64),
            has_initial_state=torch.tensor([lo > 0]),
            logits_indices=torch.tensor([hi - lo - 1]),
        )
        outs.append(staged_attention(q[lo:hi], k[lo:hi], v[lo:hi], None, meta, cache, 0.125))
        reference.write_kv_cache(k[lo:hi], v[lo:hi], plain_k, plain_v, slots[lo:hi])
    want = reference.paged_attention_prefill(
        q,
        plain_k,
        plain_v,
        cu_seqlens_of([prefix + chunk]),
        torch.tensor([prefix + chunk]),
        table,
        torch.arange(prefix + chunk),
        0.125,
    )
    assert rel_err(torch.cat(outs), want.reshape(prefix + chunk, -1)) < 1e-5
    # stored rotated: the recent page is not the plain k
    assert rel_err(cache.k_cache[5, 0], k[0]) > 0.5


def test_restage_helper_converts_block_ids_in_every_layer():
    from worker.kvcache.staged import restage

    caches = [staged_case([8], 0.0, seed=s)[0] for s in (0, 1)]
    recent = caches[0].num_recent_blocks
    block = 3
    restage(caches, [(block, recent + 1)], "cpu")
    for cache in caches:
        got = reference._staged_vectors(
            cache, torch.full((4,), recent + 1), torch.arange(4), value=True
        )
        want = cache.v_cache[block].float() * cache.v_scale
        assert rel_err(got, want) < 0.25


# ---------------------------------------------------------------- triton kernels


def triton_module():
    pytest.importorskip("triton")
    from worker.kernels.triton import turboquant

    return turboquant


def check_restage(
    device: str, hkv: int, dim: int, block_size: int, k_bits: int, v_bits: int,
    strided: bool = False,
):  # fmt: skip
    tq_kernels = triton_module()
    cache, tables, _ = staged_case(
        [3 * block_size], 0.0, 2 * hkv, hkv, dim, block_size, device, k_bits=k_bits, v_bits=v_bits
    )
    expected = StagedAttentionCache(**{**cache.__dict__})
    expected.k_codes, expected.v_codes = cache.k_codes.clone(), cache.v_codes.clone()
    expected.k_norms, expected.v_norms = cache.k_norms.clone(), cache.v_norms.clone()
    src = tables[0, [2, 0, 1]].long()  # written pages
    dst = torch.tensor([1, 3, 0], device=device)
    reference.turboquant_restage(expected, src, dst)
    if strided:  # int32 columns of one [pages, 2] tensor, as pairs of moves would be
        pairs = torch.stack([src, dst], 1).to(torch.int32)
        src, dst = pairs[:, 0], pairs[:, 1]
    tq_kernels.turboquant_restage(cache, src, dst)
    assert rel_err(cache.k_norms, expected.k_norms) < 1e-3
    assert rel_err(cache.v_norms, expected.v_norms) < 1e-3
    for bits, got, want in (
        (k_bits, cache.k_codes, expected.k_codes),
        (v_bits, cache.v_codes, expected.v_codes),
    ):
        from worker.kvcache.turboquant import unpack_codes

        same = unpack_codes(got, bits, dim) == unpack_codes(want, bits, dim)
        assert same.float().mean() > 0.999  # ties at a boundary may round either way
    untouched = torch.ones(cache.num_compressed_blocks, dtype=torch.bool)
    untouched[dst.cpu()] = False
    assert (cache.k_norms[untouched.to(device)] == 0).all()


@pytest.mark.parametrize("bits", [(4, 3), (2, 1), (3, 3), (4, 4), (1, 2)])
def test_triton_restage(bits: tuple[int, int]):
    check_restage("cpu", 2, 64, 4, *bits)


def test_triton_restage_reads_strided_int32_block_ids():
    check_restage("cpu", 2, 64, 4, 4, 3, strided=True)


def check_rotations(device: str, tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype) -> None:  # fmt: skip
    """The triton rotations against the reference ops: q a strided half of q|gate (as the
    attention layer splits it), k and v strided views of one k|v, the gate strided too."""
    from worker.kernels.triton.turboquant import rotate_qkv, unrotate_sigmoid_mul
    from worker.kvcache.turboquant import rotation_matrix

    torch.manual_seed(0)
    r32 = rotation_matrix(dim, device)
    r = r32.to(dtype)
    assert torch.equal(r.float(), r32)  # D a power of 4: entries +-2^-k, exact in 16 bits
    qg = torch.randn(tokens, hq, 2 * dim, device=device).to(dtype)
    kv = torch.randn(tokens, 2, hkv, dim, device=device).to(dtype)
    q, gate, k, v = qg[..., :dim], qg[..., dim:], kv[:, 0], kv[:, 1]
    got = rotate_qkv(q, k, v, r)
    want = reference.rotate_qkv(q, k, v, r)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.is_contiguous() and g.dtype == dtype
        assert rel_err(g.float(), w.float()) < 1e-2
    out = torch.randn(tokens, hq, dim, device=device).to(dtype)
    for gt in (gate, None):
        got_out = unrotate_sigmoid_mul(out, gt, r)
        want_out = reference.unrotate_sigmoid_mul(out, gt, r)
        assert got_out.shape == (tokens, hq * dim) and got_out.dtype == dtype
        assert rel_err(got_out.float(), want_out.float()) < 1e-2
    # there and back
    back = unrotate_sigmoid_mul(got[0], None, r).view(tokens, hq, dim)
    assert rel_err(back.float(), q.float()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "hq", "hkv", "dim"), [(3, 4, 2, 64), (9, 3, 1, 64), (2, 2, 1, 256), (300, 16, 4, 64)])  # fmt: skip
def test_triton_rotations(tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype):
    check_rotations("cpu", tokens, hq, hkv, dim, dtype)


def test_staged_attention_with_16bit_heads_rotates_through_the_ops(monkeypatch):
    """bf16 heads whose rotation is exact: q, k, v rotated by one `rotate_qkv`, the output
    un-rotated and gated by one `unrotate_sigmoid_mul`; the result is plain attention gated."""
    from worker.engine.batch import BatchMetadata
    from worker.kernels import ops
    from worker.kvcache.staged import staged_attention

    torch.manual_seed(4)
    hq, hkv, dim, bs, n = 4, 2, 64, 4, 7
    cache = StagedAttentionCache.allocate(8, 4, bs, hkv, dim, kv_dtype=torch.bfloat16)
    q, k, v, gate = (torch.randn(n, h, dim).bfloat16() for h in (hq, hkv, hkv, hq))
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])
    meta = BatchMetadata(
        seq_ids=[0],
        num_prefills=1,
        query_lens=[n],
        context_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens=cu_seqlens_of([n]),
        positions=torch.arange(n),
        slot_mapping=slots,
        block_tables=table,
        state_slots=torch.zeros(1, dtype=torch.int64),
        has_initial_state=torch.tensor([False]),
        logits_indices=torch.tensor([n - 1]),
    )
    called: list[str] = []
    for name in ("rotate_qkv", "unrotate_sigmoid_mul"):
        fn = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _fn=fn, _name=name: called.append(_name) or _fn(*a))  # fmt: skip
    got = staged_attention(q, k, v, gate, meta, cache, 0.125)
    assert called == ["rotate_qkv", "unrotate_sigmoid_mul"]
    plain_k, plain_v = torch.zeros(8, bs, hkv, dim), torch.zeros(8, bs, hkv, dim)
    reference.write_kv_cache(k.float(), v.float(), plain_k, plain_v, slots)
    attn = reference.paged_attention_prefill(
        q.float(), plain_k, plain_v, cu_seqlens_of([n]), torch.tensor([n]), table, torch.arange(n), 0.125
    )  # fmt: skip
    want = attn.reshape(n, -1) * torch.sigmoid(gate.float().reshape(n, -1))
    assert got.shape == (n, hq * dim) and rel_err(got.float(), want) < 3e-2


def check_staged_decode(
    device: str, contexts: list[int], fraction: float, hq: int, hkv: int, dim: int, bs: int,
    partition: int | None = None, kv_dtype: torch.dtype = FP8, k_bits: int = 4, v_bits: int = 3,
    block_n: int | None = None, tol: float = 2e-2, lookup: str | None = None,
    code_loads: str | None = None, max_registers: int | None = None, pad_table: int = 0,
) -> tuple[StagedAttentionCache, torch.Tensor]:  # fmt: skip
    tq_kernels = triton_module()
    cache, tables, _ = staged_case(
        contexts, fraction, hq, hkv, dim, bs, device, kv_dtype, k_bits=k_bits, v_bits=v_bits
    )
    if pad_table:  # a table wider than the contexts, as the engine's
        tables = torch.cat([tables, tables.new_zeros(len(contexts), pad_table)], 1)
    q = torch.randn(len(contexts), hq, dim, device=device).bfloat16()
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    want = reference.staged_attention_decode(q, cache, ctx, tables, dim**-0.5)
    got = tq_kernels.staged_attention_decode(
        q, cache, ctx, tables, dim**-0.5, partition, block_n=block_n, lookup=lookup,
        code_loads=code_loads, max_registers=max_registers,
    )  # fmt: skip
    err = rel_err(got, want)
    assert err < tol, err
    return cache, tables


def tile_kinds(
    cache: StagedAttentionCache, tables: torch.Tensor, contexts: list[int], bn: int, part: int
) -> set[str]:
    """What the decode kernel's tiles of bn tokens (within partitions of `part`) hold."""
    bs, recent = cache.k_cache.shape[1], cache.num_recent_blocks
    kinds = set()
    for b, n in enumerate(contexts):
        packed = tables[b, torch.arange(n) // bs].cpu() >= recent
        for start in range(0, n, part):
            for t0 in range(start, min(start + part, n), bn):
                tile = packed[t0 : min(t0 + bn, start + part, n)]
                kinds.add("codes" if tile.all() else "fp8" if not tile.any() else "mixed")
    return kinds


# the decode kernel's code paths by width: K/V bits, every head-dim the models use, GQA groups of
# 1 and 6 query heads, 3 KV heads (SmolLM2); 16-token pages, 32-token tiles, 64-token splits:
# tiles all codes, all FP8 (the window) and mixed (page 4 of 10 compressed, page 5 not)
@pytest.mark.parametrize(
    ("k_bits", "v_bits", "dim", "hq", "hkv"),
    [
        (4, 3, 64, 12, 2),
        (4, 3, 256, 6, 1),
        (3, 3, 128, 9, 3),
        (4, 4, 64, 2, 2),
        (2, 2, 64, 12, 2),
        (2, 1, 128, 9, 3),
    ],
)
@pytest.mark.parametrize("code_loads", ["bytes", "words"])
def test_triton_staged_decode_widths_and_tiles(k_bits, v_bits, dim, hq, hkv, code_loads):
    contexts = [150, 40, 16, 33]  # 33: a tile of one FP8 token after two compressed pages
    cache, tables = check_staged_decode(
        "cpu", contexts, 0.5, hq, hkv, dim, 16, partition=64, k_bits=k_bits, v_bits=v_bits,
        block_n=32, tol=1e-2, code_loads=code_loads,
    )  # fmt: skip
    assert tile_kinds(cache, tables, contexts, 32, 64) == {"codes", "fp8", "mixed"}


@pytest.mark.parametrize(("k_bits", "dim"), [(4, 64), (3, 128), (3, 32)])
def test_triton_staged_decode_word_loads_equal_byte_loads(k_bits: int, dim: int):
    """3-bit codes loaded as int32 words (3 per 32 coordinates, shifts rebuild each group's 24
    bits) decode to exactly the bytes' centroids: the same output to the bit, every code value."""
    tq_kernels = triton_module()
    cache, tables, _ = staged_case(
        [70, 33], 1.0, 4, 2, dim, 16, "cpu", FP8, k_bits=k_bits, v_bits=3
    )
    for pool in (cache.k_codes, cache.v_codes):  # every code value, not only the likely ones
        pool.random_(0, 256)
    q = torch.randn(2, 4, dim).bfloat16()
    ctx = torch.tensor([70, 33], dtype=torch.int32)
    out = {
        loads: tq_kernels.staged_attention_decode(
            q, cache, ctx, tables, dim**-0.5, 64, block_n=32, code_loads=loads
        )
        for loads in ("bytes", "words")
    }
    assert torch.equal(out["words"], out["bytes"])
    want = reference.staged_attention_decode(q, cache, ctx, tables, dim**-0.5)
    assert rel_err(out["words"], want) < 1e-2


def test_triton_staged_decode_knobs_checked_and_register_cap_ignored_on_cpu():
    check_staged_decode(
        "cpu", [150, 40], 0.5, 12, 2, 64, 16, partition=64, block_n=32, code_loads="words",
        max_registers=168, lookup="prmt_v3",
    )  # fmt: skip
    with pytest.raises(ValueError, match="code_loads"):
        check_staged_decode("cpu", [40], 0.5, 12, 2, 64, 16, code_loads="nibbles")
    with pytest.raises(ValueError, match="lookup"):
        check_staged_decode("cpu", [40], 0.5, 12, 2, 64, 16, lookup="table")


@pytest.mark.parametrize("block_n", [16, 64])
def test_triton_staged_decode_tile_sizes(block_n: int):
    check_staged_decode("cpu", [150, 70], 0.5, 12, 2, 64, 16, k_bits=4, v_bits=3, block_n=block_n)


def test_triton_staged_decode_prmt_lookup_falls_back_on_cpu():
    check_staged_decode("cpu", [150, 40], 0.5, 12, 2, 64, 16, block_n=32, lookup="prmt")


def test_triton_staged_decode_tile_of_one_compressed_token():
    """Every page compressed, the last holding one token: its tile has a single code row."""
    check_staged_decode("cpu", [33, 65], 1.0, 12, 2, 64, 16, block_n=32, tol=1e-2)


@pytest.mark.parametrize("bits", [(4, 3), (3, 3), (4, 4), (2, 2), (1, 2)])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_triton_scratch_decodes_every_width(bits: tuple[int, int], dim: int):
    """The gather-free code decoding (word loads, select tree on the folded bits, the sign
    xor-ed in) against the reference's table lookup: every code of every width, exactly."""
    tq_kernels = triton_module()
    cache, tables, _ = staged_case([24, 9], 1.0, 2, 2, dim, 4, k_bits=bits[0], v_bits=bits[1])
    for pool in (cache.k_codes, cache.v_codes):  # every code value, not only the likely ones
        pool.random_(0, 256)
    keys, values, _ = tq_kernels.staged_scratch(cache, tables, torch.float32)
    want_k, want_v, _ = reference.staged_scratch(cache, tables, torch.float32)
    assert rel_err(keys, want_k) < 1e-6 and rel_err(values, want_v) < 1e-6


@pytest.mark.parametrize("fraction", [0.0, 0.6, 1.0])
def test_triton_staged_decode_mixed_pages(fraction: float):
    check_staged_decode("cpu", [5, 70, 33], fraction, 4, 2, 64, 4)


def test_triton_staged_decode_three_kv_heads():
    """SmolLM2's shape: 9 query heads over 3 KV heads, 16-token pages."""
    check_staged_decode("cpu", [40, 70], 0.6, 9, 3, 64, 16)


def test_triton_staged_decode_split_partitions():
    check_staged_decode("cpu", [150, 9], 0.5, 6, 2, 64, 8, partition=64)


def test_triton_staged_decode_tiles_that_start_inside_a_page():
    # 20-token partitions, 16-token tiles, 8-token pages: tiles start mid-page and span one
    # page more than aligned ones, so the pools a tile holds include the page of its last tokens
    for fraction in (0.3, 0.5, 0.7):
        check_staged_decode("cpu", [150, 97, 61], fraction, 6, 2, 64, 8, partition=20, block_n=16)  # fmt: skip


def test_triton_staged_decode_splits_each_rows_own_context():
    # 8 splits a row (on a CPU) over a table of 300 pages, each row cutting its own context
    # into them, the 9-token row's all but one empty
    check_staged_decode("cpu", [150, 9, 333], 0.5, 6, 2, 64, 8, pad_table=260)


def test_triton_staged_prefill_via_scratch():
    tq_kernels = triton_module()
    cache, tables, _ = staged_case([9, 20], 0.5)
    keys, values, scratch_tables = tq_kernels.staged_scratch(cache, tables, torch.float32)
    want_k, want_v, want_tables = reference.staged_scratch(cache, tables, torch.float32)
    assert torch.equal(scratch_tables, want_tables)
    assert rel_err(keys, want_k) < 1e-5 and rel_err(values, want_v) < 1e-5
    q = torch.randn(3 + 20, 4, 64).bfloat16()
    cu = cu_seqlens_of([3, 20])
    ctx = torch.tensor([9, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(6, 9), torch.arange(20)])
    want = reference.staged_attention_prefill(q, cache, cu, ctx, tables, positions, 0.125)
    got = tq_kernels.staged_attention_prefill(q, cache, cu, ctx, tables, positions, 0.125)
    assert rel_err(got, want) < 2e-2


def check_staged_prefill(
    contexts: list[int], chunks: list[int], fraction: float, hq: int, hkv: int, dim: int,
    bs: int, k_bits: int = 4, v_bits: int = 3, seed: int = 0, device: str = "cpu",
) -> None:  # fmt: skip
    """The direct prefill (codes decoded tile by tile in the kernel) against the reference and
    the scratch way: each sequence's last `chunks[b]` tokens are the chunk, the rest cached."""
    tq_kernels = triton_module()
    cache, tables, _ = staged_case(
        contexts, fraction, hq, hkv, dim, bs, device, k_bits=k_bits, v_bits=v_bits, seed=seed
    )
    tables = tables.to(device)
    q = torch.randn(sum(chunks), hq, dim, device=device).bfloat16()
    cu = cu_seqlens_of(chunks).to(device)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    positions = torch.cat(
        [torch.arange(n - c, n, device=device) for n, c in zip(contexts, chunks, strict=True)]
    )
    scale = dim**-0.5
    want = reference.staged_attention_prefill(q, cache, cu, ctx, tables, positions, scale)
    got = tq_kernels.staged_attention_prefill(q, cache, cu, ctx, tables, positions, scale)
    scratch = tq_kernels.staged_attention_prefill(
        q, cache, cu, ctx, tables, positions, scale, way="scratch"
    )
    assert got.shape == want.shape and got.dtype == q.dtype
    assert rel_err(got, want) < 2e-2
    assert rel_err(got, scratch) < 2e-2


# key tiles of codes only, FP8 only and both (the compressed fraction), chunks that start
# mid-page over a cached prefix, several sequences in one launch, GQA groups of 1-6 heads,
# partial last tiles; every width pair the decode kernel takes
@pytest.mark.parametrize(
    ("contexts", "chunks", "fraction", "hq", "hkv", "dim", "bs", "bits"),
    [
        ([150, 40], [150, 40], 0.5, 4, 2, 64, 8, (4, 3)),
        ([150, 97, 9], [37, 97, 3], 0.7, 6, 1, 64, 16, (4, 3)),
        ([200], [65], 1.0, 4, 2, 64, 8, (4, 3)),
        ([130, 61], [130, 20], 0.0, 4, 2, 64, 8, (4, 3)),
        ([90, 33], [17, 33], 0.4, 9, 3, 128, 8, (3, 3)),
        ([120], [50], 0.5, 2, 2, 64, 8, (2, 1)),
        ([100, 80], [100, 5], 0.5, 2, 2, 64, 4, (4, 4)),
    ],
)
def test_triton_staged_prefill_decodes_codes_tile_by_tile(
    contexts, chunks, fraction, hq, hkv, dim, bs, bits
):
    check_staged_prefill(contexts, chunks, fraction, hq, hkv, dim, bs, *bits)


def test_triton_staged_prefill_refuses_an_unknown_way():
    tq_kernels = triton_module()
    cache, tables, _ = staged_case([9], 0.5)
    q, cu, ctx = torch.randn(9, 4, 64).bfloat16(), cu_seqlens_of([9]), torch.tensor([9])
    with pytest.raises(ValueError, match="direct"):
        tq_kernels.staged_attention_prefill(q, cache, cu, ctx, tables, torch.arange(9), 0.1, way="x")  # fmt: skip


def test_triton_scratch_pages_of_three_kv_heads():
    """SmolLM2's 3 KV heads: a page's rows (block_size x 3) are not a power of two."""
    tq_kernels = triton_module()
    cache, tables, _ = staged_case([9, 20], 0.5, 3, 3, 64, 4)
    keys, values, _ = tq_kernels.staged_scratch(cache, tables, torch.float32)
    want_k, want_v, _ = reference.staged_scratch(cache, tables, torch.float32)
    assert rel_err(keys, want_k) < 1e-5 and rel_err(values, want_v) < 1e-5


# ---------------------------------------------------------------- the 27B shape on a GPU


@pytest.mark.gpu
@needs_cuda
def test_gpu_restage_27b_shape():
    check_restage("cuda", 4, 256, 16, 4, 3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [0.0, 0.7, 1.0])
def test_gpu_staged_prefill_direct_27b_shape(fraction: float):
    # chunks over cached prefixes of codes and FP8 pages, one chunk a whole prompt
    check_staged_prefill(
        [4096, 1000, 33, 700], [512, 1000, 33, 129], fraction, 24, 4, 256, 16, device="cuda"
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 170, 4096])
def test_gpu_rotations_27b_shape(tokens: int):
    check_rotations("cuda", tokens, 24, 4, 256, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", [0.0, 0.9])
@pytest.mark.parametrize(
    ("block_n", "lookup", "code_loads", "max_registers"),
    [
        (None, None, None, None),
        (32, "tree", None, None),
        (64, "prmt", None, None),
        (32, "prmt", None, None),
        (64, "prmt", "words", None),
        (32, "prmt", "words", 168),
        (64, "prmt_v3", "words", None),
        (32, "prmt_v3", "bytes", 168),
    ],
)
def test_gpu_staged_decode_27b_shape(
    fraction: float,
    block_n: int | None,
    lookup: str | None,
    code_loads: str | None,
    max_registers: int | None,
):
    check_staged_decode(
        "cuda", [4096, 1000, 33, 2048, 17, 3000, 512, 4095], fraction, 24, 4, 256, 16,
        block_n=block_n, lookup=lookup, code_loads=code_loads, max_registers=max_registers,
    )  # fmt: skip


def prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 in its default mode (bit 3 of a selector nibble: replicate the byte's
    sign)."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        sel = (c >> 4 * k) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # replicate the byte's sign bit
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * k
    return out


def run_ptx(asm: str, args: dict[int, int]) -> dict[int, int]:
    """A tiny interpreter of the b32/b16 PTX the byte-permute decoder uses (and, shr, shl,
    prmt in its default mode, lop3, mov into a 16-bit pair): $N operands in, outputs out."""
    regs: dict[str, int] = {f"${n}": v & 0xFFFFFFFF for n, v in args.items()}

    def val(op: str) -> int:
        return int(op, 0) if op[0].isdigit() else regs[op]

    for line in asm.replace("{", "").replace("}", "").split(";"):
        parts = line.strip().replace(",", " ").split()
        if not parts or parts[0] == ".reg":
            continue
        op, dst, *src = parts
        if op == "mov.b32":  # mov.b32 {$a, $b}, r: the low half to $a
            lo_reg, hi_reg, word = dst, src[0], val(src[1])
            regs[lo_reg], regs[hi_reg] = word & 0xFFFF, word >> 16
            continue
        a = [val(x) for x in src]
        if op == "and.b32":
            r = a[0] & a[1]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "shl.b32":
            r = a[0] << a[1]
        elif op == "prmt.b32":
            r = prmt(*a)
        elif op == "lop3.b32":
            lut = a[3]
            r = 0
            for bit in range(32):
                i = ((a[0] >> bit & 1) << 2) | ((a[1] >> bit & 1) << 1) | (a[2] >> bit & 1)
                r |= (lut >> i & 1) << bit
        else:
            raise AssertionError(f"unknown instruction {op}")
        regs[dst] = r & 0xFFFFFFFF
    return {n: regs[f"${n}"] for n in range(8)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prmt_decoder_ptx_gives_every_centroid(dtype: torch.dtype):
    """The inline PTX of `_decode_codes_prmt` (CUDA only), run by a small interpreter: every
    code in every slot of a word decodes to the 16-bit centroid bits the reference's."""
    tq_kernels = triton_module()
    from worker.kvcache import turboquant as tq

    centroids, _ = tq.codebook(256, 4)
    bits = [int(c.to(dtype).view(torch.int16)) & 0xFFFF for c in centroids]
    lo = [sum((bits[4 * w + k] & 0xFF) << 8 * k for k in range(4)) for w in range(2)]
    hi = [sum((bits[4 * w + k] >> 8) << 8 * k for k in range(4)) for w in range(2)]
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(0, 16, (600, 8), generator=gen).tolist()
    words += [[c] * 8 for c in range(16)]
    for codes in words:
        t = sum(c << 4 * i for i, c in enumerate(codes))
        signed = t - (1 << 32) if t >> 31 else t
        x = (signed ^ (((signed >> 3) & 0x11111111) * 7)) & 0xFFFFFFFF  # the kernel's fold
        args = {8: t, 9: x, 10: lo[0], 11: lo[1], 12: hi[0], 13: hi[1]}
        got = run_ptx(tq_kernels._PRMT_4BIT.value, args)
        assert [got[i] for i in range(8)] == [bits[c] for c in codes], codes


_nibbles3: Any = None  # the kernel's callee, set by nibbles3_kernel


def nibbles3_kernel():
    """`_nibbles3` in a kernel of its own (interpreted on CPU tensors; the interpreter resolves
    the kernel's names in this module's globals)."""
    import triton.language as tl

    from worker.kernels.triton._launch import kernel

    global _nibbles3
    _nibbles3 = triton_module()._nibbles3

    @kernel
    def spread(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, _nibbles3(tl.load(src + i)))

    return spread


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prmt_decoder_gives_every_3bit_centroid(dtype: torch.dtype):
    """3-bit values by byte permutes (lookup="prmt_v3", CUDA only): `_nibbles3` (run by the
    interpreter) spreads a group's codes one per nibble, the top bit copied to bit 3, and the
    4-bit PTX (run by the small interpreter) with the 3-bit half codebook as its tables gives
    every code in every slot the reference's centroid, whatever bits 24..32 of the word hold."""
    tq_kernels = triton_module()
    from worker.kvcache import turboquant as tq

    centroids, _ = tq.codebook(256, 3)
    bits = [int(c.to(dtype).view(torch.int16)) & 0xFFFF for c in centroids]
    half = [bits[i % 4] for i in range(8)]  # `_half_codebook` at 3 bits: c[0..3], repeated
    lo = [sum((half[4 * w + k] & 0xFF) << 8 * k for k in range(4)) for w in range(2)]
    hi = [sum((half[4 * w + k] >> 8) << 8 * k for k in range(4)) for w in range(2)]
    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 8, (600, 8), generator=gen).tolist()
    groups += [[c] * 8 for c in range(8)]
    junk = torch.randint(0, 256, (len(groups),), generator=gen).tolist()
    words = [
        sum(c << 3 * i for i, c in enumerate(g)) | (j << 24)
        for g, j in zip(groups, junk, strict=True)
    ]
    src = torch.tensor([w - (1 << 32) if w >> 31 else w for w in words], dtype=torch.int32)
    n = 1 << (len(words) - 1).bit_length()
    src = torch.cat([src, torch.zeros(n - len(words), dtype=torch.int32)])
    dst = torch.empty_like(src)
    nibbles3_kernel()[(1,)](src, dst, N=n)
    for codes, spread in zip(groups, dst.tolist()[: len(groups)], strict=True):
        t = spread & 0xFFFFFFFF
        assert [(t >> 4 * i) & 0xF for i in range(8)] == [c | (c & 4) << 1 for c in codes]
        x = (spread ^ (((spread >> 3) & 0x11111111) * 7)) & 0xFFFFFFFF  # the kernel's fold
        args = {8: t, 9: x, 10: lo[0], 11: lo[1], 12: hi[0], 13: hi[1]}
        got = run_ptx(tq_kernels._PRMT_4BIT.value, args)
        assert [got[i] for i in range(8)] == [bits[c] for c in codes], codes


@pytest.mark.parametrize(("dim", "exact"), [(64, True), (256, True), (128, False)])
def test_rotations_run_in_16_bits_where_the_rotation_is_exact(dim: int, exact: bool) -> None:
    """Entries +-1/sqrt(D) are powers of two for D = 4^n: a 16-bit GEMM then rotates as fp32."""
    from worker.kvcache.staged import from_rotated, to_rotated

    cache = StagedAttentionCache.allocate(2, 2, 16, 2, dim)
    assert (cache.rotation_for(torch.bfloat16) is not None) == exact
    x = torch.randn(5, 3, dim).bfloat16()
    want = (x.float() @ cache.rotation).bfloat16()
    got = to_rotated(x, cache)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2
    assert rel_err(from_rotated(got, cache), x) < 1e-2
