"""Which failures mean "NATS or Postgres is unreachable right now" (retry later) rather than
"this request or event is wrong" (retrying changes nothing)."""

from __future__ import annotations

import asyncio

import asyncpg
import nats.errors
import nats.js.errors

# SQLSTATE classes of a server that cannot serve now: connection exception, transaction
# rollback (serialization, deadlock), insufficient resources, operator intervention (shutdown),
# system error.
_TRANSIENT_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")


def backend_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, nats.js.errors.APIError):
        # JetStream answered: only "no JetStream leader / unavailable" is about reachability.
        return isinstance(exc, nats.js.errors.ServiceUnavailableError)
    if isinstance(
        exc,
        nats.errors.Error
        | asyncpg.PostgresConnectionError
        | asyncpg.InterfaceError
        | OSError
        | asyncio.TimeoutError,
    ):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        return str(getattr(exc, "sqlstate", "") or "").startswith(_TRANSIENT_SQLSTATE_CLASSES)
    return False
