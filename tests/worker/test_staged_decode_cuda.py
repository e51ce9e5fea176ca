"""The CUDA staged-KV decode kernel (worker/kernels/cuda/staged_decode.cu): its host side on
CPU; against the reference on a GPU (`-m gpu`), over every compiled variant, page mix, value
width, query dtype, split plan and GQA group it takes, and through the registry and a CUDA
graph."""

from __future__ import annotations

import pytest
import torch

from tests.worker.cuda_sources import check_ctypes_signatures
from tests.worker.numerics import rel_err
from tests.worker.test_staged_kv import prmt, staged_case
from worker.kernels import ops, reference
from worker.kernels.cuda import staged_decode as sd
from worker.kvcache import turboquant as tq
from worker.models.cache import StagedAttentionCache

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP8 = torch.float8_e4m3fn


def test_ctypes_signature_matches_the_source() -> None:
    check_ctypes_signatures(sd.SOURCE, sd.SIGNATURES)


def test_every_variant_is_compiled() -> None:
    source = sd.SOURCE.read_text()
    for v, (warps, per_sm, prefetch) in sd.VARIANTS.items():
        launch = f"case {v}: return launch<VB, BF16, {warps}, {per_sm}, {str(prefetch).lower()}>"
        assert launch in source, launch


# ---------------------------------------------------------------- each lane's arithmetic, on CPU
#
# The kernel's fragments emulated lane by lane (lane = 4 g + t): the bytes each lane loads, its
# byte-permute decode, where each register lands in the m16n8k16 operands (PTX ISA's fragment
# layouts), the movmatrix transpose and the output's coordinates; the products in float64 must
# equal the dense ones over the codes the reference decodes.

LANES = [(lane >> 2, lane & 3) for lane in range(32)]


def tables_of(centroids: torch.Tensor, bits: int) -> tuple[int, int, int, int]:
    h = 1 << (bits - 1)
    b = [int(centroids[i % h].half().view(torch.int16)) & 0xFFFF for i in range(8)]
    lo0, lo1 = (sum((b[4 * j + i] & 0xFF) << 8 * i for i in range(4)) for j in (0, 1))
    hi0, hi1 = (sum((b[4 * j + i] >> 8) << 8 * i for i in range(4)) for j in (0, 1))
    return lo0, lo1, hi0, hi1


def decode8(w: int, tb: tuple[int, int, int, int]) -> list[int]:
    lo0, lo1, hi0, hi1 = tb
    s03, s47 = w & 0x7777, (w >> 16) & 0x7777
    l03, l47 = prmt(lo0, lo1, s03), prmt(lo0, lo1, s47)
    w4 = (w << 4) & 0xFFFFFFFF
    h03 = prmt(hi0, hi1, s03) ^ (prmt(w4, w, 0xD9C8) & 0x80808080)
    h47 = prmt(hi0, hi1, s47) ^ (prmt(w4, w, 0xFBEA) & 0x80808080)
    return [prmt(l03, h03, 0x5140), prmt(l03, h03, 0x7362), prmt(l47, h47, 0x5140), prmt(l47, h47, 0x7362)]  # fmt: skip


def nibbles3(x: int) -> int:
    x = (x & 0xFFF) | ((x << 4) & 0xFFF0000)
    x = (x & 0x3F003F) | ((x << 2) & 0x3F003F00)
    x = (x & 0x07070707) | ((x << 1) & 0x70707070)
    return x | ((x << 1) & 0x88888888)


def halves(u: int) -> tuple[float, float]:
    pair = torch.tensor([u & 0xFFFF, u >> 16], dtype=torch.int32).to(torch.int16)
    lo, hi = pair.view(torch.float16).double().tolist()
    return lo, hi


def words(row: torch.Tensor, start: int, count: int) -> list[int]:
    raw = row[start : start + 4 * count].tolist()
    return [sum(raw[4 * i + j] << 8 * j for j in range(4)) for i in range(count)]


def mma(a: list[list[int]], b: list[list[int]]) -> torch.Tensor:
    """D [16, 8] of m16n8k16 from each lane's 4 A and 2 B registers (half2 each)."""
    am, bm = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for (g, t), ar, br in zip(LANES, a, b, strict=True):
        for j, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):  # fmt: skip
            am[row, col], am[row, col + 1] = halves(ar[j])
        for j, k in enumerate([2 * t, 2 * t + 8]):
            bm[k, g], bm[k + 1, g] = halves(br[j])
    return am @ bm


def unit_vectors(codes: torch.Tensor, centroids: torch.Tensor, bits: int) -> torch.Tensor:
    index = tq.fold_codes(tq.unpack_codes(codes, bits, 256), bits)
    return centroids[index].half().double()


