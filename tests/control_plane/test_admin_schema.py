"""The admin API against its own OpenAPI document (schemathesis): every generated request to an
`/admin/v1` operation is answered without a 5xx, with a documented status and content type, and
a body that matches the documented schema. Served by uvicorn over the real NATS and Postgres."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from schemathesis import GenerationMode

from control_plane.admission import tokenmill_extension
from control_plane.app import create_app
from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from control_plane.services import Services
from tests.control_plane.conftest import ADMIN_TOKEN
from tests.control_plane.serving import serving
from tests.databases import fresh_database
from tests.openapi_cases import assert_conforms, failures, operations
from tests.threaded import ThreadedServer
from tokenmill.settings import Settings

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
    # Only the admin API: the other routes are documented and tested by their own suites.
    admin = operations(app.base_url, AUTH, r"^/admin/v1/")
    assert len(admin) >= 18, [op.label for op in admin]
    return failures(admin, modes, max_examples, AUTH)


def test_admin_api_conforms_to_its_openapi(admin_app: _ServedApp) -> None:
    assert_conforms(_failures(admin_app, 3, [GenerationMode.POSITIVE]))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_admin_api_conforms_to_its_openapi_long(admin_app: _ServedApp) -> None:
    # Negative cases too: bodies and parameters outside the schema must be documented 4xx.
    assert_conforms(_failures(admin_app, 40, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
