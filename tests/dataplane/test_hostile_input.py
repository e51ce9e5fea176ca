"""Bad input to /v1 against the real served gateway (the fast path, uvicorn, NATS, Postgres, a
fixed-rate worker): every answer is a 4xx OpenAI error object within a bounded time, before
any work; no connection is left open; nothing is metered for a refusal; and afterwards the
gateway serves as before and stops promptly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from litestar import Litestar

from control_plane.admission.keys import Caller
from control_plane.admission.view import GovernanceView
from control_plane.dataplane.errors import OpenAIError
from control_plane.dataplane.limits import InputLimits
from control_plane.dataplane.routes import DataPlane
from control_plane.dataplane.server import LINGER_S, http_protocol
from control_plane.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from events.store import StreamLayout
from tests.control_plane.serving import serving
from tests.databases import fresh_database
from tests.dataplane.harness import ADMIN_TOKEN, Stack

pytestmark = pytest.mark.timeout(120)

# Short in this module, so the slow-client cases take about a second each.
READ_TIMEOUT_S = 1.0
# The gateway's defaults (docs/dataplane.md, "Input limits").
MAX_BODY = 8 * 1024 * 1024
MAX_HEAD = 32 * 1024
# An answer slower than this is a hang for these tests.
ANSWER_WITHIN_S = READ_TIMEOUT_S + 4.0


@pytest.fixture(scope="module")
def stack_env() -> dict[str, str]:
    return {"TOKENMILL_V1_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}


@pytest.fixture(scope="module")
async def key(stack: Stack) -> dict[str, Any]:
    """The key every case here uses: its tenant's ledger must stay empty of refusals."""
    METERED.clear()  # the module runs once per stack (with the fast path, and without)
    tenant, key = await stack.tenant_with_key()
    return {**key, "tenant_id": tenant["tenant_id"]}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after the answer
    seconds: float

    def error(self) -> dict[str, Any]:
        assert self.headers.get("content-type") == "application/json", (self.headers, self.body)
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        return cast(dict[str, Any], error)


def port_of(stack: Stack) -> int:
    return int(stack.base_url.rsplit(":", 1)[1])


async def exchange(
    port: int,
    pieces: list[bytes],
    pause_s: float = 0.0,
    hang_up: bool = False,
    within: float = ANSWER_WITHIN_S,
) -> Answer | None:
    """Sends `pieces` on a fresh connection (`pause_s` apart) and reads one answer; waits
    for the server to close the connection if the answer says it will. `hang_up`: close
    after sending, read nothing (None)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    started = time.monotonic()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        try:
            for i, piece in enumerate(pieces):
                if i and pause_s:
                    await asyncio.sleep(pause_s)
                await loop.sock_sendall(sock, piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-request: the answer may still be there to read
        if hang_up:
            return None
        data, closed = b"", False
        async with asyncio.timeout(within):
            while b"\r\n\r\n" not in data:
                chunk = await loop.sock_recv(sock, 65536)
                assert chunk, f"closed without an answer: {data!r}"
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
            if headers.get("transfer-encoding") == "chunked":
                while not body.endswith(b"0\r\n\r\n"):
                    chunk = await loop.sock_recv(sock, 65536)
                    assert chunk, "closed mid-answer"
                    body += chunk
                body = unchunked(body)
            else:
                length = int(headers.get("content-length", "0"))
                while len(body) < length:
                    chunk = await loop.sock_recv(sock, 65536)
                    assert chunk, "closed mid-answer"
                    body += chunk
            seconds = time.monotonic() - started
            if headers.get("connection") == "close":
                while chunk := await loop.sock_recv(sock, 65536):
                    pass
                closed = True
        return Answer(int(status_line.split()[1]), headers, body, closed, seconds)
    finally:
        sock.close()


def unchunked(raw: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, raw = raw.partition(b"\r\n")
        if (size := int(size_line, 16)) == 0:
            return out
        out, raw = out + raw[:size], raw[size + 2 :]


def request(
    path: str,
    body: bytes,
    key: str | None,
    *,
    extra: bytes = b"",
    length: int | None = None,
    method: bytes = b"POST",
) -> bytes:
    """A request head (with `length`, default the body's, as content-length) and body."""
    head = method + b" " + path.encode() + b" HTTP/1.1\r\nhost: test\r\n"
    if key is not None:
        head += b"authorization: Bearer " + key.encode() + b"\r\n"
    head += b"content-type: application/json\r\n" + extra
    head += b"content-length: %d\r\n\r\n" % (len(body) if length is None else length)
    return head + body


async def open_connections(stack: Stack, baseline: int, within: float = LINGER_S + 1) -> int:
    """The server's open connections, once they are back to `baseline` (or after `within`)."""
    assert stack.server is not None
    deadline = time.monotonic() + within
    while len(stack.server.server_state.connections) > baseline and time.monotonic() < deadline:  # noqa: ASYNC110 (uvicorn offers no event)
        await asyncio.sleep(0.02)
    return len(stack.server.server_state.connections)


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "MODEL", "messages": MSGS, **fields}).encode()


