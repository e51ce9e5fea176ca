"""The triton kernels against their plain-PyTorch references (worker.kernels.reference).

On CPU the kernels run under the triton interpreter (small shapes, the CI check); with `-m gpu`
the same checks run compiled on CUDA at the Qwen3.6-27B shapes, batch 8. Inputs are fresh random
draws; agreement is by relative error ||out - ref|| / ||ref||, and state pools must change only
in the slots the batch names.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.worker.numerics import paged_cache, rel_err
from tests.worker.triton_env import GPU, needs_cuda
from worker.kernels import ops, reference
from worker.kernels.reference import cu_seqlens_of
from worker.kernels.triton import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    conv_update_with_ba_gates,
    conv_update_with_gates,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    gated_rms_norm,
    paged_attention_decode,
    rms_norm,
)
from worker.kernels.triton.delta_rule import decode_launch

# ---------------------------------------------------------------- norms


def check_rms_norm(shape: tuple[int, ...], unit_offset: bool, device: str) -> None:
    x = torch.randn(shape, device=device).bfloat16() * 3
    weight = torch.randn(shape[-1], device=device).bfloat16() * 0.2
    out = rms_norm(x, weight, 1e-6, unit_offset)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, reference.rms_norm(x, weight, 1e-6, unit_offset)) < 1e-2


def check_gated_rms_norm(rows: int, dim: int, device: str) -> None:
    x = torch.randn(rows, dim, device=device).bfloat16()
    gate = torch.randn(rows, dim, device=device).bfloat16()
    weight = torch.randn(dim, device=device).bfloat16()
    out = gated_rms_norm(x, gate, weight, 1e-6)
    assert rel_err(out, reference.gated_rms_norm(x, gate, weight, 1e-6)) < 1e-2


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 256)])
def test_rms_norm(shape: tuple[int, ...], unit_offset: bool) -> None:
    check_rms_norm(shape, unit_offset, "cpu")


def test_gated_rms_norm() -> None:
    check_gated_rms_norm(37, 128, "cpu")


def test_rms_norm_strided_rows() -> None:
    """A [T, H, D] view whose rows are not packed (q/k norms read slices of a projection)."""
    packed = torch.randn(6, 3 * 64).bfloat16()
    x = packed[:, 64:].view(6, 2, 64)
    weight = torch.randn(64).bfloat16()
    out = rms_norm(x, weight, 1e-6, True)
    assert rel_err(out, reference.rms_norm(x, weight, 1e-6, True)) < 1e-2


# ---------------------------------------------------------------- causal conv1d


def conv_inputs(channels: int, kernel: int, slots: int, device: str, bias: bool):
    weight = torch.randn(channels, kernel, device=device).bfloat16()
    conv_bias = torch.randn(channels, device=device).bfloat16() if bias else None
    conv_state = torch.randn(slots, channels, kernel - 1, device=device).bfloat16()
    return weight, conv_bias, conv_state


def check_conv1d_update(batch: int, channels: int, device: str, bias: bool) -> None:
    weight, conv_bias, conv_state = conv_inputs(channels, 4, batch + 3, device, bias)
    x = torch.randn(batch, channels, device=device).bfloat16()
    slots = torch.randperm(batch + 3, device=device)[:batch]
    expected_state = conv_state.clone()
    expected = reference.causal_conv1d_update(x, weight, conv_bias, expected_state, slots)
    out = causal_conv1d_update(x, weight, conv_bias, conv_state, slots)
    assert rel_err(out, expected) < 1e-2
    assert torch.equal(conv_state, expected_state)


def check_conv1d_prefill(lengths: list[int], channels: int, device: str, bias: bool) -> None:
    batch = len(lengths)
    weight, conv_bias, conv_state = conv_inputs(channels, 4, batch + 2, device, bias)
    cu_seqlens = cu_seqlens_of(lengths, device)
    x = torch.randn(int(cu_seqlens[-1]), channels, device=device).bfloat16()
    slots = torch.randperm(batch + 2, device=device)[:batch]
    has_initial = torch.arange(batch, device=device) % 3 != 1
    expected_state = conv_state.clone()
    expected = reference.causal_conv1d_prefill(
        x, weight, conv_bias, cu_seqlens, expected_state, slots, has_initial
    )
    out = causal_conv1d_prefill(x, weight, conv_bias, cu_seqlens, conv_state, slots, has_initial)
    assert rel_err(out, expected) < 1e-2
    assert rel_err(conv_state, expected_state) < 1e-2
    assert torch.equal(conv_state.view(-1) == 0, expected_state.view(-1) == 0)


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_update(bias: bool) -> None:
    check_conv1d_update(5, 300, "cpu", bias)


def check_conv_update_with_gates(batch: int, channels: int, heads: int, device: str) -> None:
    weight, _, conv_state = conv_inputs(channels, 4, batch + 3, device, False)
    x = torch.randn(batch, channels, device=device).bfloat16()
    slots = torch.randperm(batch + 3, device=device)[:batch]
    # a and b as strided views of one projection output, as the model passes them
    ab = torch.randn(batch, 2 * heads + 3, device=device).bfloat16()
    a, b = ab[:, :heads], ab[:, heads + 3 :]
    A_log = torch.randn(heads, device=device)
    dt_bias = torch.randn(heads, device=device)
    expected_state = conv_state.clone()
    want = reference.conv_update_with_gates(x, weight, expected_state, slots, a, b, A_log, dt_bias)
    got = conv_update_with_gates(x, weight, conv_state, slots, a, b, A_log, dt_bias)
    assert rel_err(got[0], want[0]) < 1e-2  # the silu conv output
    assert torch.equal(conv_state, expected_state)
    assert got[1].dtype == torch.float32 and rel_err(got[1], want[1]) < 1e-5  # g
    assert got[2].dtype == b.dtype and rel_err(got[2], want[2]) < 1e-2  # beta


def test_conv_update_computes_the_gates_in_the_same_launch() -> None:
    check_conv_update_with_gates(5, 600, 6, "cpu")  # 3 channel blocks: gates once per row


def check_conv_update_with_ba_gates(
    batch: int, channels: int, heads: int, width: int, device: str
) -> None:
    weight, _, conv_state = conv_inputs(channels, 4, batch + 3, device, False)
    x = torch.randn(batch, channels, device=device).bfloat16()
    slots = torch.randperm(batch + 3, device=device)[:batch]
    # hidden as rows of a wider tensor (its rows strided), b|a's weight as in_proj_b|a holds it
    hidden = torch.randn(batch, width + 8, device=device).bfloat16()[:, :width]
    ba_weight = (torch.randn(2 * heads, width, device=device) * width**-0.5).bfloat16()
    A_log = torch.randn(heads, device=device)
    dt_bias = torch.randn(heads, device=device)
    expected_state = conv_state.clone()
    args = (hidden, ba_weight, A_log, dt_bias)
    want = reference.conv_update_with_ba_gates(x, weight, expected_state, slots, *args)
    got = conv_update_with_ba_gates(x, weight, conv_state, slots, *args)
    assert rel_err(got[0], want[0]) < 1e-2  # the silu conv output
    assert torch.equal(conv_state, expected_state)
    # the logits' fp32 sums in another order, each rounded to bf16: at most one bf16 step apart
    assert got[1].dtype == torch.float32 and rel_err(got[1], want[1]) < 1e-2  # g
    assert got[2].dtype == hidden.dtype and rel_err(got[2], want[2]) < 1e-2  # beta
    # and the same gates as the two-launch path, the logits through the 16-bit GEMV's op
    ba = reference.linear(hidden, ba_weight, None)
    _, g, beta = reference.conv_update_with_gates(
        x, weight, conv_state.clone(), slots, ba[:, heads:], ba[:, :heads], A_log, dt_bias
    )
    assert rel_err(got[1], g) < 1e-2 and rel_err(got[2], beta) < 1e-2


def test_conv_update_refuses_a_ba_weight_of_other_heads() -> None:
    weight, _, conv_state = conv_inputs(64, 4, 4, "cpu", False)
    x, hidden = torch.randn(2, 64).bfloat16(), torch.randn(2, 32).bfloat16()
    slots = torch.tensor([0, 1])
    A_log = dt_bias = torch.zeros(3)
    for rows in (7, 8):  # odd, or 4 heads' worth for 3 heads
        ba_weight = torch.randn(rows, 32).bfloat16()
        with pytest.raises(ValueError, match="b|a weight"):
            conv_update_with_ba_gates(
                x, weight, conv_state, slots, hidden, ba_weight, A_log, dt_bias
            )


@pytest.mark.parametrize(("heads", "width"), [(5, 1500), (6, 256)])
def test_conv_update_forms_the_gates_logits_in_the_same_launch(heads: int, width: int) -> None:
    # an odd head count (a program's second head masked), K ragged against the 1,024 columns a
    # program takes a turn, and K shorter than one turn
    check_conv_update_with_ba_gates(3, 600, heads, width, "cpu")


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_prefill(bias: bool) -> None:
    # lengths shorter than K-1 take part of their new state from the old one
    check_conv1d_prefill([1, 2, 37, 70, 5], 200, "cpu", bias)


# ---------------------------------------------------------------- gated delta rule


def delta_inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, device: str):
    """q, k as views into one packed projection (as the model slices them), bf16."""
    packed = torch.randn(tokens, 2 * hk * dk + hv * dv, device=device).bfloat16()
    q = packed[:, : hk * dk].view(tokens, hk, dk)
    k = packed[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
    v = packed[:, 2 * hk * dk :].view(tokens, hv, dv)
    g = -F.softplus(torch.randn(tokens, hv, device=device) - 1.0)  # log decay <= 0
    beta = torch.rand(tokens, hv, device=device).bfloat16()
    return q, k, v, g, beta


def check_delta_decode(
    batch: int,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    l2norm: bool,
    device: str,
    state_dtype: torch.dtype = torch.float32,
    **launch: Any,
) -> None:
    q, k, v, g, beta = delta_inputs(batch, hk, hv, dk, dv, device)
    pool = batch + 3
    state = (torch.randn(pool, hv, dk, dv, device=device) * 0.1).to(state_dtype)
    slots = torch.randperm(pool, device=device)[:batch]
    expected_state = state.clone()
    scale = dk**-0.5
    expected = reference.gated_delta_rule_decode(
        q, k, v, g, beta, expected_state, slots, scale, l2norm
    )
    out = gated_delta_rule_decode(q, k, v, g, beta, state, slots, scale, l2norm, **launch)
    assert state.dtype == state_dtype
    assert rel_err(out, expected) < 1e-2
    # a 16-bit pool: both round the fp32 result once (the interpreter's casts may differ by an ulp)
    assert rel_err(state, expected_state) < (1e-5 if state_dtype == torch.float32 else 1e-2)
    others = torch.ones(pool, dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(state[others], expected_state[others])


def check_delta_prefill(
    lengths: list[int],
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    chunk_size: int,
    device: str,
    dot16: bool = False,
    state_dtype: torch.dtype = torch.float32,
) -> None:
    batch = len(lengths)
    cu_seqlens = cu_seqlens_of(lengths, device)
    q, k, v, g, beta = delta_inputs(int(cu_seqlens[-1]), hk, hv, dk, dv, device)
    pool = batch + 2
    state = (torch.randn(pool, hv, dk, dv, device=device) * 0.1).to(state_dtype)
    slots = torch.randperm(pool, device=device)[:batch]
    has_initial = torch.arange(batch, device=device) % 2 == 0
    expected_state = state.clone()
    scale = dk**-0.5
    args = (cu_seqlens,)
    expected = reference.gated_delta_rule_prefill(
        q, k, v, g, beta, *args, expected_state, slots, has_initial, scale, True
    )
    out = gated_delta_rule_prefill(
        q, k, v, g, beta, *args, state, slots, has_initial, scale, True, chunk_size=chunk_size,
        dot16=dot16,
    )  # fmt: skip
    tol = 2e-2 if dot16 else 1e-2
    assert rel_err(out, expected) < tol
    assert rel_err(state[slots], expected_state[slots]) < tol
    others = torch.ones(pool, dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(state[others], expected_state[others])


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize(("hk", "hv"), [(1, 1), (2, 6)])
def test_gated_delta_rule_decode(hk: int, hv: int, l2norm: bool) -> None:
    check_delta_decode(3, hk, hv, 16, 32, l2norm, "cpu")


def test_gated_delta_rule_decode_loads_the_state_before_the_launch_wait() -> None:
    """With `early_state` (the kernel before did not write the pool) the state is loaded before
    the programmatic-launch wait; the result is the same."""
    check_delta_decode(3, 2, 6, 16, 32, True, "cpu", block_v=16, early_state=True)


def test_decode_launch_has_its_own_settings_over_16_sequences() -> None:
    from worker.kernels.triton import delta_rule

    assert decode_launch(16) is delta_rule.DECODE_LAUNCH
    assert decode_launch(17) is delta_rule.WIDE_DECODE_LAUNCH


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_delta_rule_on_a_16_bit_state_pool(state_dtype: torch.dtype) -> None:
    """The pool may hold states in 16 bits (half the decode step's state bytes): the kernels
    widen to fp32, compute, and round once on the way back, as the reference does."""
    check_delta_decode(3, 2, 6, 16, 32, True, "cpu", state_dtype)
    check_delta_prefill([1, 0, 45, 32], 1, 2, 16, 32, 16, "cpu", state_dtype=state_dtype)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_gated_delta_rule_prefill(chunk_size: int) -> None:
    # a 1-token sequence, an empty one, one ending mid-chunk, one of whole chunks
    check_delta_prefill([1, 0, 45, 2 * chunk_size], 1, 2, 16, 32, chunk_size, "cpu")


def test_gated_delta_rule_prefill_bf16_intermediates() -> None:
    check_delta_prefill([45, 3], 1, 2, 16, 32, 32, "cpu", dot16=True)


def test_prefill_then_decode_continues_the_recurrence() -> None:
    """Prefill of n tokens then one decode step leaves the state the n+1-token prefill leaves."""
    n, hk, hv, dk, dv = 20, 1, 2, 16, 16
    q, k, v, g, beta = delta_inputs(n + 1, hk, hv, dk, dv, "cpu")
    slots = torch.tensor([0])
    first = torch.tensor([False])
    split_state = torch.zeros(1, hv, dk, dv)
    gated_delta_rule_prefill(
        q[:n], k[:n], v[:n], g[:n], beta[:n], cu_seqlens_of([n], "cpu"), split_state, slots, first,
        0.25, True, chunk_size=16, dot16=False,
    )  # fmt: skip
    last = gated_delta_rule_decode(
        q[n:], k[n:], v[n:], g[n:], beta[n:], split_state, slots, 0.25, True
    )
    whole_state = torch.zeros(1, hv, dk, dv)
    whole = gated_delta_rule_prefill(
        q, k, v, g, beta, cu_seqlens_of([n + 1], "cpu"), whole_state, slots, first, 0.25, True,
        chunk_size=16, dot16=False,
    )  # fmt: skip
    assert rel_err(split_state, whole_state) < 1e-5
    assert rel_err(last, whole[n:]) < 1e-2


def test_prefill_with_repeated_keys_stays_exact() -> None:
    """Identical keys, beta = 1, no decay: A's entries are all 1, the hardest case for the
    chunk's triangular inverse (its entries alternate in sign)."""
    tokens, dk, dv = 64, 16, 16
    k = torch.randn(1, 1, dk).expand(tokens, 1, dk).contiguous()
    q = torch.randn(tokens, 1, dk)
    v = torch.randn(tokens, 1, dv)
    g = torch.zeros(tokens, 1)
    beta = torch.ones(tokens, 1)
    cu_seqlens = cu_seqlens_of([tokens], "cpu")
    slots, first = torch.tensor([0]), torch.tensor([False])
    expected_state, state = torch.zeros(1, 1, dk, dv), torch.zeros(1, 1, dk, dv)
    expected = reference.gated_delta_rule_prefill(
        q, k, v, g, beta, cu_seqlens, expected_state, slots, first, 0.25, True
    )
    out = gated_delta_rule_prefill(
        q, k, v, g, beta, cu_seqlens, state, slots, first, 0.25, True, chunk_size=64, dot16=False
    )
    assert rel_err(out, expected) < 1e-4
    assert rel_err(state, expected_state) < 1e-4


# ---------------------------------------------------------------- paged attention decode


def check_paged_decode(
    lengths: list[int],
    hq: int,
    hkv: int,
    dim: int,
    block_size: int,
    fp8: bool,
    partition: int | None,
    device: str,
    width: int | None = None,
) -> None:
    width = width or -(-max(lengths) // block_size) + 1
    k_cache, v_cache, tables, k_scale, v_scale = paged_cache(
        lengths, hkv, dim, block_size, width, device, fp8
    )
    q = torch.randn(len(lengths), hq, dim, device=device).bfloat16()
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    scale = dim**-0.5
    args = (q, k_cache, v_cache, context_lens, tables, scale, k_scale, v_scale)
    out = paged_attention_decode(*args, partition=partition)
    assert rel_err(out, reference.paged_attention_decode(*args)) < 1e-2


@pytest.mark.parametrize("partition", [None, 64, 1024])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_attention_decode(fp8: bool, partition: int | None) -> None:
    check_paged_decode([1, 50, 130], 6, 2, 32, 16, fp8, partition, "cpu")


def test_paged_attention_decode_merges_more_splits_than_one_chunk() -> None:
    """34 splits of 16 tokens: the merge reads its partial outputs in three chunks of 16."""
    check_paged_decode([1, 300, 517], 6, 2, 32, 16, True, 16, "cpu")


def test_paged_attention_decode_refuses_a_pool_past_32_bit_rows() -> None:
    """The decode loops number (token, head) rows in 32 bits: 2^31 of them is refused before a
    launch, one fewer page passes (shapes only: meta tensors)."""
    from worker.kernels.triton.paged_attention import check_rows_fit_32_bits

    check_rows_fit_32_bits(torch.empty((2**27 - 1, 16, 1, 8), device="meta"))
    with pytest.raises(ValueError, match="32 bits"):
        check_rows_fit_32_bits(torch.empty((2**27, 16, 1, 8), device="meta"))
    pool = torch.empty((2**24, 16, 8, 8), device="meta")
    q, tables = torch.zeros(1, 8, 8), torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="32 bits"):
        paged_attention_decode(q, pool, pool, torch.ones(1, dtype=torch.int32), tables, 1.0)


def test_paged_attention_decode_splits_each_rows_own_context() -> None:
    """A table far wider than the contexts (as the engine's, sized for its context limit):
    8 splits (on a CPU), each row cutting its own context into them, most splits of the short
    rows empty."""
    from worker.kernels.triton import paged_attention as pa

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pa.split_plan(200 * 16, 4, 2, None, cpu) == (8, 0)
    # the count follows the batch, never the table's width: no width is a compile variant
    assert (
        pa.split_plan(64, 4, 2, None, cuda) == pa.split_plan(1 << 18, 4, 2, None, cuda) == (66, 0)
    )
    check_paged_decode([1, 50, 700, 130], 6, 2, 32, 16, True, None, "cpu", width=200)


# ---------------------------------------------------------------- registry


def test_registry_prefers_triton_on_cuda_only() -> None:
    for op, name in [
        ("rms_norm", "triton.rms_norm"),
        ("gated_delta_rule_decode", "triton.gdn_decode"),
        ("gated_delta_rule_prefill", "triton.gdn_chunked"),
        ("paged_attention_decode", "triton.paged_decode"),
    ]:
        names = [impl.name for impl in ops.implementations(op)]
        assert names[0] == name and names[-1] == "reference"
        assert ops.select(op, torch.device("cpu"), torch.bfloat16).name == "reference"
        kv = torch.float8_e4m3fn if "attention" in op else None
        assert ops.select(op, torch.device("cuda"), torch.bfloat16, kv).name == name
    ok, reason = ops.candidates(
        "paged_attention_decode", torch.device("cuda"), torch.bfloat16, torch.float8_e5m2
    )[0][1:]
    assert not ok and "e4m3" in reason


# ---------------------------------------------------------------- GPU, at the 27B shapes


@GPU
@needs_cuda
def test_gpu_norms_27b() -> None:
    check_rms_norm((8, 5120), True, "cuda")
    check_rms_norm((8, 24, 256), True, "cuda")
    check_gated_rms_norm(8 * 48, 128, "cuda")
    check_gated_rms_norm(4096 * 48, 128, "cuda")


@GPU
@needs_cuda
def test_gpu_conv1d_27b() -> None:
    check_conv1d_update(8, 10240, "cuda", bias=False)
    check_conv1d_prefill([512] * 7 + [3, 1], 10240, "cuda", bias=False)
    check_conv_update_with_gates(8, 10240, 48, "cuda")
    for rows in (1, 8, 16):
        check_conv_update_with_ba_gates(rows, 10240, 48, 5120, "cuda")


@GPU
@needs_cuda
def test_gpu_delta_rule_27b() -> None:
    check_delta_decode(8, 16, 48, 128, 128, True, "cuda")
    check_delta_decode(8, 16, 48, 128, 128, True, "cuda", torch.bfloat16)
    for block_v, warps in ((64, 4), (32, 2), (64, 2)):
        for batch in (8, 64, 5):
            check_delta_decode(
                batch, 16, 48, 128, 128, True, "cuda", torch.bfloat16,
                block_v=block_v, num_warps=warps, early_state=True,
            )  # fmt: skip
    check_delta_prefill([300, 64, 1, 0, 77], 16, 48, 128, 128, 64, "cuda", True, torch.bfloat16)
    for chunk_size, dot16 in ((16, False), (32, False), (32, True), (64, True)):
        check_delta_prefill([300, 64, 1, 0, 77], 16, 48, 128, 128, chunk_size, "cuda", dot16)


@GPU
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_paged_attention_27b(fp8: bool) -> None:
    check_paged_decode([700, 1, 33, 4000, 512, 768, 640, 129], 24, 4, 256, 16, fp8, None, "cuda")
