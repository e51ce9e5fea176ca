"""One decorator for every triton kernel of this package: the compiled kernel on a GPU, the
triton interpreter on CPU tensors.

The interpreter is how CI (no GPU) checks the kernels. `triton.jit` only interprets when
TRITON_INTERPRET=1 was set before `triton` was first imported (triton's own library functions,
`tl.sum` and friends, are decorated at that import), which depends on import order across a test
session: `torch._dynamo` imports triton too. So the choice is made per launch, by the tensors'
device, and when triton's library was compiled-mode decorated, its functions are run through the
interpreter for the duration of a CPU launch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from worker.kernels.pdl import pdl_enabled


@contextmanager
def _library_interpreted() -> Iterator[None]:
    """Let compiled-mode library functions (tl.sum, tl.cumsum...) be called inside an interpreted
    kernel, as the interpreter calls nested functions."""
    original = JITFunction.__call__

    def call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
        return InterpretedFunction(self.fn)(*args, **kwargs)

    JITFunction.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.__call__ = original  # type: ignore[method-assign]


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of a kernel that takes `PDL` (worker/kernels/pdl.py says why): wait until
    the previous grid on the stream completed (its writes visible), then let the next grid
    launch; its programs park at their own wait. Loads of constants (weights) may come before
    this call, never anything a previous kernel writes."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


class Kernel:
    """`kernel[grid](*args, **constexprs)` like a `triton.jit` function. A kernel that declares
    `PDL: tl.constexpr` gets it from the launcher (True on Hopper+ GPUs while PDL is on)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.takes_pdl = "PDL" in inspect.signature(fn).parameters
        self.compiled = triton.jit(fn)
        self.interpreted = (
            self.compiled
            if isinstance(self.compiled, InterpretedFunction)
            else InterpretedFunction(fn)
        )
        self.__name__ = fn.__name__

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            tensor = next(a for a in args if isinstance(a, torch.Tensor))
            on_cpu = tensor.device.type == "cpu"
            if self.takes_pdl and "PDL" not in kwargs:
                pdl = not on_cpu and pdl_enabled(tensor.device)
                kwargs["PDL"] = pdl
                if pdl:
                    kwargs["launch_pdl"] = True
            if not on_cpu:
                self.compiled[grid](*args, **kwargs)
                return
            with _library_interpreted():
                self.interpreted[grid](*args, **kwargs)

        return launch


def kernel(fn: Callable[..., Any]) -> Kernel:
    return Kernel(fn)


def dot_dtype(device: torch.device) -> Any:
    """Operand dtype of 16-bit tensor-core dots: bf16 on a GPU, fp32 under the interpreter, whose
    bf16 dot multiplies the raw bits (triton 3.9)."""
    return triton.language.float32 if device.type == "cpu" else triton.language.bfloat16
