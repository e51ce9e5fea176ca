"""Fixtures shared by the worker tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture()
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: with tiny matmuls a second thread only adds contention
    on a busy 2-core machine. Modules opt in with `pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
