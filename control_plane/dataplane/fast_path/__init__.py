"""The data plane's fast path: the one place that reaches into uvicorn's and nats-py's
internals, and its one switch.

Why: on the token path, the public APIs cost most of what a Python gateway spends per request
and per token (docs/dataplane.md, "The token hot path" and "Where the first-token time goes").
Measured under the benchmark's load on a 2-core machine, the fast path takes out ~85 us of the
~420 us between reading a request and writing it to NATS (the completion routes skip
Litestar's app level and routing, and start in the callback that read them), one task hop per
token on the way in (worker replies taken from nats-py's parser in its read loop) and on the way
out (chunks written to the connection from that read loop), and one socket write and one
flusher wake-up per request (the request written to NATS at once, the response head with its
first body).

- `uvicorn.py`: the protocol that hands the completion routes to their handler
  (`_start_asgi_task`), and what `transport.ResponseOut` writes through (the request cycle's
  transport, flow control and response state).
- `nats.py`: nats-py's protocol parser taking plain reply frames itself, subscriptions without
  their queue, and `PUB` frames written to the connection's transport.

Switch: `TOKENMILL_FAST_PATH` (default on; "0" turns it off). Off, the data plane serves on
the public APIs only: uvicorn runs the gateway's input-limits protocol (its httptools protocol
holding request heads to `limits.InputLimits`) and every request goes through the ASGI app;
nats-py is used through `nc.publish` and callback subscriptions. Responses and metering are the
same either way (tests/dataplane runs its contract tests both ways).

Tested with uvicorn 0.54, nats-py 2.16 and httptools 0.9 (`TESTED`; pyproject.toml pins the
same minors as upper bounds): with any other installed version the fast path turns itself off,
with one log line, so a newer library never breaks serving.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re

from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.dataplane")

# The versions the fast path was tested with: (distribution, lowest, first not tested).
TESTED = (
    ("uvicorn", (0, 54), (0, 55)),
    ("nats-py", (2, 16), (2, 17)),
    ("httptools", (0, 9), (0, 10)),
)

# Scope keys the fast path sets on a request. FAST_PATH: the request came through the fast
# protocol, so its response may be written through uvicorn's request cycle.
FAST_PATH = "tokenmill.fast_path"
# True when every middleware on the route passes a 2xx response through unchanged (set by
# `uvicorn.direct_routes`), so a streamed answer may be written past the send chain.
DIRECT_WRITES = "tokenmill.direct_writes"
# True when the server started the handler with the whole body already read, so reading it
# cannot wait.
BODY_IN = "tokenmill.body_in"

_untested: list[str] | None = None  # looked up once: the installed versions do not change


def enabled() -> bool:
    """Whether the fast path is on: `TOKENMILL_FAST_PATH` is not "0" and the installed
    uvicorn, nats-py and httptools are the versions it was tested with. Read when a server or
    a worker client is built."""
    if not Settings().fast_path:
        return False
    return not untested_versions()


def untested_versions() -> list[str]:
    """The installed libraries outside `TESTED` ("uvicorn 0.56.0"); logs them the first time."""
    global _untested
    if _untested is None:
        _untested = []
        for name, low, high in TESTED:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                _untested.append(f"{name} (not installed)")
                continue
            if not low <= _minor(version) < high:
                _untested.append(f"{name} {version}")
        if _untested:
            log.warning(
                "data-plane fast path off: tested with %s; installed: %s",
                ", ".join(f"{n} {'.'.join(map(str, lo))}.x" for n, lo, _ in TESTED),
                ", ".join(_untested),
            )
    return _untested


def _minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)
