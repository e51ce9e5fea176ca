"""Quantized checkpoints: our int4/fp8 format (`worker.models.int4`, quant_method "tokenmill")
and community int4 checkpoints in GPTQ layout (AutoRound, GPTQModel; quant_method "gptq").

Either loads without ever materialising the 16-bit model: the model is built on the meta device,
the quantized layers are swapped for meta Int4Linear / Fp8Linear of the expected shapes, every
checkpoint tensor's name, shape and dtype is checked against them from the safetensors headers
(and GPTQ's small zero-point and g_idx tensors are read and checked), and only then is the model
allocated on the device and filled tensor by tensor. A mismatch is a `CheckpointMismatch`
naming the tensor, raised before any device memory is taken.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from worker.loading.config import config_from_hf
from worker.loading.safetensors import checkpoint_name_to_param, safetensors_files
from worker.models.causal_lm import CausalLM
from worker.models.fp8 import Fp8Linear
from worker.models.int4 import (
    FP8,
    INT4,
    SCALE_DTYPE,
    Int4Linear,
    Int4Tensors,
    QuantizationConfig,
    pack_int4,
)

GPTQ = "gptq"

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "BOOL": torch.bool,
}
_FLOAT16ISH = (torch.bfloat16, torch.float16, torch.float32)


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the model its config describes (names the tensor)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str  # as stored
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_headers(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape from the safetensors headers (no tensor data is read)."""
    out: dict[str, TensorInfo] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                s = f.get_slice(name)
                dtype = _DTYPES.get(s.get_dtype())
                if dtype is None:
                    raise CheckpointMismatch(f"{name}: unsupported dtype {s.get_dtype()}")
                out[name] = TensorInfo(name, file, dtype, tuple(s.get_shape()))
    return out


def read_quantization_config(path: str | Path) -> dict[str, Any] | None:
    """The raw `quantization_config` of a checkpoint directory's config.json, or None."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    raw = json.loads(file.read_text()).get("quantization_config")
    return raw if isinstance(raw, dict) else None


def is_quantized_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a checkpoint directory this module loads (ours or GPTQ)."""
    raw = read_quantization_config(path)
    return raw is not None and raw.get("quant_method") in ("tokenmill", GPTQ)


def _module_path(prefix: str) -> str | None:
    """Our module name for a checkpoint module prefix (None: a part we skip)."""
    target = checkpoint_name_to_param(prefix + ".weight")
    return None if target is None else target[: -len(".weight")]


def _swap(model: CausalLM, path: str, new: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _linear_at(model: CausalLM, path: str, prefix: str) -> nn.Linear:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        module = None
    if not isinstance(module, nn.Linear):
        raise CheckpointMismatch(f"{prefix}: quantized in the checkpoint, not a linear layer here")
    return module


# --- GPTQ layout -------------------------------------------------------------------------------


@dataclass
class _GptqModule:
    prefix: str
    out_features: int
    in_features: int
    group_size: int
    symmetric: bool = True


@dataclass
class _Plan:
    """What to load: the meta model's expected parameters, the checkpoint tensor behind each,
    and for GPTQ modules how to convert them."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # our parameter -> stored
    gptq: dict[str, _GptqModule] = field(default_factory=dict)  # our module path -> GPTQ module


def _gptq_settings(raw: dict[str, Any]) -> tuple[int, bool, bool]:
    """(group size or -1, sym, v1) from a GPTQ quantization_config, which must be 4-bit without
    act-order."""
    if raw.get("bits") != 4:
        raise CheckpointMismatch(f"quantization_config: bits {raw.get('bits')!r}, only 4 loads")
    if raw.get("desc_act"):
        raise CheckpointMismatch("quantization_config: desc_act (act-order) is not supported")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointMismatch(f"quantization_config: checkpoint_format {fmt!r} is not GPTQ")
    # v1 (AutoGPTQ and most exports) stores each zero point minus one; v2 stores it as is.
    return int(raw.get("group_size", 128)), bool(raw.get("sym", True)), fmt == "gptq"


def unpack_gptq_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 nibbles (bits 4j..4j+3 = element 8i + j along `dim`) -> int codes."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    if dim == 0:  # [R, C] -> [8R, C]
        codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & 0xF
        return codes.reshape(-1, packed.shape[1])
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C] -> [R, 8C]
    return codes.reshape(packed.shape[0], -1)


def gptq_zeros(qzeros: torch.Tensor, v1: bool) -> torch.Tensor:
    """Zero points [G, N] (int32) from GPTQ's packed qzeros [G, N / 8]."""
    z = unpack_gptq_int32(qzeros, dim=1)
    return z + 1 if v1 else z


def gptq_to_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    v1: bool = True,
) -> Int4Tensors:
    """GPTQ's w[k, n] = (q - z[g(k), n]) * s[g(k), n] (qweight int32 [K/8, N] packed along K,
    qzeros int32 [G, N/8], scales fp16 [G, N]) in our layout: codes transposed to [N, K] and
    packed by nibble pairs; all-8 zero points are our symmetric groups (exact), others become
    mins m = -z * s (rounded to fp16 once)."""
    codes = unpack_gptq_int32(qweight, dim=0).t().to(torch.uint8)  # [N, K]
    z = gptq_zeros(qzeros, v1)
    s = scales.to(SCALE_DTYPE).t().contiguous()  # [N, G]
    mins = None
    if not bool((z == 8).all()):
        mins = (-(z.float().t() * s.float())).to(SCALE_DTYPE).contiguous()
    return Int4Tensors(pack_int4(codes).contiguous(), s, mins, group_size)


