"""Building blocks shared by every family: RMSNorm, rotary tables, the gated MLP, and the fusion of
sibling projections (one GEMM over concatenated weights, outputs split by views)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import ops
from worker.kernels.reference import X8
from worker.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm; `unit_offset` scales by (1 + weight) as Qwen3.5 does (weights centred on zero)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a residual add fused with this norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)

    def feed(
        self, x: torch.Tensor, residual: torch.Tensor | None, codes: bool
    ) -> tuple[torch.Tensor, torch.Tensor, X8 | None]:
        """(normed, the residual stream, the normed rows as int8 codes if `codes`): `forward`
        (residual None: the stream is x) or `add_forward`, whose output the next projection
        may take as codes (`takes_x8`)."""
        if residual is None:
            if codes:
                normed, x8 = ops.rms_norm_x8(x, self.weight, self.eps, self.unit_offset)
                return normed, x, x8
            return self(x), x, None
        if codes:
            return ops.add_rms_norm_x8(x, residual, self.weight, self.eps, self.unit_offset)
        return (*self.add_forward(x, residual), None)


def takes_x8(module: nn.Module | None, rows: int) -> bool:
    """Whether a projection runs on int8 codes of its input at `rows` rows (an int4 layer with
    `Int4Linear.takes_x8`), so the kernel before it should write them."""
    check = getattr(module, "takes_x8", None)
    return bool(check is not None and check(rows))


def project(module: nn.Module, x: torch.Tensor | None, x8: X8 | None) -> torch.Tensor:
    """module(x), or from x's int8 codes where the caller wrote them for it (`takes_x8`)."""
    if x8 is not None:
        return cast(torch.Tensor, cast(Any, module).forward_x8(x8))
    assert x is not None
    return cast(torch.Tensor, module(x))


class HostEmbedding(nn.Module):
    """A token embedding whose table lives in pinned host memory: a step reads only its tokens'
    rows, which the GPU kernel of `ops.embedding` fetches over PCIe (no copy, no host sync, so
    it runs inside a captured decode graph), and the table (the 27B's 2.37 GiB) leaves the GPU.
    llama.cpp keeps its token embeddings on the host for the same reason."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        pinned = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        self.weight = nn.Parameter(pinned.copy_(table.detach()), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight)


class Linear(nn.Linear):
    """nn.Linear whose product goes through `ops.linear` (F.linear, or on a GPU the decode GEMV
    for shapes where it beats cuBLAS). Same parameters and names as nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def beside_previous(self, x: torch.Tensor) -> torch.Tensor:
        """forward, for an x written before the launch just before this one (`ops.linear`)."""
        return ops.linear(x, self.weight, self.bias, beside_previous=True)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up when this is a fused gate|up projection."""
        return ops.linear_silu_mul(x, self.weight, None, self.bias)


class GatedProjection(Protocol):
    """A fused gate|up projection: every linear type (Linear, Fp8Linear, Int4Linear) knows how
    to form silu(gate) * up from its own weight format."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor: ...


def fusable(linears: Sequence[nn.Module | None]) -> bool:
    """Whether `fuse_linears` can concatenate these: one weight format (16-bit, fp8, or int4 of
    one group size and symmetry), one input width, biases on all or none."""
    from worker.models.fp8 import Fp8Linear
    from worker.models.int4 import Int4Linear

    if not linears or any(m is None for m in linears):
        return False
    kinds = {nn.Linear if isinstance(m, nn.Linear) else type(m) for m in linears}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, Fp8Linear, Int4Linear):
        return False
    if len({getattr(m, "in_features", None) for m in linears}) != 1:
        return False
    if len({getattr(m, "bias", None) is None for m in linears}) != 1:
        return False
    if isinstance(linears[0], Int4Linear):
        int4 = cast("list[Int4Linear]", list(linears))
        # the nibble layout only: its rows concatenate (fuse before `use_mma_kernels`)
        return len({(m.group_size, m.symmetric, m.layout) for m in int4}) == 1 and all(
            m.layout == "nibble" for m in int4
        )
    return True


