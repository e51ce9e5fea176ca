"""The int4-mma decode GEMV and its dequantization (int4_mma.cu), launched through ctypes.

`int4_mma_linear` is the op: M <= 64 rows go through the GEMV (weights streamed once, A operands
in mma fragment order, see the .cu header), more rows through a bf16/fp16 dequantization into a
per-device scratch and cuBLAS. Tilings per (N, K) come from `MMA_DECODE_TILINGS`
(bench/kernels/int4_mma.py sweeps them), else from `default_tiling`.
`int4_mma_linear_silu_mul` is the MLP's gate|up with its activation: a weight whose tiles
alternate gate / up (`reference.int4_mma_pair_tiles`) lets the GEMV write silu(gate) * up from
its epilogue (no [M, 2F] output, no second launch).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.kernels.cuda.build import load, missing
from worker.kernels.pdl import pdl_enabled
from worker.kernels.reference import X8

SOURCE = Path(__file__).with_name("int4_mma.cu")
MAX_ROWS = 64
# Which int4 decode kernels the models use: "auto" (default: the mma GEMV when decode batches
# are at most AUTO_MAX_ROWS rows, the engine's max_num_seqs), "mma" or "triton".
KERNEL_SWITCH = "TOKENMILL_INT4_KERNEL"
# On one H200 (bench/results/2026-12-01-h200-787858e-int4_mma.json) the mma GEMV beats the
# triton one by 7-12% at M = 1..8 and loses from M = 16 (gate|up 64 vs 50 us): its 2-8 token
# groups double the x operands and products per weight word.
AUTO_MAX_ROWS = 8


def kernel_choice() -> str:
    choice = os.environ.get(KERNEL_SWITCH, "auto").strip().lower() or "auto"
    if choice not in ("auto", "mma", "triton"):
        raise ValueError(f"{KERNEL_SWITCH}={choice!r}: expected auto, mma or triton")
    return choice


@dataclass(frozen=True)
class MmaTiling:
    """How one (N, K) weight is cut: `rows` 16-row tiles per CTA (1, 2 or 4: each x operand
    loaded once serves them all; 4 up to M = 16, 2 up to 32), `warps` per CTA
    splitting its K, `splits` CTAs per row block splitting K (> 1: an fp32 workspace and the last
    CTA writes), `mode` 0 (weights loaded into registers, 2 chunks in flight per warp), 1
    (cp.async into a shared-memory ring of 4 chunks per warp) or 2 (the register pipeline with
    interleaved chunks: the CTA's warps take turns along one contiguous run, `depth` 2 or 4
    chunks in flight; groups of a power-of-two multiple of 64) or 3 (stream-K over mode 2's
    pipeline: `splits` CTAs per SM share all row blocks x chunks evenly, no partial wave) or 4
    (sm_90: a producer warp streams stages of `warps` chunks into a ring of `depth` with the
    bulk-copy engine, `warps` consumer warps multiply; `splits` CTAs per SM share the row blocks
    x stages evenly, as mode 3) or 7 (mode 2 on a register ring of `depth` + 1 sets, so a
    chunk's load is never waited for by the chunk that issued it) or 9 (mode 7 with each warp
    taking whole groups, so their sums close once a group: groups of 128 only, 3 chunks in
    flight) or 10 (mode 9's ring in `splits` persistent CTAs per SM, each taking row blocks in
    turn over all of K with the ring running on across them: 2 row tiles, M <= 16, K / 128
    groups a multiple of `warps` whose share a warp is a multiple of 2 groups; else mode 9).
    Modes 5, 6 and 8 are timing probes (4's, 2's and 7's weight stream without the math), never
    the product. From M = 17 modes 7 and 9 run as mode 2 (their register sets spill at 4+ token
    groups)."""

    rows: int = 2
    warps: int = 8
    splits: int = 1
    depth: int = 4
    mode: int = 1


# K split over the grid's y (each part its own workspace slot); of those, the ones that form the
# product (the others are probes); the bulk-copy pipeline and its probe (sm_90)
K_SPLIT_PRODUCT_MODES = (0, 1, 2, 7, 9)
K_SPLIT_MODES = (*K_SPLIT_PRODUCT_MODES, 6, 8)
BULK_MODES = (4, 5)
PERSISTENT_MODE = 10


def persistent_fits(t: MmaTiling, m: int, k: int, group_size: int) -> bool:
    """Whether mode 10 runs this case: 2 row tiles, M <= 16, groups of 128, and each warp's
    share of a row block's K whole turns of its ring (4 chunks: 2 groups)."""
    groups = k // 128
    return (
        t.rows == 2
        and m <= 16
        and group_size == 128
        and k % 128 == 0
        and groups % t.warps == 0
        and (groups // t.warps) % 2 == 0
    )


# Per weight shape, filled from the GPU's tuning file (worker/kernels/tuning; measured at M = 8
# by `python -m bench.kernels.int4_mma --write-tuning`).
MMA_DECODE_TILINGS: dict[tuple[int, int], MmaTiling] = {}


def default_tiling(n: int, k: int, group_size: int, sms: int = 132) -> MmaTiling:
    """Two row tiles per CTA where N allows, 8 warps on the cp.async ring, K split over CTAs
    until ~2 CTAs per SM stream weight (every warp keeping at least one group)."""
    rows = 2 if n % 32 == 0 else 1
    blocks = n // (16 * rows)
    groups = -(-k // group_size)
    warps = 8
    splits = max(1, min(-(-2 * sms // blocks), groups // warps))
    return MmaTiling(rows, warps, splits)


def tiling_for_rows(
    t: MmaTiling, m: int, n: int, k: int, group_size: int, sm90: bool = True
) -> MmaTiling:
    """The tiling `gemv` launches for M = `m` rows of a weight tuned as `t` (tuned at M = 8):
    fewer row tiles a CTA as token groups grow (registers), and the pipelines whose layout or
    registers do not fit the case swapped for one that does."""
    gc = group_size // 64
    if t.mode == PERSISTENT_MODE and not persistent_fits(t, m, k, group_size):
        t = dataclasses.replace(t, mode=9, splits=1)  # its `splits` counted CTAs per SM
    if m > 16 and t.rows == 4:  # 4 tiles x 4 token groups spill registers
        t = dataclasses.replace(t, rows=2)
    if m > 32 and t.rows == 2:  # 8 token groups x 2 tiles spill registers: one tile per CTA
        t = dataclasses.replace(t, rows=1)
    if t.mode == 9 and (gc != 2 or (k // 64) % 2):  # whole groups of 2 chunks
        t = dataclasses.replace(t, mode=7)
    if m > 16 and t.mode in (7, 9):  # the ring's sets spill at 4+ token groups: mode 2's pipeline
        t = dataclasses.replace(t, mode=2)
    if t.mode in BULK_MODES and ((k // 64) % t.warps or not sm90):
        t = default_tiling(n, k, group_size)  # a stage is one chunk per consumer warp; sm_90
    if t.mode >= 2 and gc & (gc - 1):  # interleaved chunks find their group by a shift
        t = dataclasses.replace(t, mode=1, splits=t.splits if t.mode in K_SPLIT_MODES else 1)
    return t


def supports(n: int, k: int, group_size: int) -> tuple[bool, str]:
    if n % 16 or k % 64:
        return False, f"needs N % 16 == 0 and K % 64 == 0, got N={n}, K={k}"
    if group_size % 64:
        return False, f"needs a group size that is a multiple of 64, got {group_size}"
    return True, "int4-mma layout"


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def available(device: torch.device) -> tuple[bool, str]:
    """Whether the mma kernels can run on `device` (the registry's reason string)."""
    if kernel_choice() == "triton":
        return False, f"{KERNEL_SWITCH}=triton"
    reason = missing(device, (8, 0), "mma.sync bf16 (sm_80 or newer)", SOURCE)
    return (False, reason) if reason else (True, "CUDA sm_80+, built with nvcc")


_P, _I = ctypes.c_void_p, ctypes.c_int
# the extern "C" signatures of int4_mma.cu (tests compare them with the source)
SIGNATURES = {
    "tm_w4_gemv": [_P] * 6 + [_I] * 14 + [_P],
    "tm_w4_gemv_x8": [_P] * 7 + [_I] * 9 + [_P],
    "tm_w4_dequant": [_P] * 3 + [_I] * 4 + [_P],
    "tm_w4_dequant_e4m3": [_P] * 4 + [_I] * 3 + [_P],
    "tm_w4_codes_e4m3": [_P] * 4 + [_I] * 3 + [_P],
}


_libraries: dict[torch.device, ctypes.CDLL] = {}


def _library(device: torch.device) -> ctypes.CDLL:
    """The typed library for `device`, looked up once per device (every eager launch asks)."""
    lib = _libraries.get(device)
    if lib is None:
        lib = load(SOURCE, _arch(device))
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = _I
        _libraries[device] = lib
    return lib


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(
            f"{what} failed: {'bad arguments' if code < 0 else f'CUDA error {code}'}"
        )


_workspaces: dict[torch.device, torch.Tensor] = {}
_arrivals: dict[torch.device, torch.Tensor] = {}


def _zeroed(cache: dict[torch.device, torch.Tensor], device: torch.device, n: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Per-device buffers that are zero between launches (the last CTA of each row block
    re-zeroes what it used), grown on demand; launches on one stream share them."""
    buf = cache.get(device)
    if buf is None or buf.numel() < n:
        buf = cache[device] = torch.zeros(n, dtype=dtype, device=device)
    return buf


def _split_workspaces(
    device: torch.device, t: MmaTiling, m: int, n: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The fp32 workspace and arrival counters a launch of tiling `t` at M = `m` rows needs (K
    split over the grid's y: a slot per part, summed in order; stream-K's segments, modes 3-5,
    add into one), or (None, None) where its row blocks are whole (the persistent ring's)."""
    if t.mode == PERSISTENT_MODE or (t.splits == 1 and t.mode in K_SPLIT_MODES):
        return None, None
    token_groups = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8  # the kernel's MT
    parts = t.splits if t.mode in K_SPLIT_MODES else 1
    ws = _zeroed(_workspaces, device, parts * n // 16 * token_groups * 128, torch.float32)
    return ws, _zeroed(_arrivals, device, n // 16, torch.int32)


def gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    tiling: MmaTiling | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [M <= 64, K] (bf16/fp16, contiguous rows) times the int4-mma weight -> [M, N]. With
    `silu_mul`, the weight is a fused gate|up [2F, K] in paired tiles
    (`reference.int4_mma_pair_tiles`) and the result silu(gate) * up [M, F]: formed in the
    epilogue where the tiling has 2 or 4 tiles per CTA and a K-split mode (0-2, 7, 9), else from
    the product."""
    m, k = x.shape
    n = 16 * qweight.shape[0]
    if m > MAX_ROWS or 64 * qweight.shape[1] != k:
        raise ValueError(f"int4-mma gemv: x {tuple(x.shape)} against weight [{n}, {64 * qweight.shape[1]}]")  # fmt: skip
    if silu_mul and n % 32:
        raise ValueError(f"int4-mma gemv: silu_mul needs paired gate|up tiles, got N={n}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    if scales.data_ptr() % 16:  # the register ring copies them 16 bytes at a time
        scales = scales.clone()
    t = tiling or MMA_DECODE_TILINGS.get((n, k)) or default_tiling(n, k, group_size)
    # the capability matters to the bulk pipeline alone: no query on the other modes' calls
    sm90 = t.mode not in BULK_MODES or torch.cuda.get_device_capability(x.device) >= (9, 0)
    t = tiling_for_rows(t, m, n, k, group_size, sm90)
    gc = group_size // 64
    # the epilogue pairs a CTA's tiles (even rows) in the K-split pipelines
    fused = silu_mul and t.rows in (2, 4) and t.mode in (*K_SPLIT_PRODUCT_MODES, PERSISTENT_MODE)
    out = torch.empty((m, n // 2 if fused else n), dtype=x.dtype, device=x.device)
    ws, arrivals = _split_workspaces(x.device, t, m, n)
    code = _library(x.device).tm_w4_gemv(
        qweight.data_ptr(), scales.data_ptr(), x.data_ptr(), out.data_ptr(),
        None if ws is None else ws.data_ptr(), None if arrivals is None else arrivals.data_ptr(),
        m, n, k, x.stride(0), out.stride(0), gc, int(x.dtype == torch.bfloat16),
        t.rows, t.warps, t.splits, t.depth, t.mode, int(fused), int(pdl_enabled(x.device)),
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    _check(code, "int4-mma gemv")
    return silu_mul_of_pairs(out) if silu_mul and not fused else out


# The modes the int8 products run in (ring_run's whole groups, and its persistent form)
X8_MODES = (9, PERSISTENT_MODE)
# Per weight shape, the tiling the int8 products run at (the tuning file's
# `int4_mma_x8_tilings`, measured at M = 8 by `python -m bench.kernels.int4_mma --write-tuning`);
# a shape without one runs its 16-bit tiling.
MMA_X8_TILINGS: dict[tuple[int, int], MmaTiling] = {}
# Whether decode steps feed the int4 GEMVs int8 codes of x (the norms and the attention's output
# gate write them beside their output, `reference.int4_mma_x8`) and multiply on int8 tensor
# cores: "1" on; off by default until measured on the GPU. `set_x8` flips it at run time (graphs
# captured before keep what they captured).
# TOKENMILL_INT4_X8_DOWN=1 (with it) also the MLP's down projection, whose input no kernel
# writes as codes (gate|up's epilogue sees 16 outputs of a 128-k group): a launch of its own
# rounds the activation (`ops.quantize_x8`).
X8_SWITCH, X8_DOWN_SWITCH = "TOKENMILL_INT4_X8", "TOKENMILL_INT4_X8_DOWN"
_x8 = {
    "on": os.environ.get(X8_SWITCH, "0") == "1",
    "down": os.environ.get(X8_DOWN_SWITCH, "0") == "1",
}


def set_x8(on: bool, down: bool = False) -> None:
    _x8["on"], _x8["down"] = on, down


def x8_enabled(down: bool = False) -> bool:
    """Whether the int8 products run (`down`: for the MLP's down projection too)."""
    return _x8["on"] and (_x8["down"] or not down)


def x8_tiling(n: int, k: int, m: int, group_size: int) -> MmaTiling | None:
    """The tiling `gemv_x8` launches for this weight at M = `m` (the tuned one, as `gemv` would
    run it), or None where the int8 products do not run: groups of 128, M <= 16, 2 row tiles in
    mode 9 or 10."""
    if group_size != 128 or m > 16 or k % 128 or n % 32:
        return None
    t = (
        MMA_X8_TILINGS.get((n, k))
        or MMA_DECODE_TILINGS.get((n, k))
        or default_tiling(n, k, group_size)
    )
    t = tiling_for_rows(t, m, n, k, group_size)
    return t if t.rows == 2 and t.mode in X8_MODES else None


def gemv_x8(
    codes: torch.Tensor,
    xscales: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    tiling: MmaTiling | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """`gemv` with x as int8 codes [M <= 16, K] and fp32 scales [M, K / 128]
    (`reference.int4_mma_x8`), the products on int8 tensor cores: bf16 [M, N] (or silu(gate) *
    up [M, N / 2] of a paired gate|up weight). Runs the weight's tiling where it is mode 9 or 10
    on 2 row tiles (`x8_tiling`); `tiling` overrides it (the kernel bench)."""
    m, k = codes.shape
    n = 16 * qweight.shape[0]
    if codes.dtype != torch.int8 or 64 * qweight.shape[1] != k or xscales.shape != (m, k // 128):
        raise ValueError(f"int4-mma gemv_x8: codes {tuple(codes.shape)} {codes.dtype}, scales {tuple(xscales.shape)} against weight [{n}, {64 * qweight.shape[1]}]")  # fmt: skip
    t = tiling or x8_tiling(n, k, m, group_size)
    if t is None or group_size != 128 or t.rows != 2 or t.mode not in X8_MODES or m > 16:
        raise ValueError(f"int4-mma gemv_x8 runs groups of 128, M <= 16, 2 row tiles in mode 9 or 10; got {t}, M={m}")  # fmt: skip
    codes, xscales = codes.contiguous(), xscales.float().contiguous()
    if scales.data_ptr() % 16:
        scales = scales.clone()
    out = torch.empty((m, n // 2 if silu_mul else n), dtype=torch.bfloat16, device=codes.device)
    ws, arrivals = _split_workspaces(codes.device, t, m, n)
    code = _library(codes.device).tm_w4_gemv_x8(
        qweight.data_ptr(), scales.data_ptr(), codes.data_ptr(), xscales.data_ptr(),
        out.data_ptr(), None if ws is None else ws.data_ptr(),
        None if arrivals is None else arrivals.data_ptr(), m, n, k, out.stride(0), t.warps,
        t.splits, t.mode, int(silu_mul), int(pdl_enabled(codes.device)),
        torch.cuda.current_stream(codes.device).cuda_stream,
    )  # fmt: skip
    _check(code, "int4-mma gemv_x8")
    return out


def silu_mul_of_pairs(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [..., F] from a paired-tile gate|up product [..., 2F] (the unfused way:
    prefill, and tilings the epilogue does not pair), reading the pairs in place: no reordered
    copy of a prefill's [tokens, 2F]."""
    from worker.kernels.triton.activations import silu_mul

    return silu_mul(y, paired=16)


def _scratch(device: torch.device, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The prefill scratch both int4 layouts dequantize into (one per device)."""
    from worker.kernels.triton.int4_gemm import dequant_scratch

    return dequant_scratch(device, n, k, dtype)


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (bf16/fp16), written into a reusable per-device scratch."""
    n, k = 16 * qweight.shape[0], 64 * qweight.shape[1]
    out = _scratch(qweight.device, n, k, dtype)
    code = _library(qweight.device).tm_w4_dequant(
        qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, group_size // 64,
        int(dtype == torch.bfloat16), torch.cuda.current_stream(qweight.device).cuda_stream,
    )  # fmt: skip
    _check(code, "int4-mma dequantize")
    return out


def e4m3_channel_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: a scale per output channel that maps its int4 values into e4m3's range: codes
    minus 8 reach -8, so the channel's largest group scale x 8 lands on e4m3's largest, 448."""
    largest = scales.float().abs().amax(dim=1).reshape(-1)  # mma scales [N / 16, G, 16]
    return (largest * (8.0 / torch.finfo(torch.float8_e4m3fn).max)).clamp_min(1e-12)


# A weight's channel scales, formed once: a 4,096-token prefill step asked for them 256 times,
# four torch launches each (~1,000 launches of host time a step). Keyed by the scales tensor's
# id, holding a weak reference to check the id still names that tensor (ids are reused once a
# tensor is freed); an in-place change of the scales (its version) forms them again. Tensors
# made under inference mode keep no version: theirs are the loaded model's, never changed.
_channel_scales: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def channel_scales_of(scales: torch.Tensor) -> torch.Tensor:
    """`e4m3_channel_scales(scales)`, formed once per scales tensor and kept while it lives."""
    key, version = id(scales), -1 if scales.is_inference() else scales._version
    held = _channel_scales.get(key)
    if held is not None and held[0]() is scales and held[1] == version:
        return held[2]
    channel = e4m3_channel_scales(scales)

    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _channel_scales.pop(key, None)

    _channel_scales[key] = (weakref.ref(scales, forget), version, channel)
    return channel


def dequantize_e4m3(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the [N, K] weight in e4m3 over `e4m3_channel_scales`, in the scratch; those scales):
    the operands of the FP8 prefill path's scaled_mm."""
    n, k = 16 * qweight.shape[0], 64 * qweight.shape[1]
    out = _scratch(qweight.device, n, k, torch.float8_e4m3fn)
    channel = channel_scales_of(scales)
    code = _library(qweight.device).tm_w4_dequant_e4m3(
        qweight.data_ptr(), scales.data_ptr(), channel.data_ptr(), out.data_ptr(), n, k,
        group_size // 64, torch.cuda.current_stream(qweight.device).cuda_stream,
    )  # fmt: skip
    _check(code, "int4-mma dequantize to e4m3")
    return out, channel


def codes_e4m3(qweight: torch.Tensor) -> torch.Tensor:
    """The [N, K] codes q - 8 in e4m3 (exact), row-major, in the scratch: the W4A8 prefill
    GEMM's weight operand (`int4_gemm.w4a8_gemm`)."""
    return _codes(qweight, None, 0)[0]


def codes_and_block_scales_e4m3(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`codes_e4m3` and, from the same launch, the group scales as cuBLAS's 1x128 blocks ([N,
    K / 128] fp32, strides (1, N), in a second scratch; `int4_gemm.blockwise_scales` builds the
    same from four torch ops): both operands of the blockwise W4A8 GEMM."""
    codes, blocks = _codes(qweight, scales, group_size)
    assert blocks is not None
    return codes, blocks


def _codes(
    qweight: torch.Tensor, scales: torch.Tensor | None, group_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = 16 * qweight.shape[0], 64 * qweight.shape[1]
    out = _scratch(qweight.device, n, k, torch.float8_e4m3fn)
    blocks = None
    if scales is not None:
        from worker.kernels.triton.int4_gemm import dequant_scratch

        blocks = dequant_scratch(qweight.device, k // 128, n, torch.float32, "block scales").t()
    code = _library(qweight.device).tm_w4_codes_e4m3(
        qweight.data_ptr(), 0 if scales is None else scales.data_ptr(),
        0 if blocks is None else blocks.data_ptr(), out.data_ptr(), n, k, group_size // 64,
        torch.cuda.current_stream(qweight.device).cuda_stream,
    )  # fmt: skip
    _check(code, "int4-mma codes to e4m3")
    return out, blocks


def _prefill_mode(device: torch.device, group_size: int) -> str:
    """TOKENMILL_INT4_PREFILL resolved for this device (bf16, fp8 or w4a8), the switch the
    triton layout's prefill reads too."""
    from worker.kernels.triton import int4_gemm

    return int4_gemm.prefill_path_for(device, group_size)


def int4_mma_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The registry's op (see `worker.kernels.reference.int4_mma_linear`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] <= MAX_ROWS:
        y = gemv(x2, qweight, scales, group_size)
        if bias is not None:
            y = y + bias
    elif (path := _prefill_mode(x.device, group_size)) == "fp8":
        from worker.kernels.triton.fp8_gemm import scaled_mm

        w8, channel = dequantize_e4m3(qweight, scales, group_size)
        y = scaled_mm(x2, w8, channel, bias)
    elif path == "w4a8":
        from worker.kernels.triton.int4_gemm import takes_blockwise, w4a8_linear

        if takes_blockwise(x2, group_size):
            codes, blocks = codes_and_block_scales_e4m3(qweight, scales, group_size)
            y = w4a8_linear(x2, codes, scales, group_size, bias, block_scales=blocks)
        else:
            y = w4a8_linear(x2, codes_e4m3(qweight), scales, group_size, bias)
    else:
        y = F.linear(x2, dequantize(qweight, scales, group_size, x.dtype), bias)
    return y.reshape(*lead, y.shape[-1])


def int4_mma_linear_of_silu_mul(
    y: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The registry's op (see `worker.kernels.reference.int4_mma_linear_of_silu_mul`): past the
    decode rows the activation is formed as x is rounded to e4m3, per token and 128 columns on
    the blockwise W4A8 path (`w4a8_linear(..., silu_paired=16)`), per token on the e4m3 one
    (`silu_mul_quantize_rows(..., paired=16)`); else silu_mul then the product."""
    lead, two_f = y.shape[:-1], y.shape[-1]
    y2 = y.reshape(-1, two_f)
    path = _prefill_mode(y.device, group_size) if y2.shape[0] > MAX_ROWS else None
    if path == "fp8":
        from worker.kernels.triton.fp8_gemm import scaled_mm, silu_mul_quantize_rows

        q, x_scale = silu_mul_quantize_rows(y2, paired=16)
        w8, channel = dequantize_e4m3(qweight, scales, group_size)
        out = scaled_mm(q, w8, channel, bias, x_scale=x_scale, out_dtype=y.dtype)
        return out.reshape(*lead, out.shape[-1])
    if path == "w4a8":
        from worker.kernels.triton.int4_gemm import takes_blockwise, w4a8_linear

        if takes_blockwise(y2[:, : two_f // 2], group_size):
            codes, blocks = codes_and_block_scales_e4m3(qweight, scales, group_size)
            out = w4a8_linear(
                y2, codes, scales, group_size, bias, block_scales=blocks, silu_paired=16
            )
            return out.reshape(*lead, out.shape[-1])
    return int4_mma_linear(silu_mul_of_pairs(y), qweight, scales, group_size, bias)


def int4_mma_linear_x8(
    x8: X8,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The registry's op (see `worker.kernels.reference.int4_mma_linear_x8`)."""
    y = gemv_x8(x8.codes, x8.scales, qweight, scales, group_size)
    return y if bias is None else y + bias


def int4_mma_linear_silu_mul_x8(
    x8: X8, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The registry's op (see `worker.kernels.reference.int4_mma_linear_silu_mul_x8`)."""
    return gemv_x8(x8.codes, x8.scales, qweight, scales, group_size, silu_mul=True)


def int4_mma_linear_silu_mul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The registry's op (see `worker.kernels.reference.int4_mma_linear_silu_mul`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] <= MAX_ROWS:
        y = gemv(x2, qweight, scales, group_size, silu_mul=True)
    else:
        y = silu_mul_of_pairs(int4_mma_linear(x2, qweight, scales, group_size))
    return y.reshape(*lead, y.shape[-1])
