"""OpenAI error objects for /v1: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import os

import msgspec


def new_request_id() -> str:
    """A request's id: in `x-request-id`, usage events and the ledger."""
    return os.urandom(16).hex()  # as random as uuid4().hex, a few calls fewer


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class OpenAIError(Exception):
    """Raised anywhere under /v1; the router turns it into the status and error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorEnvelope(ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers or {}

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.body)

    def header_items(self, request_id: str | None = None) -> dict[str, str]:
        """The answer's headers: always an `x-request-id` (a fresh one for a request refused
        before it had one), so a client can name any answer it disputes."""
        return {**self.headers, "x-request-id": request_id or new_request_id()}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def invalid_api_key() -> OpenAIError:
    return OpenAIError(
        401,
        "Incorrect API key provided. Pass a valid tokenmill key as `Authorization: Bearer <key>`.",
        code="invalid_api_key",
    )


def tenant_suspended() -> OpenAIError:
    return OpenAIError(
        403, "This key's tenant is suspended.", type="permission_error", code="tenant_suspended"
    )


def model_not_allowed(model: str) -> OpenAIError:
    return OpenAIError(
        403,
        f"This API key is not allowed to use the model `{model}`.",
        type="permission_error",
        param="model",
        code="model_not_allowed",
    )


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def no_worker(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No worker is serving the model `{model}` right now; try again later.",
        type="server_error",
        code="model_unavailable",
        headers={"retry-after": "1"},
    )


def body_store_unavailable() -> OpenAIError:
    """A request larger than one NATS message found the object store that carries such
    requests unavailable (worker/request_bodies.py)."""
    return OpenAIError(
        503,
        "This request is too large for one message and the store that carries large requests "
        "is unavailable right now; try again later.",
        type="server_error",
        code="service_unavailable",
        headers={"retry-after": "1"},
    )


def worker_failed(detail: str) -> OpenAIError:
    """The worker died or its stream broke mid-request; the tokens it produced are metered."""
    return OpenAIError(
        502,
        f"The worker serving this request failed: {detail}",
        type="server_error",
        code="worker_error",
    )


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes).",
        code="request_too_large",
    )


def read_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        408, f"The request body did not arrive within {seconds:g} s.", code="request_timeout"
    )


def not_found(method: str, path: str) -> OpenAIError:
    return OpenAIError(404, f"Invalid URL ({method} {path}).", code="not_found")


def method_not_allowed(method: str, path: str, allowed: str) -> OpenAIError:
    return OpenAIError(
        405,
        f"{method} is not allowed on {path}; use {allowed}.",
        code="method_not_allowed",
        headers={"allow": allowed},
    )


def header_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        431,
        f"The request's headers are larger than this server accepts ({limit} bytes).",
        code="request_header_fields_too_large",
    )


def head_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        408, f"The request's headers did not arrive within {seconds:g} s.", code="request_timeout"
    )
