"""Usage events: one per finished request from the worker that served it, and one from the
gateway recording what it delivered to the client. Reconciliation compares the two.

Evolve only by adding fields with defaults (msgspec decodes old messages unchanged)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "error"]


class RequestFinished(msgspec.Struct, tag="request.finished", kw_only=True, frozen=True):
    """Published by the worker; the billing source of truth. Dedupe id: `req:<request_id>`."""

    schema_version: int = 1
    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    model: str
    worker_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int
    finish_reason: FinishReason
    ttft_ms: float | None = None
    e2e_ms: float
    started_at: datetime
    finished_at: datetime


class GatewayDelivered(msgspec.Struct, tag="gateway.delivered", kw_only=True, frozen=True):
    """Published by the gateway: the tokens it relayed to the client. Dedupe id: `gw:<request_id>`."""

    schema_version: int = 1
    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    gateway_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    client_disconnected: bool = False
    finished_at: datetime


UsageEvent = RequestFinished | GatewayDelivered


def usage_subject(prefix: str, kind: Literal["worker", "gateway"], sku_id: str) -> str:
    return f"{prefix}.usage.{kind}.{sku_id}"


def usage_stream_name(prefix: str) -> str:
    return f"{prefix}_USAGE"


def dedupe_id(event: UsageEvent) -> str:
    return ("req:" if isinstance(event, RequestFinished) else "gw:") + event.request_id


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(UsageEvent)


def encode_usage(event: UsageEvent) -> bytes:
    return _encoder.encode(event)


def decode_usage(data: bytes) -> UsageEvent:
    return _decoder.decode(data)
