"""Usage events, three records per dispatched request: what the worker generated
(WorkerGenerated), what the gateway wrote to the client (its `Delivery`), and the bill
(RequestFinished, from the gateway: what was delivered). The gateway's delivery record travels
inside its bill (`RequestFinished.delivered`), so a gateway that dies loses both or neither;
GatewayDelivered is the delivery record older gateways published on its own. Reconciliation
compares them.

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


class Delivery(msgspec.Struct, kw_only=True, frozen=True):
    """What the gateway wrote to the client's connection, as the gateway records it: carried in
    the bill it publishes in the same message (projected into `gateway_deliveries`), so that no
    bill is ever stored without its delivery record."""

    gateway_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    client_disconnected: bool = False
    # The worker stopped answering (the gateway billed what it had delivered, and has no
    # worker count to compare with).
    worker_lost: bool = False


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
    # The gateway's delivery record (None from gateways and workers that published it apart,
    # as GatewayDelivered, or not at all).
    delivered: Delivery | None = None


class WorkerGenerated(_RequestCounts, tag="worker.generated", kw_only=True, frozen=True):
    """Published by the worker: the tokens it generated for a request, whoever received them.
    Not a bill. Dedupe id: `wk:<request_id>`."""

    # The worker stopped because the request's gateway went silent (see worker.serve).
    gateway_lost: bool = False
    # The gateway that dispatched the request ("" from older workers): reconciliation tells a
    # gateway that died from one that left a request unreported.
    gateway_id: str = ""
    ttft_ms: float | None = None
    e2e_ms: float
    started_at: datetime
    finished_at: datetime


class GatewayDelivered(msgspec.Struct, tag="gateway.delivered", kw_only=True, frozen=True):
    """The delivery record as older gateways published it, apart from the bill (batched, so a
    killed gateway could lose it while its bill survived); still projected. Dedupe id:
    `gw:<request_id>`."""

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
