"""The OpenAI-compatible data plane: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

`DataPlane` owns what the routes need — a NATS connection of its own (the hot path does not
share one with the admin API), the gateway and the authorizer — and gives the app factory a
Litestar router plus start/stop callables."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import nats
from litestar import Request, Response, Router, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from nats.aio.client import Client as NATS

from control_plane.dataplane import errors
from control_plane.dataplane.auth import Authorizer
from control_plane.dataplane.gateway import (
    ChunkLost,
    Gateway,
    GatewaySettings,
    NoWorker,
    OutcomeListener,
    Relay,
    RequestRejected,
    WorkerLost,
)
from control_plane.dataplane.requests import (
    ChatCompletionBody,
    CompletionBody,
    parse_chat,
    parse_completion,
)
from control_plane.dataplane.responses import DONE, Kind, StreamWriter, full_response, usage
from control_plane.governance.admission import Admission, Refusal, Ticket
from events.governance import GovernanceView, Sku
from worker.protocol import ChatMessage, GenerateRequest, TokenChunk

log = logging.getLogger("tokenmill.dataplane")

JSON = "application/json"


def estimate_prompt_tokens(prompt: str | None, messages: list[ChatMessage] | None) -> int:
    """What admission reserves for the prompt before the worker has tokenized it: a third of
    its UTF-8 bytes (BPE vocabularies average 3-4 bytes a token on text) plus the chat
    template's framing. It settles to the worker's count when the request ends."""
    if messages is not None:
        return sum(len(m.content.encode()) // 3 + 8 for m in messages) + 8
    return len((prompt or "").encode()) // 3 + 1


def _error_response(exc: errors.OpenAIError) -> Response[bytes]:
    return Response(exc.to_json(), status_code=exc.status, media_type=JSON, headers=exc.headers)


def _openai_error_handler(_: Request, exc: Exception) -> Response[bytes]:
    assert isinstance(exc, errors.OpenAIError)
    return _error_response(exc)


def _http_error_handler(_: Request, exc: Exception) -> Response[bytes]:
    """Litestar's own refusals (405, bad content type...) as OpenAI error objects too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status >= 500:
        log.error("unhandled error under /v1", exc_info=exc)
        return _error_response(
            errors.OpenAIError(502, "Internal error in the gateway.", type="server_error")
        )
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    return _error_response(errors.OpenAIError(status, detail))


