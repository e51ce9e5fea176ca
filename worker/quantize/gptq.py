"""GPTQ (Frantar et al., 2022) onto the int4 layout of `worker.models.int4`, in plain torch.

Per linear layer with input activations X, GPTQ minimises ||X W^T - X Q^T|| column by column:
each column is rounded to the grid, and its rounding error is spread over the columns not yet
quantized through the inverse Hessian H^-1 (H = X^T X, damped), in blocks of `block_size`
columns with the update of the later columns deferred to the end of each block ("lazy batch"
updates). Group scales are those of `quantize_rtn` (symmetric: the group's largest-magnitude
value is code 0; affine: min and max), computed from the already-updated weights when a group
starts. With act-order, columns go in decreasing Hessian diagonal order and the groups' scales
are fixed up front from the original weights (static groups), since our layout keeps groups
contiguous in k and has no per-column group index.

`gptq_model` runs the 16-bit model layer by layer on calibration tokens (see there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from worker.engine.batch import BatchMetadata
from worker.kernels.reference import int4_dequantize
from worker.models.cache import ModelCache
from worker.models.causal_lm import CausalLM, DecoderLayer
from worker.models.int4 import SCALE_DTYPE, Int4Tensors, pack_int4
from worker.quantize.perplexity import prefill_batch

# Clipping ratios tried per group when searching scales: a group's range shrunk by up to 50%
# rounds its many small weights finer at the cost of clipping its few large ones.
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))


def _group_params(
    w: torch.Tensor,
    symmetric: bool,
    clip_search: bool = False,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, min or None) [N] (fp32 values of the fp16 that is stored) for a group w [N, g]:
    those of `quantize_rtn`, or with `clip_search` the range shrunk by the ratio of
    `CLIP_RATIOS` that rounds the group with the least squared error, each column's error
    weighted by `importance` [g] (its input's mean square, H's diagonal) when given."""
    ratios = torch.tensor(CLIP_RATIOS if clip_search else (1.0,), device=w.device)
    if symmetric:
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))  # [N, 1]
        extreme = torch.where(extreme.abs() < 1e-10, torch.full_like(extreme, 1e-10), extreme)
        scale = (extreme * ratios / -8.0).to(SCALE_DTYPE).float()  # [N, C]
        mins = None
    else:
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) * ratios).clamp_min(1e-10) / 15.0
        scale = scale.to(SCALE_DTYPE).float()
        mins = (lo * ratios).to(SCALE_DTYPE).float()
    if len(ratios) == 1:
        return scale[:, 0], None if mins is None else mins[:, 0]
    m = None if mins is None else mins.unsqueeze(-1)
    back = _dequant(_codes(w.unsqueeze(1), scale.unsqueeze(-1), m), scale.unsqueeze(-1), m)
    err = (back - w.unsqueeze(1)) ** 2
    if importance is not None:
        err = err * importance
    best = err.sum(-1).argmin(dim=-1, keepdim=True)  # [N, 1]
    chosen = scale.gather(-1, best).squeeze(-1)
    return chosen, None if mins is None else mins.gather(-1, best).squeeze(-1)


def _codes(w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """Codes (float, 0..15) of a column w [N] on its group's grid."""
    if mins is None:
        return ((w / scale).round() + 8).clamp(0, 15)
    return ((w - mins) / scale).round().clamp(0, 15)


def _dequant(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    return (q - 8) * scale if mins is None else q * scale + mins


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    damp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    clip_search: bool = False,
) -> Int4Tensors:
    """Int4 of a weight [N, K] given H = sum of x x^T [K, K] over the layer's calibration inputs.
    `damp` adds that fraction of H's mean diagonal to the diagonal (a well-conditioned
    inverse); K may end in a ragged group."""
    if weight.device.type == "cpu":
        # The column loop is thousands of small ops: on CPU, intra-op threads only add
        # synchronisation (20x slower on a busy 2-core machine than one thread).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _gptq(
                weight, hessian, group_size, symmetric, damp, act_order, block_size, clip_search
            )
        finally:
            torch.set_num_threads(threads)
    return _gptq(weight, hessian, group_size, symmetric, damp, act_order, block_size, clip_search)


def _gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    symmetric: bool,
    damp: float,
    act_order: bool,
    block_size: int,
    clip_search: bool,
) -> Int4Tensors:
    n, k = weight.shape
    device = weight.device
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that never fire: any value is exact, keep them zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    groups = -(-k // group_size)
    scales = torch.zeros(n, groups, device=device)
    mins = None if symmetric else torch.zeros(n, groups, device=device)
    perm = torch.arange(k, device=device)
    # the clip search weighs each column's rounding error by its input's mean square (H's
    # diagonal): the output error's diagonal part, which the search then trades, not the
    # weight's own error
    importance = torch.diag(h).clone()
    if act_order:
        for g in range(groups):  # static groups: the layout needs contiguous ones
            cols = slice(g * group_size, (g + 1) * group_size)
            s, m = _group_params(w[:, cols], symmetric, clip_search, importance[cols])
            scales[:, g] = s
            if mins is not None and m is not None:
                mins[:, g] = m
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    else:
        block_size = group_size  # a block starts where a group does: its scale is fresh

    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, device=device)
    # The upper Cholesky factor of H^-1: row i holds the update of columns i.. after column i.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.zeros(n, k, device=device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        if not act_order:
            g = i1 // group_size
            s, m = _group_params(w1, symmetric, clip_search, importance[i1:i2])
            scales[:, g] = s
            if mins is not None and m is not None:
                mins[:, g] = m
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group_size
            s = scales[:, g]
            m = None if mins is None else mins[:, g]
            q = _codes(w1[:, i], s, m)
            codes[:, i1 + i] = q
            e = (w1[:, i] - _dequant(q, s, m)) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return Int4Tensors(
        pack_int4(codes.to(torch.uint8)),
        scales.to(SCALE_DTYPE),
        None if mins is None else mins.to(SCALE_DTYPE),
        group_size,
    )


