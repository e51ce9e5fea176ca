"""Early release under programmatic dependent launch (worker/kernels/pdl.py): the norms and the
attention's output gate may let the next kernel launch before their own wait.

On CPU: the switch never reaches a kernel off the GPU (the interpreter has no PDL) and the
kernels that take it still compute their references. With `-m gpu`: a W4 decode step's chain of
GEMVs and short kernels in a CUDA graph, early release on, gives each product of the new input
at every replay, including the 16-bit b|a GEMV whose late wait reads the norm's output beside
the int4 GEMV after the norm."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.worker.numerics import rel_err
from worker.kernels import ops, pdl, reference
from worker.kernels.triton import _launch
from worker.kernels.triton.activations import _sigmoid_mul_kernel
from worker.kernels.triton.norm import _rms_norm_kernel
from worker.models.int4 import quantize_rtn

GPU = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def early_release() -> Iterator[None]:
    pdl.set_early_release(True)
    try:
        yield
    finally:
        pdl.set_early_release(False)


def test_only_the_short_kernels_between_gemvs_release_early() -> None:
    from worker.kernels.triton.x8 import _quantize_x8_kernel

    assert _rms_norm_kernel.takes_early_release and _sigmoid_mul_kernel.takes_early_release
    assert _quantize_x8_kernel.takes_early_release
    from worker.kernels.triton.conv1d import _conv_update_kernel

    # the recurrence after the conv update loads only its state slots before its wait
    assert _conv_update_kernel.takes_early_release
    from worker.kernels.triton.fp8_gemm import _gemv_kernel

    # a GEMV with a late wait reads its input before waiting: it must never release early
    assert not _gemv_kernel.takes_early_release


def test_the_switch_stays_off_the_cpu(early_release: None) -> None:
    assert not pdl.early_release_enabled(torch.device("cpu"))
    seen: list[dict[str, object]] = []
    original = _launch.InterpretedFunction.__getitem__

    def record(self: object, grid: object) -> object:
        run = original(self, grid)  # type: ignore[arg-type]

        def launch(*args: object, **kwargs: object) -> object:
            seen.append(kwargs)
            return run(*args, **kwargs)

        return launch

    torch.manual_seed(0)
    x, res, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    _launch.InterpretedFunction.__getitem__ = record  # type: ignore[method-assign]
    try:
        from worker.kernels.triton.norm import add_rms_norm

        normed, total = add_rms_norm(x, res, w, 1e-6, True)
    finally:
        _launch.InterpretedFunction.__getitem__ = original  # type: ignore[method-assign]
    assert seen and all(k["EARLY_RELEASE"] is False and k["PDL"] is False for k in seen)
    want, want_total = reference.add_rms_norm(x, res, w, 1e-6, True)
    assert rel_err(normed, want) < 1e-5 and rel_err(total, want_total) < 1e-6


def int4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words, mma scales, dequantized fp32 weight) of a random int4 g128 weight on the GPU."""
    q = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, True)
    words, scales = reference.int4_mma_pack(q.qweight, q.scales)
    return words, scales, reference.int4_dequantize(q.qweight, q.scales, None, 128)


@GPU
@needs_cuda
def test_gpu_decode_chain_with_early_release(early_release: None) -> None:
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton.fp8_gemm import DecodeTiling, w8_gemv

    if not pdl.early_release_enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 or newer")
    torch.manual_seed(0)
    device, bf16, m = torch.device("cuda"), torch.bfloat16, 8
    act = torch.empty(m, 17408, device=device, dtype=bf16)
    resid = torch.empty(m, 5120, device=device, dtype=bf16)
    norm_w = torch.randn(5120, device=device) * 0.1
    down = int4_weight(5120, 17408)
    qkvz = int4_weight(16384, 5120)
    o = int4_weight(5120, 6144)
    ba_w = torch.randn(96, 5120, device=device, dtype=bf16) * 0.02

    def step() -> tuple[torch.Tensor, ...]:
        y = int4_mma.gemv(act, down[0], down[1], 128)
        x, h = ops.add_rms_norm(y, resid, norm_w, 1e-6, True)  # releases early
        mixed = int4_mma.gemv(x, qkvz[0], qkvz[1], 128)
        ba = w8_gemv(x, ba_w, None, None, DecodeTiling(32, 256, 20), beside_previous=True)
        gated = ops.sigmoid_mul(mixed[:, :6144], mixed[:, 6144:12288])  # releases early
        return h, ba, int4_mma.gemv(gated, o[0], o[1], 128)

    act.copy_(torch.randn_like(act))
    resid.copy_(torch.randn_like(resid))
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, ba, out = step()
    for _ in range(20):
        act.copy_(torch.randn_like(act))
        resid.copy_(torch.randn_like(resid))
        graph.replay()
        y = (act.float() @ down[2].T).to(bf16)
        want_x, want_h = reference.add_rms_norm(y, resid, norm_w, 1e-6, True)
        assert rel_err(h.float(), want_h.float()) < 1e-2
        assert rel_err(ba.float(), want_x.float() @ ba_w.float().T) < 2e-2
        mixed = (want_x.float() @ qkvz[2].T).to(bf16)
        gated = reference.sigmoid_mul(mixed[:, :6144], mixed[:, 6144:12288])
        assert rel_err(out.float(), gated.float() @ o[2].T) < 3e-2


