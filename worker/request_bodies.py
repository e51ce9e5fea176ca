"""Requests too large for one NATS message travel through the JetStream object store.

A core NATS message is at most the server's `max_payload` (1 MiB unless the operator raised
it), while a /v1 body may be 8 MiB (TOKENMILL_V1_MAX_BODY_BYTES): a prompt of a few hundred
thousand tokens does not fit. The gateway puts such a request, encoded, into the bucket
`request_bodies_bucket(prefix)` under its request id and dispatches a stub that names it
(`GenerateRequest.body_object`; only the fields a worker reads before the body); the worker that takes
the stub reads the object back and deletes it. The object store (nats-py's public API) chunks
the bytes into messages that fit whatever max_payload the server has, so no server setting
needs raising; its objects expire after `TTL_S`, so the bodies of requests no worker took do
not pile up. Small requests, nearly all of them, never touch it.
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import ObjectStoreConfig
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from worker import protocol as p

# Bodies no worker took (it died before, the request was lost) expire after this long.
TTL_S = 3600.0
# Room left under max_payload for the protocol line's subject and reply inbox.
HEADROOM = 1024


def fits(nc: NATS, data: bytes) -> bool:
    """Whether `data` goes out as one message on this connection."""
    return len(data) + HEADROOM <= nc.max_payload


class RequestBodies:
    """One connection's handle on the bucket, opened (the gateway: created) on first use."""

    def __init__(self, nc: NATS, prefix: str) -> None:
        self.nc, self.bucket = nc, p.request_bodies_bucket(prefix)
        self._store: ObjectStore | None = None

    async def _open(self, create: bool) -> ObjectStore:
        if self._store is None:
            js = self.nc.jetstream()
            try:
                self._store = await js.object_store(self.bucket)
            except NotFoundError:  # the bucket (BucketNotFoundError)
                if not create:
                    raise
                config = ObjectStoreConfig(bucket=self.bucket, ttl=TTL_S)
                self._store = await js.create_object_store(self.bucket, config=config)
        return self._store

    async def put(self, request: p.GenerateRequest, data: bytes) -> p.GenerateRequest:
        """Stores `data` (the request, encoded) and returns the stub to dispatch instead."""
        store = await self._open(create=True)
        try:
            await store.put(request.request_id, data)
        except Exception:
            self._store = None  # opened again next time (the bucket may have been removed)
            raise
        # the fields a worker reads before the body (acceptance, lease, metering), nothing
        # else: whatever part of a request is large (prompt, tools, a schema) stays out
        return p.GenerateRequest(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            key_id=request.key_id,
            sku_id=request.sku_id,
            model=request.model,
            reply_to=request.reply_to,
            admitted_at=request.admitted_at,
            gateway_id=request.gateway_id,
            body_object=request.request_id,
        )

    async def take(self, stub: p.GenerateRequest) -> p.GenerateRequest:
        """The whole request a stub names; its object is deleted once read."""
        assert stub.body_object is not None
        store = await self._open(create=False)
        try:
            found = await store.get(stub.body_object)
        except Exception:
            self._store = None
            raise
        request = p.decode_request(found.data or b"")
        if request.request_id != stub.request_id:
            raise ValueError(f"request body {stub.body_object} holds {request.request_id}")
        await store.delete(stub.body_object)
        # the stub's routing fields are the current ones (a rerouted stub keeps its reply inbox)
        return msgspec.structs.replace(request, reply_to=stub.reply_to, body_object=None)
