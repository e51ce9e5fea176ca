"""RFC 9457 problem details for the admin API: every error is `application/problem+json` with
type, title, status, detail and a machine-readable `reason`. Bad input is a 4xx, never a 500;
an unreachable NATS or Postgres is a 503."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotAuthorizedException,
    NotFoundException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import ExceptionHandlersMap

from events.unavailable import backend_unavailable
from events.validation import InvalidEvent

log = logging.getLogger("tokenmill.api")

PROBLEM_JSON = "application/problem+json"
PROBLEM_TYPE_BASE = "https://tokenmill.dev/problems/"


class ProblemDetails(msgspec.Struct, kw_only=True):
    """The body of every admin error (RFC 9457); some carry more members (`field`, `errors`,
    `current_version`, `tenant_id`, ...)."""

    type: str
    title: str
    status: int
    detail: str
    instance: str
    reason: str
    field: str | None = None


_DESCRIPTIONS = {
    400: "Invalid request: a malformed or out-of-range parameter or body (`field` names it)",
    401: "Missing or wrong admin token",
    404: "No such resource",
    409: "Conflict: a stale If-Match, a concurrent write, or the resource's state forbids it",
    422: "The body names resources that do not exist",
    503: "NATS or Postgres unreachable, or the read models did not catch up in time",
}


def problem_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI `responses` for the error statuses a route sends, as problem details (with 400,
    401 and 503, which every admin route can send)."""
    return {
        status: ResponseSpec(
            data_container=ProblemDetails,
            description=_DESCRIPTIONS[status],
            media_type=PROBLEM_JSON,
            generate_examples=False,
        )
        for status in sorted({400, 401, 503, *statuses})
    }


class ProblemError(Exception):
    """A failure the client can act on; `reason` is a stable snake_case code."""

    def __init__(
        self,
        status: int,
        reason: str,
        detail: str,
        *,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.title = title or reason.replace("_", " ").capitalize()
        self.headers = headers or {}
        self.extra = extra


def not_found(what: str, ident: str) -> ProblemError:
    return ProblemError(404, f"{what}_not_found", f"no {what.replace('_', ' ')} {ident!r}")


def problem_response(
    request: Request[Any, Any, Any], exc: ProblemError
) -> Response[dict[str, Any]]:
    body = {
        "type": PROBLEM_TYPE_BASE + exc.reason,
        "title": exc.title,
        "status": exc.status,
        "detail": exc.detail,
        "instance": request.url.path,
        "reason": exc.reason,
        **exc.extra,
    }
    return Response(body, status_code=exc.status, media_type=PROBLEM_JSON, headers=exc.headers)


def _from_http_exception(exc: HTTPException) -> ProblemError:
    if isinstance(exc, ValidationException):
        errors = exc.extra if isinstance(exc.extra, list) else []
        messages = " ".join(str(e.get("message", "")) for e in errors if isinstance(e, dict))
        reason = "unknown_field" if "unknown field" in messages else "invalid_request"
        detail = messages or exc.detail
        # Litestar names the whole body "data" when the error has no path in it.
        fields = [
            e["key"]
            for e in errors
            if isinstance(e, dict)
            and e.get("key")
            and (e["key"], e.get("source")) != ("data", "body")
        ]
        extra: dict[str, Any] = {"field": str(fields[0])} if fields else {}
        return ProblemError(400, reason, detail, title="Invalid request", errors=errors, **extra)
    if isinstance(exc, NotAuthorizedException):
        return ProblemError(401, "unauthorized", exc.detail, headers={"WWW-Authenticate": "Bearer"})
    if isinstance(exc, PermissionDeniedException):
        return ProblemError(403, "forbidden", exc.detail)
    if isinstance(exc, NotFoundException):
        return ProblemError(404, "not_found", exc.detail)
    if isinstance(exc, MethodNotAllowedException):
        return ProblemError(405, "method_not_allowed", exc.detail, headers=dict(exc.headers or {}))
    reason = "invalid_request" if exc.status_code == 400 else f"http_{exc.status_code}"
    return ProblemError(exc.status_code, reason, exc.detail, headers=dict(exc.headers or {}))


def handle_problem(request: Request[Any, Any, Any], exc: ProblemError) -> Response[dict[str, Any]]:
    return problem_response(request, exc)


def handle_http_exception(
    request: Request[Any, Any, Any], exc: HTTPException
) -> Response[dict[str, Any]]:
    return problem_response(request, _from_http_exception(exc))


def handle_invalid_event(
    request: Request[Any, Any, Any], exc: InvalidEvent
) -> Response[dict[str, Any]]:
    # The write would have appended an event no projection can store: refused, nothing appended.
    return problem_response(
        request, ProblemError(400, exc.reason, exc.detail, title="Invalid request", field=exc.field)
    )


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    # Never raises: an exception in here would make Litestar answer with a bare text 500.
    if isinstance(exc, TimeoutError):
        log.warning("backend timeout on %s: %r", request.url.path, exc)
        return problem_response(
            request, ProblemError(503, "timeout", "a backend did not answer in time")
        )
    if backend_unavailable(exc):
        log.warning("backend unavailable on %s: %r", request.url.path, exc)
        return problem_response(
            request, ProblemError(503, "backend_unavailable", "NATS or Postgres is unreachable")
        )
    log.error("unexpected error on %s", request.url.path, exc_info=exc)
    return problem_response(
        request, ProblemError(500, "internal_error", "unexpected error; see the server log")
    )


PROBLEM_HANDLERS: ExceptionHandlersMap = {
    ProblemError: handle_problem,
    InvalidEvent: handle_invalid_event,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