@torch.no_grad()
def fuse_linears(linears: Sequence[nn.Module]) -> nn.Module:
    """One projection whose output is the given projections' outputs side by side: weights (and
    FP8 per-channel scales, int4 codes and group scales/mins, and biases) concatenated along the
    output axis, gpt-fast style. The parts are left for the caller to drop, which frees their
    memory. Raises TypeError for parts `fusable` rejects."""
    from worker.models.fp8 import Fp8Linear
    from worker.models.int4 import Int4Linear

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(m, name) for m in linears]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ValueError(f"cannot fuse projections where only some have a {name}")
        if parts[0].element_size() == 1:  # fp8: concatenate the bytes (cat of any 1-byte type)
            return torch.cat([p.detach().view(torch.uint8) for p in parts]).view(parts[0].dtype)
        return torch.cat([p.detach() for p in parts])

    if not fusable(linears):
        kinds = sorted({type(m).__name__ for m in linears})
        raise TypeError(f"cannot fuse {kinds} (formats, widths or biases differ)")
    if isinstance(linears[0], Int4Linear):
        qweight, scales = cat("qweight"), cat("scales")
        assert qweight is not None and scales is not None
        return Int4Linear(qweight, scales, cat("mins"), cat("bias"), linears[0].group_size)
    if isinstance(linears[0], Fp8Linear):
        weight, scale = cat("weight"), cat("weight_scale")
        assert weight is not None and scale is not None
        return Fp8Linear(weight, scale, cat("bias"))
    weight, bias = cat("weight"), cat("bias")
    assert weight is not None
    fused = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary channels (fp32), with Llama 3 / linear scaling applied."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported")
    return inv_freq


class RotaryTables(nn.Module):
    """cos/sin tables [max_positions, rotary_dim / 2] in fp32 for `ops.apply_rotary`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary_dim = config.rotary_dim
        half = config.rotary_dim // 2
        self.cos = nn.Buffer(torch.empty(config.max_position_embeddings, half), persistent=False)
        self.sin = nn.Buffer(torch.empty(config.max_position_embeddings, half), persistent=False)
        if not self.cos.is_meta:
            self.reset()

    def reset(self) -> None:
        """(Re)compute the tables on their device (after `to_empty`, say)."""
        inv_freq = rope_inv_freq(self.config).to(self.cos.device)
        positions = torch.arange(self.cos.shape[0], device=self.cos.device, dtype=torch.float)
        angles = torch.outer(positions, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); after `fuse_projections`, gate|up is one GEMM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj: nn.Module | None = Linear(h, f, bias=bias)
        self.up_proj: nn.Module | None = Linear(h, f, bias=bias)
        self.gate_up_proj: nn.Module | None = None
        self.down_proj = Linear(f, h, bias=bias)

    def fuse_projections(self) -> None:
        """gate|up as one projection when both have one format (a mixed pair stays two)."""
        if fusable([self.gate_proj, self.up_proj]):
            assert self.gate_proj is not None and self.up_proj is not None
            self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
            self.gate_proj = self.up_proj = None

    def takes_x8(self, rows: int) -> bool:
        return takes_x8(self.gate_up_proj, rows)

    def forward(self, x: torch.Tensor, x8: X8 | None = None) -> torch.Tensor:
        """x8: x's int8 codes, written for gate|up (`takes_x8`)."""
        if x8 is not None:
            act = cast(Any, self.gate_up_proj).silu_mul_x8(x8)
            down = getattr(self.down_proj, "takes_x8", None)
            if down is not None and down(act.shape[0], own_launch=True):
                return project(self.down_proj, None, ops.quantize_x8(act))
            return self.down_proj(act)
        if self.gate_up_proj is not None:
            gate_up = cast(GatedProjection, self.gate_up_proj)
            # Past the decode rows (whose gate|up GEMV forms the activation in its epilogue), a
            # down projection that rounds its input (FP8) takes the activation from gate|up's
            # output in that same pass.
            of_silu_mul = getattr(self.down_proj, "of_silu_mul", None)
            if of_silu_mul is not None and x.numel() > 64 * x.shape[-1]:
                return cast(torch.Tensor, of_silu_mul(gate_up(x)))
            # int4 (paired tiles): the same, gate|up's product read as its GEMM gives it
            of_gate_up = getattr(self.down_proj, "of_gate_up", None)
            if of_gate_up is not None and x.numel() > 64 * x.shape[-1]:
                out = of_gate_up(self.gate_up_proj, x)
                if out is not None:
                    return cast(torch.Tensor, out)
            return self.down_proj(gate_up.silu_mul(x))
        assert self.gate_proj is not None and self.up_proj is not None
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
