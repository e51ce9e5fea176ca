"""The plain-PyTorch kernel references against simple dense equivalents (and transformers' own
DeltaNet functions), and the registry's choice and explanation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import ops, reference


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32)])
def test_rms_norm(shape: tuple[int, ...], unit_offset: bool) -> None:
    x = torch.randn(shape)
    w = torch.randn(shape[-1])
    scale = (1 + w) if unit_offset else w
    dense = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * scale
    assert rel_err(ops.rms_norm(x, w, 1e-6, unit_offset), dense) < 1e-6


def test_gated_rms_norm() -> None:
    x, gate, w = torch.randn(7, 32), torch.randn(7, 32), torch.randn(32)
    dense = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w * gate * torch.sigmoid(gate)
    assert rel_err(ops.gated_rms_norm(x, gate, w, 1e-6), dense) < 1e-6


@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_apply_rotary_matches_complex_rotation(rotary_dim: int) -> None:
    tokens, heads, dim, theta = 9, 3, 64, 10_000.0
    x = torch.randn(tokens, heads, dim)
    positions = torch.randint(0, 100, (tokens,))
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = torch.outer(torch.arange(100).float(), inv_freq)
    out = ops.apply_rotary(x, positions, (angles.cos(), angles.sin()), rotary_dim)
    # Neox layout: channel i pairs with channel i + rotary_dim/2; rotate the pair as a complex number.
    half = rotary_dim // 2
    pairs = torch.complex(x[..., :half], x[..., half:rotary_dim])
    rotated = pairs * torch.polar(torch.ones_like(angles[positions]), angles[positions])[:, None]
    expected = torch.cat((rotated.real, rotated.imag, x[..., rotary_dim:]), dim=-1)
    assert rel_err(out, expected) < 1e-5


def _split(total: int, pieces: list[int]) -> torch.Tensor:
    assert sum(pieces) == total
    return reference.cu_seqlens_of(pieces)


@pytest.mark.parametrize("lengths", [[1], [5, 2, 9], [3, 1]])
def test_causal_conv1d_prefill_then_update_equals_full_convolution(lengths: list[int]) -> None:
    channels, kernel, extra = 6, 4, 3
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    seqs = [torch.randn(n + extra, channels) for n in lengths]
    state = torch.randn(len(lengths) + 2, channels, kernel - 1)  # garbage: must be ignored
    slots = torch.arange(len(lengths)) + 1
    first = torch.cat([s[:n] for s, n in zip(seqs, lengths, strict=True)])
    out = ops.causal_conv1d_prefill(
        first,
        weight,
        bias,
        _split(first.shape[0], lengths),
        state,
        slots,
        torch.zeros(len(lengths), dtype=torch.bool),
    )
    steps = [
        ops.causal_conv1d_update(
            torch.stack([s[n + i] for s, n in zip(seqs, lengths, strict=True)]),
            weight,
            bias,
            state,
            slots,
        )
        for i in range(extra)
    ]
    for b, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        dense = F.silu(
            F.conv1d(s.t()[None], weight[:, None], bias, padding=kernel - 1, groups=channels)
        )
        dense = dense[0, :, : s.shape[0]].t()
        start = sum(lengths[:b])
        got = torch.cat([out[start : start + n], *[step[b : b + 1] for step in steps]])
        assert rel_err(got, dense) < 1e-6


def test_causal_conv1d_prefill_continues_from_state() -> None:
    channels, kernel = 4, 4
    weight = torch.randn(channels, kernel)
    x = torch.randn(10, channels)
    state = torch.zeros(1, channels, kernel - 1)
    slot, one = torch.tensor([0]), torch.ones(1, dtype=torch.bool)
    whole = ops.causal_conv1d_prefill(x, weight, None, _split(10, [10]), state.clone(), slot, ~one)
    a = ops.causal_conv1d_prefill(x[:2], weight, None, _split(2, [2]), state, slot, ~one)
    b = ops.causal_conv1d_prefill(x[2:], weight, None, _split(8, [8]), state, slot, one)
    assert rel_err(torch.cat([a, b]), whole) < 1e-6


def _delta_inputs(tokens: int, hk: int, hv: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    q, k = torch.randn(tokens, hk, dk), torch.randn(tokens, hk, dk)
    v = torch.randn(tokens, hv, dv)
    g = -F.softplus(torch.randn(tokens, hv))  # log decay <= 0
    beta = torch.rand(tokens, hv)
    return q, k, v, g, beta


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 6)])
def test_gated_delta_rule_matches_transformers(hk: int, hv: int) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    lengths = [7, 1, 12]
    dk, dv = 16, 8
    q, k, v, g, beta = _delta_inputs(sum(lengths), hk, hv, dk, dv)
    state = torch.zeros(4, hv, dk, dv)
    slots = torch.tensor([3, 0, 2])
    out = ops.gated_delta_rule_prefill(
        q,
        k,
        v,
        g,
        beta,
        _split(q.shape[0], lengths),
        state,
        slots,
        torch.zeros(3, dtype=torch.bool),
        dk**-0.5,
        True,
    )
    start = 0
    for b, n in enumerate(lengths):
        sl = slice(start, start + n)
        hf_out, hf_state = hf.torch_recurrent_gated_delta_rule(
            q[None, sl],
            k[None, sl],
            v[None, sl],
            g[None, sl],
            beta[None, sl],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert rel_err(out[sl], hf_out[0]) < 1e-5
        assert rel_err(state[slots[b]], hf_state[0]) < 1e-5
        start += n


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_delta_rule_equals_recurrence(chunk_size: int) -> None:
    lengths = [13, 3, 30]
    hk, hv, dk, dv = 2, 4, 16, 16
    q, k, v, g, beta = _delta_inputs(sum(lengths), hk, hv, dk, dv)
    init = torch.randn(3, hv, dk, dv) * 0.1
    slots, has = torch.tensor([2, 1, 0]), torch.tensor([True, False, True])
    cu = _split(q.shape[0], lengths)
    s1, s2 = init.clone(), init.clone()
    a = reference.gated_delta_rule_prefill(q, k, v, g, beta, cu, s1, slots, has, dk**-0.5, True)
    b = reference.gated_delta_rule_prefill_chunked(
        q, k, v, g, beta, cu, s2, slots, has, dk**-0.5, True, chunk_size=chunk_size
    )
    assert rel_err(b, a) < 1e-4
    assert rel_err(s2, s1) < 1e-4


def test_delta_rule_decode_continues_prefill() -> None:
    hk, hv, dk, dv, n = 1, 2, 8, 8, 6
    q, k, v, g, beta = _delta_inputs(n, hk, hv, dk, dv)
    slot, no = torch.tensor([0]), torch.zeros(1, dtype=torch.bool)
    whole_state = torch.zeros(1, hv, dk, dv)
    whole = ops.gated_delta_rule_prefill(
        q, k, v, g, beta, _split(n, [n]), whole_state, slot, no, 0.3, False
    )
    state = torch.zeros(1, hv, dk, dv)
    ops.gated_delta_rule_prefill(
        q[:2], k[:2], v[:2], g[:2], beta[:2], _split(2, [2]), state, slot, no, 0.3, False
    )
    steps = [
        ops.gated_delta_rule_decode(
            q[t : t + 1],
            k[t : t + 1],
            v[t : t + 1],
            g[t : t + 1],
            beta[t : t + 1],
            state,
            slot,
            0.3,
            False,
        )
        for t in range(2, n)
    ]
    assert rel_err(torch.cat(steps), whole[2:]) < 1e-5
    assert rel_err(state, whole_state) < 1e-5


def _paged(
    keys: list[torch.Tensor], block_size: int, num_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter per-sequence keys into a paged cache at shuffled blocks; (cache, tables, slots)."""
    heads, dim = keys[0].shape[1:]
    cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype)
    free = torch.randperm(num_blocks).tolist()
    width = max(-(-k.shape[0] // block_size) for k in keys)
    tables = torch.zeros(len(keys), width, dtype=torch.int32)
    all_slots = []
    for b, k in enumerate(keys):
        blocks = [free.pop() for _ in range(-(-k.shape[0] // block_size))]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(k.shape[0])
        all_slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    return cache, tables, torch.cat(all_slots)


def _dense_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_prefill_and_decode_match_dense(hq: int, hkv: int, block_size: int) -> None:
    dim = 16
    contexts = [11, 1, 20]
    chunk = [4, 1, 20]  # tokens fed this step: the tail of each context
    ks = [torch.randn(n, hkv, dim) for n in contexts]
    vs = [torch.randn(n, hkv, dim) for n in contexts]
    k_cache, tables, slots = _paged(ks, block_size, 16, torch.float32)
    v_cache = torch.zeros_like(k_cache)
    ops.write_kv_cache(torch.cat(ks), torch.cat(vs), k_cache, v_cache, slots)
    q = torch.randn(sum(chunk), hq, dim)
    positions = torch.cat([torch.arange(n - c, n) for n, c in zip(contexts, chunk, strict=True)])
    out = ops.paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        _split(sum(chunk), chunk),
        torch.tensor(contexts, dtype=torch.int32),
        tables,
        positions,
        dim**-0.5,
    )
    start = 0
    for b, c in enumerate(chunk):
        sl = slice(start, start + c)
        assert rel_err(out[sl], _dense_causal(q[sl], ks[b], vs[b], positions[sl])) < 1e-5
        start += c
    q1 = torch.randn(3, hq, dim)
    dec = ops.paged_attention_decode(
        q1, k_cache, v_cache, torch.tensor(contexts, dtype=torch.int32), tables, dim**-0.5
    )
    for b, n in enumerate(contexts):
        dense = _dense_causal(q1[b : b + 1], ks[b], vs[b], torch.tensor([n - 1]))
        assert rel_err(dec[b : b + 1], dense) < 1e-5


def test_fp8_kv_cache_dequantizes_on_read() -> None:
    dim, hkv, n = 32, 2, 24
    k, v = torch.randn(n, hkv, dim) * 3, torch.randn(n, hkv, dim) * 3
    k_cache, tables, slots = _paged([k], 8, 4, torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = float(k.abs().max() / 448), float(v.abs().max() / 448)
    ops.write_kv_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    q = torch.randn(1, 4, dim)
    ctx = torch.tensor([n], dtype=torch.int32)
    got = ops.paged_attention_decode(q, k_cache, v_cache, ctx, tables, dim**-0.5, k_scale, v_scale)
    dense = _dense_causal(q, k, v, torch.tensor([n - 1]))
    assert rel_err(got, dense) < 0.08  # e4m3 keeps 3 mantissa bits
    assert rel_err(got, dense) > 0  # it really was quantized


def test_registry_picks_first_supported_and_explains() -> None:
    calls: list[str] = []

    def fast_norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        calls.append("fast")
        return reference.rms_norm(x, w, eps, unit_offset)

    def cpu_fp32_only(device, dtype, kv_dtype):  # type: ignore[no-untyped-def]
        if dtype != torch.float32:
            return False, f"only float32, got {dtype}"
        return True, "test kernel"

    ops.register("rms_norm", fast_norm, cpu_fp32_only, priority=5, name="fast-test")
    try:
        x, w = torch.randn(2, 8), torch.randn(8)
        ops.rms_norm(x, w, 1e-6, False)
        assert calls == ["fast"]
        ops.rms_norm(x.double(), w.double(), 1e-6, False)  # unsupported dtype: reference
        assert calls == ["fast"]
        assert ops.select("rms_norm", x.device, torch.float64).name == "reference"
        table = ops.explain("cpu", torch.float64)
        assert "only float32, got torch.float64" in table
        assert all(op in table for op in ops.OPS)
        assert "fast-test" in ops.explain("cpu", torch.float32).splitlines()[2]
    finally:
        ops.unregister("rms_norm", "fast-test")
    assert ops.select("rms_norm", torch.device("cpu"), torch.float32).name == "reference"


def test_reference_is_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    ops.register(
        "rms_norm", reference.rms_norm, lambda d, t, k: (True, "yes"), 5, name="always-test"
    )
    try:
        assert ops.select("rms_norm", torch.device("cpu"), torch.float32).name == "always-test"
        monkeypatch.setenv("TOKENMILL_KERNELS", "reference")
        ops.reset_choices()
        assert ops.select("rms_norm", torch.device("cpu"), torch.float32).name == "reference"
    finally:
        ops.unregister("rms_norm", "always-test")
        ops.reset_choices()


def test_a_broken_plugin_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "PLUGINS", ("worker.kernels.does_not_exist",))
    monkeypatch.setattr(ops, "_plugins_loaded", False)
    monkeypatch.setattr(ops, "_plugin_errors", {})
    table = ops.explain("cpu", torch.float32)
    assert "worker.kernels.does_not_exist not loaded: ModuleNotFoundError" in table
    assert ops.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6, False).shape == (1, 4)
