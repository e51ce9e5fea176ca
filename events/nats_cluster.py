"""Connecting to NATS as a cluster: a list of seed URLs, start-up that waits (within a bound)
for a cluster still forming, KV buckets created with the install's replica count, and
unsubscribes bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from events.store import EventStore
from tokenmill.settings import nats_servers

log = logging.getLogger(__name__)
T = TypeVar("T")

# JetStream's error codes for "stream name already in use with a different configuration"
# and "replicas > 1 not supported in non-clustered mode".
STREAM_CONFIG_MISMATCH = 10058
REPLICAS_NOT_SUPPORTED = 10074
# How long start-up keeps retrying: a cluster whose nodes start together elects its meta
# leader within seconds, and answers JetStream requests with timeouts until then.
STARTUP_WITHIN_S = 60.0
# An unsubscribe waits for the socket to drain; a stalled connection (the server no longer
# reading, seen under load) would hold a shutdown for good.
UNSUBSCRIBE_S = 5.0


async def retry_startup(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    within_s: float = STARTUP_WITHIN_S,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
) -> T:
    """`attempt()` until it succeeds, with exponential backoff, for at most `within_s`; the
    last failure is raised after that. For start-up only: a server or cluster that is still
    coming up refuses connections or times out JetStream requests for a while."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    delay = first_delay_s
    while True:
        try:
            return await attempt()
        except (OSError, TimeoutError, NatsError, ServiceUnavailableError) as e:
            if isinstance(e, APIError) and not _transient(e):
                raise
            left = deadline - loop.time()
            if left <= 0:
                raise
            log.warning("%s: %s; retrying in %.1fs", what, type(e).__name__, delay)
            await asyncio.sleep(min(delay, left))
            delay = min(max_delay_s, delay * 2) * random.uniform(0.8, 1.0)


def _transient(e: APIError) -> bool:
    # 503 (no JetStream leader yet) and 408/504 time-outs pass; a refused config does not.
    return e.code in (408, 503, 504) or e.code is None


async def connect(
    url: str | list[str],
    *,
    name: str,
    within_s: float = STARTUP_WITHIN_S,
    **options: Any,
) -> NATS:
    """A connection that reconnects forever once made. Making it waits up to `within_s` for
    a server to answer (the servers may start after us, as in compose or a fresh cluster);
    nats-py retries each seed every `reconnect_time_wait` meanwhile."""
    servers = nats_servers(url) if isinstance(url, str) else url
    options.setdefault("max_reconnect_attempts", -1)
    options.setdefault("reconnect_time_wait", 0.5)
    options.setdefault("connect_timeout", 2)
    options.setdefault("error_cb", _log_error)
    try:
        return await asyncio.wait_for(nats.connect(servers, name=name, **options), within_s)
    except TimeoutError:
        raise ConnectionError(
            f"no NATS server answered at {','.join(servers)} within {within_s:.0f}s"
        ) from None


async def _log_error(e: Exception) -> None:
    # nats-py's default logs every failed attempt with a traceback; one line says enough.
    log.warning("nats: %s: %s", type(e).__name__, e)


async def ensure_streams(store: EventStore, *, within_s: float = STARTUP_WITHIN_S) -> None:
    """The event store's streams, retried while a fresh cluster answers with time-outs."""

    async def attempt() -> None:
        try:
            await store.ensure_streams()
        except APIError as e:
            if e.err_code == REPLICAS_NOT_SUPPORTED:
                raise replicas_error("the event streams", store.layout.replicas) from e
            raise

    await retry_startup("creating the event streams", attempt, within_s=within_s)


def replicas_error(what: str, replicas: int) -> RuntimeError:
    return RuntimeError(
        f"{what}: the NATS server refuses {replicas} replicas (a single server holds 1); set "
        "TOKENMILL_STREAM_REPLICAS=1, or connect to a JetStream cluster of at least that many"
    )


async def ensure_key_value(
    js: JetStreamContext, config: KeyValueConfig, *, within_s: float = STARTUP_WITHIN_S
) -> KeyValue:
    """The bucket, created with `config` or brought to its replica count (an install moved
    from one server to a cluster keeps its buckets). Retried while the cluster forms."""

    async def attempt() -> KeyValue:
        try:
            return await js.create_key_value(config)
        except APIError as e:
            if e.err_code == REPLICAS_NOT_SUPPORTED:
                raise replicas_error(f"KV bucket {config.bucket}", config.replicas) from e
            if e.err_code != STREAM_CONFIG_MISMATCH:
                raise
        # It exists with another config: change only the replica count, keep the rest.
        stream = f"KV_{config.bucket}"
        info = await js.stream_info(stream)
        if info.config.num_replicas != config.replicas:
            current: StreamConfig = info.config
            current.num_replicas = config.replicas
            await js.update_stream(current)
        try:
            return await js.key_value(config.bucket)
        except BucketNotFoundError:  # deleted meanwhile: the next attempt creates it
            raise TimeoutError(f"KV bucket {config.bucket} vanished") from None

    return await retry_startup(f"creating KV bucket {config.bucket}", attempt, within_s=within_s)


async def unsubscribe_within(sub: Any, within_s: float = UNSUBSCRIBE_S) -> None:
    """Unsubscribe `sub` (a core or JetStream subscription), giving up after `within_s`; a
    connection already closed is no error here."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(sub.unsubscribe(), within_s)
