"""FP8 (e4m3) weights with per-output-channel scales, gpt-fast style: after a model is built or
loaded in 16-bit, `quantize_fp8` swaps every nn.Linear (the LM head included) for an `Fp8Linear`
holding the quantized weight and its scales; the 16-bit weight is freed as each layer is swapped,
so a 27B model quantizes on the GPU it was built on. Embeddings, norms and the conv stay 16-bit.

Matmuls go through `ops.fp8_linear` (triton w8a16 / `torch._scaled_mm` on CUDA; the reference
dequantizes, which is how CPU runs and how the tests bound the error against bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.kernels import ops

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, rows_per_chunk: int = 8192) -> tuple[torch.Tensor, ...]:
    """(e4m3 weight [N, K], fp32 scale [N]) with w ~ q * scale[:, None]; the scale maps each
    output channel's largest magnitude to 448. Chunked so the fp32 temporary stays small."""
    q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_per_chunk):
        rows = weight[start : start + rows_per_chunk].float()
        s = rows.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
        q[start : start + rows_per_chunk] = (rows / s[:, None]).to(FP8)
        scale[start : start + rows_per_chunk] = s
    return q, scale


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Parameters (not buffers) so weight byte counts and `.to()` see them; never trained.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias)

    @classmethod
    def empty(
        cls,
        out_features: int,
        in_features: int,
        bias_dtype: torch.dtype | None = None,
        device: torch.device | str = "meta",
    ) -> Fp8Linear:
        """Uninitialised tensors of the right shapes (loaders build on meta, then fill)."""
        bias = None
        if bias_dtype is not None:
            bias = torch.empty(out_features, dtype=bias_dtype, device=device)
        return cls(
            torch.empty(out_features, in_features, dtype=FP8, device=device),
            torch.empty(out_features, dtype=torch.float32, device=device),
            bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def of_silu_mul(self, y: torch.Tensor) -> torch.Tensor:
        """This projection of silu(gate) * up, from a gate|up projection's output y [..., 2F]."""
        return ops.fp8_linear_of_silu_mul(y, self.weight, self.weight_scale, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up when this is a fused gate|up projection."""
        return ops.linear_silu_mul(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


@torch.no_grad()
def quantize_fp8(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of `model` for an Fp8Linear, in place; returns the model."""
    # names only: holding the modules in a list would keep every 16-bit weight alive to the end
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, Fp8Linear.from_linear(linear))
        del linear  # the 16-bit weight goes with the last reference
    return model
