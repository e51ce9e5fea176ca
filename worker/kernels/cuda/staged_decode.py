"""Staged-KV decode attention with fragments built in registers (staged_decode.cu), through
ctypes. Same contract as `worker.kernels.triton.turboquant.staged_attention_decode` (rotated
q in, rotated output out, the same split plan and merge); shapes the CUDA kernel does not take
(`shape_reason`) go to the Triton kernel.

`TOKENMILL_STAGED_DECODE` picks: "auto" (default: this kernel where it can run), "cuda" (the
same), "triton" (the Triton kernel always; the bench times both side by side).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from worker.kernels.cuda.build import load, missing
from worker.kernels.pdl import pdl_enabled
from worker.models.cache import StagedAttentionCache

SOURCE = Path(__file__).with_name("staged_decode.cu")
SWITCH = "TOKENMILL_STAGED_DECODE"
HEAD_DIM = 256
MAX_GROUP = 8  # query heads per KV head: the B operand's n
# the compiled CTA shapes (launch_variant in the .cu): (warps, CTAs an SM the registers are
# held to, value codes prefetched a tile ahead)
VARIANTS = {0: (4, 2, True), 1: (4, 3, False), 2: (8, 1, True), 3: (4, 2, False), 4: (8, 1, False)}
DEFAULT_VARIANT = 0
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# the extern "C" signature of staged_decode.cu (a test compares it with the source)
SIGNATURES = {"tm_staged_decode": [_P] * 14 + [_F] * 3 + [_I] * 14 + [_P]}


def choice() -> str:
    value = os.environ.get(SWITCH, "auto").strip().lower() or "auto"
    if value not in ("auto", "cuda", "triton"):
        raise ValueError(f"{SWITCH}={value!r}: expected auto, cuda or triton")
    return value


def available(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """The registry's check: device, dtypes and the switch (shapes: `shape_reason`)."""
    if choice() == "triton":
        return False, f"{SWITCH}=triton"
    if reason := missing(device, (8, 9), "cvt.f16x2.e4m3x2 (sm_89 or newer)", SOURCE):
        return False, reason
    if dtype not in (torch.bfloat16, torch.float16) or kv_dtype != torch.float8_e4m3fn:
        return False, f"needs bf16/fp16 queries and an fp8-e4m3 recent pool, got {kv_dtype}"
    return True, "CUDA sm_89+, fp8 recent pages + 4-bit keys, built with nvcc"


def shape_reason(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    partition: int | None,
) -> str:
    """Why the CUDA kernel cannot take this call ("" when it can)."""
    hq, dim = q.shape[-2:]
    block_size, hkv = cache.k_cache.shape[1], cache.k_cache.shape[2]
    if dim != HEAD_DIM:
        return f"head dim {dim}, not {HEAD_DIM}"
    if cache.k_bits != 4 or cache.v_bits not in (3, 4):
        return f"K{cache.k_bits}/V{cache.v_bits} codes, not K4 with V3 or V4"
    if hq % hkv or hq // hkv > MAX_GROUP:
        return f"{hq} query heads over {hkv} KV heads: more than {MAX_GROUP} a KV head"
    if block_size % 16 or (partition or 0) % 16:
        return f"pages of {block_size} tokens or splits of {partition}: not multiples of 16"
    if cache.k_cache.dtype != torch.float8_e4m3fn or not cache.k_norms.dtype == torch.float16:
        return f"a {cache.k_cache.dtype} recent pool or {cache.k_norms.dtype} norms"
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        return f"{block_tables.dtype} block tables or {context_lens.dtype} context lengths"
    return ""


def _pow2_at_least(n: int) -> int:
    # triton.next_power_of_2 without importing triton here: the int4 GEMV shares this package
    # and runs without it
    return 1 << max(0, n - 1).bit_length()


def splits_for(batch: int, kv_heads: int, variant: int, sms: int) -> int:
    """Splits per sequence: at most one wave of CTAs at the variant's CTAs an SM (a second,
    partial wave would double the step for a few CTAs), by the batch's power-of-two bucket
    only (the merge compiles per split count; see `decode_splits`)."""
    _, per_sm, _ = VARIANTS[variant]
    return max(1, sms * per_sm // (_pow2_at_least(batch) * kv_heads))


_libraries: dict[torch.device, ctypes.CDLL] = {}
_sms: dict[torch.device, int] = {}


def _library(device: torch.device) -> ctypes.CDLL:
    lib = _libraries.get(device)
    if lib is None:
        major, minor = torch.cuda.get_device_capability(device)
        lib = load(SOURCE, f"{major}{minor}")
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = _I
        _libraries[device] = lib
        _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return lib


def staged_attention_decode(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    partition: int | None = None,
    variant: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Rotated q [B, Hq, D] over mixed pages; the rotated output [B, Hq, D]. `variant` (a key
    of VARIANTS) and `splits` (per sequence) default to DEFAULT_VARIANT and `splits_for`;
    `partition` fixes the tokens a split instead (a multiple of 16)."""
    from worker.kernels.triton import turboquant as tk
    from worker.kernels.triton.paged_attention import _combine_kernel

    if shape_reason(q, cache, context_lens, block_tables, partition):
        return tk.staged_attention_decode(q, cache, context_lens, block_tables, scale, partition)
    tk.check_staged_inputs(q, cache, block_tables)
    batch, hq, dim = q.shape
    block_size, hkv = cache.k_cache.shape[1], cache.k_cache.shape[2]
    v = DEFAULT_VARIANT if variant is None else variant
    if v not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {v}")
    if q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8:
        q = q.contiguous()
    lib = _library(q.device)
    if partition:
        num_splits = -(-block_tables.shape[1] * block_size // partition)
    else:
        num_splits = splits or splits_for(batch, hkv, v, _sms[q.device])
    out = torch.empty((batch, hq, dim), dtype=q.dtype, device=q.device)
    single = num_splits == 1
    part_out = out if single else q.new_empty((batch, hq, num_splits, dim), dtype=torch.float32)
    part_lse = out if single else q.new_empty((batch, hq, num_splits), dtype=torch.float32)
    k_scale, v_scale = tk._scales(cache)
    code = lib.tm_staged_decode(
        q.data_ptr(), cache.k_cache.data_ptr(), cache.v_cache.data_ptr(),
        cache.k_codes.data_ptr(), cache.k_norms.data_ptr(), cache.v_codes.data_ptr(),
        cache.v_norms.data_ptr(), cache.k_centroids.data_ptr(), cache.v_centroids.data_ptr(),
        context_lens.data_ptr(), block_tables.data_ptr(), part_out.data_ptr(),
        part_lse.data_ptr(), out.data_ptr(), scale, k_scale, v_scale, batch, hq, hkv,
        block_size, cache.num_recent_blocks, q.stride(0), q.stride(1), block_tables.stride(0),
        num_splits, partition or 0, cache.v_bits, int(q.dtype == torch.bfloat16), v,
        int(pdl_enabled(q.device)), torch.cuda.current_stream(q.device).cuda_stream,
    )  # fmt: skip
    if code:
        raise RuntimeError(
            f"staged decode failed: {'bad arguments' if code < 0 else f'CUDA error {code}'}"
        )
    if not single:
        _combine_kernel[(batch * hq,)](
            part_out,
            part_lse,
            out,
            1.0,
            num_splits,
            D=dim,
            SP=_pow2_at_least(num_splits),
            num_warps=4,
        )
    return out
