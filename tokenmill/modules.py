"""Optional modules named by string: the app's extensions and billing's projections are
found this way so that a lower package never imports the packages built on it."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from types import ModuleType


def installed_modules(names: Iterable[str]) -> Iterator[ModuleType]:
    """Each named module that is installed, in order. One that is absent is skipped; one that
    is there but fails to import (a missing dependency of its own) raises."""
    for name in names:
        try:
            yield importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
