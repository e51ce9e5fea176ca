"""The OpenAI-compatible data plane: `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
`/v1/responses`.

`DataPlane` owns what the routes need — a NATS connection of its own (the hot path does not
share one with the admin API), the gateway and the authorizer — and gives the app factory a
Litestar router plus start/stop callables."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import nats
from litestar import Request, Response, Router, asgi, get
from litestar.config.app import AppConfig
from litestar.exceptions import HTTPException
from litestar.plugins import InitPlugin
from litestar.types import ASGIApp, Receive, Scope, Send
from nats.aio.client import Client as NATS

from control_plane.admission.admit import Admission, Refusal, Ticket
from control_plane.admission.keys import Authorizer, Caller
from control_plane.admission.view import GovernanceView, Sku
from control_plane.dataplane import errors
from control_plane.dataplane.asgi import Completion, serve_completion
from control_plane.dataplane.dispatch import BodyStoreUnavailable
from control_plane.dataplane.gateway import Gateway, GatewaySettings, NoWorker, OutcomeListener
from control_plane.dataplane.limits import InputLimits
from control_plane.dataplane.requests import Parsed, parse_chat, parse_completion
from control_plane.dataplane.responses import Kind, StreamWriter
from control_plane.dataplane.responses_api import ResponsesWriter, parse_responses
from events.nats_cluster import nats_servers
from worker.protocol import ChatMessage, GenerateRequest, Tool

log = logging.getLogger("tokenmill.dataplane")

JSON = "application/json"


def estimate_prompt_tokens(
    prompt: str | None,
    messages: list[ChatMessage] | None,
    tools: list[Tool] | None = None,
    prompts: list[str] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
) -> int:
    """What admission reserves for the prompt before the worker has tokenized it: a third of
    its UTF-8 bytes (BPE vocabularies average 3-4 bytes a token on text) plus the chat
    template's framing (tools and earlier calls are written into the prompt too); several
    prompts, the sum; token ids, their count. It settles to the worker's count when the
    request ends."""
    if prompt_token_ids is not None:
        return sum(len(ids) for ids in prompt_token_ids)
    if prompts is not None:
        return sum(estimate_prompt_tokens(text, None) for text in prompts)
    if messages is not None:
        total = 8
        for m in messages:
            total += len(m.content.encode()) // 3 + 8
            for c in m.tool_calls or ():
                total += (len(c.name) + len(c.arguments.encode())) // 3 + 8
        for t in tools or ():
            total += (len(t.description or "") + len(t.parameters or "")) // 3 + 16
        return total
    return len((prompt or "").encode()) // 3 + 1


def _error_response(exc: errors.OpenAIError) -> Response[bytes]:
    return Response(
        exc.to_json(), status_code=exc.status, media_type=JSON, headers=exc.header_items()
    )


def _openai_error_handler(_: Request, exc: Exception) -> Response[bytes]:
    assert isinstance(exc, errors.OpenAIError)
    return _error_response(exc)


def _http_error_handler(request: Request, exc: Exception) -> Response[bytes]:
    """Litestar's own refusals (404, 405, bad content type...) as OpenAI error objects too."""
    if isinstance(exc, errors.OpenAIError):
        return _error_response(exc)
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status >= 500:
        log.error("unhandled error under /v1", exc_info=exc)
        return _error_response(
            errors.OpenAIError(502, "Internal error in the gateway.", type="server_error")
        )
    method, path = request.scope.get("method", "GET"), request.scope["path"]
    if status == 404:
        return _error_response(errors.not_found(method, path))
    if status == 405:
        allowed = (exc.headers or {}).get("allow", "") if isinstance(exc, HTTPException) else ""
        return _error_response(errors.method_not_allowed(method, path, allowed))
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    return _error_response(errors.OpenAIError(status, detail))


