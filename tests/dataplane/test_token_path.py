"""The first-token path at the socket: the response head goes out with the first token in one
write, and a client that stops reading backs the gateway up without unbounded buffering while
every token is still relayed and metered exactly."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from control_plane.dataplane import transport as transport_module
from tests.dataplane.harness import Stack
from tests.dataplane.test_delivery_billing import generation_rows
from tests.dataplane.test_openai_api import MESSAGES, expected_text

pytestmark = pytest.mark.timeout(120)

# uvicorn pauses a connection's writers at this much in user space (its flow control).
UVICORN_HIGH_WATER = 64 * 1024
LONG_ANSWER = 2000  # tokens, ~190 bytes of SSE each: far more than the socket buffers below


@pytest.fixture(scope="module")
async def fast_sku(stack: Stack) -> dict[str, Any]:
    sku, _ = await stack.served_sku("fast-", tokens_per_s=4000.0, output_tokens=LONG_ANSWER)
    return sku


def chat_request(key: str, model: str, **body: Any) -> bytes:
    payload = json.dumps({"model": model, "messages": MESSAGES, "stream": True, **body}).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\n"
        + f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n".encode()
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


async def connect(stack: Stack, rcvbuf: int | None = None) -> tuple[socket.socket, Any]:
    """A client socket and the server's transport for that connection."""
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the TCP window stays this small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    port = int(stack.base_url.rsplit(":", 1)[1])
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    assert stack.server is not None
    for _ in range(100):
        for protocol in stack.server.server_state.connections:
            transport = getattr(protocol, "transport", None)
            if transport is not None and transport.get_extra_info("peername") == sock.getsockname():
                return sock, transport
        await asyncio.sleep(0.01)
    raise AssertionError("the server has no transport for our connection")


async def read_head(sock: socket.socket) -> tuple[dict[str, str], bytes]:
    loop, data = asyncio.get_running_loop(), b""
    while b"\r\n\r\n" not in data:
        data += await loop.sock_recv(sock, 4096)
    head, _, rest = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    assert status.startswith("HTTP/1.1 200"), head
    return {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}, rest


async def backed_up_stream(
    stack: Stack, sku: dict[str, Any]
) -> tuple[socket.socket, Any, str, bytes]:
    """A streamed chat request over a connection whose both socket buffers are 4 KiB, so a
    client that stops reading backs the answer up quickly: (client socket, server transport,
    request id, the bytes read past the response head)."""
    _, key = await stack.tenant_with_key()
    sock, transport = await connect(stack, rcvbuf=4096)
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    await asyncio.get_running_loop().sock_sendall(sock, chat_request(key["key"], sku["name"]))
    headers, rest = await read_head(sock)
    return sock, transport, headers["x-request-id"], rest


