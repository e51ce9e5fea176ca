"""Int4 weights with group-wise fp16 scales (docs/worker-contract.md, "Int4 weights").

The layout, shared by the quantizer, the checkpoint loaders and the kernels:
- `qweight` uint8 [N, K / 2]: byte j of row n holds k = 2j in its low nibble and k = 2j + 1 in
  its high nibble (unsigned codes 0..15). Row-major, so a kernel's [BN, BK / 2] tile is BN runs
  of BK / 2 contiguous bytes: 16-byte vector loads.
- `scales` fp16 [N, ceil(K / group_size)], one per group of `group_size` consecutive k.
- `mins` fp16 of the same shape, or None. Symmetric groups (None): w = (q - 8) * s.
  Affine groups: w = q * s + m, which GGUF Q4_1 stores as is and GPTQ's (q - z) * s maps onto
  with m = -z * s; GGUF Q4_0 is symmetric with group 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from worker.kernels import ops
from worker.kernels.reference import X8

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class Int4Tensors:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 (K even) -> packed uint8 [N, K / 2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even K, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K / 2] -> uint8 codes [N, K]."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(*qweight.shape[:-1], -1)


@torch.no_grad()
def quantize_rtn(
    weight: torch.Tensor, group_size: int = 128, symmetric: bool = True
) -> Int4Tensors:
    """Round-to-nearest int4 of a [N, K] weight, per group of `group_size` k (the last group may
    be shorter). Symmetric, as GGUF Q4_0: s = (the group's largest-magnitude
    value) / -8, so that value is code 0 exactly and the other side reaches 7 |s| (s may be
    negative). Affine: s = (max - min) / 15, m = min."""
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.zeros(n, groups * group_size, dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.float()
    g = padded.view(n, groups, group_size)
    if symmetric:
        # pad columns are zero, so they never raise a group's amax
        idx = g.abs().argmax(dim=-1, keepdim=True)
        extreme = g.gather(-1, idx).squeeze(-1)
        extreme = torch.where(extreme.abs() < 1e-10, torch.full_like(extreme, 1e-10), extreme)
        scales = (extreme / -8.0).to(SCALE_DTYPE)
        s = scales.float().unsqueeze(-1)
        codes = ((g / s).round() + 8).clamp(0, 15)
        mins = None
    else:
        real = torch.arange(groups * group_size, device=weight.device).view(groups, group_size) < k
        lo = torch.where(real, g, torch.inf).amin(dim=-1)
        hi = torch.where(real, g, -torch.inf).amax(dim=-1)
        scales = ((hi - lo).clamp_min(1e-10) / 15.0).to(SCALE_DTYPE)
        mins = lo.to(SCALE_DTYPE)
        s = scales.float().unsqueeze(-1)
        codes = ((g - mins.float().unsqueeze(-1)) / s).round().clamp(0, 15)
    qweight = pack_int4(codes.view(n, -1)[:, :k].to(torch.uint8))
    return Int4Tensors(qweight, scales, mins, group_size)


# --- Checkpoint format (shared with worker.quantize) -------------------------------------------
# A quantized checkpoint's config.json carries `"quantization_config": QuantizationConfig.to_json()`;
# an int4 module `<prefix>` (the HF tensor name without `.weight`) stores `<prefix>.qweight`,
# `<prefix>.scales` and, when not symmetric, `<prefix>.mins`; an fp8 module stores
# `<prefix>.weight` (e4m3) and `<prefix>.weight_scale` (fp32 [N]); every other tensor is 16-bit.
QUANT_METHOD = "tokenmill"
FORMAT = "int4-nibble-v1"
INT4 = "int4"
FP8 = "fp8"
PRECISIONS = (INT4, FP8)
METHODS = ("rtn", "gptq")
QWEIGHT, SCALES, MINS = "qweight", "scales", "mins"
FP8_WEIGHT, FP8_SCALE = "weight", "weight_scale"
QWEIGHT_DTYPE = torch.uint8


@dataclass(frozen=True)
class QuantizationConfig:
    """The `quantization_config` entry of a quantized checkpoint's config.json. `modules` maps
    each quantized module's HF prefix to "int4" or "fp8"; modules not listed are 16-bit."""

    modules: dict[str, str]
    group_size: int = 128
    symmetric: bool = True
    method: str = "rtn"

    def __post_init__(self) -> None:
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"quantization_config: group_size {self.group_size} must be even")
        if self.method not in METHODS:
            raise ValueError(f"quantization_config: method {self.method!r} not in {METHODS}")
        bad = {p: v for p, v in self.modules.items() if v not in PRECISIONS}
        if bad:
            raise ValueError(f"quantization_config: precisions {bad} not in {PRECISIONS}")

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> QuantizationConfig:
        if raw.get("quant_method") != QUANT_METHOD:
            raise ValueError(
                f"quantization_config: quant_method {raw.get('quant_method')!r}, "
                f"expected {QUANT_METHOD!r}"
            )
        if raw.get("format") != FORMAT:
            raise ValueError(
                f"quantization_config: format {raw.get('format')!r}, expected {FORMAT!r}"
            )
        modules, group_size = raw.get("modules"), raw.get("group_size", 128)
        symmetric, method = raw.get("symmetric", True), raw.get("method", "rtn")
        if not isinstance(modules, dict) or not all(isinstance(k, str) for k in modules):
            raise ValueError("quantization_config: modules must map module prefixes to precisions")
        if not isinstance(group_size, int) or isinstance(group_size, bool):
            raise ValueError(f"quantization_config: group_size {group_size!r} is not an integer")
        if not isinstance(symmetric, bool) or not isinstance(method, str):
            raise ValueError("quantization_config: symmetric must be a bool, method a string")
        return cls(dict(modules), group_size, symmetric, method)

    def to_json(self) -> dict[str, object]:
        return {
            "quant_method": QUANT_METHOD,
            "format": FORMAT,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "method": self.method,
            "modules": dict(sorted(self.modules.items())),
        }


