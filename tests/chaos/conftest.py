"""Each chaos test breaks its stack: one stack per module, as the data-plane tests make it."""

from tests.dataplane.conftest import fast_path, module_database_url, stack, stack_env

__all__ = ["fast_path", "module_database_url", "stack", "stack_env"]