class DataPlane:
    def __init__(
        self,
        nats_url: str,
        prefix: str,
        governance: GovernanceView,
        settings: GatewaySettings | None = None,
        limits: InputLimits | None = None,
    ) -> None:
        self.nats_url, self.prefix = nats_url, prefix
        self.governance = governance
        self.settings = settings or GatewaySettings()
        self.limits = limits or InputLimits.from_settings()
        self.authorizer = Authorizer(governance)
        # Quotas and rate limits (the governance extension's Admission), when there is one.
        self.admission: Admission | None = None
        self._outcome_listeners: list[OutcomeListener] = []
        self.nc: NATS | None = None
        self._gateway: Gateway | None = None

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            raise RuntimeError("the data plane is not started")
        return self._gateway

    async def start(self) -> None:
        self.nc = await nats.connect(
            nats_servers(self.nats_url),
            name=f"gateway {self.settings.gateway_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        self._gateway = Gateway(self.nc, self.prefix, self.settings)
        for listener in self._outcome_listeners:
            self._gateway.on_outcome(listener)
        await self._gateway.start()

    def on_outcome(self, listener: OutcomeListener) -> None:
        """Called once per dispatched request when it ends (metrics, quota settlement...)."""
        self._outcome_listeners.append(listener)
        if self._gateway is not None:
            self._gateway.on_outcome(listener)

    async def stop(self) -> None:
        if self._gateway is not None:
            await self._gateway.close()
        if self.nc is not None:
            await self.nc.drain()

    def router(self) -> Router:
        plane = self

        @get("/models")
        async def list_models(request: Request) -> Response[bytes]:
            caller = plane.authorizer.caller(request.headers.get("authorization"))
            data = [_model_card(s) for s in plane.authorizer.models(caller)]
            return Response(_dumps({"object": "list", "data": data}), media_type=JSON)

        # A path: the model a SKU serves may hold a slash ("Qwen/Qwen3.6-27B", or its %2F).
        @get("/models/{model:path}")
        async def get_model(request: Request, model: str) -> Response[bytes]:
            caller = plane.authorizer.caller(request.headers.get("authorization"))
            sku = plane.authorizer.sku(caller, model.removeprefix("/"))
            return Response(_dumps(_model_card(sku)), media_type=JSON)

        @asgi("/chat/completions", copy_scope=False)
        async def chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
            await plane.serve_chat(scope, receive, send)

        @asgi("/completions", copy_scope=False)
        async def completions(scope: Scope, receive: Receive, send: Send) -> None:
            await plane.serve_text(scope, receive, send)

        @asgi("/responses", copy_scope=False)
        async def responses(scope: Scope, receive: Receive, send: Send) -> None:
            await plane.serve_responses(scope, receive, send)

        return Router(
            path="/v1",
            route_handlers=[list_models, get_model, chat_completions, completions, responses],
            exception_handlers={
                errors.OpenAIError: _openai_error_handler,
                Exception: _http_error_handler,
            },
            include_in_schema=True,
        )

    async def serve_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_completion(
            self.authorizer.caller, self._prepare_chat, self.limits, scope, receive, send
        )

    async def serve_text(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_completion(
            self.authorizer.caller, self._prepare_text, self.limits, scope, receive, send
        )

    async def serve_responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_completion(
            self.authorizer.caller, self._prepare_responses, self.limits, scope, receive, send
        )

    def completion_handlers(self) -> dict[str, ASGIApp]:
        """The completion routes' ASGI functions by full path, for an HTTP server that hands
        these paths to them directly (`fast_path.uvicorn.direct_routes`)."""
        return {
            "/v1/chat/completions": self.serve_chat,
            "/v1/completions": self.serve_text,
            "/v1/responses": self.serve_responses,
        }

    async def _prepare_chat(self, caller: Caller, raw: bytes, request_id: str) -> Completion:
        return await self._dispatch("chat", caller, parse_chat(raw), request_id)

    async def _prepare_text(self, caller: Caller, raw: bytes, request_id: str) -> Completion:
        return await self._dispatch("completion", caller, parse_completion(raw), request_id)

    async def _prepare_responses(self, caller: Caller, raw: bytes, request_id: str) -> Completion:
        return await self._dispatch("response", caller, parse_responses(raw), request_id)

    async def _dispatch(
        self, kind: Kind, caller: Caller, parsed: Parsed, request_id: str
    ) -> Completion:
        """Authorize the model, admit (quotas, rate limits), dispatch to a worker."""
        body, sampling = parsed.body, parsed.sampling
        sku = self.authorizer.sku(caller, body.model)
        ticket: Ticket | None = None
        if self.admission is not None:
            decision = await self.admission.admit(
                caller.tenant.tenant_id,
                caller.key.key_id,
                sku.sku_id,
                estimate_prompt_tokens(
                    parsed.prompt,
                    parsed.messages,
                    parsed.tools,
                    parsed.prompts,
                    parsed.prompt_token_ids,
                ),
                sampling.max_tokens,
                request_id,
                choices=parsed.choices,
            )
            if isinstance(decision, Refusal):
                raise errors.OpenAIError(
                    decision.status,
                    decision.message,
                    type=decision.type,
                    code=decision.code,
                    headers=decision.response_headers(),
                )
            ticket = decision
            # The answer can never outgrow what admission reserved (all choices share it).
            sampling = msgspec.structs.replace(
                sampling, token_budget=ticket.max_tokens // parsed.choices
            )
        gen = GenerateRequest(
            request_id=request_id,
            tenant_id=caller.tenant.tenant_id,
            key_id=caller.key.key_id,
            sku_id=sku.sku_id,
            model=sku.model,
            reply_to="",
            admitted_at=time.time(),
            **{**parsed.generate_fields(), "sampling": sampling},
        )
        try:
            relay = await self.gateway.open(gen, ticket)
        except BaseException as exc:  # never dispatched: give back what admission reserved
            if ticket is not None:
                ticket.release()
            if isinstance(exc, NoWorker):
                raise errors.no_worker(sku.name) from None
            if isinstance(exc, BodyStoreUnavailable):
                log.error("request %s: %s", request_id, exc)
                raise errors.body_store_unavailable() from None
            raise
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        writer: StreamWriter
        if kind == "response":
            writer = ResponsesWriter(parsed, request_id, int(gen.admitted_at), sku.name)
        else:
            # The prompts' text before their choices' (when the worker does not write it)
            echo = None
            if parsed.echo and not parsed.worker_echo:
                echo = parsed.prompts or [parsed.prompt or ""]
            writer = StreamWriter(
                kind,
                request_id,
                int(gen.admitted_at),
                sku.name,
                include_usage,
                parsed.choices,
                echo,
                parsed.n,
            )
        headers = ticket.headers if ticket is not None else {}
        return Completion(relay, writer, sku.name, bool(body.stream), headers)


class V1Errors(InitPlugin):
    """The app's own refusals of a /v1 request (no such route, such as endpoints this server
    does not offer, such as embeddings; a method the route does not take) as
    OpenAI error objects; other paths keep the app's handlers (problem details)."""

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        handlers = dict(app_config.exception_handlers)
        fallback = handlers.get(HTTPException) or handlers.get(Exception)
        for key, handler in [*handlers.items(), (HTTPException, fallback)]:
            if handler is not None:
                handlers[key] = _v1_first(handler)
        app_config.exception_handlers = handlers
        return app_config


def _v1_first(handler: Any) -> Any:
    def handle(request: Request, exc: Exception) -> Response[Any]:
        if request.scope["path"] == "/v1" or request.scope["path"].startswith("/v1/"):
            return _http_error_handler(request, exc)
        return handler(request, exc)  # type: ignore[no-any-return]

    return handle


def _model_card(sku: Sku) -> dict[str, object]:
    return {
        "id": sku.name,
        "object": "model",
        "created": int(sku.published_at.timestamp()),
        "owned_by": "tokenmill",
    }


def _dumps(obj: object) -> bytes:
    return msgspec.json.encode(obj)