# --- The module ----------------------------------------------------------------------------------
NIBBLE, MMA = "nibble", "mma"  # an Int4Linear's resident layouts


class Int4Linear(nn.Module):
    """A linear layer with an int4 weight in the layout above; products go through
    `ops.int4_linear` (triton on CUDA; the reference dequantizes)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> None:
        super().__init__()
        n, half = qweight.shape
        groups = -(-2 * half // group_size)
        if qweight.dtype != QWEIGHT_DTYPE:
            raise ValueError(f"qweight must be uint8, got {qweight.dtype}")
        for name, t in (("scales", scales), ("mins", mins)):
            if t is not None and (tuple(t.shape) != (n, groups) or t.dtype != SCALE_DTYPE):
                raise ValueError(
                    f"{name}: expected float16 {(n, groups)} for qweight {(n, half)} at group "
                    f"{group_size}, got {t.dtype} {tuple(t.shape)}"
                )
        self.out_features, self.in_features = n, 2 * half
        self.group_size = group_size
        # Parameters (not buffers) so weight byte counts and `.to()` see them; never trained.
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.mins = None if mins is None else nn.Parameter(mins, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # NIBBLE (the checkpoint's layout, triton kernels) or MMA (`to_mma_layout`)
        self.layout = NIBBLE
        # MMA only: a fused gate|up whose tiles alternate gate / up
        # (`reference.int4_mma_pair_tiles`), so the decode GEMV forms silu(gate) * up itself
        self.gate_up_paired = False

    @property
    def symmetric(self) -> bool:
        return self.mins is None

    @classmethod
    def from_tensors(
        cls,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        group_size: int = 128,
    ) -> Int4Linear:
        return cls(qweight, scales, mins, bias, group_size)

    @classmethod
    def empty(
        cls,
        out_features: int,
        in_features: int,
        group_size: int,
        symmetric: bool,
        bias_dtype: torch.dtype | None = None,
        device: torch.device | str = "meta",
    ) -> Int4Linear:
        """Uninitialised tensors of the right shapes (loaders build on meta, then fill)."""
        if in_features % 2:
            raise ValueError(f"int4 needs an even in_features, got {in_features}")
        groups = -(-in_features // group_size)

        def half(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=SCALE_DTYPE, device=device)

        qweight = torch.empty(out_features, in_features // 2, dtype=QWEIGHT_DTYPE, device=device)
        mins = None if symmetric else half(out_features, groups)
        bias = None
        if bias_dtype is not None:
            bias = torch.empty(out_features, dtype=bias_dtype, device=device)
        return cls(qweight, half(out_features, groups), mins, bias, group_size)

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int = 128,
        symmetric: bool = True,
        rows_per_chunk: int = 4096,
    ) -> Int4Linear:
        """Round-to-nearest (`quantize_rtn`), in row chunks so the fp32 temporaries stay small
        next to a large weight (the 27B head is 248k rows)."""
        weight = linear.weight
        bias = None if linear.bias is None else linear.bias.detach()
        n, k = weight.shape
        if weight.is_meta:  # shapes only (byte counts of a model never materialised)
            out = cls.empty(n, k, group_size, symmetric, None, "meta")
            out.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            return out
        chunks = [
            quantize_rtn(weight[s : s + rows_per_chunk], group_size, symmetric)
            for s in range(0, n, rows_per_chunk)
        ]
        qweight = torch.cat([c.qweight for c in chunks])
        scales = torch.cat([c.scales for c in chunks])
        mins = None if symmetric else torch.cat([c.mins for c in chunks if c.mins is not None])
        return cls(qweight, scales, mins, bias, group_size)

    def mma_layout_supported(self) -> tuple[bool, str]:
        from worker.kernels.cuda.int4_mma import supports

        if not self.symmetric:
            return False, "affine groups (mins) stay in the nibble layout"
        return supports(self.out_features, self.in_features, self.group_size)

    @torch.no_grad()
    def to_mma_layout(self, gate_up: bool = False) -> None:
        """Repack in place for the int4-mma kernels (worker/kernels/cuda): same bytes, codes in
        mma fragment order. Fusing projections must happen before (it concatenates rows of the
        nibble layout). `gate_up`: this is a fused gate|up projection (`silu_mul` is called);
        its tiles are paired where F % 16 == 0 and there is no bias, so decode steps form
        silu(gate) * up in the GEMV's epilogue. A layer already in the mma layout stays as is."""
        from worker.kernels import reference

        ok, reason = self.mma_layout_supported()
        if not ok:
            raise ValueError(f"int4-mma layout: {reason}")
        if self.layout == MMA:
            return
        qweight, scales = reference.int4_mma_pack(self.qweight.data, self.scales.data)
        paired = gate_up and self.bias is None and self.out_features % 32 == 0
        if paired:
            qweight, scales = reference.int4_mma_pair_tiles(qweight, scales)
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.layout = MMA
        self.gate_up_paired = paired

    def nibble_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, scales) in the checkpoint's nibble layout, whatever the resident layout."""
        from worker.kernels import reference

        if self.gate_up_paired:
            return reference.int4_mma_unpack(
                *reference.int4_mma_unpair_tiles(self.qweight, self.scales)
            )
        if self.layout == MMA:
            return reference.int4_mma_unpack(self.qweight, self.scales)
        return self.qweight, self.scales

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] (tests; the 16-bit model a quantized one stands for)."""
        from worker.kernels import reference

        qweight, scales = self.nibble_tensors()
        return reference.int4_dequantize(qweight, scales, self.mins, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_paired:  # the outputs in gate|up order, as the unpaired weight gives
            from worker.kernels import reference

            y = ops.int4_mma_linear(x, self.qweight, self.scales, self.group_size)
            return reference.int4_mma_unpair_outputs(y)
        if self.layout == MMA:
            return ops.int4_mma_linear(x, self.qweight, self.scales, self.group_size, self.bias)
        return ops.int4_linear(x, self.qweight, self.scales, self.mins, self.group_size, self.bias)

    def of_gate_up(self, gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """This projection (the MLP's down) of silu(gate) * up from x through `gate_up`, where
        both are int4-mma layers and gate|up's tiles are paired: its product is read as the GEMM
        gives it (no reorder) and the activation formed on its way into this GEMM; else None."""
        if not (
            isinstance(gate_up, Int4Linear)
            and gate_up.gate_up_paired
            and self.layout == MMA
            and gate_up.group_size == self.group_size
        ):
            return None
        y = ops.int4_mma_linear(x, gate_up.qweight, gate_up.scales, gate_up.group_size)
        return ops.int4_mma_linear_of_silu_mul(
            y, self.qweight, self.scales, self.group_size, self.bias
        )

    def takes_x8(self, rows: int, own_launch: bool = False) -> bool:
        """Whether this layer runs on int8 codes of its input at `rows` rows
        (`TOKENMILL_INT4_X8=1`, the int4-mma layout, symmetric groups of 128, M <= 16, and on a
        GPU a tiling the int8 kernel runs); its producer then writes them (`ops.*_x8`).
        `own_launch`: codes that a launch of their own would write (`ops.quantize_x8`), asked
        for the MLP's down projection (`TOKENMILL_INT4_X8_DOWN=1` too)."""
        from worker.kernels.cuda.int4_mma import x8_enabled, x8_tiling

        if not x8_enabled(own_launch) or self.layout != MMA or not self.symmetric:
            return False
        if self.group_size != 128 or self.in_features % 128 or not 1 <= rows <= 16:
            return False
        if self.qweight.device.type != "cuda":
            return True  # the reference op
        return x8_tiling(self.out_features, self.in_features, rows, 128) is not None

    def forward_x8(self, x8: X8) -> torch.Tensor:
        """This layer of x given as int8 codes (`takes_x8`): outputs in gate|up order for a
        paired gate|up, as `forward` gives them."""
        y = ops.int4_mma_linear_x8(x8, self.qweight, self.scales, self.group_size, self.bias)
        if self.gate_up_paired:
            from worker.kernels import reference

            return reference.int4_mma_unpair_outputs(y)
        return y

    def silu_mul_x8(self, x8: X8) -> torch.Tensor:
        """silu(gate) * up of a paired gate|up, from int8 codes of its input."""
        if not self.gate_up_paired:
            return ops.silu_mul(self.forward_x8(x8))
        return ops.int4_mma_linear_silu_mul_x8(x8, self.qweight, self.scales, self.group_size)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up when this is a fused gate|up projection."""
        if self.gate_up_paired:
            return ops.int4_mma_linear_silu_mul(x, self.qweight, self.scales, self.group_size)
        if self.layout == MMA:
            return ops.silu_mul(self.forward(x))
        return ops.int4_linear_silu_mul(
            x, self.qweight, self.scales, self.mins, self.group_size, self.bias
        )

    def extra_repr(self) -> str:
        kind = "symmetric" if self.mins is None else "affine"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 g{self.group_size} {kind}"
        )


# --- The default scheme --------------------------------------------------------------------------

# Kept 16-bit by `quantize_int4`: DeltaNet's beta and decay logits (tiny: N = value heads) feed
# sigmoid/exp gates whose errors compound in the recurrent state.
KEEP_16BIT_SUFFIXES = ("in_proj_a", "in_proj_b")
# the MLP's fused gate|up (worker.models.layers.MLP), the projection whose silu_mul runs
GATE_UP = "gate_up_proj"
_FUSED_NAMES = ("qkv_proj", "in_proj_qkvzba", "in_proj_qkvz", "in_proj_ba", GATE_UP)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


@torch.no_grad()
def quantize_int4(
    model: ModuleT,
    group_size: int = 128,
    lm_head: str | None = FP8,
    symmetric: bool = True,
) -> ModuleT:
    """The default int4 scheme, in place (returns the model): every nn.Linear to an Int4Linear
    (RTN, `group_size`, symmetric) except DeltaNet's in_proj_a / in_proj_b (16-bit) and the LM
    head, which becomes `lm_head`: "fp8" (per-channel Fp8Linear, the default), "int4", or None
    (16-bit). Embeddings, norms and the conv are not linear layers and stay 16-bit. Each 16-bit
    weight is freed as its layer is swapped, so a 27B model quantizes on the GPU it was built
    on. Run before `fuse_projections`. The per-module precisions end up in
    `model.quantization_config` (HF prefixes, as a checkpoint records them)."""
    from worker.models.fp8 import Fp8Linear

    if lm_head not in (FP8, INT4, None):
        raise ValueError(f"lm_head={lm_head!r}: expected 'fp8', 'int4' or None")
    # names only: holding the modules in a list would keep every 16-bit weight alive to the end
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    fused = [n for n in names if n.rpartition(".")[2] in _FUSED_NAMES]
    if fused:
        raise ValueError(f"quantize before fuse_projections (fused: {fused[:3]})")
    modules: dict[str, str] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        precision: str | None = INT4
        if child in KEEP_16BIT_SUFFIXES or linear.in_features % 2:
            precision = None
        elif name == "lm_head":
            precision = lm_head
        if precision == INT4:
            setattr(parent, child, Int4Linear.from_linear(linear, group_size, symmetric))
        elif precision == FP8:
            setattr(parent, child, Fp8Linear.from_linear(linear))
        if precision is not None:
            modules[name] = precision
        del linear  # the 16-bit weight goes with the last reference
    existing = getattr(model, "quantization_config", None)
    if isinstance(existing, QuantizationConfig):  # e.g. a GGUF's native int4 layers
        modules = {**existing.modules, **modules}
    # any module may be given; CausalLM declares the attribute
    setattr(model, "quantization_config", QuantizationConfig(modules, group_size, symmetric, "rtn"))  # noqa: B010
    return model


def use_mma_kernels(model: nn.Module, dtype: torch.dtype, max_decode_rows: int) -> int:
    """Repack every Int4Linear the int4-mma kernels take (symmetric, N % 16, K % 64, groups of
    a multiple of 64) when the registry picks those kernels for the model's device and `dtype`
    (activations) and, with `TOKENMILL_INT4_KERNEL=auto`, decode batches stay within the rows
    where they win (`max_decode_rows`, the engine's max_num_seqs); returns how many. Others
    keep the nibble layout and the triton kernels. Fused gate|up projections get paired tiles
    (`Int4Linear.to_mma_layout`). Call after `fuse_projections`."""
    from worker.kernels.cuda.int4_mma import AUTO_MAX_ROWS, kernel_choice

    layers = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, Int4Linear) and m.layout == NIBBLE
    ]
    if not layers:
        return 0
    if kernel_choice() == "auto" and max_decode_rows > AUTO_MAX_ROWS:
        return 0
    impl = ops.select("int4_mma_linear", layers[0][1].qweight.device, dtype)
    if impl.name == "reference":  # plain PyTorch would unpack per call: keep the nibble kernels
        return 0
    done = 0
    for name, layer in layers:
        if layer.mma_layout_supported()[0]:
            layer.to_mma_layout(gate_up=name.rpartition(".")[2] == GATE_UP)
            done += 1
    return done


def precision_of(module: nn.Module) -> str:
    """Whether "int4", "fp8" or "16-bit": how a module's own parameters are stored."""
    from worker.models.fp8 import Fp8Linear

    if isinstance(module, Int4Linear):
        return INT4
    if isinstance(module, Fp8Linear):
        return FP8
    return "16-bit"


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident parameter bytes by precision ("int4": codes, scales and mins; "fp8": weights
    and scales; "16-bit": everything else, biases of quantized layers included) and "total".
    Works on meta tensors, so a full-size model's payload is computed without memory."""
    out = {INT4: 0, FP8: 0, "16-bit": 0}
    for module in model.modules():
        kind = precision_of(module)
        for name, p in module.named_parameters(recurse=False):
            nbytes = p.numel() * p.element_size()
            out["16-bit" if name == "bias" else kind] += nbytes
    out["total"] = sum(out.values())
    return out
