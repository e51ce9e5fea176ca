"""The completion routes at the ASGI level: the token hot path.

Going below Litestar's request/response objects here saves a few hundred microseconds of time
to first token per request (measured in bench/gateway_overhead.py), and gives direct control
of the two things that matter: the response starts only once the worker produced its first
chunk (so a refusal still gets its own status), and a client that hangs up is noticed at once
(a task waits for `http.disconnect` and interrupts the relay, which then cancels generation
and meters what was produced)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

from litestar.types import Message, Receive, Scope, Send

from control_plane.admission.keys import Caller
from control_plane.dataplane import errors
from control_plane.dataplane.fast_path import BODY_IN
from control_plane.dataplane.gateway import (
    ChunkLost,
    ClientGone,
    NoWorker,
    Relay,
    RequestRejected,
    WorkerLost,
)
from control_plane.dataplane.limits import InputLimits
from control_plane.dataplane.responses import StreamWriter, usage
from control_plane.dataplane.transport import ResponseOut
from worker.protocol import TokenChunk

log = logging.getLogger("tokenmill.dataplane")

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Completion:
    """What a handler decided before dispatch: the relay and how to answer."""

    def __init__(
        self, relay: Relay, writer: StreamWriter, model: str, stream: bool, headers: dict[str, str]
    ) -> None:
        self.relay, self.writer, self.model, self.stream = relay, writer, model, stream
        self.headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        self.headers.append((b"x-request-id", relay.dispatch.request_id.encode()))
        self.out: ResponseOut | None = None


# Parses the body of an authorized caller's request and dispatches it under the given request
# id; raises OpenAIError.
Prepare = Callable[[Caller, bytes, str], Awaitable[Completion]]
# The caller named by the Authorization header (None: none); raises OpenAIError.
Authorize = Callable[[str | None], Caller]


def relay_error(exc: BaseException, model: str) -> errors.OpenAIError | None:
    """The client's error for what a relay raised (None: not a relay failure)."""
    if isinstance(exc, NoWorker):
        return errors.no_worker(model)
    if isinstance(exc, RequestRejected):
        r = exc.rejected
        too_long = r.param in ("messages", "prompt", "input")
        code = r.code if r.code is not None else "context_length_exceeded" if too_long else None
        return errors.invalid_request(r.message, param=r.param, code=code)
    if isinstance(exc, WorkerLost):
        return errors.worker_failed("the worker stopped responding")
    if isinstance(exc, ChunkLost):
        return errors.worker_failed("part of the token stream was lost")
    return None