class DataPlane:
    def __init__(
        self,
        nats_url: str,
        prefix: str,
        governance: GovernanceView,
        settings: GatewaySettings | None = None,
    ) -> None:
        self.nats_url, self.prefix = nats_url, prefix
        self.governance = governance
        self.settings = settings or GatewaySettings()
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
            self.nats_url,
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

        @get("/models/{model:str}")
        async def get_model(request: Request, model: str) -> Response[bytes]:
            caller = plane.authorizer.caller(request.headers.get("authorization"))
            return Response(
                _dumps(_model_card(plane.authorizer.sku(caller, model))), media_type=JSON
            )

        @post("/chat/completions", status_code=200)
        async def chat_completions(request: Request) -> Response[bytes] | Stream:
            return await plane._complete("chat", request)

        @post("/completions", status_code=200)
        async def completions(request: Request) -> Response[bytes] | Stream:
            return await plane._complete("completion", request)

        return Router(
            path="/v1",
            route_handlers=[list_models, get_model, chat_completions, completions],
            exception_handlers={
                errors.OpenAIError: _openai_error_handler,
                Exception: _http_error_handler,
            },
            include_in_schema=True,
        )

    async def _complete(self, kind: Kind, request: Request) -> Response[bytes] | Stream:
        caller = self.authorizer.caller(request.headers.get("authorization"))
        raw = await request.body()
        body: ChatCompletionBody | CompletionBody
        if kind == "chat":
            body, messages, sampling = parse_chat(raw)
            prompt = None
        else:
            body, prompt, sampling = parse_completion(raw)
            messages = None
        sku = self.authorizer.sku(caller, body.model)
        gen = GenerateRequest(
            request_id=uuid.uuid4().hex,
            tenant_id=caller.tenant.tenant_id,
            key_id=caller.key.key_id,
            sku_id=sku.sku_id,
            model=sku.model,
            prompt=prompt,
            messages=messages,
            sampling=sampling,
            reply_to="",
            admitted_at=time.time(),
        )
        ticket: Ticket | None = None
        if self.admission is not None:
            decision = await self.admission.admit(
                gen.tenant_id,
                gen.key_id,
                gen.sku_id,
                estimate_prompt_tokens(prompt, messages),
                sampling.max_tokens,
                gen.request_id,
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
            # The answer can never outgrow what admission reserved.
            budget = msgspec.structs.replace(sampling, token_budget=ticket.max_tokens)
            gen = msgspec.structs.replace(gen, sampling=budget)
        headers = dict(ticket.headers) if ticket is not None else {}
        try:
            relay = await self.gateway.open(gen, ticket)
        except NoWorker:
            if ticket is not None:
                ticket.release()
            raise errors.no_worker(sku.name) from None
        created = int(gen.admitted_at)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            writer = StreamWriter(kind, gen.request_id, created, sku.name, include_usage)
            chunks = relay.chunks()
            # Wait for the first chunk before answering, so that a request refused by the worker
            # or unserved gets a proper status instead of an error inside a 200 stream.
            first = await _first_or_error(relay, chunks, sku.name)
            return Stream(
                _sse(relay, chunks, first, writer, include_usage),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-request-id": gen.request_id, **headers},
            )
        text = []
        try:
            async for chunk in relay.chunks():
                text.append(chunk.text)
        except BaseException as exc:
            raise _relay_error(exc, sku.name) from None
        finally:
            relay.release()
        fin = relay.finished
        assert fin is not None
        if fin.finish_reason == "error":
            raise errors.worker_failed(fin.error or "generation failed")
        u = usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)
        content = full_response(
            kind, gen.request_id, created, sku.name, "".join(text), fin.finish_reason, u
        )
        return Response(
            content, media_type=JSON, headers={"x-request-id": gen.request_id, **headers}
        )


def _relay_error(exc: BaseException, model: str) -> BaseException:
    """Maps what a relay raises to the client's error (other exceptions pass through)."""
    if isinstance(exc, NoWorker):
        return errors.no_worker(model)
    if isinstance(exc, RequestRejected):
        r = exc.rejected
        return errors.invalid_request(
            r.message, param=r.param, code="context_length_exceeded" if r.param else None
        )
    if isinstance(exc, WorkerLost):
        return errors.worker_failed("the worker stopped responding")
    if isinstance(exc, ChunkLost):
        return errors.worker_failed("part of the token stream was lost")
    return exc


async def _first_or_error(
    relay: Relay, chunks: AsyncIterator[TokenChunk], model: str
) -> TokenChunk | None:
    try:
        return await anext(chunks, None)
    except BaseException as exc:
        relay.release()
        raise _relay_error(exc, model) from None


async def _sse(
    relay: Relay,
    chunks: AsyncIterator[TokenChunk],
    first: TokenChunk | None,
    writer: StreamWriter,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE events of one streamed response. The `finally` runs when the client goes away
    too (Litestar cancels the stream): the relay then cancels generation and still meters."""
    try:
        try:
            chunk = first
            while chunk is not None:
                if chunk.text:
                    yield writer.delta(chunk.text)
                chunk = await anext(chunks, None)
        except (NoWorker, RequestRejected, WorkerLost, ChunkLost) as exc:
            err = _relay_error(exc, "")
            assert isinstance(err, errors.OpenAIError)
            yield StreamWriter.error(err.to_json())
            return
        fin = relay.finished
        assert fin is not None
        if fin.finish_reason == "error":
            yield StreamWriter.error(
                errors.worker_failed(fin.error or "generation failed").to_json()
            )
            return
        yield writer.delta("", fin.finish_reason)
        if include_usage:
            yield writer.usage(usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens))
        yield DONE
    finally:
        relay.release()


def _model_card(sku: Sku) -> dict[str, object]:
    return {
        "id": sku.name,
        "object": "model",
        "created": int(sku.published_at.timestamp()),
        "owned_by": "tokenmill",
    }


def _dumps(obj: object) -> bytes:
    return msgspec.json.encode(obj)
