"""Plain-PyTorch references of every op the models call (docs/worker-contract.md).

They are the definition of each op: readable, run anywhere (CPU included), and the yardstick the
GPU kernels in `worker/kernels/triton/` are tested against. Semantics follow Hugging Face
transformers (Llama, Qwen3, Qwen3.5): norms in fp32, softmax in fp32, DeltaNet states computed in fp32
(stored in the slot pool's dtype).
Tokens are flat (varlen) with `cu_seqlens`; per-sequence states live in slot pools.

FP8 KV caches store `value / scale` in `float8_e4m3fn`; reads multiply by the per-layer scale.

Size: The plain-PyTorch reference of every kernel op, side by side: long by nature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from worker.models.cache import StagedAttentionCache

_ACTIVATIONS = {"silu": F.silu, None: lambda t: t}


def cu_seqlens_of(lengths: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """The int32 `cu_seqlens` [B + 1] of sequences of these lengths laid end to end."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


def _lens(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of `table` [V, H] on ids' device. The table may live in host memory while
    ids are on a GPU (`worker.models.layers.HostEmbedding`): here through the host, with a sync."""
    return F.embedding(ids.to(table.device), table).to(ids.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last axis. `unit_offset`: y = norm(x) * (1 + weight) (Qwen3.5/3.6, weights
    stored centred on zero, scaled in fp32); otherwise y = weight * norm(x) (Llama: the norm is cast
    back to the input dtype before the scale)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add then the next norm: (rms_norm(x + residual), x + residual), the sum
    rounded to x's dtype first (as an unfused `hidden = hidden + out` does)."""
    total = x + residual
    return rms_norm(total, weight, eps, unit_offset), total


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation on a fused gate|up output x[..., 2F]: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention output x[T, N] * sigmoid(gate), gate of x's size in any shape (the
    per-head gate half of q_proj, [T, H, D])."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeltaNet gates from the a/b projections [T, Hv]: the log decay
    g = -exp(A_log) * softplus(a + dt_bias) in fp32 (<= 0) and beta = sigmoid(b) in b's dtype."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """DeltaNet output norm: norm(x) * weight * silu(gate), the gate applied in fp32."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
) -> torch.Tensor:
    """Neox-style rotary embedding (rotate halves) over the first `rotary_dim` channels of x[T, H, D];
    cos/sin tables are [max_pos, rotary_dim / 2]. The remaining channels pass through."""
    cos_table, sin_table = cos_sin
    half = rotary_dim // 2
    cos = cos_table[positions].float().unsqueeze(1)  # [T, 1, half]
    sin = sin_table[positions].float().unsqueeze(1)
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's per-head q and k norms, then rotary on both: q [T, Hq, D], k [T, Hk,
    D] (strided views of the fused projection are fine) -> contiguous [T, Hq, D], [T, Hk, D]."""
    q = apply_rotary(rms_norm(q, q_weight, eps, unit_offset), positions, cos_sin, rotary_dim)
    k = apply_rotary(rms_norm(k, k_weight, eps, unit_offset), positions, cos_sin, rotary_dim)
    return q.contiguous(), k.contiguous()


def qk_norm_rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qk_norm_rotary, then write_kv_cache of its k and v; q's result."""
    q, k = qk_norm_rotary(
        q, k, q_weight, k_weight, eps, unit_offset, positions, cos_sin, rotary_dim
    )
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over each sequence of x[T, C] (kernel K), continuing from
    conv_state[slot] (the previous K-1 inputs) where has_initial_state, else from zeros. Writes each
    sequence's last K-1 inputs back to conv_state[slot]."""
    channels, kernel = weight.shape
    out = torch.empty_like(x)
    for b, (start, end) in enumerate(_lens(cu_seqlens)):
        slot = int(state_slots[b])
        if bool(has_initial_state[b]):
            prev = conv_state[slot].to(weight.dtype)
        else:
            prev = weight.new_zeros(channels, kernel - 1)
        window = torch.cat((prev, x[start:end].t().to(weight.dtype)), dim=-1)  # [C, K-1+L]
        y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0]
        out[start:end] = _ACTIVATIONS[activation](y).t().to(x.dtype)
        conv_state[slot] = window[:, window.shape[-1] - (kernel - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of the causal conv for x[B, C]: shifts each sequence's conv_state[slot]."""
    window = torch.cat(
        (conv_state[state_slots].to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)), -1
    )
    conv_state[state_slots] = window[:, :, 1:].to(conv_state.dtype)
    y = (window * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias
    return _ACTIVATIONS[activation](y).to(x.dtype)


def conv_update_with_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DeltaNet decode step's inputs: the silu conv update of x[B, C] (state shifted in place)
    and the gates (g, beta) from a, b [B, H], as causal_conv1d_update and gdn_gates."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return causal_conv1d_update(x, weight, None, conv_state, state_slots), g, beta


def conv_update_with_ba_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    hidden: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv_update_with_gates with the gates' logits b|a = hidden @ ba_weight^T (b's rows first,
    as the fused in_proj_b|a holds them), formed in fp32 and rounded to hidden's dtype."""
    heads = ba_weight.shape[0] // 2
    ba = F.linear(hidden.float(), ba_weight.float()).to(hidden.dtype)
    b, a = ba[:, :heads], ba[:, heads:]
    return conv_update_with_gates(x, weight, conv_state, state_slots, a, b, A_log, dt_bias)


def _l2norm(t: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + eps)


def _delta_rule_inputs(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k with the key heads repeated for their value heads (value head h reads key head
    h // (Hv // Hk)), optionally L2-normalised, q scaled."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    repeat = num_v_heads // k.shape[-2]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=-2)
        k = k.repeat_interleave(repeat, dim=-2)
    return q * scale, k


def _initial_state(state: torch.Tensor, slot: int, has_initial_state: bool) -> torch.Tensor:
    """Sequence's state in fp32 (the pool may store it in 16 bits): its slot, or zeros."""
    if has_initial_state:
        return state[slot].float()
    return torch.zeros(state.shape[1:], dtype=torch.float32, device=state.device)


def _delta_rule_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for state[..., Hv, dk, dv] (fp32):
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return state, (state * q.unsqueeze(-1)).sum(-2)


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """The gated delta rule, token by token, over each sequence of the flat batch. q, k [T, Hk, dk],
    v [T, Hv, dv], g (log decay, <= 0) and beta [T, Hv]; state [S, Hv, dk, dv] is read from and
    written back to state[slot] (zeros where not has_initial_state). Returns o [T, Hv, dv]."""
    num_v_heads = v.shape[-2]
    qs, ks = _delta_rule_inputs(q, k, num_v_heads, scale, use_qk_l2norm)
    vs, gs, betas = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for b, (start, end) in enumerate(_lens(cu_seqlens)):
        slot = int(state_slots[b])
        s = _initial_state(state, slot, bool(has_initial_state[b]))
        for t in range(start, end):
            s, out[t] = _delta_rule_step(s, qs[t], ks[t], vs[t], gs[t], betas[t])
        state[slot] = s
    return out.to(v.dtype)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    early_state: bool = False,
) -> torch.Tensor:
    """One gated-delta-rule step for each of B sequences (q, k [B, Hk, dk], v [B, Hv, dv]).
    `early_state` is a scheduling hint for kernels; it does not change the result."""
    qs, ks = _delta_rule_inputs(q, k, v.shape[-2], scale, use_qk_l2norm)
    s, out = _delta_rule_step(
        state[state_slots].float(), qs, ks, v.float(), g.float(), beta.float()
    )
    state[state_slots] = s.to(state.dtype)
    return out.to(v.dtype)


def gated_delta_rule_prefill_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The same op as `gated_delta_rule_prefill`, computed chunk-wise (the WY / UT-transform form
    the GPU kernels use): within a chunk the delta-rule updates become triangular solves and
    matmuls; only the chunk-to-chunk state is sequential. Equal to the recurrence up to rounding."""
    num_v_heads = v.shape[-2]
    qs, ks = _delta_rule_inputs(q, k, num_v_heads, scale, use_qk_l2norm)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for b, (start, end) in enumerate(_lens(cu_seqlens)):
        slot = int(state_slots[b])
        s = _initial_state(state, slot, bool(has_initial_state[b]))
        for c in range(start, end, chunk_size):
            stop = min(c + chunk_size, end)
            # Heads first: [Hv, L, d]
            qc, kc = qs[c:stop].transpose(0, 1), ks[c:stop].transpose(0, 1)
            vc = v[c:stop].float().transpose(0, 1)
            gc, bc = g[c:stop].float().t(), beta[c:stop].float().t()  # [Hv, L]
            length = stop - c
            decay = gc.cumsum(-1)  # log of the decay from the chunk start through token i
            causal = torch.ones(length, length, dtype=torch.bool, device=v.device).tril()
            pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
            pair = pair.exp()  # [Hv, L, L]: decay between token j and token i (j <= i)
            k_beta = kc * bc.unsqueeze(-1)
            # (I + A) w = rhs with A strictly lower: A_ij = beta_i k_i.k_j decay(j->i)
            system = (k_beta @ kc.transpose(-1, -2)) * pair
            system = system.tril(-1) + torch.eye(length, device=v.device)
            u = torch.linalg.solve_triangular(
                system, vc * bc.unsqueeze(-1), upper=False, unitriangular=True
            )
            w = torch.linalg.solve_triangular(
                system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True
            )
            v_new = u - w @ s  # the part of each value the carried state does not already predict
            attn = (qc @ kc.transpose(-1, -2)) * pair
            o = (qc * decay.exp().unsqueeze(-1)) @ s + attn @ v_new
            out[c:stop] = o.transpose(0, 1)
            tail = (decay[:, -1:] - decay).exp().unsqueeze(-1)  # decay from token i to chunk end
            s = s * decay[:, -1].exp()[:, None, None] + (kc * tail).transpose(-1, -2) @ v_new
        state[slot] = s
    return out.to(v.dtype)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store k, v [T, Hkv, D] at flat slots (block * block_size + offset) of the paged caches
    [num_blocks, block_size, Hkv, D]. Negative slots (padding) are skipped. FP8 caches store
    value / scale."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    heads, dim = k_cache.shape[-2:]
    k_flat, v_flat = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    k_flat[slots] = _quantize(k[keep], k_cache.dtype, k_scale)
    v_flat[slots] = _quantize(v[keep], v_cache.dtype, v_scale)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    beside_previous: bool = False,
) -> torch.Tensor:
    """x [..., K] times a 16-bit (or fp32) weight [N, K]: F.linear (one stream: beside_previous
    changes nothing)."""
    return F.linear(x, weight, bias)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times an fp8 weight [N, K] with per-output-channel fp32 scales [N]: the weight
    is dequantized (w * scale) to x's dtype and used as a plain linear layer."""
    return F.linear(x, (weight.float() * scale[:, None]).to(x.dtype), bias)


def fp8_linear_of_silu_mul(
    y: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The down projection of silu(gate) * up from a gate|up output y [..., 2F]."""
    return fp8_linear(silu_mul(y), weight, scale, bias)


def linear_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated MLP's activation from x and its fused gate|up weight [2F, K] (fp8 with scales,
    or 16-bit with scale None): silu_mul of the projection."""
    gate_up = linear(x, weight, bias) if scale is None else fp8_linear(x, weight, scale, bias)
    return silu_mul(gate_up)


def int4_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """The fp32 weight [N, K] of an int4 weight (docs/worker-contract.md, "Int4 weights"):
    qweight uint8 [N, K / 2] holds k = 2j in bits 0-3 and k = 2j + 1 in bits 4-7 of byte j;
    scales (and mins) fp16 [N, ceil(K / group_size)]. Symmetric (mins None): w = (q - 8) * s;
    affine: w = q * s + m (GGUF Q4_1; GPTQ's (q - z) * s has m = -z * s)."""
    n, half = qweight.shape
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(n, 2 * half).float()
    k = q.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    if mins is None:
        return (q - 8.0) * s
    return q * s + mins.float().repeat_interleave(group_size, dim=1)[:, :k]


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times an int4 weight [N, K] (see `int4_dequantize`): the weight dequantized to
    x's dtype and used as a plain linear layer."""
    weight = int4_dequantize(qweight, scales, mins, group_size).to(x.dtype)
    return F.linear(x, weight, bias)


def w4a8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(a * a_scale) @ (codes * s).T in fp32: a [M, K] e4m3 with row scales [M, 1], codes [N, K]
    (int4 values held in any dtype), group scales s [N, G] over groups of `group_size` of K."""
    weight = (
        codes.float() * scales.float().repeat_interleave(group_size, dim=1)[:, : codes.shape[1]]
    )
    out = (a.float() * a_scale.float()) @ weight.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def int4_linear_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated MLP's activation from x and an int4 fused gate|up weight [2F, K]."""
    return silu_mul(int4_linear(x, qweight, scales, mins, group_size, bias))


# The int4-mma layout (docs/worker-contract.md, "Int4 weights"; worker/kernels/cuda/int4_mma.cu):
# 16-row tiles x 64-k chunks, each lane's four mma A-operand words in one 16-byte quad. Byte b of
# word i of lane (g, t) holds rows (g, g + 8) (low, high nibble) of chunk k
# 8 t + 32 (i >> 1) + 4 (i & 1) + MMA_K_OF_BYTE[b].
MMA_K_OF_BYTE = (0, 2, 1, 3)


def int4_mma_pack(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric int4 weight (qweight uint8 [N, K / 2], scales fp16 [N, G]) in the int4-mma
    layout: int32 [N / 16, K / 64, 32, 4] and fp16 scales [N / 16, G, 16]. N % 16 == 0 and
    K % 64 == 0."""
    n, half = qweight.shape
    k = 2 * half
    if n % 16 or k % 64:
        raise ValueError(f"int4-mma needs N % 16 == 0 and K % 64 == 0, got N={n}, K={k}")
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(n, k)
    # row = 16 rt + 8 h + g; k = 64 c + 32 i_hi + 8 t + 4 i_lo + e
    c = codes.view(n // 16, 2, 8, k // 64, 2, 4, 2, 4)  # [rt, h, g, c, i_hi, t, i_lo, e]
    c = c.permute(0, 3, 2, 5, 4, 6, 7, 1).reshape(n // 16, k // 64, 8, 4, 4, 4, 2)
    c = c[..., list(MMA_K_OF_BYTE), :]  # [rt, c, g, t, i, byte, h]
    packed = (c[..., 0] | (c[..., 1] << 4)).contiguous()
    words = packed.view(n // 16, k // 64, 32, 16).view(torch.int32)
    groups = scales.shape[1]
    mma_scales = scales.view(n // 16, 16, groups).transpose(1, 2).contiguous()
    return words, mma_scales


def int4_mma_unpack(
    qweight: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `int4_mma_pack`: (qweight uint8 [N, K / 2], scales fp16 [N, G])."""
    tiles, chunks = qweight.shape[:2]
    n, k = 16 * tiles, 64 * chunks
    b = qweight.contiguous().view(torch.uint8).view(tiles, chunks, 8, 4, 4, 4)
    c = torch.stack((b & 0xF, b >> 4), dim=-1)  # [rt, c, g, t, i, byte, h]
    c = c[..., [MMA_K_OF_BYTE.index(e) for e in range(4)], :]  # byte -> e
    c = c.view(tiles, chunks, 8, 4, 2, 2, 4, 2)  # [rt, c, g, t, i_hi, i_lo, e, h]
    codes = c.permute(0, 7, 2, 1, 4, 3, 5, 6).reshape(n, k)
    groups = scales.shape[1]
    flat_scales = scales.transpose(1, 2).reshape(n, groups)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), flat_scales


def int4_mma_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times a symmetric int4 weight in the int4-mma layout (`int4_mma_pack`)."""
    q, s = int4_mma_unpack(qweight, scales)
    return int4_linear(x, q, s, None, group_size, bias)


# x for the int4-mma GEMV's int8 products (int4_mma.cu, X8): token m's chunk c (64 k) is 64
# bytes, lane t's 16 at 16 t; byte 8 p + 4 h + b holds k = 64 c + 32 p + 8 t + 4 h +
# MMA_K_OF_BYTE[b], so B register h of the chunk's m16n8k32 product p is one 32-bit word, in the
# weight words' k order.
X8_GROUP = 128


def _x8_order(device: torch.device) -> torch.Tensor:
    """For each stored byte of a chunk, the k within the chunk it holds."""
    order = [
        32 * p + 8 * t + 4 * h + MMA_K_OF_BYTE[b]
        for t in range(4)
        for p in range(2)
        for h in range(2)
        for b in range(4)
    ]
    return torch.tensor(order, device=device)


class X8(NamedTuple):
    """An activation as the int4 GEMV's int8 products take it (`int4_mma_x8`): codes int8 [M, K]
    in the X8 order, scales fp32 [M, K / 128], and the dtype of the activation they stand for
    (the GEMV's output dtype)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype = torch.bfloat16


def int4_mma_x8(x: torch.Tensor) -> X8:
    """x [M, K] (K % 128 == 0) rounded to int8 per token and group of 128 k: scale = absmax /
    127, codes floor(x / scale + 0.5) (the kernels that write them round so), stored in the X8
    order above; scales fp32 [M, K / 128]. A zero group has scale 0 and codes 0."""
    m, k = x.shape
    if k % X8_GROUP:
        raise ValueError(f"int4-mma x8 needs K % {X8_GROUP} == 0, got K={k}")
    groups = x.float().reshape(m, k // X8_GROUP, X8_GROUP)
    scales = groups.abs().amax(-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.floor(groups / safe[..., None] + 0.5).to(torch.int8).view(m, k)
    stored = codes.view(m, k // 64, 64)[..., _x8_order(x.device)].reshape(m, k)
    return X8(stored.contiguous(), scales.contiguous(), x.dtype)


def int4_mma_x8_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 x [M, K] that `int4_mma_x8`'s codes and scales stand for (natural k order)."""
    m, k = codes.shape
    natural = torch.empty_like(codes).view(m, k // 64, 64)
    natural[..., _x8_order(codes.device)] = codes.view(m, k // 64, 64)
    values = natural.view(m, k // X8_GROUP, X8_GROUP).float() * scales[..., None]
    return values.view(m, k)


def quantize_x8(x: torch.Tensor) -> X8:
    """x [M, K] as int8 codes (`int4_mma_x8`) by a launch of its own."""
    return int4_mma_x8(x)


def rms_norm_x8(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> tuple[torch.Tensor, X8]:  # fmt: skip
    """rms_norm, and its output as int8 codes for the int4 GEMV after it (rows [.., D] flat)."""
    out = rms_norm(x, weight, eps, unit_offset)
    return out, int4_mma_x8(out.reshape(-1, out.shape[-1]))


def add_rms_norm_x8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, X8]:
    """add_rms_norm, and its normed output as int8 codes."""
    out, total = add_rms_norm(x, residual, weight, eps, unit_offset)
    return out, total, int4_mma_x8(out.reshape(-1, out.shape[-1]))


def gated_rms_norm_x8(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, X8]:
    """gated_rms_norm of x [T, H, D], and its output as int8 codes of rows [T, H * D]."""
    out = gated_rms_norm(x, gate, weight, eps)
    return out, int4_mma_x8(out.reshape(out.shape[0], -1))


def sigmoid_mul_x8(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, X8]:
    """sigmoid_mul, and its output [T, N] as int8 codes."""
    out = sigmoid_mul(x, gate)
    return out, int4_mma_x8(out)


def int4_mma_linear_x8(
    x8: X8,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The int4-mma weight times x given as int8 codes (`int4_mma_x8`), in x's dtype."""
    x = int4_mma_x8_values(x8.codes, x8.scales)
    return int4_mma_linear(x, qweight, scales, group_size, bias).to(x8.dtype)


def int4_mma_linear_of_silu_mul(
    y: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP's down projection (int4-mma layout) of silu(gate) * up from a gate|up output y
    [..., 2F] with paired tiles (`int4_mma_pair_tiles`), read as the GEMM gives it."""
    return int4_mma_linear(silu_mul(int4_mma_unpair_outputs(y)), qweight, scales, group_size, bias)


def int4_mma_linear_silu_mul_x8(
    x8: X8, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """silu(gate) * up from x given as int8 codes and a paired gate|up weight."""
    q, s = int4_mma_unpair_tiles(qweight, scales)
    return silu_mul(int4_mma_linear_x8(x8, q, s, group_size))


# A fused gate|up weight [2F, K] in the int4-mma layout may have its 16-row tiles paired: tile 2j
# holds gate rows 16 j..16 j + 15 and tile 2j + 1 the up rows of the same outputs (F % 16 == 0),
# so the decode GEMV's CTAs, which own an even number of tiles, form silu(gate) * up themselves.


def _regroup_tiles(t: torch.Tensor, outer: int) -> torch.Tensor:
    """t's first axis seen as [outer, n / outer] and read the other way round."""
    n = t.shape[0]
    return t.view(outer, n // outer, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def int4_mma_pair_tiles(
    qweight: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) of a fused gate|up weight in the int4-mma layout, tiles reordered from
    gate..., up... to gate 0, up 0, gate 1, up 1, ... (`int4_mma_unpair_tiles` undoes it)."""
    tiles = qweight.shape[0]
    if tiles % 2:
        raise ValueError(f"pairing gate|up tiles needs F % 16 == 0, got 2F = {16 * tiles}")
    return _regroup_tiles(qweight, 2), _regroup_tiles(scales, 2)


def int4_mma_unpair_tiles(
    qweight: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `int4_mma_pair_tiles`: gate tiles first, then up tiles."""
    half = qweight.shape[0] // 2
    return _regroup_tiles(qweight, half), _regroup_tiles(scales, half)


def int4_mma_unpair_outputs(y: torch.Tensor) -> torch.Tensor:
    """A paired-tile projection's output [..., 2F] in gate|up order (what the unpaired weight
    gives): 16 gate columns, 16 up columns, ... -> the F gate columns, then the F up columns."""
    two_f = y.shape[-1]
    return y.unflatten(-1, (two_f // 32, 2, 16)).transpose(-3, -2).flatten(-3)


def int4_mma_linear_silu_mul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """silu(gate) * up [..., F] from x [..., K] and a fused gate|up weight [2F, K] in the
    int4-mma layout with paired tiles (`int4_mma_pair_tiles`)."""
    q, s = int4_mma_unpair_tiles(qweight, scales)
    return silu_mul(int4_mma_linear(x, q, s, group_size))


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize == 1:
        return (x.float() / scale).to(dtype)
    return x.to(dtype)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: float
) -> torch.Tensor:
    """The first `length` entries [length, Hkv, D] (fp32) of one sequence's paged cache."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[pos // block_size].long()
    values = cache[blocks, pos % block_size].float()
    if cache.dtype.itemsize == 1:
        values = values * scale
    return values


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal softmax attention of q [L, Hq, D] at positions q_pos over keys/values [N, Hkv, D]
    (position i at index i); query head h reads kv head h // (Hq // Hkv)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk q [T, Hq, D] over its whole context in the paged
    cache (cached prefix + this chunk, already written), GQA by Hq // Hkv."""
    out = torch.empty_like(q)
    lengths = context_lens.tolist()
    for b, (start, end) in enumerate(_lens(cu_seqlens)):
        keys = _gather_context(k_cache, block_tables[b], lengths[b], k_scale)
        values = _gather_context(v_cache, block_tables[b], lengths[b], v_scale)
        out[start:end] = _attend(q[start:end], keys, values, positions[start:end], scale)
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token q [B, Hq, D] per sequence over its whole cached context."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        keys = _gather_context(k_cache, block_tables[b], length, k_scale)
        values = _gather_context(v_cache, block_tables[b], length, v_scale)
        last = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], keys, values, last, scale)[0]
    return out


# ---------------------------------------------------------------- staged KV pages
#
# A StagedAttentionCache (worker/models/cache.py) keeps each layer's pages in two pools: recent
# pages FP8, compressed pages TurboQuant codes (worker/kvcache/turboquant.py), every vector in the
# codec's rotated basis. Block ids below cache.num_recent_blocks are recent pages. These ops take
# rotated queries and return rotated outputs (sum_j p_j R v_j = R sum_j p_j v_j): the layer
# rotates q once per head and un-rotates the output once per head (worker/kvcache/staged.py).


def _staged_vectors(
    cache: StagedAttentionCache, blocks: torch.Tensor, offsets: torch.Tensor, value: bool
) -> torch.Tensor:
    """Keys (or values) [N, Hkv, D] fp32 in the rotated basis at (block id, offset) pairs of
    either pool: FP8 times its scale, or centroid * norm."""
    from worker.kvcache import turboquant as tq

    pages, scale = (cache.v_cache, cache.v_scale) if value else (cache.k_cache, cache.k_scale)
    codes, norms = (cache.v_codes, cache.v_norms) if value else (cache.k_codes, cache.k_norms)
    bits = cache.v_bits if value else cache.k_bits
    recent = cache.num_recent_blocks
    compressed = blocks >= recent
    plain = pages[blocks.clamp(max=recent - 1), offsets].float()
    if pages.dtype.itemsize == 1:
        plain = plain * scale
    if not cache.num_compressed_blocks:
        return plain
    index = (blocks - recent).clamp(0, cache.num_compressed_blocks - 1)
    encoded = tq.Encoded(codes[index, offsets], norms[index, offsets])
    decoded = tq.dequantize_rotated(encoded, bits, pages.shape[-1])
    return torch.where(compressed[:, None, None], decoded, plain)


def _staged_context(
    cache: StagedAttentionCache, block_table: torch.Tensor, length: int, value: bool
) -> torch.Tensor:
    block_size = cache.k_cache.shape[1]
    pos = torch.arange(length, device=block_table.device)
    return _staged_vectors(cache, block_table[pos // block_size].long(), pos % block_size, value)


def turboquant_restage(
    cache: StagedAttentionCache, recent_blocks: torch.Tensor, compressed_blocks: torch.Tensor
) -> None:
    """Re-encode recent pages (block ids) into compressed pages (compressed pool indices, not
    block ids): each token's k and v per head become TurboQuant codes of their own bit width and
    an fp16 norm. The recent pages are left as they were."""
    from worker.kvcache import turboquant as tq

    src, dst = recent_blocks.long(), compressed_blocks.long()
    if src.numel() == 0:
        return
    for pages, scale, codes, norms, bits in (
        (cache.k_cache, cache.k_scale, cache.k_codes, cache.k_norms, cache.k_bits),
        (cache.v_cache, cache.v_scale, cache.v_codes, cache.v_norms, cache.v_bits),
    ):
        values = pages[src].float()
        if pages.dtype.itemsize == 1:
            values = values * scale
        encoded = tq.quantize_rotated(values, bits)
        codes[dst] = encoded.codes
        norms[dst] = encoded.norms


def staged_attention_prefill(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention_prefill` over mixed recent/compressed pages, q and the result [T, Hq, D]
    in the rotated basis."""
    out = torch.empty_like(q)
    lengths = context_lens.tolist()
    for b, (start, end) in enumerate(_lens(cu_seqlens)):
        keys = _staged_context(cache, block_tables[b], lengths[b], value=False)
        values = _staged_context(cache, block_tables[b], lengths[b], value=True)
        out[start:end] = _attend(q[start:end], keys, values, positions[start:end], scale)
    return out


def rotate_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each of q, k, v @ rotation: 16-bit GEMMs, fp32 sums."""
    return q @ rotation, k @ rotation, v @ rotation


def unrotate_sigmoid_mul(
    x: torch.Tensor, gate: torch.Tensor | None, rotation: torch.Tensor
) -> torch.Tensor:
    """(x @ rotation^T) as [T, H * D], then sigmoid_mul with gate where given."""
    out = (x @ rotation.T).reshape(x.shape[0], -1)
    return out if gate is None else sigmoid_mul(out, gate)


def staged_attention_decode(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention_decode` over mixed recent/compressed pages, q and the result [B, Hq, D]
    in the rotated basis."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        keys = _staged_context(cache, block_tables[b], length, value=False)
        values = _staged_context(cache, block_tables[b], length, value=True)
        last = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], keys, values, last, scale)[0]
    return out


def staged_scratch(
    cache: StagedAttentionCache, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every page the block tables [B, M] name, both kinds, as plain caches of `dtype`
    [B * M, block_size, Hkv, D] (rotated basis, scales applied) and the tables into them
    [B, M] (row-major): a prefill over mixed pages can then run the plain prefill kernel.
    No host sync: the scratch covers the tables' full width."""
    batch, width = block_tables.shape
    block_size = cache.k_cache.shape[1]
    blocks = block_tables.reshape(-1).long().repeat_interleave(block_size)
    offsets = torch.arange(block_size, device=blocks.device).repeat(batch * width)
    shape = (batch * width, block_size, *cache.k_cache.shape[2:])
    keys = _staged_vectors(cache, blocks, offsets, value=False).to(dtype).view(shape)
    values = _staged_vectors(cache, blocks, offsets, value=True).to(dtype).view(shape)
    tables = torch.arange(batch * width, device=blocks.device, dtype=torch.int32)
    return keys, values, tables.view(batch, width)
