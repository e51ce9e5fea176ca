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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


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


class Kernel:
    """`kernel[grid](*args, **constexprs)` like a `triton.jit` function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.compiled = triton.jit(fn)
        self.interpreted = (
            self.compiled
            if isinstance(self.compiled, InterpretedFunction)
            else InterpretedFunction(fn)
        )
        self.__name__ = fn.__name__

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
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
