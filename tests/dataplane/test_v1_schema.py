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
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

from control_plane.embedded import EmbeddedNats
from tests.dataplane.harness import Stack, running_stack
from tests.threaded import ThreadedServer

CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
]

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
            sku = await stack.publish_sku("schema-" + uuid.uuid4().hex[:6])
            stack.start_worker(sku["sku_id"], tokens_per_s=2000.0, output_tokens=4)
            await stack.wait_served(sku["sku_id"])
            _, key = await stack.tenant_with_key()
            self.stack, self.key, self.sku = stack, key["key"], sku["name"]
            self.started()
            await self.until_stopped()


@pytest.fixture(scope="module")
def served(
    nats_server: EmbeddedNats, module_database_url: str, tmp_path_factory: Any
) -> Iterator[_ServedStack]:
    with _ServedStack(nats_server.url, module_database_url, tmp_path_factory.mktemp("v1")) as s:
        yield s


def _cases(
    operation: Any, mode: GenerationMode, max_examples: int, auth: dict[str, str], sku: str
) -> Any:
    """A test of `operation`'s generated cases: valid ones name a model that exists, so some
    are served."""
    positive = mode == GenerationMode.POSITIVE

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=max_examples,
        derandomize=True,  # the same cases on every run
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        if positive and isinstance(case.body, dict):
            case.body["model"] = sku
        case.call_and_validate(headers=auth, checks=CHECKS, timeout=30)

    return run


def _failures(served: _ServedStack, max_examples: int, modes: list[GenerationMode]) -> list[str]:
    assert served.stack is not None
    auth = {"Authorization": f"Bearer {served.key}"}
    config = schemathesis.Config.from_dict({"seed": 20261201, "headers": auth})
    schema = schemathesis.openapi.from_url(
        served.stack.base_url + "/schema/openapi.json", config=config
    ).include(path_regex=r"^/v1/(chat/completions|completions|responses|models)")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 5, [op.label for op in operations]
    failures = []
    for operation in operations:
        for mode in modes:
            run = _cases(operation, mode, max_examples, auth, served.sku)
            try:
                run()
            except Unsatisfiable:  # no invalid request exists (no body, free-form path)
                assert mode == GenerationMode.NEGATIVE, operation.label
            except (Exception, BaseExceptionGroup) as e:  # schemathesis groups its failures
                failures.append(f"{operation.label} ({mode}): {e}")
    return failures


def test_v1_conforms_to_its_openapi(served: _ServedStack) -> None:
    failures = _failures(served, 5, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_v1_conforms_to_its_openapi_long(served: _ServedStack) -> None:
    failures = _failures(served, 200, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    assert not failures, "\n\n".join(failures)
