"""The worker protocol: msgspec messages between the gateway and workers over core NATS.

Subjects (``prefix`` is the install's stream prefix, ``sku`` a SKU id):

- ``{prefix}.work.{sku}``: GenerateRequest, to the queue group ``{prefix}.workers.{sku}``, so
  NATS hands each request to exactly one live worker of the SKU. The request carries a reply
  inbox; a publish with no worker in the group is answered by NATS with a 503 status there.
- ``{prefix}.cancel.{sku}``: Cancel, to every worker of the SKU (the one holding the request
  acts, the others ignore it): cheaper than tracking which worker took it before it says so.
- the request's inbox: Accepted, then TokenChunk..., then Finished (or Rejected).
- ``{prefix}.workers.announce`` / ``.heartbeat.{sku}`` / ``.gone``: presence and load.
  Telemetry, not events: nothing here is replayed, so core NATS is enough.
- ``{prefix}.workers.discover``: a gateway that starts asks every worker to announce again.

Token chunks travel on core NATS (at most once); each carries a sequence number so the gateway
notices a lost one. Billing never depends on them, except when the worker dies mid-stream (see
docs in control_plane/dataplane/gateway.py): the worker's usage event on JetStream is the
source of truth.

Evolve only by adding fields with defaults, so mixed versions keep talking.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "error"]


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    # The client's max_tokens; None: up to the model's context length. A worker refuses a
    # request whose prompt + max_tokens exceeds its context.
    max_tokens: int | None = None
    stop: list[str] = []
    seed: int | None = None
    # A cap set by the gateway (what admission reserved): generation stops there with finish
    # reason "length", but unlike max_tokens it is never a reason to refuse the request.
    token_budget: int | None = None

    def max_new_tokens(self, room: int | None) -> int | None:
        """Most tokens to generate, given `room` left in the context (None: unknown)."""
        limits = [
            x
            for x in (room if self.max_tokens is None else self.max_tokens, self.token_budget)
            if x is not None
        ]
        return min(limits) if limits else None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    model: str
    # Exactly one of: a plain prompt (completions), or messages to render with the model's
    # chat template (chat completions).
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = SamplingParams()
    reply_to: str
    # Epoch seconds when the gateway admitted it: the worker's TTFT/e2e clock starts here.
    admitted_at: float

    @property
    def chat(self) -> bool:
        return self.messages is not None


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag="cancel"):
    request_id: str


class Accepted(msgspec.Struct, frozen=True, kw_only=True, tag="accepted"):
    """First reply: which worker holds the request, so the gateway can watch its heartbeat."""

    request_id: str
    worker_id: str


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True, tag="chunk"):
    request_id: str
    seq: int  # 0, 1, 2, ... per request; a gap means a chunk was lost
    text: str  # new text since the previous chunk (may be "" while a multibyte char is pending)
    completion_tokens: int  # tokens generated so far, including this chunk's
    prompt_tokens: int
    cached_tokens: int = 0


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    """Last reply. Sent only after the worker's RequestFinished is acked by JetStream."""

    request_id: str
    seq: int  # the sequence number the next chunk would have had
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    error: str | None = None


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag="rejected"):
    """The request is invalid for this model (say, the prompt exceeds the context); nothing ran,
    nothing is metered. The gateway answers the client with a 400."""

    request_id: str
    message: str
    param: str | None = None


class WorkerAnnounce(msgspec.Struct, frozen=True, kw_only=True, tag="announce"):
    worker_id: str
    sku_id: str
    model: str
    backend: str
    capacity: int  # concurrent sequences it runs at full speed
    max_context: int | None = None


class WorkerHeartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat"):
    worker_id: str
    sku_id: str
    running: int
    waiting: int
    kv_pressure: float  # 0..1: share of the KV cache in use
    ts: float  # worker's epoch seconds


class WorkerGone(msgspec.Struct, frozen=True, kw_only=True, tag="gone"):
    """A worker that stops cleanly says so; one that dies is noticed by its missing heartbeat."""

    worker_id: str
    sku_id: str


Reply = Accepted | TokenChunk | Finished | Rejected
Presence = WorkerAnnounce | WorkerHeartbeat | WorkerGone

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)
_cancel_decoder = msgspec.msgpack.Decoder(Cancel)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_presence_decoder = msgspec.msgpack.Decoder(Presence)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> GenerateRequest:
    return _request_decoder.decode(data)


def decode_cancel(data: bytes) -> Cancel:
    return _cancel_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)


def decode_presence(data: bytes) -> Presence:
    return _presence_decoder.decode(data)


def work_subject(prefix: str, sku_id: str) -> str:
    return f"{prefix}.work.{sku_id}"


def work_queue(prefix: str, sku_id: str) -> str:
    return f"{prefix}.workers.{sku_id}"


def cancel_subject(prefix: str, sku_id: str) -> str:
    return f"{prefix}.cancel.{sku_id}"


def announce_subject(prefix: str) -> str:
    return f"{prefix}.workers.announce"


def heartbeat_subject(prefix: str, sku_id: str) -> str:
    return f"{prefix}.workers.heartbeat.{sku_id}"


def gone_subject(prefix: str) -> str:
    return f"{prefix}.workers.gone"


def discover_subject(prefix: str) -> str:
    return f"{prefix}.workers.discover"


def presence_wildcard(prefix: str) -> str:
    """Everything a gateway listens to for its registry of live workers."""
    return f"{prefix}.workers.>"