def text(**fields: Any) -> bytes:
    return json.dumps({"model": "MODEL", "prompt": "hi", **fields}).encode()


DEEP = b"[" * 10_000 + b"]" * 10_000
# (case, path, body with MODEL for the SKU's name, status, the error's param or None)
BAD_BODIES: list[tuple[str, str, bytes, int, str | None]] = [
    ("invalid JSON", CHAT, b'{"model": ', 400, None),
    ("not an object", TEXT, b"[1, 2]", 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("model not a string", CHAT, json.dumps({"model": 5, "messages": MSGS}).encode(), 400, "model"),
    ("messages not a list", CHAT, json.dumps({"model": "MODEL", "messages": "hi"}).encode(), 400, "messages"),
    ("temperature a string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("stream a string", TEXT, text(stream="yes"), 400, "stream"),
    ("stop a number", TEXT, text(stop=5), 400, "stop"),
    ("seed a float", TEXT, text(seed=1.5), 400, "seed"),
    ("max_tokens 10**30", TEXT, text(max_tokens=10**30), 400, "max_tokens"),
    ("max_tokens 2**63", CHAT, chat(max_tokens=2**63), 400, "max_tokens"),
    ("max_completion_tokens 10**30", CHAT, chat(max_completion_tokens=10**30), 400, "max_completion_tokens"),
    ("seed 10**30", CHAT, chat(seed=10**30), 400, "seed"),
    ("seed -10**30", TEXT, text(seed=-(10**30)), 400, "seed"),
    ("max_tokens 0", TEXT, text(max_tokens=0), 400, "max_tokens"),
    ("max_tokens -1", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("temperature 1e400", CHAT, chat().replace(b"}", b', "temperature": 1e400}'), 400, None),
    ("n 10**30", TEXT, text(n=10**30), 400, "n"),
    ("logprobs nested 10,000 deep", TEXT, text().replace(b"}", b', "logprobs": ' + DEEP + b"}"), 400, None),
    ("content nested 10,000 deep", CHAT, b'{"model": "MODEL", "messages": [{"role": "user", "content": ' + DEEP + b"}]}", 400, None),
    ("unknown field nested 10,000 deep", CHAT, chat().replace(b"}", b', "x": ' + DEEP + b"}"), 400, None),
    ("invalid UTF-8", TEXT, b'{"model": "MODEL", "prompt": "\xff\xfe"}', 400, None),
    ("lone surrogate", TEXT, b'{"model": "MODEL", "prompt": "\\udc00"}', 400, None),
    ("NUL in user", CHAT, chat(user="a\x00b"), 400, "user"),
    ("metadata with NUL", CHAT, chat(metadata={"k": "a\x00"}), 400, "metadata"),
    ("response_format xml", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    ("store true", CHAT, chat(store=True), 400, "store"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [c[1:] for c in BAD_BODIES],
    ids=[c[0] for c in BAD_BODIES],
)
async def test_a_bad_body_is_a_400_naming_the_field(
    stack: Stack,
    sku: dict[str, Any],
    key: dict[str, Any],
    path: str,
    body: bytes,
    status: int,
    param: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = body.replace(b"MODEL", sku["name"].encode())
    answer = await exchange(port_of(stack), [request(path, body, key["key"])])
    assert answer is not None and answer.status == status, answer
    assert answer.error()["param"] == param
    assert not answer.closed  # the whole body was read: the connection carries on
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# A header of raw non-UTF-8 bytes (`request` writes its key as UTF-8).
LATIN1_KEY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer \xff\xfe\x80"
    b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
)
# Requests refused from their head: (case, request bytes, status, code).
BAD_HEADS: list[tuple[str, bytes, int, str | None]] = [
    ("non-UTF-8 key", LATIN1_KEY, 401, "invalid_api_key"),
    ("key over 256 characters", request(TEXT, b"{}", "tm_" + "a" * 300), 401, "invalid_api_key"),
    ("1 MB key", request(CHAT, b"{}", "tm_" + "a" * 1_000_000), 431, "request_header_fields_too_large"),
    ("40 KiB of headers", request(CHAT, b"{}", None, extra=b"x-pad: " + b"a" * 40_000 + b"\r\n"), 431, "request_header_fields_too_large"),
    ("many small headers", request(CHAT, b"{}", None, extra=b"x-a: b\r\n" * 6000), 431, "request_header_fields_too_large"),
    ("GET", request(CHAT, b"", None, method=b"GET"), 405, "method_not_allowed"),
    ("malformed content-length", request(CHAT, b"{}", None, length=2).replace(b"length: 2", b"length: 2x"), 400, None),
    ("malformed request line", b"POST /v1/completions HTTP/9\r\n\r\n", 400, None),
    ("declared length over the limit", request(CHAT, b"", "tm_nope", length=MAX_BODY + 1), 413, "request_too_large"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "status", "code"), [c[1:] for c in BAD_HEADS], ids=[c[0] for c in BAD_HEADS]
)
async def test_a_bad_head_is_refused_before_the_body(
    stack: Stack, raw: bytes, status: int, code: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    answer = await exchange(port_of(stack), [raw])
    assert answer is not None and answer.status == status, answer
    assert answer.error()["code"] == code
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a traceback logged"


async def test_a_refused_head_elsewhere_is_a_problem_details_answer(stack: Stack) -> None:
    # The head limits hold on every path; the admin API answers problem details.
    raw = b"GET /admin/v1/tenants HTTP/1.1\r\nhost: t\r\nx-pad: " + b"a" * 40_000 + b"\r\n\r\n"
    answer = await exchange(port_of(stack), [raw])
    assert answer is not None and answer.status == 431 and answer.closed
    assert answer.headers["content-type"] == "application/problem+json"
    assert json.loads(answer.body)["reason"] == "request_header_fields_too_large"


# The fast path, and the same handler through the app (a trailing slash).
PATHS = pytest.mark.parametrize("path", [TEXT, CHAT + "/"], ids=["direct", "through the app"])


@PATHS
async def test_an_unauthenticated_body_is_not_read(stack: Stack, path: str) -> None:
    # The head promises 1 MB that never comes: the 401 cannot have waited for it.
    head = request(path, b"", "tm_nope", length=1_000_000)
    answer = await exchange(port_of(stack), [head], within=2.0)
    assert answer is not None and answer.status == 401 and answer.closed
    assert answer.error()["code"] == "invalid_api_key"


@PATHS
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_oversized_body_is_a_413_while_reading(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any], chunked: bool, path: str
) -> None:
    assert stack.server is not None
    baseline = len(stack.server.server_state.connections)
    prompt = b"a" * (MAX_BODY + 1024)
    body = b'{"model": "' + sku["name"].encode() + b'", "prompt": "' + prompt + b'"}'
    if chunked:  # no length up front: refused once what was read passes the limit
        head = request(path, b"", key["key"]).replace(
            b"content-length: 0\r\n", b"transfer-encoding: chunked\r\n"
        )
        pieces = [head] + [
            b"%x\r\n%b\r\n" % (len(body[i : i + 65536]), body[i : i + 65536])
            for i in range(0, len(body), 65536)
        ]
        pieces.append(b"0\r\n\r\n")
    else:  # the declared length is refused at once, and what is sent anyway discarded
        pieces = [request(path, body, key["key"])]
    answer = await exchange(port_of(stack), pieces)
    assert answer is not None and answer.status == 413, answer
    assert answer.error()["code"] == "request_too_large" and answer.closed
    assert await open_connections(stack, baseline) <= baseline


async def test_a_1mb_prompt_is_answered(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any]
) -> None:
    """Bodies past uvicorn's 64 KiB read pause used to hang: the handler waited for the
    whole body, and uvicorn for the handler to ask for more."""
    prompt = " ".join(["w" * 999] * 1000)  # 1 MB; the fixed-rate worker counts words
    async with httpx.AsyncClient(base_url=stack.v1, timeout=20) as http:
        r = await http.post(
            "/completions",
            json={"model": sku["name"], "prompt": prompt, "max_tokens": 4},
            headers={"authorization": f"Bearer {key['key']}"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1000
    METERED.append(r.json()["id"].removeprefix("cmpl-"))


# Request ids answered 200 by this module's stack, to check the ledger against at the end.
METERED: list[str] = []


async def test_a_body_sent_slowly_in_pieces_is_served(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any]
) -> None:
    raw = request(TEXT, text(model=sku["name"], max_tokens=2), key["key"])
    pieces = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    answer = await exchange(port_of(stack), pieces, pause_s=READ_TIMEOUT_S / 2 / len(pieces))
    assert answer is not None and answer.status == 200, answer
    METERED.append(json.loads(answer.body)["id"].removeprefix("cmpl-"))


async def test_a_client_that_waits_for_100_continue_is_asked_at_once(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any]
) -> None:
    """curl and others send a large body only after `100 Continue` (or a 1 s wait)."""
    body = text(model=sku["name"], max_tokens=2)
    head = request(TEXT, b"", key["key"], extra=b"expect: 100-continue\r\n", length=len(body))
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port_of(stack)))
        await loop.sock_sendall(sock, head)
        async with asyncio.timeout(0.5):
            assert (await loop.sock_recv(sock, 4096)).startswith(b"HTTP/1.1 100 Continue")
        await loop.sock_sendall(sock, body)
        async with asyncio.timeout(5):
            answer = await loop.sock_recv(sock, 65536)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    METERED.append(answer.split(b'"id":"cmpl-', 1)[1].split(b'"', 1)[0].decode())


@pytest.mark.parametrize("stalls_in", ["head", "body"])
async def test_a_stalled_request_is_a_408(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any], stalls_in: str
) -> None:
    raw = request(TEXT, text(model=sku["name"]), key["key"])
    part = raw[:20] if stalls_in == "head" else raw[:-5]
    answer = await exchange(port_of(stack), [part])
    assert answer is not None and answer.status == 408, answer
    assert answer.error()["code"] == "request_timeout" and answer.closed
    assert READ_TIMEOUT_S * 0.9 < answer.seconds < READ_TIMEOUT_S + 1.5


@pytest.mark.parametrize("gone_after", ["head", "half the body"])
async def test_a_client_gone_mid_request_leaves_nothing_open(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any], gone_after: str
) -> None:
    assert stack.server is not None
    baseline = len(stack.server.server_state.connections)
    body = text(model=sku["name"], prompt="x" * 200_000)
    raw = request(TEXT, body, key["key"])
    cut = raw.index(b"\r\n\r\n") + 4 + (0 if gone_after == "head" else len(body) // 2)
    await exchange(port_of(stack), [raw[:cut]], hang_up=True)
    assert await open_connections(stack, baseline, within=2.0) <= baseline


# /v1 paths and methods there is no route for: (method, path, status, code).
NO_ROUTE = [
    ("GET", "/v1/models/a%2Fb", 404, "model_not_found"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    ("DELETE", "/v1/usage", 405, "method_not_allowed"),
    ("POST", "/v1/embeddings", 404, "not_found"),
    ("GET", "/v1/nothing/here", 404, "not_found"),
]


@pytest.mark.parametrize(("method", "path", "status", "code"), NO_ROUTE)
async def test_every_v1_refusal_is_an_openai_error(
    stack: Stack, key: dict[str, Any], method: str, path: str, status: int, code: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        r = await http.request(
            method, path, headers={"authorization": f"Bearer {key['key']}"}, json={}
        )
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == code


async def test_a_model_named_with_a_slash_is_found(stack: Stack, key: dict[str, Any]) -> None:
    sku = await stack.publish_sku("slash-" + uuid.uuid4().hex[:6], model="org/model-x")
    async with httpx.AsyncClient(base_url=stack.v1) as http:
        auth = {"authorization": f"Bearer {key['key']}"}
        for path in ("/models/org/model-x", "/models/org%2Fmodel-x"):
            r = await http.get(path, headers=auth)
            assert r.status_code == 200 and r.json()["id"] == sku["name"], r.text


async def test_harmless_fields_are_accepted(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any]
) -> None:
    body = {
        "model": sku["name"],
        "messages": MSGS,
        "max_tokens": 2,
        "response_format": {"type": "text"},
        "store": False,
    }
    async with httpx.AsyncClient(base_url=stack.v1, timeout=10) as http:
        r = await http.post(
            "/chat/completions", json=body, headers={"authorization": f"Bearer {key['key']}"}
        )
    assert r.status_code == 200, r.text
    METERED.append(r.json()["id"].removeprefix("chatcmpl-"))


async def test_a_suspended_tenants_key_cannot_read_usage(stack: Stack) -> None:
    tenant, key = await stack.tenant_with_key()
    auth = {"authorization": f"Bearer {key['key']}"}
    async with httpx.AsyncClient(base_url=stack.v1) as http:
        assert (await http.get("/usage", headers=auth)).status_code == 200
        await stack.admin("POST", f"/tenants/{tenant['tenant_id']}/suspend")
        deadline = time.monotonic() + 5
        while (r := await http.get("/usage", headers=auth)).status_code == 200:
            assert time.monotonic() < deadline, "still readable after the suspension"
            await asyncio.sleep(0.05)
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_suspended"


async def test_made_up_keys_do_not_grow_the_gateway(stack: Stack, key: dict[str, Any]) -> None:
    authorizer = stack.plane.authorizer
    authorizer.caller(f"Bearer {key['key']}")  # a real key is remembered
    before = len(authorizer._hashes)

    def made_up_keys(n: int) -> int:
        refused = 0
        for i in range(n):
            try:
                authorizer.caller(f"Bearer tm_{i:08x}_{'z' * 200}")
            except OpenAIError as exc:
                refused += exc.status == 401
        return refused

    made_up_keys(100)  # what the first refusals allocate once
    tracemalloc.start()
    try:
        first = tracemalloc.take_snapshot()
        assert made_up_keys(2000) == 2000
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(first, "filename"))
    finally:
        tracemalloc.stop()
    assert len(authorizer._hashes) == before
    assert grown < 64 * 1024, f"{grown} bytes kept after 2,000 made-up keys"
    # Over HTTP too: requests with 1 MB keys are refused from their head.
    async with httpx.AsyncClient(base_url=stack.v1) as http:
        for _ in range(10):
            r = await http.get("/models", headers={"authorization": "Bearer " + "k" * 1_000_000})
            assert r.status_code == 431
    assert len(authorizer._hashes) == before


async def test_after_all_that_the_gateway_serves_and_meters_exactly(
    stack: Stack, sku: dict[str, Any], key: dict[str, Any]
) -> None:
    """Runs last in this module: nothing refused above was metered, everything answered was,
    once, and the gateway still answers normally."""
    async with httpx.AsyncClient(base_url=stack.v1, timeout=10) as http:
        r = await http.post(
            "/chat/completions",
            json={"model": sku["name"], "messages": MSGS, "max_tokens": 3},
            headers={"authorization": f"Bearer {key['key']}"},
        )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    METERED.append(r.json()["id"].removeprefix("chatcmpl-"))
    await stack.ledger_rows(METERED)
    await stack.delivery_rows(METERED)
    rows = await stack.services.pool.fetch(
        "SELECT request_id FROM usage_ledger WHERE tenant_id = $1", key["tenant_id"]
    )
    assert sorted(r["request_id"] for r in rows) == sorted(METERED)


async def test_the_server_stops_promptly_with_a_request_half_sent(
    fast_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn's SIGTERM handler sets `should_exit`; a request whose body is still arriving
    must not hold the stop (one over 64 KiB used to, forever), even with a long read timeout."""
    view = GovernanceView(cast(Any, None), StreamLayout("T"))
    limits = InputLimits(read_timeout_s=60.0)
    plane = DataPlane("nats://unused", "T", view, limits=limits)
    # Authorized (no key exists here), so the handler goes on to wait for the body.
    monkeypatch.setattr(plane.authorizer, "caller", lambda _: cast(Caller, None))
    app = Litestar(route_handlers=[plane.router()])
    http = http_protocol(app, plane.completion_handlers(), limits)
    loop = asyncio.get_running_loop()
    socks = []
    async with serving(app, http=http) as (base_url, server):
        port = int(base_url.rsplit(":", 1)[1])
        for length in (100, 1_000_000):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            raw = request(TEXT, b"x" * length, "tm_x")
            await loop.sock_sendall(sock, raw[: len(raw) // 2])
            socks.append(sock)
        await asyncio.sleep(0.2)
        assert len(server.server_state.connections) == 2
        server.should_exit = True
        started = time.monotonic()
    assert time.monotonic() - started < 10
    for sock in socks:
        sock.close()


async def test_the_openapi_document_describes_v1(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        doc = (await http.get("/schema/openapi.json")).json()
    schemas = doc["components"]["schemas"]

    def resolved(content: dict[str, Any]) -> dict[str, Any]:
        ref = content["application/json"]["schema"]["$ref"]
        return cast(dict[str, Any], schemas[ref.rsplit("/", 1)[1]])

    chat, text = (
        doc["paths"]["/v1/chat/completions"]["post"],
        doc["paths"]["/v1/completions"]["post"],
    )
    chat_body = resolved(chat["requestBody"]["content"])
    assert {"model", "messages"} <= set(chat_body["required"])
    assert chat_body["additionalProperties"] is False  # unknown fields are refused
    bounds = chat_body["properties"]["max_tokens"]["anyOf"][0]
    assert (bounds["minimum"], bounds["maximum"]) == (1, 2**31 - 1)
    assert "choices" in resolved(chat["responses"]["200"]["content"])["properties"]
    assert "prompt" in resolved(text["requestBody"]["content"])["required"]
    assert set(resolved(text["responses"]["413"]["content"])["properties"]) == {"error"}
    assert (
        "data"
        in resolved(doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"])["properties"]
    )
    assert "/v1/models/{model}" in doc["paths"] and "/v1/usage" in doc["paths"]
    # Tools, structured output, logprobs and choices, asked for and answered.
    chat_fields = set(chat_body["properties"])
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format"} <= chat_fields
    assert {"logprobs", "top_logprobs", "n"} <= chat_fields
    assert {"echo", "logprobs", "n"} <= set(resolved(text["requestBody"]["content"])["properties"])
    assert "tool_calls" in schemas["ChatMessageOut"]["properties"]
    assert set(schemas["ChatChoice"]["properties"]["finish_reason"]["enum"]) == {
        "stop", "length", "tool_calls",
    }  # fmt: skip
    assert "top_logprobs" in schemas["TokenLogprobOut"]["required"]
    assert "text_offset" in schemas["TextLogprobs"]["required"]
    responses = doc["paths"]["/v1/responses"]["post"]
    responses_body = resolved(responses["requestBody"]["content"])
    assert {"model", "input"} <= set(responses_body["required"])
    assert "stream_options" not in responses_body["properties"]
    response = resolved(responses["responses"]["200"]["content"])
    assert {"output", "usage", "status"} <= set(response["properties"])
    assert "text/event-stream" in responses["responses"]["200"]["content"]
    assert "429" in responses["responses"]
    # Every reference resolves.
    refs = {m for m in json.dumps(doc).split('"$ref": "')[1:]}
    for ref in refs:
        name = ref.split('"', 1)[0]
        assert name.startswith("#/components/schemas/") and name.rsplit("/", 1)[1] in schemas


@pytest.mark.slow
@pytest.mark.e2e
def test_tokenmill_serve_stops_on_sigterm_with_requests_half_sent(
    nats_server: EmbeddedNats, postgres_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    """`tokenmill serve` as deployed: after hostile traffic, with requests still half sent
    (bodies over and under 64 KiB, a head), it serves as usual and SIGTERM stops it in 10 s."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with fresh_database(postgres_server, "sigterm_") as database_url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env |= {
            "TOKENMILL_NATS_URL": nats_server.url,
            "TOKENMILL_DATABASE_URL": database_url,
            "TOKENMILL_ADMIN_TOKEN": ADMIN_TOKEN,
            "TOKENMILL_STREAM_PREFIX": "G" + uuid.uuid4().hex[:10].upper(),
        }
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port)]
        cmd += ["--data-dir", str(tmp_path)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        socks: list[socket.socket] = []
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, "did not start"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                        break
                time.sleep(0.2)
            admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            t = httpx.post(f"{base}/admin/v1/tenants", json={"name": "sig"}, headers=admin)
            k = httpx.post(
                f"{base}/admin/v1/tenants/{t.json()['tenant_id']}/keys", headers=admin, json={}
            )
            key = k.json()["key"]
            auth = {"authorization": f"Bearer {key}"}
            deadline = time.monotonic() + 5
            while httpx.get(f"{base}/v1/models", headers=auth).status_code != 200:
                assert time.monotonic() < deadline, "the key never became valid"
                time.sleep(0.05)
            for raw in (
                request(TEXT, b"x" * 1_000_000, key),
                request(CHAT, b"x" * 1000, key),
                request(CHAT, b"", key)[:30],
            ):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(raw[: max(30, len(raw) // 2)])
                socks.append(sock)
            big = request(CHAT, b"x" * (MAX_BODY + 1), key)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(big)
                assert sock.recv(65536).startswith(b"HTTP/1.1 413")
            assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            proc.wait(timeout=10)
            assert time.monotonic() - started < 10
        finally:
            for sock in socks:
                sock.close()
            if proc.poll() is None:
                proc.kill()
                print(proc.communicate()[0].decode()[-3000:])
