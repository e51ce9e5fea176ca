"""The op registry: the only way models call kernels.

Each op has a list of implementations, highest priority first. An implementation says whether it
can run for a call's device and dtypes (`supported(device, dtype, kv_dtype) -> (ok, reason)`); the
registry uses the first that can and remembers the choice per (device type, dtypes). The plain
PyTorch reference (`worker.kernels.reference`) is always registered last and always runs.

Registering a GPU kernel is one line (from `worker/kernels/triton/`, imported lazily on first use,
so a missing or broken triton is only a reason in `explain()`, never an import error):

    register("rms_norm", triton_rms_norm, cuda_only, priority=10)

`explain(device, dtype, kv_dtype)` returns a table of every op, the chosen implementation and
each candidate's reason. `TOKENMILL_KERNELS=reference` forces the references everywhere.

Size: The op registry: one entry per op, each picking its kernel or the reference and saying
why; a table, long by nature.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worker.kernels import reference

if TYPE_CHECKING:
    from worker.kernels.reference import X8
    from worker.models.cache import StagedAttentionCache

Supported = Callable[[torch.device, torch.dtype, "torch.dtype | None"], tuple[bool, str]]

OPS = (
    "rms_norm",
    "add_rms_norm",
    "gated_rms_norm",
    "silu_mul",
    "sigmoid_mul",
    "gdn_gates",
    "apply_rotary",
    "qk_norm_rotary",
    "qk_norm_rotary_write_kv",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "conv_update_with_gates",
    "conv_update_with_ba_gates",
    "gated_delta_rule_prefill",
    "gated_delta_rule_decode",
    "write_kv_cache",
    "paged_attention_prefill",
    "paged_attention_decode",
    "linear",
    "fp8_linear",
    "fp8_linear_of_silu_mul",
    "linear_silu_mul",
    "int4_linear",
    "int4_linear_silu_mul",
    "int4_mma_linear",
    "int4_mma_linear_silu_mul",
    "int4_mma_linear_of_silu_mul",
    # an int4 GEMV's input also as int8 codes (reference.int4_mma_x8), from the kernel before it,
    # and the GEMV on int8 tensor cores that takes them
    "rms_norm_x8",
    "add_rms_norm_x8",
    "gated_rms_norm_x8",
    "sigmoid_mul_x8",
    "quantize_x8",
    "int4_mma_linear_x8",
    "int4_mma_linear_silu_mul_x8",
    "turboquant_restage",
    "staged_attention_prefill",
    "staged_attention_decode",
    "rotate_qkv",
    "unrotate_sigmoid_mul",
    "embedding",
)
# Ops whose implementation choice also depends on the KV cache dtype (fp8 or not).
_KV_OPS = {
    "write_kv_cache",
    "qk_norm_rotary_write_kv",
    "paged_attention_prefill",
    "paged_attention_decode",
    "turboquant_restage",
    "staged_attention_prefill",
    "staged_attention_decode",
}

# Modules that register GPU implementations when imported.
PLUGINS: tuple[str, ...] = ("worker.kernels.triton", "worker.kernels.cuda")


@dataclass(frozen=True)
class Implementation:
    op: str
    name: str
    fn: Callable[..., Any]
    supported: Supported
    priority: int


def always(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    return True, "plain PyTorch, runs on every device"


def cuda_only(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """A ready-made `supported` for kernels that run on any CUDA device and float dtype."""
    if device.type != "cuda":
        return False, f"needs CUDA, got {device.type}"
    return True, "CUDA device"


_registry: dict[str, list[Implementation]] = {op: [] for op in OPS}
_chosen: dict[tuple[str, str, torch.dtype, torch.dtype | None], Implementation] = {}
_plugin_errors: dict[str, str] = {}
_plugins_loaded = False


def register(
    op: str,
    fn: Callable[..., Any],
    supported: Supported = cuda_only,
    priority: int = 10,
    name: str | None = None,
) -> None:
    """Add an implementation of `op`; higher priority is tried first (the reference has -1000)."""
    if op not in _registry:
        raise KeyError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    impl = Implementation(op, name or f"{fn.__module__}.{fn.__qualname__}", fn, supported, priority)
    entries = [e for e in _registry[op] if e.name != impl.name] + [impl]
    _registry[op] = sorted(entries, key=lambda e: -e.priority)
    _chosen.clear()


def unregister(op: str, name: str) -> None:
    """Remove a named implementation (the reference stays)."""
    if name == "reference":
        raise ValueError("the reference implementation is always registered")
    _registry[op] = [e for e in _registry[op] if e.name != name]
    _chosen.clear()


def implementations(op: str) -> list[Implementation]:
    """The registered implementations of `op`, in the order they are tried."""
    _load_plugins()
    return list(_registry[op])


def reset_choices() -> None:
    """Forget memoised choices (after changing TOKENMILL_KERNELS, say)."""
    _chosen.clear()


for _op in OPS:
    register(_op, getattr(reference, _op), always, priority=-1000, name="reference")


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in PLUGINS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a GPU kernel package must never break CPU serving
            _plugin_errors[module] = f"{type(exc).__name__}: {exc}"


def _forced_reference() -> bool:
    return os.environ.get("TOKENMILL_KERNELS", "").strip().lower() == "reference"


def candidates(
    op: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> list[tuple[Implementation, bool, str]]:
    """Every implementation of `op` in priority order with whether it can run here and why."""
    _load_plugins()
    rows = []
    for impl in _registry[op]:
        if _forced_reference() and impl.name != "reference":
            ok, reason = False, "TOKENMILL_KERNELS=reference"
        else:
            try:
                ok, reason = impl.supported(device, dtype, kv_dtype)
            except Exception as exc:
                ok, reason = False, f"supported() raised {type(exc).__name__}: {exc}"
        rows.append((impl, ok, reason))
    return rows


def select(
    op: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> Implementation:
    """The implementation of `op` used for this device and dtypes (memoised)."""
    key = (op, device.type, dtype, kv_dtype)
    impl = _chosen.get(key)
    if impl is None:
        impl = next(i for i, ok, _ in candidates(op, device, dtype, kv_dtype) if ok)
        _chosen[key] = impl
    return impl


def explain(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
) -> str:
    """A plain-text table: per op, the chosen implementation and every candidate's reason."""
    device = torch.device(device)
    lines = [f"kernels for device={device.type} dtype={dtype} kv_dtype={kv_dtype or dtype}"]
    lines.append(f"{'op':<26} {'chosen':<28} candidates")
    for op in OPS:
        kv = (kv_dtype or dtype) if op in _KV_OPS else None
        rows = candidates(op, device, dtype, kv)
        chosen = next(i.name for i, ok, _ in rows if ok)
        detail = "; ".join(f"{i.name}: {'yes' if ok else 'no'} ({why})" for i, ok, why in rows)
        lines.append(f"{op:<26} {chosen:<28} {detail}")
    for module, error in _plugin_errors.items():
        lines.append(f"plugin {module} not loaded: {error}")
    return "\n".join(lines)


