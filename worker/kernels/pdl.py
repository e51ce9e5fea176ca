"""Whether kernels launch with programmatic dependent launch (PDL, Hopper and newer).

A decode step is ~800 short dependent kernels; with PDL each kernel's launch and its programs'
start overlap the tail of the one before it (the kernel waits in its first statement until its
predecessor completed, see worker/kernels/triton/_launch.py). TOKENMILL_PDL=0 turns it off;
`set_pdl` flips it at run time (graphs captured before keep what they captured). This module
imports no triton, so the engine can consult it on machines without one.

Early release (`TOKENMILL_PDL_EARLY_RELEASE=1`, off by default until measured; `set_early_release`
at run time): the short kernels that sit between two weight-streaming GEMVs (the norms, the
attention's output gate, the int8 codes' own launch) let the next kernel launch before their
own wait instead of after it, so the GEMV after them is resident and has its first weights and
scales in registers while the GEMV before them still runs, instead of starting that prologue
once it has finished. So does the DeltaNet's conv update, whose next kernel, the recurrence,
loads its states before its wait. Correct
because a kernel's wait still waits for the kernel before it to complete, and that one waited
for its own predecessor. The rule it asks of the kernels launched after an early-releasing one:
before their wait they read only what no kernel still running may write: constants (weights,
scales), or the recurrence's own state slots (`early_state`: written by an earlier step, or
other slots by this step's prefill); the int4-mma GEMV and every triton kernel that waits first
keep it; a GEMV with a late wait (`w8_gemv(..., beside_previous=True)`) must never follow one.
"""

from __future__ import annotations

import functools
import os

import torch

_state = {
    "on": os.environ.get("TOKENMILL_PDL", "1") != "0",
    "early": os.environ.get("TOKENMILL_PDL_EARLY_RELEASE", "0") == "1",
}


def set_pdl(on: bool) -> None:
    _state["on"] = on


def set_early_release(on: bool) -> None:
    _state["early"] = on


def early_release_enabled(device: torch.device) -> bool:
    """Whether the kernels that may release early do so on `device` (PDL on, and the switch)."""
    return _state["early"] and pdl_enabled(device)


def pdl_enabled(device: torch.device) -> bool:
    if not _state["on"] or device.type != "cuda":
        return False
    return _hopper_or_newer(device.index if device.index is not None else -1)


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    """Asked on every kernel launch, so the device query runs once per GPU."""
    device = torch.cuda.current_device() if index < 0 else index
    return torch.cuda.get_device_capability(device)[0] >= 9
