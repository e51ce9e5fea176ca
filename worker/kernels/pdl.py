"""Whether kernels launch with programmatic dependent launch (PDL, Hopper and newer).

A decode step is ~800 short dependent kernels; with PDL each kernel's launch and its programs'
start overlap the tail of the one before it (the kernel waits in its first statement until its
predecessor completed, see worker/kernels/triton/_launch.py). TOKENMILL_PDL=0 turns it off;
`set_pdl` flips it at run time (graphs captured before keep what they captured). This module
imports no triton, so the engine can consult it on machines without one.
"""

from __future__ import annotations

import functools
import os

import torch

_state = {"on": os.environ.get("TOKENMILL_PDL", "1") != "0"}


def set_pdl(on: bool) -> None:
    _state["on"] = on


def pdl_enabled(device: torch.device) -> bool:
    if not _state["on"] or device.type != "cuda":
        return False
    return _hopper_or_newer(device.index if device.index is not None else -1)


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    """Asked on every kernel launch, so the device query runs once per GPU."""
    device = torch.cuda.current_device() if index < 0 else index
    return torch.cuda.get_device_capability(device)[0] >= 9
