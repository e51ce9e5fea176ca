"""Small elementwise fusions of the decode step, each one launch where torch takes several:
silu(gate) * up over a fused gate|up projection, the attention output gate x * sigmoid(gate)
reading the gate in place from q_proj's output, and the DeltaNet gates (beta, log decay g) from
the a/b projections. At batch 8 these are launch-bound; what they save is launches, not bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.reference import X8
from worker.kernels.triton._launch import kernel, pdl_release_wait, pdl_wait
from worker.kernels.triton.x8 import store_x8


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of fp32 values, in `dtype`: silu rounded to `dtype` before the product,
    as F.silu(gate) * up does."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@kernel
def _silu_mul_kernel(
    x, out, F, stride_x, BLOCK: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    if PAIRED:  # PAIRED gate columns, then PAIRED up columns, and again
        gate_cols = (cols // PAIRED) * (2 * PAIRED) + cols % PAIRED
        up_cols = gate_cols + PAIRED
    else:
        gate_cols = cols
        up_cols = F + cols
    gate = tl.load(x + row * stride_x + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + up_cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * F + cols, silu_times(gate, up, out.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, paired: int = 0) -> torch.Tensor:
    """silu(x[..., :F]) * x[..., F:] for x[..., 2F] (rows may be strided, the last dim not).
    `paired` > 0: x's columns alternate that many gate and up columns (an int4-mma gate|up
    with paired tiles, `reference.int4_mma_unpair_outputs` says how), read in place."""
    two_f = x.shape[-1]
    f = two_f // 2
    rows = x.reshape(-1, two_f)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], f), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(f))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(f, block))](
            rows, out, f, rows.stride(0), BLOCK=block, PAIRED=paired, num_warps=4
        )
    return out.view(*x.shape[:-1], f)


@kernel
def _sigmoid_mul_kernel(
    x,
    gate,
    out,
    codes,
    scales,
    N,
    D,
    stride_xt,
    stride_gt,
    stride_gh,
    BLOCK: tl.constexpr,
    X8: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_RELEASE: tl.constexpr,
):
    """out[t, n] = x[t, n] * sigmoid(gate[t, n // D, n % D]) (gate as [T, N / D, D] strided).
    The attention's output gate, before the o projection: it may release early (pdl.py)."""
    pdl_release_wait(PDL, EARLY_RELEASE)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    xv = tl.load(x + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate + t * stride_gt + (cols // D) * stride_gh + cols % D, mask=mask, other=0.0)
    # round the sigmoid to the activation dtype before the product, as torch does
    sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(out.dtype.element_ty).to(tl.float32)
    y = (xv * sig).to(out.dtype.element_ty)
    tl.store(out + t * N + cols, y, mask=mask)
    if X8:  # the output again as int8 codes, for the o projection's int8 products (x8.py)
        one = tl.zeros((1,), dtype=tl.int64)
        store_x8(tl.reshape(tl.where(mask, y.to(tl.float32), 0.0), (1, BLOCK)), codes, scales,
                 one + t * N, one + t * (N // 128), tl.program_id(1) * BLOCK, one == 0, N, 1, BLOCK)  # fmt: skip


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, N] * sigmoid(gate), gate [T, H, D] with H * D = N (a strided view is read in
    place) or [T, N]."""
    return _sigmoid_mul(x, gate, False)[0]


def sigmoid_mul_x8(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, X8]:
    """sigmoid_mul, and its output as int8 codes for the int4 GEMV after it, from one pass."""
    out, codes = _sigmoid_mul(x, gate, True)
    assert codes is not None
    return out, codes


def _sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, x8: bool) -> tuple[torch.Tensor, X8 | None]:
    tokens, n = x.shape
    gate3 = gate if gate.dim() == 3 else gate.reshape(tokens, 1, n)
    if x.stride(1) != 1 or gate3.stride(2) != 1 or gate3.shape[1] * gate3.shape[2] != n:
        raise ValueError("sigmoid_mul needs contiguous last dims and a gate of x's size")
    if x8 and n % 128:
        raise ValueError(f"int8 codes need rows of a multiple of 128, got {n}")
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    codes8 = None
    codes = scales = out
    if x8:
        codes8 = X8(
            torch.empty((tokens, n), dtype=torch.int8, device=x.device),
            torch.empty((tokens, n // 128), dtype=torch.float32, device=x.device),
            x.dtype,
        )
        codes, scales = codes8.codes, codes8.scales
    if tokens:
        block = min(1024, triton.next_power_of_2(n))
        if x8:
            block = max(block, 128)
        _sigmoid_mul_kernel[(tokens, triton.cdiv(n, block))](
            x,
            gate3,
            out,
            codes,
            scales,
            n,
            gate3.shape[2],
            x.stride(0),
            gate3.stride(0),
            gate3.stride(1),
            BLOCK=block,
            X8=x8,
            num_warps=4,
        )
    return out, codes8


@triton.jit
def gdn_gates_row(
    a, b, A_log, dt_bias, g, beta, row, H, stride_a, stride_b, BLOCK: tl.constexpr
):  # fmt: skip
    """One token's DeltaNet gates from its a and b rows. Shared by the gates kernel and the conv
    update that computes them on the way."""
    heads = tl.arange(0, BLOCK)
    mask = heads < H
    a_row = tl.load(a + row * stride_a + heads, mask=mask, other=0.0).to(tl.float32)
    b_row = tl.load(b + row * stride_b + heads, mask=mask, other=0.0).to(tl.float32)
    store_gdn_gates(a_row, b_row, heads, mask, A_log, dt_bias, g, beta, row, H)


@triton.jit
def store_gdn_gates(a_row, b_row, heads, mask, A_log, dt_bias, g, beta, row, H):
    """The gates of one token's `heads` from their a and b logits (fp32 values): g = -exp(A_log)
    * softplus(a + dt_bias) (fp32), beta = sigmoid(b)."""
    x = a_row + tl.load(dt_bias + heads, mask=mask, other=0.0).to(tl.float32)
    # softplus(x) = max(x, 0) + log(1 + exp(-|x|)), with log(1 + y) ~ y - y^2 / 2 for tiny y
    y = tl.exp(-tl.abs(x))
    softplus = tl.maximum(x, 0.0) + tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))
    decay = tl.exp(tl.load(A_log + heads, mask=mask, other=0.0).to(tl.float32))
    tl.store(g + row * H + heads, -decay * softplus, mask=mask)
    tl.store(
        beta + row * H + heads, (1.0 / (1.0 + tl.exp(-b_row))).to(beta.dtype.element_ty), mask=mask
    )


@kernel
def _gdn_gates_kernel(
    a, b, A_log, dt_bias, g, beta, H, stride_a, stride_b, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    gdn_gates_row(a, b, A_log, dt_bias, g, beta, row, H, stride_a, stride_b, BLOCK)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32 [T, H], beta [T, H] in b's dtype) from a, b [T, H] (rows may be strided)."""
    tokens, heads = a.shape
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("gdn gates need a contiguous head dim")
    g = torch.empty((tokens, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((tokens, heads), dtype=b.dtype, device=b.device)
    if tokens:
        _gdn_gates_kernel[(tokens,)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            heads,
            a.stride(0),
            b.stride(0),
            BLOCK=triton.next_power_of_2(heads),
            num_warps=1,
        )
    return g, beta
