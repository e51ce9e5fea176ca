"""The admin API against its own OpenAPI document (schemathesis): every generated request to an
`/admin/v1` operation is answered without a 5xx, with a documented status and content type, and
a body that matches the documented schema. Served by uvicorn over the real NATS and Postgres."""

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

from control_plane.admission import tokenmill_extension
from control_plane.app import create_app
from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from control_plane.services import Services
from tests.control_plane.conftest import ADMIN_TOKEN
from tests.control_plane.serving import serving
from tests.databases import fresh_database
from tests.threaded import ThreadedServer
from tokenmill.settings import Settings

# What the admin API promises: no 5xx, and only what its document says (status, content type,
# body). The stateful and data-acceptance checks are left out: a generated write is often a
# legitimate 4xx (unknown tenant, stale If-Match), which those would count as failures.
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class _ServedApp(ThreadedServer):
    """The app (admin API + limits) served from its own thread and event loop."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self.base_url = ""

    async def serve(self) -> None:
        services = await Services.connect(self.settings, ADMIN_TOKEN)
        try:
            extension = tokenmill_extension(services)
            services.extra.update(extension.extra)
            app = create_app(services, extensions=[extension], run_projectors=True)
            async with serving(app) as (base_url, _server):
                self.base_url = base_url
                self.started()
                await self.until_stopped()
        finally:
            await services.close()


@pytest.fixture(scope="module")
def admin_app(
    nats_server: EmbeddedNats, postgres_server: EmbeddedPostgres, tmp_path_factory: Any
) -> Iterator[_ServedApp]:
    data_dir: Path = tmp_path_factory.mktemp("schema")
    with fresh_database(postgres_server, "schema_") as url:
        settings = Settings(
            data_dir=data_dir,
            nats_url=nats_server.url,
            database_url=url,
            admin_token=ADMIN_TOKEN,
            stream_prefix="S" + uuid.uuid4().hex[:10].upper(),
        )
        with _ServedApp(settings) as served:
            yield served


def _failures(app: _ServedApp, max_examples: int, modes: list[GenerationMode]) -> list[str]:
    """Run every /admin/v1 operation's generated cases; the failures, one text per operation."""
    config = schemathesis.Config.from_dict({"seed": 20261201, "headers": AUTH})
    schema = schemathesis.openapi.from_url(app.base_url + "/schema/openapi.json", config=config)
    # Only the admin API: the other routes are documented and tested by their own suites.
    schema = schema.include(path_regex=r"^/admin/v1/")
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 18, [op.label for op in operations]
    for operation in operations:
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=max_examples,
                derandomize=True,  # the same cases on every run
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],  # report the case as found
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any) -> None:
                case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=30)

            try:
                run()
            except Unsatisfiable:
                # No negative case exists (only free-form string path parameters).
                assert mode == GenerationMode.NEGATIVE, operation.label
            except (Exception, BaseExceptionGroup) as e:  # schemathesis groups its failures
                failures.append(f"{operation.label} ({mode}): {e}")
    return failures


def test_admin_api_conforms_to_its_openapi(admin_app: _ServedApp) -> None:
    failures = _failures(admin_app, 3, [GenerationMode.POSITIVE])
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_admin_api_conforms_to_its_openapi_long(admin_app: _ServedApp) -> None:
    # Negative cases too: bodies and parameters outside the schema must be documented 4xx.
    failures = _failures(admin_app, 40, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    assert not failures, "\n\n".join(failures)