def sse_text(body: bytes) -> str:
    """The content of a chunked SSE chat stream, checking it ends with [DONE]."""
    raw, payload = body, b""
    while True:  # undo the chunked transfer encoding
        size_line, _, raw = raw.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload, raw = payload + raw[:size], raw[size + 2 :]
    events = [e.removeprefix(b"data: ") for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return "".join(
        json.loads(e)["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if json.loads(e)["choices"]
    )


@pytest.mark.fast_path_only
async def test_the_head_and_the_first_token_go_out_in_one_write(
    stack: Stack, sku: dict[str, Any]
) -> None:
    _, key = await stack.tenant_with_key()
    sock, transport = await connect(stack)
    writes: list[bytes] = []
    writers: list[asyncio.Task[Any] | None] = []
    write = transport.write

    def counting(data: bytes) -> None:
        writes.append(bytes(data))
        writers.append(asyncio.current_task())
        write(data)

    transport.write = counting
    try:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, chat_request(key["key"], sku["name"], max_tokens=4))
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            data += await loop.sock_recv(sock, 65536)
    finally:
        transport.write = write
        sock.close()
    head, _, first_body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert b'"role":"assistant","content":" t0"' in first_body
    # ...written by the gateway's NATS read loop as the token came in, not by the HTTP task.
    assert writers[0] is not None and writers[0] is stack.plane.nc._reading_task  # type: ignore[union-attr]
    assert sse_text(data.partition(b"\r\n\r\n")[2]) == expected_text(4)


@pytest.mark.fast_path_only
async def test_a_streamed_answer_skips_the_send_chain_and_keeps_uvicorns_framing(
    stack: Stack, sku: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route's only middleware (the refusal counter) passes a 200 through, so its head and
    chunks are written past the ASGI send chain: with uvicorn's own head (its default
    headers, chunked), tokens after the first straight from the NATS read loop, and the
    connection stays usable for the next request."""
    direct: list[bytes] = []
    write_direct = transport_module.ResponseOut._write_direct

    def recording(self: Any, body: bytes) -> bool:
        done = write_direct(self, body)
        if done:
            direct.append(body)
        return done

    monkeypatch.setattr(transport_module.ResponseOut, "_write_direct", recording)
    from_read_loop: list[bytes] = []
    write_soon = transport_module.ResponseOut.write_soon

    def recording_soon(self: Any, body: bytes, tokens: int = 0) -> None:
        from_read_loop.append(body)
        write_soon(self, body, tokens)

    monkeypatch.setattr(transport_module.ResponseOut, "write_soon", recording_soon)
    _, key = await stack.tenant_with_key()
    sock, _ = await connect(stack)
    loop = asyncio.get_running_loop()
    try:
        for n in (4, 20):  # two answers on one keep-alive connection
            await loop.sock_sendall(sock, chat_request(key["key"], sku["name"], max_tokens=n))
            headers, data = await read_head(sock)
            while not data.endswith(b"0\r\n\r\n"):
                data += await loop.sock_recv(sock, 65536)
            assert headers["transfer-encoding"] == "chunked"
            assert headers["content-type"] == "text/event-stream"
            assert "date" in headers and "server" in headers and "x-request-id" in headers
            assert sse_text(data) == expected_text(n)
    finally:
        sock.close()
    # Every chunk but each answer's last went out directly (the first one with the head), and
    # once streaming, tokens were written from the NATS read loop, not by waking the handler.
    assert len(direct) >= 2 and all(b'"content":" t' in body for body in direct)
    assert len(from_read_loop) >= 10


async def test_a_client_that_stops_reading_is_backed_up_not_buffered_and_metered_exactly(
    stack: Stack, fast_sku: dict[str, Any]
) -> None:
    loop = asyncio.get_running_loop()
    sock, transport, request_id, rest = await backed_up_stream(stack, fast_sku)

    # The client reads nothing more while the worker produces the whole answer.
    buffered = [0]

    async def watch() -> None:
        while True:
            buffered.append(transport.get_write_buffer_size())
            await asyncio.sleep(0.005)

    watching = asyncio.create_task(watch())
    # The worker has finished (its record is in); the bill waits for the delivery.
    generated = (await generation_rows(stack, [request_id]))[request_id]
    await asyncio.sleep(0.3)  # the gateway has all of it
    watching.cancel()
    assert generated["completion_tokens"] == LONG_ANSWER and generated["finish_reason"] == "stop"
    # Flow control held the answer back (~380 KB) instead of queueing it on the socket.
    assert max(buffered) <= UVICORN_HIGH_WATER + 16 * 1024, max(buffered)

    # The client reads again: every token arrives, in order, and the bill matches.
    data = rest
    while not data.endswith(b"0\r\n\r\n"):
        data += await loop.sock_recv(sock, 1 << 20)
    sock.close()
    assert sse_text(data) == expected_text(LONG_ANSWER)
    delivered = (await stack.delivery_rows([request_id]))[request_id]
    assert delivered["completion_tokens"] == LONG_ANSWER and not delivered["client_disconnected"]
    row = await stack.ledger_row(request_id)
    assert row["completion_tokens"] == LONG_ANSWER and row["finish_reason"] == "stop"


async def test_a_client_that_stops_reading_then_hangs_up_is_metered_exactly(
    stack: Stack, fast_sku: dict[str, Any]
) -> None:
    sock, _, request_id, _ = await backed_up_stream(stack, fast_sku)
    await asyncio.sleep(0.1)  # mid-answer, backed up
    sock.close()
    row = await stack.ledger_row(request_id)
    delivered = (await stack.delivery_rows([request_id]))[request_id]
    # Billed is what reached the client's socket; the rest the worker generated is waste.
    assert delivered["completion_tokens"] == row["completion_tokens"] > 0
    assert delivered["finish_reason"] == row["finish_reason"]
    generated = (await generation_rows(stack, [request_id]))[request_id]
    assert generated["completion_tokens"] == row["completion_tokens"] + row["unbilled_waste_tokens"]


async def test_read_loop_writes_go_out_on_the_next_turn_even_after_another_loop() -> None:
    """Bodies taken in the read loop are written by one callback on the loop's next turn; what
    a loop that closed left waiting does not stop a new loop's writes."""
    written: list[str] = []

    class Out:
        def __init__(self, name: str) -> None:
            self.name = name

        def _write_soon_now(self) -> None:
            written.append(self.name)

    soon = transport_module._SoonWrites()
    closed = asyncio.new_event_loop()
    closed.close()
    soon.loop, soon.waiting, soon.scheduled = closed, [Out("stale")], True  # type: ignore[list-item]
    loop = asyncio.get_running_loop()
    soon.add(Out("a"), loop)  # type: ignore[arg-type]
    soon.add(Out("b"), loop)  # type: ignore[arg-type]
    assert written == []
    await asyncio.sleep(0)
    assert written == ["a", "b"] and not soon.scheduled and soon.waiting == []
