"""The triton paged-attention prefill kernel against its reference
(worker.kernels.reference.paged_attention_prefill).

On CPU it runs under the triton interpreter at small shapes; with `-m gpu` compiled on CUDA at
the Qwen3.6-27B shape (8 sequences x 512 tokens, 24 query / 4 kv heads of 256). Each sequence
feeds a chunk after a cached prefix: its context (prefix + chunk) is already in the paged cache,
whose blocks are scattered. Agreement is by relative error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from tests.worker.numerics import paged_cache, rel_err
from tests.worker.triton_env import needs_cuda
from worker.kernels import ops, reference
from worker.kernels.reference import cu_seqlens_of
from worker.kernels.triton import paged_attention_prefill
from worker.kernels.triton._launch import kernel
from worker.kernels.triton.paged_attention import prefill_rows

# q, k_cache, v_cache, cu_seqlens, context_lens, block_tables, positions, scale, k_scale, v_scale
PrefillArgs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, float, float, float,
]  # fmt: skip


def prefill_args(
    chunks: list[tuple[int, int]],
    hq: int,
    hkv: int,
    dim: int,
    block_size: int,
    fp8: bool,
    device: str,
) -> PrefillArgs:
    """The op's arguments for sequences of (cached prefix, chunk) tokens: random caches holding
    every context position, each sequence's blocks scattered, one spare table column."""
    contexts = [prefix + chunk for prefix, chunk in chunks]
    width = max(-(-n // block_size) for n in contexts) + 1
    k_cache, v_cache, tables, k_scale, v_scale = paged_cache(
        contexts, hkv, dim, block_size, width, device, fp8
    )
    tokens = sum(chunk for _, chunk in chunks)
    q = torch.randn(tokens, hq, dim, device=device).bfloat16()
    positions = torch.cat([torch.arange(p, p + c) for p, c in chunks]).to(device)
    cu = cu_seqlens_of([c for _, c in chunks], device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, cu, context_lens, tables.to(device), positions, dim**-0.5,
            k_scale, v_scale)  # fmt: skip


# no prefix / prefix shorter than the chunk / prefix far longer / one token / tile multiples
CHUNKS = [(0, 37), (20, 64), (100, 5), (0, 1), (33, 70)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hq,hkv,dim", [(2, 2, 32), (6, 1, 32), (12, 2, 64)])
def test_prefill_matches_reference(hq: int, hkv: int, dim: int, fp8: bool) -> None:
    args = prefill_args(CHUNKS, hq, hkv, dim, 16, fp8, "cpu")
    out = paged_attention_prefill(*args)
    expected = reference.paged_attention_prefill(*args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64), (16, 32)])
def test_prefill_tile_sizes(block_m: int, block_n: int) -> None:
    """Small tiles: many tiles per sequence, unmasked steps before the diagonal, partial tiles."""
    args = prefill_args([(45, 50), (0, 33), (7, 16)], 6, 1, 32, 16, False, "cpu")
    out = paged_attention_prefill(*args, block_m=block_m, block_n=block_n)
    assert rel_err(out, reference.paged_attention_prefill(*args)) < 1e-2


def test_prefill_default_tiles_at_head_dim_256() -> None:
    """The tiles the 27B shape compiles with (128 query rows, 32 keys a step), at GQA 6."""
    args = prefill_args([(150, 140), (0, 9)], 6, 1, 256, 16, True, "cpu")
    assert rel_err(paged_attention_prefill(*args), reference.paged_attention_prefill(*args)) < 1e-2


def test_prefill_single_sequence_and_strided_queries() -> None:
    """One sequence; q a view into a wider projection (the output gate's chunk of it)."""
    args = prefill_args([(70, 30)], 4, 2, 32, 16, False, "cpu")
    q = args[0]
    wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2]).bfloat16()
    wide[..., : q.shape[2]] = q
    out = paged_attention_prefill(wide[..., : q.shape[2]], *args[1:])
    assert rel_err(out, reference.paged_attention_prefill(*args)) < 1e-2


@pytest.mark.parametrize("chunks", [[(45, 50), (0, 33)], [(150, 14)]])
def test_widened_fp8_pages_give_the_same_output(chunks: list[tuple[int, int]]) -> None:
    """FP8 pages widened into the fp16 scratch first: the same values in the same dots."""
    args = prefill_args(chunks, 6, 2, 32, 16, True, "cpu")
    plain = paged_attention_prefill(*args, widen_from_tokens=0)
    widened = paged_attention_prefill(*args, widen_from_tokens=1)
    assert torch.equal(plain, widened)


def test_no_scratch_past_its_byte_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.kernels.triton import paged_attention

    made: list[int] = []
    widen = paged_attention.widened_pages
    monkeypatch.setattr(paged_attention, "widened_pages", lambda *a: made.append(1) or widen(*a))
    args = prefill_args([(40, 8)], 2, 2, 32, 16, True, "cpu")
    paged_attention_prefill(*args, widen_from_tokens=1)
    assert made == [1]
    monkeypatch.setattr(paged_attention, "FP8_SCRATCH_MAX_BYTES", 1024)
    paged_attention_prefill(*args, widen_from_tokens=1)
    assert made == [1]


def test_widened_pages_follow_the_tables() -> None:
    from worker.kernels.triton.paged_attention import widened_pages

    _, k_cache, v_cache, _, _, tables, *_ = prefill_args([(20, 20)], 2, 2, 32, 16, True, "cpu")
    keys, values, into = widened_pages(k_cache, v_cache, tables)
    assert keys.dtype == values.dtype == torch.float16 and into.shape == tables.shape
    for b, row in enumerate(tables.tolist()):
        for i, page in enumerate(row):
            assert torch.equal(keys[into[b, i]], k_cache[page].to(torch.float16))
            assert torch.equal(values[into[b, i]], v_cache[page].to(torch.float16))