def _plan_gptq(
    model: CausalLM, raw: dict[str, Any], headers: dict[str, TensorInfo], plan: _Plan
) -> None:
    group, sym, v1 = _gptq_settings(raw)
    for name in headers:
        if not name.endswith(".qweight"):
            continue
        prefix = name[: -len(".qweight")]
        path = _module_path(prefix)
        if path is None:
            continue
        linear = _linear_at(model, path, prefix)
        n, k = linear.out_features, linear.in_features
        g = k if group == -1 else group
        groups = -(-k // g)
        expected = {
            "qweight": (torch.int32, (k // 8, n)),
            "qzeros": (torch.int32, (groups, n // 8)),
            "scales": (torch.float16, (groups, n)),
        }
        for leaf, (dtype, shape) in expected.items():
            got = headers.get(f"{prefix}.{leaf}")
            if got is None:
                raise CheckpointMismatch(f"{prefix}.{leaf}: missing from the checkpoint")
            if (got.dtype, got.shape) != (dtype, shape):
                raise CheckpointMismatch(
                    f"{got.name}: checkpoint {got.dtype} {got.shape}, expected {dtype} {shape} "
                    f"for a {k} -> {n} linear at group {g}"
                )
        if k % 8 or n % 8:
            raise CheckpointMismatch(f"{name}: GPTQ packing needs K and N divisible by 8")
        module = _GptqModule(prefix, n, k, g)
        # Small tensors, read now so a bad checkpoint fails before the device is touched.
        with safe_open(str(headers[f"{prefix}.qzeros"].file), framework="pt") as f:
            zeros = gptq_zeros(f.get_tensor(f"{prefix}.qzeros"), v1)
        module.symmetric = bool((zeros == 8).all())
        if sym and not module.symmetric:
            raise CheckpointMismatch(
                f"{prefix}.qzeros: sym is set but zero points other than 8 are stored "
                f"(checkpoint_format {'gptq' if v1 else 'gptq_v2'}: "
                f"{'v1 stores z - 1' if v1 else 'v2 stores z'})"
            )
        g_idx = headers.get(f"{prefix}.g_idx")
        if g_idx is not None:
            with safe_open(str(g_idx.file), framework="pt") as f:
                idx = f.get_tensor(g_idx.name)
            trivial = torch.arange(k) // g
            if idx.shape != trivial.shape or not torch.equal(idx.long(), trivial):
                raise CheckpointMismatch(
                    f"{g_idx.name}: a reordered g_idx (act-order) is not supported"
                )
        bias = linear.bias
        bias_dtype = None if bias is None else bias.dtype
        _swap(model, path, Int4Linear.empty(n, k, g, module.symmetric, bias_dtype))
        plan.gptq[path] = module


# --- Both formats --------------------------------------------------------------------------------


def _plan_tokenmill(model: CausalLM, qc: QuantizationConfig) -> None:
    for prefix, precision in qc.modules.items():
        path = _module_path(prefix)
        if path is None:
            continue
        if path == "lm_head" and model.lm_head is None:
            raise CheckpointMismatch(f"{prefix}: quantized, but this model ties its head")
        linear = _linear_at(model, path, prefix)
        n, k = linear.out_features, linear.in_features
        bias_dtype = None if linear.bias is None else linear.bias.dtype
        if precision == INT4:
            if k % 2:
                raise CheckpointMismatch(f"{prefix}: int4 needs an even in_features, got {k}")
            new: nn.Module = Int4Linear.empty(n, k, qc.group_size, qc.symmetric, bias_dtype)
        else:
            assert precision == FP8
            new = Fp8Linear.empty(n, k, bias_dtype)
        _swap(model, path, new)


def _match_tensors(model: CausalLM, headers: dict[str, TensorInfo], plan: _Plan) -> None:
    """Pair each model parameter with its checkpoint tensor, checking names, shapes and dtypes;
    16-bit parameters take any float checkpoint dtype (cast on copy), quantized ones exactly
    theirs."""
    params = dict(model.named_parameters())
    gptq_leaves = {f"{m.prefix}.{leaf}" for m in plan.gptq.values() for leaf in _GPTQ_LEAVES}
    quantized = {
        name
        for name, module in model.named_modules()
        if isinstance(module, Int4Linear | Fp8Linear) and name not in plan.gptq
    }
    for stored, info in headers.items():
        if stored in gptq_leaves:
            continue
        target = checkpoint_name_to_param(stored)
        if target is None or (target == "lm_head.weight" and model.lm_head is None):
            continue
        param = params.get(target)
        if param is None:
            raise CheckpointMismatch(f"{stored}: checkpoint tensor has no place in the model")
        owner = target.rpartition(".")[0]
        exact = owner in quantized and not target.endswith(".bias")
        if info.shape != tuple(param.shape):
            raise CheckpointMismatch(
                f"{stored}: checkpoint {info.dtype} {info.shape} != model {param.dtype} "
                f"{tuple(param.shape)}"
            )
        if (exact and info.dtype != param.dtype) or (not exact and info.dtype not in _FLOAT16ISH):
            want = param.dtype if exact else "a float (16/32-bit)"
            raise CheckpointMismatch(f"{stored}: checkpoint dtype {info.dtype}, expected {want}")
        plan.tensors[target] = info
    converted = {f"{p}.{leaf}" for p in plan.gptq for leaf in ("qweight", "scales", "mins")}
    missing = sorted(set(params) - set(plan.tensors) - converted)
    if missing:
        raise CheckpointMismatch(f"checkpoint lacks {missing[:8]} ({len(missing)} tensors)")


_GPTQ_LEAVES = ("qweight", "qzeros", "scales", "g_idx")


def _tensors(plan: _Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter, CPU tensor) pairs, one file open at a time."""
    direct: dict[Path, list[tuple[str, str]]] = {}
    for target, info in plan.tensors.items():
        direct.setdefault(info.file, []).append((target, info.name))
    for file, names in direct.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for target, stored in names:
                yield target, f.get_tensor(stored)


@torch.no_grad()
def load_quantized_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> CausalLM:
    """A model from a quantized checkpoint directory (ours or GPTQ layout): int4 / fp8 layers
    as stored, everything else in `dtype`. Validated from the headers before allocation."""
    path = Path(path)
    raw_config = json.loads((path / "config.json").read_text())
    raw = raw_config.get("quantization_config")
    if not isinstance(raw, dict):
        raise CheckpointMismatch(f"{path}/config.json has no quantization_config")
    config = config_from_hf(raw_config, name=path.name)
    with torch.device("meta"):
        model = CausalLM(config)
    model.to(dtype=dtype)
    headers = read_headers(path)
    plan = _Plan()
    if raw.get("quant_method") == GPTQ:
        _plan_gptq(model, raw, headers, plan)
        group, _, v1 = _gptq_settings(raw)
        modules = {m.prefix: INT4 for m in plan.gptq.values()}
        groups = {m.group_size for m in plan.gptq.values()} or {group}
        symmetric = all(m.symmetric for m in plan.gptq.values())
        qc = QuantizationConfig(modules, max(groups), symmetric, GPTQ)
    else:
        try:
            qc = QuantizationConfig.from_json(raw)
        except ValueError as e:
            raise CheckpointMismatch(str(e)) from e
        v1 = True
        _plan_tokenmill(model, qc)
    _match_tensors(model, headers, plan)

    # Validated: now, and only now, the device memory (the quantized sizes) is taken.
    model = model.to_empty(device=device)
    model.requires_grad_(False).eval()
    model.reset_buffers()
    params = dict(model.named_parameters())
    for target, tensor in _tensors(plan):
        params[target].copy_(tensor)
    for module_path, m in plan.gptq.items():
        files = {
            leaf: headers[f"{m.prefix}.{leaf}"].file for leaf in ("qweight", "qzeros", "scales")
        }
        parts = {}
        for leaf, file in files.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                parts[leaf] = f.get_tensor(f"{m.prefix}.{leaf}")
        t = gptq_to_int4(parts["qweight"], parts["qzeros"], parts["scales"], m.group_size, v1)
        module = model.get_submodule(module_path)
        assert isinstance(module, Int4Linear)
        module.qweight.copy_(t.qweight)
        module.scales.copy_(t.scales)
        if module.mins is not None and t.mins is not None:
            module.mins.copy_(t.mins)
    model.quantization_config = qc
    return model
