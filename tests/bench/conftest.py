"""Fixtures shared by the bench tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture()
def one_thread() -> Iterator[None]:
    """One intra-op thread: the benches' tiny models on a busy 2-core machine gain nothing
    from a second one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
