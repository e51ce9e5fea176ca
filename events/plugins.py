"""Packages above a layer contribute to it by module name: the layer names the module and looks
up a hook in it, so it imports nothing of the packages built on it (the app's extensions,
the projections of billing)."""

from __future__ import annotations

import importlib
from typing import Any


def hook(module_name: str, hook_name: str) -> Any | None:
    """`module_name.hook_name`, or None when the module is not installed or has no such hook;
    an import error inside an installed module is raised."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None
        raise
    return getattr(module, hook_name, None)