def _pick(op: str, x: torch.Tensor, kv: torch.Tensor | None = None) -> Callable[..., Any]:
    return select(op, x.device, x.dtype, None if kv is None else kv.dtype).fn


# The ops, with the signatures of docs/worker-contract.md; see `worker.kernels.reference`.


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of `table` [V, H], on ids' device; the table on it or in pinned host
    memory. Chosen by ids' device and the table's dtype."""
    return select("embedding", ids.device, table.dtype).fn(ids, table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    return _pick("rms_norm", x)(x, weight, eps, unit_offset)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a residual add and the following norm."""
    return _pick("add_rms_norm", x)(x, residual, weight, eps, unit_offset)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _pick("gated_rms_norm", x)(x, gate, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate|up projection x[..., 2F] -> [..., F]."""
    return _pick("silu_mul", x)(x)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x[T, N] * sigmoid(gate) for a gate of N elements per token in any (strided) shape."""
    return _pick("sigmoid_mul", x)(x, gate)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeltaNet (g, beta) from the a/b projections: fp32 log decay and sigmoid write strength."""
    return _pick("gdn_gates", a)(a, b, A_log, dt_bias)


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
) -> torch.Tensor:
    return _pick("apply_rotary", x)(x, positions, cos_sin, rotary_dim)


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
    """apply_rotary(rms_norm(q)), apply_rotary(rms_norm(k)): an attention layer's q/k norms and
    rotary (kernels: one launch for the four)."""
    return _pick("qk_norm_rotary", q)(
        q, k, q_weight, k_weight, eps, unit_offset, positions, cos_sin, rotary_dim
    )


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
    """qk_norm_rotary with its k and v written into the paged caches (write_kv_cache); q's
    result (kernels: one launch for the five)."""
    fn = _pick("qk_norm_rotary_write_kv", q, k_cache)
    return fn(
        q, k, v, q_weight, k_weight, eps, unit_offset, positions, cos_sin, rotary_dim,
        k_cache, v_cache, slot_mapping, k_scale, v_scale,
    )  # fmt: skip


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
    fn = _pick("causal_conv1d_prefill", x)
    return fn(x, weight, bias, cu_seqlens, conv_state, state_slots, has_initial_state, activation)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    fn = _pick("causal_conv1d_update", x)
    return fn(x, weight, bias, conv_state, state_slots, activation)


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
    """(silu conv update of x[B, C], g, beta): a DeltaNet decode step's inputs in one call (one
    launch on a GPU instead of two)."""
    fn = _pick("conv_update_with_gates", x)
    return fn(x, weight, conv_state, state_slots, a, b, A_log, dt_bias)


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
    """`conv_update_with_gates` with the gates' logits b|a = hidden @ ba_weight^T formed in the
    same call (a 16-bit b|a beside int4 qkv|z: one launch instead of two on a GPU)."""
    fn = _pick("conv_update_with_ba_gates", x)
    return fn(x, weight, conv_state, state_slots, hidden, ba_weight, A_log, dt_bias)


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
    fn = _pick("gated_delta_rule_prefill", q)
    return fn(
        q, k, v, g, beta, cu_seqlens, state, state_slots, has_initial_state, scale, use_qk_l2norm
    )


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
    """`early_state`: the kernel launched just before did not write `state` (a hint a kernel
    may use to start loading it sooner; the result is the same)."""
    fn = _pick("gated_delta_rule_decode", q)
    return fn(q, k, v, g, beta, state, state_slots, scale, use_qk_l2norm, early_state=early_state)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    fn = _pick("write_kv_cache", k, k_cache)
    fn(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


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
    fn = _pick("paged_attention_prefill", q, k_cache)
    return fn(
        q,
        k_cache,
        v_cache,
        cu_seqlens,
        context_lens,
        block_tables,
        positions,
        scale,
        k_scale,
        v_scale,
    )


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
    fn = _pick("paged_attention_decode", q, k_cache)
    return fn(q, k_cache, v_cache, context_lens, block_tables, scale, k_scale, v_scale)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    beside_previous: bool = False,
) -> torch.Tensor:
    """x [..., K] times a 16-bit weight [N, K] (the model's nn.Linear layers). beside_previous:
    x was written before the launch just before this one, so a GPU kernel may run beside that
    launch (triton's `w8_gemv` says how); the result is the same."""
    return _pick("linear", x)(x, weight, bias, beside_previous)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times an e4m3 weight [N, K] with per-output-channel scales [N] (fp32)."""
    return _pick("fp8_linear", x)(x, weight, scale, bias)


def fp8_linear_of_silu_mul(
    y: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8_linear(silu_mul(y)): a gated MLP's down projection (e4m3 weight [N, F], scales [N])
    of silu(gate) * up from its gate|up output y [..., 2F] (kernels round the activation to the
    GEMM's e4m3 input in one pass, without the 16-bit activation between)."""
    return _pick("fp8_linear_of_silu_mul", y)(y, weight, scale, bias)


def linear_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A gated MLP's activation silu(gate) * up [..., F] from x [..., K] and its fused gate|up
    weight [2F, K]: e4m3 with per-channel scales [2F], or 16-bit with scale None (decode kernels
    form the activation in the projection's epilogue: one launch, no [.., 2F] intermediate)."""
    return _pick("linear_silu_mul", x)(x, weight, scale, bias)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times an int4 weight [N, K]: packed uint8 qweight [N, K / 2], fp16 group
    scales [N, ceil(K / group_size)], optional fp16 mins of the same shape (affine groups)."""
    return _pick("int4_linear", x)(x, qweight, scales, mins, group_size, bias)


def int4_linear_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up [..., F] from x and an int4 fused gate|up weight [2F, K] (decode kernels
    form the activation in the GEMV's epilogue)."""
    return _pick("int4_linear_silu_mul", x)(x, qweight, scales, mins, group_size, bias)


def int4_mma_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times a symmetric int4 weight in the int4-mma layout: int32 qweight
    [N / 16, K / 64, 32, 4], fp16 scales [N / 16, G, 16] (`reference.int4_mma_pack`)."""
    return _pick("int4_mma_linear", x)(x, qweight, scales, group_size, bias)


def int4_mma_linear_silu_mul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """silu(gate) * up [..., F] from x and a fused gate|up weight [2F, K] in the int4-mma layout
    with paired tiles (`reference.int4_mma_pair_tiles`; decode GEMVs form the activation in their
    epilogue)."""
    return _pick("int4_mma_linear_silu_mul", x)(x, qweight, scales, group_size)


def int4_mma_linear_of_silu_mul(
    y: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """int4_mma_linear(silu_mul of a paired-tile gate|up output y [..., 2F]): the MLP's down
    projection past the decode rows (on the W4A8 prefill path one kernel forms the activation's
    e4m3 codes, without the 16-bit activation between)."""
    return _pick("int4_mma_linear_of_silu_mul", y)(y, qweight, scales, group_size, bias)


def rms_norm_x8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, X8]:
    """rms_norm, and its output as int8 codes for an int4 GEMV's int8 products."""
    return _pick("rms_norm_x8", x)(x, weight, eps, unit_offset)


def add_rms_norm_x8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, X8]:
    """add_rms_norm, and the normed rows as int8 codes."""
    return _pick("add_rms_norm_x8", x)(x, residual, weight, eps, unit_offset)


def gated_rms_norm_x8(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, X8]:
    """gated_rms_norm of x [T, H, D], and its output as int8 codes of rows [T, H * D]."""
    return _pick("gated_rms_norm_x8", x)(x, gate, weight, eps)


def sigmoid_mul_x8(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, X8]:
    """sigmoid_mul, and its output as int8 codes."""
    return _pick("sigmoid_mul_x8", x)(x, gate)


def quantize_x8(x: torch.Tensor) -> X8:
    """x [M, K] as int8 codes by a launch of its own (an input no kernel before writes so)."""
    return _pick("quantize_x8", x)(x)


def int4_mma_linear_x8(
    x8: X8,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int4_mma_linear` of x given as int8 codes: the products on int8 tensor cores, the
    output in x's dtype. Chosen by the codes' device and that dtype."""
    impl = select("int4_mma_linear_x8", x8.codes.device, x8.dtype)
    return impl.fn(x8, qweight, scales, group_size, bias)


def int4_mma_linear_silu_mul_x8(
    x8: X8, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`int4_mma_linear_silu_mul` of x given as int8 codes."""
    impl = select("int4_mma_linear_silu_mul_x8", x8.codes.device, x8.dtype)
    return impl.fn(x8, qweight, scales, group_size)


# Staged KV pages (worker/models/cache.py StagedAttentionCache): rotated-basis queries in,
# rotated-basis outputs out; see worker.kernels.reference.

PLUGINS = (*PLUGINS, "worker.kernels.triton.turboquant")


def rotate_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] (heads may be strided views) times the staged cache's
    rotation [D, D] (in their 16-bit dtype, exact in it): contiguous heads in the pages' basis."""
    return _pick("rotate_qkv", q)(q, k, v, rotation)


def unrotate_sigmoid_mul(
    x: torch.Tensor, gate: torch.Tensor | None, rotation: torch.Tensor
) -> torch.Tensor:
    """Rotated attention output x [T, H, D] back to the heads' basis (x @ rotation^T, rounded
    to x's dtype), times sigmoid(gate) where gate [T, H, D] (strided) is given: [T, H * D]."""
    return _pick("unrotate_sigmoid_mul", x)(x, gate, rotation)


def turboquant_restage(
    cache: StagedAttentionCache, recent_blocks: torch.Tensor, compressed_blocks: torch.Tensor
) -> None:
    """Re-encode recent pages (block ids) into compressed pool entries (indices)."""
    _pick("turboquant_restage", cache.k_cache, cache.k_cache)(
        cache, recent_blocks, compressed_blocks
    )


def staged_attention_prefill(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    fn = _pick("staged_attention_prefill", q, cache.k_cache)
    return fn(q, cache, cu_seqlens, context_lens, block_tables, positions, scale)


def staged_attention_decode(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    fn = _pick("staged_attention_decode", q, cache.k_cache)
    return fn(q, cache, context_lens, block_tables, scale)
