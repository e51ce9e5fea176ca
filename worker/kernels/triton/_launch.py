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

import collections
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

from worker.kernels.pdl import early_release_enabled, pdl_enabled


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


@triton.jit
def pdl_release_wait(PDL: tl.constexpr, EARLY_RELEASE: tl.constexpr):
    """`pdl_wait` of a short kernel that may let the next grid launch before its own wait
    (EARLY_RELEASE, worker/kernels/pdl.py says when that is safe): the next kernel's programs
    then take their places and load their constants while this one waits."""
    if PDL:
        if EARLY_RELEASE:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


# Integer arguments that change from one engine step to the next (row, token and sequence
# counts; the width of a step's block table; attention splits). Triton specializes integers on
# `== 1` and on divisibility by 16, so each such argument would double the variants a batch
# composition can hit; a variant first met under traffic compiles while a whole wave of
# requests waits (seconds on the H200). Not specializing them costs nothing measurable: they are
# loop bounds and masks, never strides of a vector load.
PER_STEP_SIZES = frozenset(
    {"M", "n_rows", "n_tokens", "num_seqs", "num_splits", "SPLITS", "stride_bt", "splits"}
)

_compiles = 0
# What the last compilations were: (kernel name, its specialization as triton prints it)
_compiled: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)


def _count_compile(*args: Any, **kwargs: Any) -> None:
    global _compiles
    if not kwargs.get("already_compiled", False):
        _compiles += 1
        fn = kwargs.get("fn")
        _compiled.append((str(getattr(fn, "name", "?")), str(kwargs.get("repr", ""))))


def compiles() -> int:
    """Kernel compilations seen in this process (triton's post-compile hook): a count that
    grows while serving means a step waited on a compile."""
    return _compiles


def compiled_since(count: int) -> list[tuple[str, str]]:
    """(kernel name, specialization) of the compilations after the `count`-th (at most the
    last 64): what a slow step waited on, for its log line."""
    new = _compiles - count
    return list(_compiled)[-new:] if new > 0 else []


def _install_compile_hook() -> None:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return  # an older triton: no count
    previous = runtime.jit_post_compile_hook
    if previous is None:
        runtime.jit_post_compile_hook = _count_compile
        return

    def both(*args: Any, **kwargs: Any) -> Any:
        _count_compile(*args, **kwargs)
        return previous(*args, **kwargs)

    runtime.jit_post_compile_hook = both


_install_compile_hook()


class Kernel:
    """`kernel[grid](*args, **constexprs)` like a `triton.jit` function. A kernel that declares
    `PDL: tl.constexpr` gets it from the launcher (True on Hopper+ GPUs while PDL is on), and one
    that declares `EARLY_RELEASE: tl.constexpr` gets whether to release early (`pdl_release_wait`).
    Arguments named in PER_STEP_SIZES are not specialized."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = inspect.signature(fn).parameters
        self.takes_pdl = "PDL" in params
        self.takes_early_release = "EARLY_RELEASE" in params
        self.per_step = [name for name in params if name in PER_STEP_SIZES]
        self.compiled = triton.jit(fn, do_not_specialize=self.per_step)
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
                if self.takes_early_release and "EARLY_RELEASE" not in kwargs:
                    kwargs["EARLY_RELEASE"] = pdl and early_release_enabled(tensor.device)
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
