"""Billing's control events: a finalized invoice is an event on the control stream, subject
`{prefix}.ctl.invoice.<invoice_id>`, carrying the whole invoice document.

Finalizing appends with "expected last subject sequence = 0": JetStream itself refuses a
second finalization of the same invoice id, whichever replica tries, so a finalized invoice
can never be replaced. The message id makes a retried publish of the same event a no-op."""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from events.control import ControlEvent, control_stream_name
from events.store import WRONG_LAST_SEQUENCE
from pricing.invoices import Invoice, InvoiceAlreadyFinalized


class InvoiceFinalized(ControlEvent, tag="invoice.finalized", kw_only=True, frozen=True):
    invoice_id: str
    tenant_id: str
    digest: str  # Invoice.content_digest, to check a rebuild against
    invoice: Invoice


_TAG = b'"invoice.finalized"'
_decoder = msgspec.json.Decoder(InvoiceFinalized)
_encoder = msgspec.json.Encoder(decimal_format="string")


def invoice_subject(prefix: str, invoice_id: str) -> str:
    return f"{prefix}.ctl.invoice.{invoice_id}"


def encode_invoice_event(event: InvoiceFinalized) -> bytes:
    return _encoder.encode(event)


def decode_invoice_event(data: bytes) -> InvoiceFinalized | None:
    """The event, or None for any other control event (they share the stream)."""
    if _TAG not in data:
        return None
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        return None


def finalized_event(invoice: Invoice, actor: str = "scheduler") -> InvoiceFinalized:
    if invoice.status != "finalized" or invoice.finalized_at is None:
        raise ValueError(f"{invoice.invoice_id} is a draft; finalize it first")
    return InvoiceFinalized(
        event_id=f"{invoice.invoice_id}.finalized",
        occurred_at=invoice.finalized_at,
        actor=actor,
        invoice_id=invoice.invoice_id,
        tenant_id=invoice.tenant_id,
        digest=invoice.content_digest,
        invoice=invoice,
    )


async def publish_finalized(js: JetStreamContext, prefix: str, event: InvoiceFinalized) -> int:
    """Append the event; returns its control-stream sequence. Raises InvoiceAlreadyFinalized
    if another finalization of the invoice is already on the stream."""
    try:
        ack = await js.publish(
            invoice_subject(prefix, event.invoice_id),
            encode_invoice_event(event),
            headers={"Nats-Msg-Id": event.event_id, "Nats-Expected-Last-Subject-Sequence": "0"},
            stream=control_stream_name(prefix),
        )
    except APIError as e:
        if e.err_code == WRONG_LAST_SEQUENCE:
            raise InvoiceAlreadyFinalized(f"{event.invoice_id} is already finalized") from e
        raise
    return int(ack.seq)


async def read_finalized(
    js: JetStreamContext, prefix: str, invoice_id: str
) -> tuple[int, InvoiceFinalized] | None:
    """The finalization on the stream of `invoice_id`, with its sequence, if there is one."""
    try:
        msg = await js.get_last_msg(
            control_stream_name(prefix), invoice_subject(prefix, invoice_id)
        )
    except NotFoundError:
        return None
    event = decode_invoice_event(msg.data or b"")
    return (int(msg.seq or 0), event) if event is not None else None
