"""/v1 against its own OpenAPI document (schemathesis): generated requests to the completion,
responses and models routes, valid and invalid, are never answered with a 5xx, and every answer has a
documented status and content type. Served by the test harness (the fast path, real NATS,
Postgres and a fixed-rate worker) from its own thread, since schemathesis calls it
synchronously."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from schemathesis import GenerationMode

from control_plane.embedded import EmbeddedNats
from tests.dataplane.harness import Stack, running_stack
from tests.openapi_cases import assert_conforms, failures, operations
from tests.threaded import ThreadedServer

# The whole stack with a worker process, served by a fixture of this module.
pytestmark = pytest.mark.e2e


class _ServedStack(ThreadedServer):
    start_timeout_s = 90.0

    def __init__(self, nats_url: str, database_url: str, data_dir: Path) -> None:
        super().__init__()
        self.args = (nats_url, database_url, "V" + uuid.uuid4().hex[:10].upper(), data_dir)
        self.stack: Stack | None = None
        self.key = ""
        self.sku = ""

    async def serve(self) -> None:
        async with running_stack(*self.args) as stack:
            sku, _ = await stack.served_sku("schema-", tokens_per_s=2000.0, output_tokens=4)
            _, key = await stack.tenant_with_key()
            self.stack, self.key, self.sku = stack, key["key"], sku["name"]
            self.started()
            await self.until_stopped()


@pytest.fixture(scope="module")
def served(
    fast_path: bool, nats_server: EmbeddedNats, module_database_url: str, tmp_path_factory: Any
) -> Iterator[_ServedStack]:
    with _ServedStack(nats_server.url, module_database_url, tmp_path_factory.mktemp("v1")) as s:
        yield s


def _failures(served: _ServedStack, max_examples: int, modes: list[GenerationMode]) -> list[str]:
    assert served.stack is not None
    auth = {"Authorization": f"Bearer {served.key}"}
    v1 = r"^/v1/(chat/completions|completions|responses|models)"
    v1_operations = operations(served.stack.base_url, auth, v1)
    assert len(v1_operations) == 5, [op.label for op in v1_operations]

    def name_the_model(case: Any) -> None:
        """Valid requests name a model that exists, so some are served."""
        if isinstance(case.body, dict):
            case.body["model"] = served.sku

    return failures(v1_operations, modes, max_examples, auth, name_the_model)


def test_v1_conforms_to_its_openapi(served: _ServedStack) -> None:
    assert_conforms(_failures(served, 5, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_v1_conforms_to_its_openapi_long(served: _ServedStack) -> None:
    assert_conforms(_failures(served, 200, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
