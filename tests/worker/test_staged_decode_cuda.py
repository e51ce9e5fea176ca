"""The CUDA staged-KV decode kernel (worker/kernels/cuda/staged_decode.cu): its host side on
CPU; against the reference on a GPU (`-m gpu`), over every compiled variant, page mix, value
width, query dtype, split plan and GQA group it takes, and through the registry and a CUDA
graph."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from tests.worker.numerics import rel_err
from tests.worker.test_staged_kv import staged_case
from worker.kernels import ops, reference
from worker.kernels.cuda import staged_decode as sd
from worker.models.cache import StagedAttentionCache

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP8 = torch.float8_e4m3fn


def test_ctypes_signature_matches_the_source() -> None:
    """ctypes cannot check a call against the C prototype: compare them here."""
    source = sd.SOURCE.read_text()
    for name, argtypes in sd.SIGNATURES.items():
        params = re.search(rf"int {name}\(([^)]*)\)", source)
        assert params is not None, name
        kinds = [
            ctypes.c_void_p if "*" in p else ctypes.c_float if "float" in p else ctypes.c_int
            for p in params.group(1).split(",")
        ]
        assert kinds == argtypes, name


def test_every_variant_is_compiled() -> None:
    source = sd.SOURCE.read_text()
    for v, (warps, per_sm, prefetch) in sd.VARIANTS.items():
        launch = f"case {v}: return launch<VB, BF16, {warps}, {per_sm}, {str(prefetch).lower()}>"
        assert launch in source, launch


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