@pytest.mark.parametrize("v_bits", [3, 4])
def test_lane_emulation_gives_the_tiles_products(v_bits: int) -> None:
    gen = torch.Generator().manual_seed(v_bits)
    kc, vc = tq.codebook(256, 4)[0], tq.codebook(256, v_bits)[0]
    k_codes = torch.randint(0, 256, (16, 128), generator=gen, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (16, 32 * v_bits), generator=gen, dtype=torch.uint8)
    q = torch.randn(8, 256, generator=gen).half()
    p = torch.rand(16, 8, generator=gen).half()  # P^T: 16 tokens x 8 heads
    kt, vt = tables_of(kc, 4), tables_of(vc, v_bits)
    # scores, S^T = K Q^T: lane t holds bytes [32 t, 32 t + 32) of tokens g and g + 8, and
    # its head g's query coordinates [64 t, 64 t + 64) as 32 half2
    qbits = q.view(torch.int16).to(torch.int32) & 0xFFFF
    qf = [[int(qbits[g, 64 * t + 2 * j]) | int(qbits[g, 64 * t + 2 * j + 1]) << 16 for j in range(32)] for g, t in LANES]  # fmt: skip
    s = torch.zeros(16, 8, dtype=torch.float64)
    for w in range(8):
        dec = [(decode8(words(k_codes[g], 32 * t, 8)[w], kt), decode8(words(k_codes[g + 8], 32 * t, 8)[w], kt)) for g, t in LANES]  # fmt: skip
        lane_qf = [qf[lane] for lane in range(32)]
        s += mma([[a[0], b[0], a[1], b[1]] for a, b in dec], [[f[4 * w], f[4 * w + 1]] for f in lane_qf])  # fmt: skip
        s += mma([[a[2], b[2], a[3], b[3]] for a, b in dec], [[f[4 * w + 2], f[4 * w + 3]] for f in lane_qf])  # fmt: skip
    keys = unit_vectors(k_codes, kc, 4)
    assert torch.allclose(s, keys @ q.double().T, rtol=1e-12, atol=1e-12)
    # values, O^T = V^T P^T: P^T's B fragment as movmatrix leaves it (lane (g, t): tokens 2t,
    # 2t + 1 and 2t + 8, 2t + 9 of head g); lane g decodes coordinates [32 g, 32 g + 32) of
    # tokens 2t, 2t+1, 2t+8, 2t+9, m-tile i's rows g and g + 8 being coordinates 32 g + 2 i, + 1
    pbits = p.view(torch.int16).to(torch.int32) & 0xFFFF
    pb = [[int(pbits[2 * t + 8 * h, g]) | int(pbits[2 * t + 8 * h + 1, g]) << 16 for h in (0, 1)] for g, t in LANES]  # fmt: skip
    out = torch.zeros(8, 256, dtype=torch.float64)
    for e in range(4):
        groups = []
        for g, t in LANES:
            per_token = []
            for tok in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9):
                v = words(v_codes[tok], 4 * v_bits * g, v_bits)
                if v_bits == 4:
                    group = v[e]
                else:
                    group = nibbles3([v[0], (v[0] >> 24) | (v[1] << 8), (v[1] >> 16) | (v[2] << 16), v[2] >> 8][e] & 0xFFFFFFFF)  # fmt: skip
                per_token.append(decode8(group, vt))
            groups.append(per_token)
        for i in range(4):
            a = [[prmt(x[0][i], x[1][i], 0x5410), prmt(x[0][i], x[1][i], 0x7632), prmt(x[2][i], x[3][i], 0x5410), prmt(x[2][i], x[3][i], 0x7632)] for x in groups]  # fmt: skip
            d = mma(a, pb)  # O^T's m-tile 4 e + i: [16 rows, 8 heads]
            for g, t in LANES:
                for r, c in ((g, 32 * g + 2 * (4 * e + i)), (g + 8, 32 * g + 2 * (4 * e + i) + 1)):
                    out[2 * t, c], out[2 * t + 1, c] = d[r, 2 * t], d[r, 2 * t + 1]
    values = unit_vectors(v_codes, vc, v_bits)
    assert torch.allclose(out, p.double().T @ values, rtol=1e-12, atol=1e-12)


def small_cache(dim: int = 256, k_bits: int = 4, v_bits: int = 3, bs: int = 16, kv=FP8):
    return StagedAttentionCache.allocate(4, 4, bs, 2, dim, k_bits, v_bits, kv, "cpu")


@pytest.mark.parametrize(
    ("kwargs", "hq", "partition", "reason"),
    [
        ({}, 12, None, ""),
        ({}, 16, 64, ""),
        ({"dim": 128}, 12, None, "head dim 128"),
        ({"k_bits": 3}, 12, None, "K3/V3"),
        ({"v_bits": 2}, 12, None, "K4/V2"),
        ({}, 18, None, "18 query heads over 2 KV heads"),
        ({"bs": 8}, 12, None, "pages of 8"),
        ({}, 12, 40, "splits of 40"),
        ({"kv": torch.bfloat16}, 12, None, "torch.bfloat16 recent pool"),
    ],
)
def test_shapes_the_kernel_does_not_take_are_named(kwargs, hq, partition, reason) -> None:
    cache = small_cache(**kwargs)
    q = torch.zeros(2, hq, cache.k_cache.shape[-1], dtype=torch.bfloat16)
    ctx = torch.ones(2, dtype=torch.int32)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    got = sd.shape_reason(q, cache, ctx, tables, partition)
    assert reason in got if reason else got == ""
    if not reason:
        assert "int64 block tables" in sd.shape_reason(q, cache, ctx, tables.long(), partition)


