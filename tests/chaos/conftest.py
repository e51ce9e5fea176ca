"""Each chaos test breaks its stack: one stack per module, as the data-plane tests make it."""

from tests.dataplane.conftest import module_database_url, stack

__all__ = ["module_database_url", "stack"]