def dequantize(q: Int4Tensors) -> torch.Tensor:
    """The fp32 weight an int4 kernel computes with."""
    return int4_dequantize(q.qweight, q.scales, q.mins, q.group_size)


class HessianHook:
    """Accumulates H = sum over tokens of x x^T of a linear layer's input (fp32)."""

    def __init__(self, module: nn.Linear) -> None:
        k = module.in_features
        self.hessian = torch.zeros(k, k, dtype=torch.float32, device=module.weight.device)
        self.tokens = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.hessian.addmm_(x.T, x)
        self.tokens += x.shape[0]


Progress = Callable[[str], None]


@torch.no_grad()
def gptq_model(
    model: CausalLM,
    sequences: Sequence[Sequence[int]],
    targets: set[str],
    group_size: int = 128,
    symmetric: bool = True,
    damp: float = 0.01,
    act_order: bool = False,
    clip_search: bool = True,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> dict[str, Int4Tensors]:
    """GPTQ of the linear layers named in `targets` (our module names, e.g.
    `model.layers.0.mlp.down_proj`, `lm_head`), layer by layer: the calibration sequences (all
    of one length) go through layer i with 16-bit weights to gather each target's Hessian, its
    targets are quantized and written back into the model as their dequantized values, and the
    sequences go through layer i again to become layer i + 1's inputs, which therefore carry the
    quantization error of the layers below (as GPTQ's sequential order does). Only one layer's
    Hessians and the hidden states of the calibration tokens are held at a time.

    The model is left fake-quantized: each target's weight is its int4 value."""
    if not sequences or len({len(s) for s in sequences}) != 1:
        raise ValueError("gptq_model needs calibration sequences of one length")
    results: dict[str, Int4Tensors] = {}
    chunks = [sequences[i : i + batch_size] for i in range(0, len(sequences), batch_size)]
    # Chunks of one shape share one metadata and one cache: each step is a fresh prefill, so
    # nothing it reads comes from an earlier chunk.
    shared: dict[int, tuple[BatchMetadata, ModelCache]] = {}
    steps: list[tuple[BatchMetadata, ModelCache]] = []
    states: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for chunk in chunks:
        ids, meta, cache = prefill_batch(model, chunk)
        steps.append(shared.setdefault(len(chunk), (meta, cache)))
        states.append((model.model.embed_tokens(ids), None))

    def quantize_modules(modules: dict[str, nn.Linear], hooks: dict[str, HessianHook]) -> None:
        for name, module in modules.items():
            hooks[name].handle.remove()
            q = gptq_quantize(
                module.weight,
                hooks[name].hessian,
                group_size,
                symmetric,
                damp,
                act_order,
                clip_search=clip_search,
            )
            module.weight.copy_(dequantize(q).to(module.weight.dtype))
            results[name] = q
            if progress is not None:
                progress(name)

    rotary = model.model.rotary
    last = max(
        (
            i
            for i in range(len(model.model.layers))
            for t in targets
            if t.startswith(f"model.layers.{i}.")
        ),
        default=-1,
    )
    for index, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        if index > last and "lm_head" not in targets:
            break  # nothing above to calibrate: skip the forward passes
        prefix = f"model.layers.{index}."
        modules = {
            prefix + name: m
            for name, m in layer.named_modules()
            if isinstance(m, nn.Linear) and prefix + name in targets
        }
        hooks = {name: HessianHook(m) for name, m in modules.items()}
        for c, (hidden, residual) in enumerate(states):
            meta, cache = steps[c]
            layer(hidden, residual, meta, cache.layers[index], rotary)
        quantize_modules(modules, hooks)
        for c, (hidden, residual) in enumerate(states):
            meta, cache = steps[c]
            states[c] = layer(hidden, residual, meta, cache.layers[index], rotary)

    if "lm_head" in targets and isinstance(model.lm_head, nn.Linear):
        head = {"lm_head": model.lm_head}
        hooks = {"lm_head": HessianHook(model.lm_head)}
        for hidden, residual in states:
            if residual is None:
                model.lm_head(model.model.norm(hidden))
            else:
                model.lm_head(model.model.norm.add_forward(hidden, residual)[0])
        quantize_modules(head, hooks)
    return results
