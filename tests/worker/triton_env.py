"""Imported first by the Triton kernel tests: without CUDA the kernels run under Triton's
interpreter (effective when triton is not yet imported; the kernels' launcher interprets CPU
tensors either way), and a machine without triton skips the module."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

GPU = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