def test_registry_prefers_triton_prefill_on_cuda_only() -> None:
    names = [impl.name for impl in ops.implementations("paged_attention_prefill")]
    assert names[0] == "triton.paged_prefill" and names[-1] == "reference"
    cpu = ops.select("paged_attention_prefill", torch.device("cpu"), torch.bfloat16)
    assert cpu.name == "reference"
    for kv in (None, torch.bfloat16, torch.float8_e4m3fn):
        chosen = ops.select("paged_attention_prefill", torch.device("cuda"), torch.bfloat16, kv)
        assert chosen.name == "triton.paged_prefill"


@kernel
def _rows_kernel(cu_seqlens, context_lens, positions, num_seqs, seq_of, rows_in, BM: tl.constexpr, SEQS: tl.constexpr):  # fmt: skip
    tile = tl.program_id(0)
    b, _, rows, in_chunk, _, _, _ = prefill_rows(cu_seqlens, context_lens, positions, num_seqs, tile, BM, 16, SEQS)  # fmt: skip
    tl.store(seq_of + tile, b)
    tl.store(rows_in + tile, tl.sum(in_chunk.to(tl.int32), 0))


def test_surplus_prefill_programs_hold_no_rows() -> None:
    """The prefill grid is an upper bound (tiles + sequences): the programs past the last tile
    must have no rows, or their masked loads read before q and positions (an illegal address
    on a GPU when the memory there is unmapped)."""
    lengths, bm = [20, 16, 5], 16
    cu = cu_seqlens_of(lengths, "cpu")
    positions = torch.cat([torch.arange(n) for n in lengths])
    tiles = sum(-(-n // bm) for n in lengths)
    grid = triton.cdiv(sum(lengths), bm) + len(lengths)
    seq_of = torch.full((grid,), -1, dtype=torch.int32)
    rows_in = torch.full((grid,), -1, dtype=torch.int32)
    _rows_kernel[(grid,)](
        cu, torch.tensor(lengths, dtype=torch.int32), positions, len(lengths), seq_of, rows_in,
        BM=bm, SEQS=4,
    )  # fmt: skip
    # tiles run last-first within a sequence: 20 tokens = a tile of 4 rows then one of 16
    assert seq_of[:tiles].tolist() == [0, 0, 1, 2] and rows_in[:tiles].tolist() == [4, 16, 16, 5]
    assert (seq_of[tiles:] >= len(lengths)).all() and (rows_in[tiles:] == 0).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_paged_attention_prefill_27b(fp8: bool) -> None:
    """8 fresh prompts of 512 tokens (the load point), then chunks after cached prefixes."""
    for chunks in ([(0, 512)] * 8, [(512, 512), (0, 300), (1500, 77), (3, 1)]):
        args = prefill_args(chunks, 24, 4, 256, 16, fp8, "cuda")
        out = paged_attention_prefill(*args)
        assert rel_err(out, reference.paged_attention_prefill(*args)) < 1e-2
        if fp8:  # the same kernel over pages widened first: the same output
            assert torch.equal(out, paged_attention_prefill(*args, widen_from_tokens=1))


# Compiles the 27B-shape kernel for sm_90 and prints the cubin's resource usage. In a fresh
# interpreter: this module imports triton in interpreter mode, whose functions cannot compile.
_COMPILE_FOR_HOPPER = """
import subprocess, sys, tempfile
from pathlib import Path
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.paged_attention import _prefill_kernel, prefill_tiles

kv = sys.argv[1]
block_m, block_n, warps = prefill_tiles(256)
pointers = {"q": "*bf16", "k_cache": "*" + kv, "v_cache": "*" + kv, "cu_seqlens": "*i32",
            "context_lens": "*i32", "block_tables": "*i32", "positions": "*i64", "out": "*bf16"}
scalars = {"qk_scale": "fp32", "v_scale": "fp32", "num_seqs": "i32", "stride_qt": "i32",
           "stride_qh": "i32", "stride_bt": "i32"}
constexprs = dict(HQ=24, HKV=4, D=256, BLOCK_SIZE=16, BM=block_m, BN=block_n, SEQS=8,
                  DOT=tl.float16 if kv in ("fp8e4nv", "fp16") else tl.bfloat16, PDL=True)
signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
names = list(signature)
# what the launcher specializes at run time: 16-byte aligned pointers, strides multiple of 16
aligned = [*pointers, "stride_qt", "stride_qh", "stride_bt"]
source = ASTSource(
    fn=_prefill_kernel.compiled,
    signature=signature,
    constexprs={(names.index(k),): v for k, v in constexprs.items()},
    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
)
compiled = triton.compile(
    source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2}
)
ptx = compiled.asm["ptx"]
print("pipelined" if "cp.async" in ptx else "not pipelined", "wgmma" if "wgmma" in ptx else "")
cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
    cubin.write(compiled.asm["cubin"])
    cubin.flush()
    print(subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True,
                         text=True, check=True).stdout)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bf16", "fp8e4nv", "fp16"])  # fp16: FP8 pages widened
def test_prefill_compiles_for_hopper_without_spills(kv: str) -> None:
    """The 27B-shape kernel compiled ahead of time for sm_90 (no GPU needed): it builds, its K/V
    loads are pipelined (cp.async), it uses wgmma, and its registers do not spill."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER, kv],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not pipelined" not in done.stdout and "wgmma" in done.stdout, done.stdout
    assert "LOCAL:0 " in done.stdout, done.stdout
