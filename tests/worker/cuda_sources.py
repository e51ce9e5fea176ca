"""Checks of the CUDA C++ sources that need no GPU."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def check_ctypes_signatures(source: Path, signatures: Mapping[str, Sequence[Any]]) -> None:
    """ctypes cannot check a call against the C prototype: each extern "C" function's
    parameters (pointers, floats, ints) must be the argtypes its wrapper declares."""
    text = source.read_text()
    for name, argtypes in signatures.items():
        params = re.search(rf"int {name}\(([^)]*)\)", text)
        assert params is not None, name
        kinds = [
            ctypes.c_void_p if "*" in p else ctypes.c_float if "float" in p else ctypes.c_int
            for p in params.group(1).split(",")
        ]
        assert kinds == list(argtypes), name