def test_the_switch_and_the_device_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert sd.available(cpu, torch.bfloat16, FP8) == (False, "needs CUDA, got cpu")
    monkeypatch.setenv(sd.SWITCH, "triton")
    assert sd.available(cpu, torch.bfloat16, FP8)[1] == f"{sd.SWITCH}=triton"
    monkeypatch.setenv(sd.SWITCH, "fastest")
    with pytest.raises(ValueError, match="expected auto, cuda or triton"):
        sd.available(cpu, torch.bfloat16, FP8)


def test_splits_fill_one_wave_by_the_batch_bucket() -> None:
    # 8 rows x 4 KV heads on 132 SMs: 264 CTAs at 2 an SM -> 8 splits; 5-8 rows share a bucket
    assert sd.splits_for(8, 4, 0, 132) == 8 == sd.splits_for(5, 4, 0, 132)
    assert sd.splits_for(8, 4, 1, 132) == 12  # 3 CTAs an SM
    assert sd.splits_for(32, 4, 0, 132) == 2 and sd.splits_for(64, 4, 0, 132) == 1


# ---------------------------------------------------------------- on a GPU

CONTEXTS = [4096, 1000, 33, 2048, 17, 3000, 512, 4095]


def check(
    contexts: list[int],
    fraction: float,
    hq: int = 24,
    hkv: int = 4,
    v_bits: int = 3,
    bs: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    variant: int | None = None,
    partition: int | None = None,
    pad_table: int = 0,
) -> None:
    cache, tables, _ = staged_case(contexts, fraction, hq, hkv, 256, bs, "cuda", FP8, 4, v_bits)
    if pad_table:  # a table wider than the contexts, as the engine's
        tables = torch.cat([tables, tables.new_zeros(len(contexts), pad_table)], 1)
    q = torch.randn(len(contexts), hq, 256, device="cuda").to(dtype)
    ctx = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    want = reference.staged_attention_decode(q, cache, ctx, tables, 256**-0.5)
    got = sd.staged_attention_decode(q, cache, ctx, tables, 256**-0.5, partition, variant)
    assert got.dtype == dtype
    err = rel_err(got, want)
    assert err < 2e-2, err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", sorted(sd.VARIANTS))
@pytest.mark.parametrize("fraction", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("v_bits", [3, 4])
def test_gpu_variants_page_mixes_and_value_widths(variant: int, fraction: float, v_bits: int):
    check(CONTEXTS, fraction, v_bits=v_bits, variant=variant)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("partition", [None, 16, 64, 8192])  # 8192: one split, out written
def test_gpu_query_dtypes_and_split_plans(dtype: torch.dtype, partition: int | None):
    check(CONTEXTS, 0.5, dtype=dtype, partition=partition)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("hq", "hkv"), [(32, 4), (4, 4), (9, 3), (2, 1)])
def test_gpu_gqa_groups(hq: int, hkv: int):
    check([300, 16, 1, 129], 0.7, hq=hq, hkv=hkv)


@pytest.mark.gpu
@needs_cuda
def test_gpu_larger_pages_and_a_padded_table():
    check([1000, 47, 640], 0.5, bs=32, pad_table=5)
    check([1000, 47, 640], 0.5, pad_table=7)


@pytest.mark.gpu
@needs_cuda
def test_gpu_registry_picks_it_and_falls_back_by_shape(monkeypatch: pytest.MonkeyPatch):
    chosen = [i.name for i in ops.implementations("staged_attention_decode")]
    assert chosen[0] == "cuda.staged_decode"
    cache, tables, _ = staged_case([200, 70], 0.5, 8, 2, 128, 16, "cuda", FP8)
    q = torch.randn(2, 8, 128, device="cuda").bfloat16()
    ctx = torch.tensor([200, 70], dtype=torch.int32, device="cuda")
    want = reference.staged_attention_decode(q, cache, ctx, tables, 128**-0.5)
    got = ops.staged_attention_decode(q, cache, ctx, tables, 128**-0.5)  # head dim 128: Triton
    assert rel_err(got, want) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_replays_under_a_cuda_graph():
    cache, tables, _ = staged_case(CONTEXTS, 0.6, 24, 4, 256, 16, "cuda", FP8)
    q = torch.randn(len(CONTEXTS), 24, 256, device="cuda").bfloat16()
    ctx = torch.tensor(CONTEXTS, dtype=torch.int32, device="cuda")
    eager = sd.staged_attention_decode(q, cache, ctx, tables, 256**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sd.staged_attention_decode(q, cache, ctx, tables, 256**-0.5)
    q.copy_(torch.randn_like(q))
    graph.replay()
    want = sd.staged_attention_decode(q, cache, ctx, tables, 256**-0.5)
    assert torch.equal(out, want) and not torch.equal(out, eager)