@GPU
@needs_cuda
@pytest.mark.parametrize("ba_in_conv", [False, True])
def test_gpu_deltanet_chain_with_early_release(early_release: None, ba_in_conv: bool) -> None:
    """A W4 DeltaNet layer's decode chain in a CUDA graph: int4 qkv|z, the conv update (which
    releases early) with its gates (b|a from a GEMV beside qkv|z, or formed in its own launch),
    then the recurrence loading its states before its wait. Every replay's output and states
    match the references' run step by step on copies of the states."""
    from worker.kernels.cuda import int4_mma

    if not pdl.early_release_enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 or newer")
    torch.manual_seed(1)
    device, bf16, m = torch.device("cuda"), torch.bfloat16, 8
    hk, hv, dk, dv, conv_dim = 16, 48, 128, 128, 10240
    x = torch.empty(m, 5120, device=device, dtype=bf16)
    qkvz = int4_weight(conv_dim + hv * dv, 5120)
    ba_w = (torch.randn(2 * hv, 5120, device=device) * 0.02).to(bf16)
    conv_w = (torch.randn(conv_dim, 4, device=device) * 0.5).to(bf16)
    A_log, dt_bias = torch.randn(hv, device=device) * 0.5, torch.randn(hv, device=device)
    slots = torch.randperm(m + 2, device=device)[:m]
    conv_state = (torch.randn(m + 2, conv_dim, 3, device=device) * 0.5).to(bf16)
    state = (torch.randn(m + 2, hv, dk, dv, device=device) * 0.05).to(bf16)
    want_conv, want_state = conv_state.clone(), state.clone()

    def rule(
        mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor, op: Any
    ) -> torch.Tensor:
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(m, hk, dk), k.view(m, hk, dk), v.view(m, hv, dv)
        return op(q, k, v, g, beta, pool, slots, dk**-0.5, True, early_state=True)

    def step() -> torch.Tensor:
        mixed = int4_mma.gemv(x, qkvz[0], qkvz[1], 128)[:, :conv_dim]
        if ba_in_conv:
            conv, g, beta = ops.conv_update_with_ba_gates(
                mixed, conv_w, conv_state, slots, x, ba_w, A_log, dt_bias
            )
        else:
            ba = ops.linear(x, ba_w, None, beside_previous=True)
            conv, g, beta = ops.conv_update_with_gates(
                mixed, conv_w, conv_state, slots, ba[:, hv:], ba[:, :hv], A_log, dt_bias
            )
        return rule(conv, g, beta, state, ops.gated_delta_rule_decode)

    x.copy_(torch.randn_like(x))
    step()  # compiles
    torch.cuda.synchronize()
    conv_state.copy_(want_conv)
    state.copy_(want_state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        mixed = (x.float() @ qkvz[2].T).to(bf16)[:, :conv_dim]
        conv, g, beta = reference.conv_update_with_ba_gates(
            mixed, conv_w, want_conv, slots, x, ba_w, A_log, dt_bias
        )
        want = rule(conv, g, beta, want_state, reference.gated_delta_rule_decode)
        torch.cuda.synchronize()
        assert rel_err(out.float(), want.float()) < 3e-2
        assert rel_err(state.float(), want_state.float()) < 3e-2
        assert rel_err(conv_state.float(), want_conv.float()) < 2e-2
