"""The floor under any Python gateway on this machine: a bare HTTP -> NATS relay.

Not a gateway: no auth, admission, metering, error handling or flow control. It parses the
request with httptools, writes a GenerateRequest to NATS on its own socket and writes each
reply back as SSE, all inside the event-loop callbacks that read them (no task, no nats-py).
What it adds to time to first token is what two extra process hops and minimal HTTP cost here;
a real gateway cannot add less. Run it as gateway B of bench/gateway/ab.py:

    python -m bench.gateway.ab --b-cmd "python -m bench.gateway.relay_floor {port}"

It serves the first SKU it hears a worker announce (the benchmark runs one)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import httptools
import msgspec

from worker import protocol as p

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"x-request-id: %s\r\n\r\n"
)
PREFIX = os.environ.get("TOKENMILL_STREAM_PREFIX", "TM")
INBOX = "_INBOX.floor" + uuid.uuid4().hex[:10]


def sse_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Exchange:
    """One request: its client's transport and whether the head went out."""

    def __init__(self, transport: asyncio.Transport, request_id: str) -> None:
        self.transport, self.request_id, self.started = transport, request_id, False

    def on_reply(self, payload: bytes) -> bool:
        """True once the answer is complete."""
        m = p.decode_reply(payload)
        if isinstance(m, p.TokenChunk) and m.text:
            event = msgspec.json.encode({"choices": [{"delta": {"content": m.text}}]})
            data = sse_chunk(b"data: " + event + b"\n\n")
            if not self.started:
                data, self.started = HEAD % self.request_id.encode() + data, True
            self.transport.write(data)
        elif isinstance(m, p.Finished):
            self.transport.write(sse_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return True
        return False


class NatsWire(asyncio.Protocol):
    """Just enough of the NATS protocol: replies on the inbox, presence for the SKU id."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.exchanges: dict[str, Exchange] = {}
        self.sku_id: str | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(
            b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
            + f"SUB {INBOX}.* 1\r\nSUB {p.presence_wildcard(PREFIX)} 2\r\n".encode()
            + f"PUB {p.discover_subject(PREFIX)} 0\r\n\r\n".encode()
        )

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while (eol := buf.find(b"\r\n", pos)) >= 0:
            line = bytes(buf[pos:eol]).split()
            if line and line[0] in (b"MSG", b"HMSG"):
                end = eol + 2 + int(line[-1]) + 2
                if end > len(buf):
                    break
                payload = bytes(buf[eol + 2 : end - 2])
                pos = end
                if line[0] == b"MSG" and line[2] == b"1":
                    request_id = line[1].decode()[len(INBOX) + 1 :]
                    ex = self.exchanges.get(request_id)
                    if ex is not None and ex.on_reply(payload):
                        del self.exchanges[request_id]
                elif line[0] == b"MSG" and self.sku_id is None:
                    try:
                        self.sku_id = p.decode_presence(payload).sku_id
                    except Exception:  # a discover ping
                        pass
                continue
            if line == [b"PING"]:
                self.transport.write(b"PONG\r\n")
            pos = eol + 2
        del buf[:pos]

    def dispatch(self, transport: asyncio.Transport, body: bytes) -> None:
        if self.sku_id is None:
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            return
        chat = msgspec.json.decode(body)
        request_id = uuid.uuid4().hex
        reply = f"{INBOX}.{request_id}"
        request = p.GenerateRequest(
            request_id=request_id,
            tenant_id="floor",
            key_id="floor",
            sku_id=self.sku_id,
            model="floor",
            messages=[p.ChatMessage(m["role"], m["content"]) for m in chat["messages"]],
            sampling=p.SamplingParams(max_tokens=chat.get("max_tokens")),
            reply_to=reply,
            admitted_at=time.time(),
        )
        self.exchanges[request_id] = Exchange(transport, request_id)
        data = p.encode(request)
        subject = p.work_subject(PREFIX, self.sku_id)
        self.transport.write(f"PUB {subject} {reply} {len(data)}\r\n".encode() + data + b"\r\n")


class HttpIn(asyncio.Protocol):
    def __init__(self, nats: NatsWire) -> None:
        self.nats, self.body = nats, b""
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.body = b""

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.nats.dispatch(self.transport, self.body)


async def main(port: int) -> None:
    url = urlsplit(os.environ.get("TOKENMILL_NATS_URL", "nats://127.0.0.1:4222"))
    loop = asyncio.get_running_loop()
    _, nats = await loop.create_connection(NatsWire, url.hostname, url.port or 4222)
    server = await loop.create_server(lambda: HttpIn(nats), "127.0.0.1", port)
    gc.freeze()
    await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("port", type=int, help="the port it serves HTTP on")
    asyncio.run(main(ap.parse_args().port))
