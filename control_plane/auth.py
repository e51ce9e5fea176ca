"""The admin bearer token: TOKENMILL_ADMIN_TOKEN, or one generated on first start and kept
(mode 0600) in `<data_dir>/admin-token`."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.types import Guard

from control_plane.problems import ProblemError
from tokenmill.settings import Settings

TOKEN_FILE = "admin-token"


def resolve_admin_token(settings: Settings) -> tuple[str, bool]:
    """The admin token and whether it was generated just now (print it once, then)."""
    if settings.admin_token:
        return settings.admin_token, False
    path = Path(settings.data_dir) / TOKEN_FILE
    if path.exists():
        return path.read_text().strip(), False
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "tmadm_" + secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token, True


def bearer_guard(token: str, realm: str) -> Guard:
    """A route guard admitting `Authorization: Bearer <token>` only; `realm` names what the
    token is for (`admin`, `metrics`) in the refusal."""
    expected = token.encode()

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        scheme, _sep, value = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), expected):
            raise ProblemError(
                401,
                "unauthorized",
                f"a valid {realm} bearer token is required",
                headers={"WWW-Authenticate": f'Bearer realm="tokenmill-{realm}"'},
            )

    return guard


def admin_guard(token: str) -> Guard:
    """A route guard admitting `Authorization: Bearer <token>` only."""
    return bearer_guard(token, "admin")