async def serve_completion(
    authorize: Authorize,
    prepare: Prepare,
    limits: InputLimits,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """One /v1 completion request, start to finish. Never raises.

    Everything that can be refused from the head is refused before the body is read (method,
    key, declared length); the body is read up to `limits.max_body_bytes` and within
    `limits.read_timeout_s`. A refusal that leaves part of the body unread closes the
    connection (the server discards the rest while the client sends it)."""
    completion: Completion | None = None
    watcher: asyncio.Task[None] | None = None
    body_read = bool(scope.get(BODY_IN))
    # Made before anything can be refused: every answer, refusals included, names it.
    request_id = errors.new_request_id()
    try:
        if scope.get("method") != "POST":
            raise errors.OpenAIError(405, "Use POST for this endpoint.", code="method_not_allowed")
        authorization = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                # latin-1, as Litestar decodes headers: it cannot fail on any byte.
                authorization = v.decode("latin-1")
            elif k == b"content-length" and (not v.isdigit() or int(v) > limits.max_body_bytes):
                # Checked before the key too: nothing of such a body will be read.
                raise errors.body_too_large(limits.max_body_bytes)
        caller = authorize(authorization)
        body = await _read_body(receive, limits, body_read)
        body_read = True
        completion = await prepare(caller, body, request_id)
        watcher = asyncio.create_task(_interrupt_on_disconnect(receive, completion))
        if completion.stream:
            await _stream(completion, scope, send, receive)
        else:
            await _whole(completion, scope, send, receive)
    except errors.OpenAIError as exc:
        await _send_error(send, exc, request_id, close=not body_read)
    except ClientGone:
        pass
    except Exception as exc:  # a bug: an OpenAI error for the client, the trace for us
        log.exception("unhandled error under /v1")
        await _send_error(
            send,
            errors.OpenAIError(
                502, f"Internal error in the gateway: {type(exc).__name__}", type="server_error"
            ),
            request_id,
            close=not body_read,
        )
    finally:
        if watcher is not None:
            watcher.cancel()
        if completion is not None:
            if completion.out is not None:  # what reached the client is what is billed
                completion.relay.delivered_completion_tokens = completion.out.delivered_tokens
            completion.relay.release()


async def _read_body(receive: Receive, limits: InputLimits, body_in: bool) -> bytes:
    if body_in:  # the common case: one message, no timer
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        body = cast(bytes, message.get("body", b""))
        if len(body) > limits.max_body_bytes:
            raise errors.body_too_large(limits.max_body_bytes)
        return body
    parts: list[bytes] = []
    size = 0
    if asyncio.current_task() is None:
        # Stepped by hand (`fast_path.uvicorn.start_eagerly` on 3.11): a timeout needs a task,
        # and the task takes over at the first suspension.
        await asyncio.sleep(0)
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                part = cast(bytes, message.get("body", b""))
                size += len(part)
                if size > limits.max_body_bytes:
                    raise errors.body_too_large(limits.max_body_bytes)
                parts.append(part)
                if not message.get("more_body"):
                    return b"".join(parts)
    except TimeoutError:
        raise errors.read_timeout(limits.read_timeout_s) from None


async def _interrupt_on_disconnect(receive: Receive, c: Completion) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    if c.out is not None:  # before it exists, the interrupt ends the relay: nothing is sent
        c.out.client_left()
    c.relay.interrupt()


async def _send_error(
    send: Send, exc: errors.OpenAIError, request_id: str, close: bool = False
) -> None:
    items = exc.header_items(request_id).items()
    headers = [*JSON_HEADERS, *((k.encode(), v.encode()) for k, v in items)]
    if close:  # the rest of the body is not read: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    try:
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": exc.to_json(), "more_body": False})
    except Exception:  # the response had already started, or the client is gone
        log.debug("could not send %s", exc.status)


async def _whole(c: Completion, scope: Scope, send: Send, receive: Receive) -> None:
    chunks: list[TokenChunk] = []
    try:
        while c.relay.finished is None:
            chunks.extend(await c.relay.batch())
    except (NoWorker, RequestRejected, WorkerLost, ChunkLost) as exc:
        raise relay_error(exc, c.model) from None  # type: ignore[misc]
    fin = c.relay.finished
    if fin.finish_reason == "error":
        raise errors.worker_failed(fin.error or "generation failed")
    u = usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)
    content = c.writer.whole(chunks, fin, u)
    start: Message = {
        "type": "http.response.start",
        "status": 200,
        "headers": [*JSON_HEADERS, *c.headers],
    }
    c.out = ResponseOut(scope, send, receive, start)
    await c.out.write(content, more_body=False, tokens=fin.completion_tokens)
    c.relay.answered = not c.out.client_gone


async def _stream(c: Completion, scope: Scope, send: Send, receive: Receive) -> None:
    relay, w = c.relay, c.writer
    start: Message = {
        "type": "http.response.start",
        "status": 200,
        "headers": [*SSE_HEADERS, *c.headers],
    }
    out = c.out = ResponseOut(scope, send, receive, start, stream=True)

    # Nothing is sent before the first chunk: a worker's refusal, or no worker at all, still
    # gets its own status instead of an error inside a 200 stream. Chunks are written from the
    # NATS read loop while the connection allows: the first with the response head at once,
    # later ones (direct responses only) on the loop's next turn, without waking this task
    # for each. This task writes the rest: what was queued meanwhile, and the end.
    def ready() -> bool:
        return out.can_write_soon() if out.started else out.can_write_now()

    def write(chunk: TokenChunk) -> None:
        data = w.chunk(chunk)
        if not out.started:
            out.write_now(data, chunk.completion_tokens)
        elif data:
            out.write_soon(data, chunk.completion_tokens)

    relay.relay_chunks_with(write, ready)
    body = b""
    tokens: int | None = None
    try:
        while True:
            chunks = await relay.batch()
            # Every chunk that is in goes out in one write (several arrive together when the
            # event loop was busy or the connection was backed up).
            body = b"".join([w.chunk(chunk) for chunk in chunks])
            tokens = chunks[-1].completion_tokens if chunks else None
            if relay.finished is not None:
                break
            if body or not out.started:
                await out.write(body, tokens=tokens)
    except (NoWorker, RequestRejected, WorkerLost, ChunkLost) as exc:
        relay.relay_chunks_with(None)  # nothing more from the read loop before the error
        err = relay_error(exc, c.model)
        assert err is not None
        if not out.started:
            raise err from None
        await out.write(w.error(err.to_json()), more_body=False)
        return
    finally:
        relay.relay_chunks_with(None)
    fin = relay.finished
    if fin.finish_reason == "error":
        body += w.error(errors.worker_failed(fin.error or "generation failed").to_json())
    else:
        body += w.end(fin, usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens))
        tokens = fin.completion_tokens
    await out.write(body, more_body=False, tokens=tokens)
    relay.answered = fin.finish_reason != "error" and not out.client_gone
