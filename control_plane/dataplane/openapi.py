"""/v1 in the app's OpenAPI document (`/schema/openapi.json`), in OpenAI's shapes.

The completion routes are ASGI handlers (the token hot path), which Litestar leaves out of
its document, and the models routes answer raw bytes; so these paths are written here, their
schemas generated from the structs that parse requests and render answers (so the document
says what the server accepts: bounds, enums, no unknown fields)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Litestar
from litestar.config.app import AppConfig
from litestar.openapi.spec import SecurityScheme
from litestar.plugins import InitPlugin

from control_plane.dataplane.errors import ErrorEnvelope
from control_plane.dataplane.requests import ChatCompletionBody, CompletionBody
from control_plane.dataplane.responses import ChatCompletion, TextCompletion
from control_plane.dataplane.responses_api import INPUT_ITEMS, Response, ResponsesBody

log = logging.getLogger("tokenmill.dataplane")


class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"


_REF = "#/components/schemas/{name}"
_STRUCTS = [
    ChatCompletionBody,
    CompletionBody,
    ChatCompletion,
    TextCompletion,
    ResponsesBody,
    Response,
    *INPUT_ITEMS,
    Model,
    ModelList,
]


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=ref)}}}


def _errors(*statuses: int) -> dict[str, Any]:
    what = {
        400: "Invalid request (the error names the parameter)",
        401: "Missing, unknown or revoked API key",
        403: "Tenant suspended, or the key may not use this model",
        404: "No such model",
        408: "The request body did not arrive in time",
        413: "The request body is too large",
        429: "Rate limit or quota exceeded",
        502: "The worker failed",
        503: "No worker serves the model now",
    }
    return {str(s): {"description": what[s], "content": _json("ErrorEnvelope")} for s in statuses}


_STREAMED = "The answer; with `stream: true`, server-sent events of chunks ending `data: [DONE]`"


def _completion(
    summary: str, body: str, answer: str, tag: str = "completions", streamed: str = _STREAMED
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": f"create{body}",
            "tags": [tag],
            "security": [{"api_key": []}],
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {
                "200": {
                    "description": streamed,
                    "content": {
                        **_json(answer),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 403, 404, 408, 413, 429, 502, 503),
            },
        }
    }


def v1_document() -> tuple[dict[str, Any], dict[str, Any]]:
    """(paths, component schemas) for /v1, as OpenAPI 3.1 (JSON Schema) dictionaries."""
    _, schemas = msgspec.json.schema_components([*_STRUCTS, ErrorEnvelope], ref_template=_REF)
    # The Responses API's `input` is read item by item (responses_api.input_messages), from
    # dicts: its items as the shapes that reading accepts. `stream_options` is no field of it.
    responses_body = schemas["ResponsesBody"]
    items = {"anyOf": [{"$ref": _REF.format(name=t.__name__)} for t in INPUT_ITEMS]}
    responses_body["properties"]["input"] = {
        "anyOf": [{"type": "string"}, {"type": "array", "items": items}]
    }
    responses_body["properties"].pop("stream_options", None)
    get_model = {
        "summary": "One model (a SKU name, or the model a SKU serves)",
        "operationId": "retrieveModel",
        "tags": ["models"],
        "security": [{"api_key": []}],
        "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "responses": {"200": {"description": "The model", "content": _json("Model")}}
        | _errors(401, 403, 404),
    }
    paths = {
        "/v1/chat/completions": _completion(
            "Chat completion", "ChatCompletionBody", "ChatCompletion"
        ),
        "/v1/completions": _completion("Text completion", "CompletionBody", "TextCompletion"),
        "/v1/responses": _completion(
            "Create a response (stateless: nothing is stored)",
            "ResponsesBody",
            "Response",
            tag="responses",
            streamed="The Response object; with `stream: true`, server-sent events "
            "(`response.created`, output items and deltas, `response.completed` or "
            "`response.incomplete`)",
        ),
        "/v1/models": {
            "get": {
                "summary": "The models this key may use",
                "operationId": "listModels",
                "tags": ["models"],
                "security": [{"api_key": []}],
                "responses": {"200": {"description": "Models", "content": _json("ModelList")}}
                | _errors(401, 403),
            }
        },
        "/v1/models/{model}": {"get": get_model},
    }
    return paths, schemas


class V1OpenAPI(InitPlugin):
    """Adds `v1_document()` to the app's OpenAPI document when the app starts."""

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        if app_config.openapi_config is not None:
            app_config.on_startup = [*app_config.on_startup, self._document]
        return app_config

    @staticmethod
    def _document(app: Litestar) -> None:
        openapi = app.openapi_schema
        paths, schemas = v1_document()
        # Litestar's own entries for these paths (if any) describe raw bytes: replaced. The
        # dictionaries pass through its serializer as they are.
        openapi.paths = {
            **{p: v for p, v in (openapi.paths or {}).items() if p not in paths},
            **paths,
        }
        components = openapi.components
        components.schemas = {**(components.schemas or {}), **schemas}
        security = dict(components.security_schemes or {})
        security["api_key"] = SecurityScheme(
            type="http", scheme="bearer", description="A tenant's API key (tm_...)"
        )
        components.security_schemes = security
