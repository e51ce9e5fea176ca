"""The GPU's tuning file from what this run's sweeps chose and measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.engine.suite import Suite


def write_tuning(suite: Suite, into_package: bool) -> None:
    """The settings this run chose and measured, as the GPU's tuning file: a copy in the out
    folder, and the package's own file with --write-tuning."""
    from worker.kernels import tuning

    gpu = torch.cuda.get_device_name()
    data = tuning.snapshot(gpu, measured_by="python -m bench.engine.suite")
    tuning.write(suite.out / f"tuning-{tuning.gpu_slug(gpu)}.json", data)
    if into_package:
        tuning.write(tuning.path_for(gpu), data)
    suite.report["tuning_file"] = str(tuning.path_for(gpu)) if into_package else None
