"""Usage events, three independent records per dispatched request: what the worker generated
(WorkerGenerated), what the gateway wrote to the client (GatewayDelivered), and the bill
(RequestFinished, from the gateway: what was delivered). Reconciliation compares them.

Evolve only by adding fields with defaults (msgspec decodes old messages unchanged)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "error"]


class _RequestCounts(msgspec.Struct, kw_only=True, frozen=True):
    """The fields the bill and the worker's record share, first in both (and on the wire)."""

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


class RequestFinished(_RequestCounts, tag="request.finished", kw_only=True, frozen=True):
    """The bill: the tokens delivered to the client. Published by the gateway that answered
    the request (older workers published it themselves). Dedupe id: `req:<request_id>`."""

    ttft_ms: float | None = None
    e2e_ms: float
    started_at: datetime
    finished_at: datetime
    # Completion tokens the worker generated that never reached the client (it hung up, the
    # stream failed): not billed, counted here and in tokenmill_unbilled_waste_tokens_total.
    unbilled_waste_tokens: int = 0


class WorkerGenerated(_RequestCounts, tag="worker.generated", kw_only=True, frozen=True):
    """Published by the worker: the tokens it generated for a request, whoever received them.
    Not a bill. Dedupe id: `wk:<request_id>`."""

    # The worker stopped because the request's gateway went silent (see worker.serve).
    gateway_lost: bool = False
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
    # The worker stopped answering (the gateway billed what it had delivered, and has no
    # worker count to compare with).
    worker_lost: bool = False


UsageEvent = RequestFinished | GatewayDelivered | WorkerGenerated


def usage_subject(prefix: str, kind: Literal["worker", "gateway"], sku_id: str) -> str:
    return f"{prefix}.usage.{kind}.{sku_id}"


def subject_of(prefix: str, event: UsageEvent) -> str:
    """The subject an event is appended on: the gateway's own record on `gateway`, the
    worker's record and the bill on `worker` (the bill settles the worker's generation)."""
    kind: Literal["worker", "gateway"] = (
        "gateway" if isinstance(event, GatewayDelivered) else "worker"
    )
    return usage_subject(prefix, kind, event.sku_id)


def usage_stream_name(prefix: str) -> str:
    return f"{prefix}_USAGE"


def dedupe_id(event: UsageEvent) -> str:
    if isinstance(event, RequestFinished):
        return "req:" + event.request_id
    if isinstance(event, WorkerGenerated):
        return "wk:" + event.request_id
    return "gw:" + event.request_id


# Bound methods: one encoder and one decoder of the union for the process.
encode_usage: Callable[[UsageEvent], bytes] = msgspec.json.Encoder().encode
decode_usage: Callable[[bytes], UsageEvent] = msgspec.json.Decoder(UsageEvent).decode
