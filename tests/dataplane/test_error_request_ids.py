"""Every /v1 answer names its request in `x-request-id`, refusals before dispatch included, so a
client can dispute any answer it got."""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from typing import Any

import httpx
import pytest

from tests.dataplane.harness import Stack
from tests.dataplane.test_hostile_input import (
    BAD_HEADS,
    CHAT,
    NO_ROUTE,
    TEXT,
    chat,
    exchange,
    port_of,
    request,
)

pytestmark = pytest.mark.timeout(60)

REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module")
async def key(stack: Stack) -> dict[str, Any]:
    return (await stack.tenant_with_key())[1]


def _request_id(headers: httpx.Headers | dict[str, str]) -> str:
    rid = headers.get("x-request-id")
    assert rid is not None and REQUEST_ID.match(rid), headers
    return rid


async def test_refusals_before_dispatch_carry_a_request_id(
    stack: Stack, key: dict[str, Any], sku: dict[str, Any]
) -> None:
    auth = {"authorization": f"Bearer {key['key']}"}
    seen = set()
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        answers = [
            await http.post(CHAT, json={"model": sku["name"], "messages": []}),  # 401
            await http.post(CHAT, headers=auth, content=b"{not json"),  # 400
            await http.post(CHAT, headers=auth, content=chat(model="nope")),  # 404
        ]
        for method, path, status, _ in NO_ROUTE:  # the app's own refusals under /v1
            answers.append(await http.request(method, path, headers=auth, json={}))
            assert answers[-1].status_code == status
    for r in answers:
        assert r.status_code >= 400 and "error" in r.json(), r.text
        seen.add(_request_id(r.headers))
    assert len(seen) == len(answers), "request ids repeat"


async def test_a_refused_head_carries_a_request_id(stack: Stack, key: dict[str, Any]) -> None:
    too_long = request(TEXT, b"", key["key"], length=10**9)  # 413 from the declared length
    for _, raw, status, _code in [*BAD_HEADS[:3], ("413", too_long, 413, None)]:
        answer = await exchange(port_of(stack), [raw])
        assert answer is not None and answer.status == status
        _request_id(answer.headers)


async def test_no_worker_and_a_dead_worker_carry_the_request_id(
    stack: Stack, key: dict[str, Any]
) -> None:
    auth = {"authorization": f"Bearer {key['key']}"}
    sku = await stack.publish_sku("rid-" + uuid.uuid4().hex[:6])
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        r = await http.post(CHAT, headers=auth, content=chat(model=sku["name"]))
        assert r.status_code == 503
        _request_id(r.headers)

        worker = stack.start_worker(sku["sku_id"], tokens_per_s=20, output_tokens=100)
        await stack.wait_served(sku["sku_id"])
        killed = False

        async def kill_soon() -> None:
            nonlocal killed
            await asyncio.sleep(0.5)
            worker.send_signal(signal.SIGKILL)
            killed = True

        task = asyncio.create_task(kill_soon())
        r = await http.post(CHAT, headers=auth, content=chat(model=sku["name"]))
        await task
        assert killed and r.status_code == 502 and r.json()["error"]["code"] == "worker_error"
        rid = _request_id(r.headers)
        # The id is the one the request was metered under.
        row = await stack.ledger_row(rid)
        assert row["finish_reason"] == "error"
