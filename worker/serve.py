"""The worker process: serves one SKU from one backend over NATS.

    python -m worker.serve --sku-id SKU --model NAME --backend fixed_rate --config '{"tokens_per_s": 50}'

It announces itself, heartbeats its load, takes requests from the SKU's queue group and serves
them concurrently, streaming chunks to each request's inbox; a Cancel (the client hung up)
stops generation. Every request it accepted ends with exactly one usage event (WorkerGenerated:
what it generated) on JetStream, dedupe id `wk:<request_id>`, retried until acked. It sends
Finished first: the bill is the gateway's (what it delivered), so a stream's end need not wait
on JetStream, and this record is the one reconciliation compares the bill with.

Size: One process's whole life (connect, announce, heartbeat, serve, watch leases, drain) in one
module: the parts share the connection and the table of requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events.nats_cluster import nats_servers, unsubscribe_within
from events.publish import UsagePublisher
from events.usage import WorkerGenerated
from tokenmill.settings import WorkerSettings
from worker import protocol as p
from worker.backends import Backend, InvalidRequest, make_backend
from worker.request_bodies import RequestBodies

log = logging.getLogger("tokenmill.worker")


class Worker:
    def __init__(self, settings: WorkerSettings, backend: Backend) -> None:
        if not settings.sku_id:
            raise ValueError("a worker needs a SKU id (--sku-id / TOKENMILL_WORKER_SKU)")
        self.settings = settings
        self.backend = backend
        self.nc: NATS | None = None
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        # Cancels that arrived before their request (different subjects, no ordering between them).
        self._early_cancels: dict[str, float] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        # Gateway leases: last heard (monotonic) by lease subject; in-flight requests' leases.
        self._leases: dict[str, float] = {}
        self._leased: dict[str, tuple[str, _Generation]] = {}
        self._stopping = asyncio.Event()

    @property
    def prefix(self) -> str:
        return self.settings.stream_prefix

    async def run(self) -> None:
        """Serves until `stop()`, then drains."""
        s = self.settings
        await self.backend.start()
        self.nc = await nats.connect(
            nats_servers(s.nats_url),
            name=f"worker {s.worker_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        self._usage = UsagePublisher(self.nc.jetstream(), self.prefix)
        self._bodies = RequestBodies(self.nc, self.prefix)
        work = await self.nc.subscribe(
            p.work_subject(self.prefix, s.sku_id),
            queue=p.work_queue(self.prefix, s.sku_id),
            cb=self._on_request,
            pending_msgs_limit=1_000_000,
        )
        # Requests the gateway routed to this worker (by load, by prefix affinity).
        direct = await self.nc.subscribe(
            p.direct_work_subject(self.prefix, s.sku_id, s.worker_id),
            cb=self._on_request,
            pending_msgs_limit=1_000_000,
        )
        await self.nc.subscribe(p.cancel_subject(self.prefix, s.sku_id), cb=self._on_cancel)
        await self.nc.subscribe(p.discover_subject(self.prefix), cb=self._on_discover)
        await self.nc.subscribe(p.gateway_lease_wildcard(self.prefix), cb=self._on_lease)
        watchdog = asyncio.create_task(self._watch_gateways())
        # What the process holds by now (the model, its kernels, the warm-up's compilations)
        # lives as long as it does: out of the collector's sight, a full collection no longer
        # walks it while holding the lock the engine thread needs between kernel launches.
        gc.collect()
        gc.freeze()
        await self._announce()
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        log.info("worker %s serving SKU %s with %s", s.worker_id, s.sku_id, self.backend.name)
        try:
            await self._stopping.wait()
        finally:
            # No new work; give in-flight requests their drain time, then cancel (they still meter).
            await unsubscribe_within(work)
            await unsubscribe_within(direct)
            if self._handlers:
                _, pending = await asyncio.wait(set(self._handlers), timeout=s.drain_s)
                if pending:
                    for gen in self._in_flight.values():
                        gen.cancel()
                    await asyncio.wait(pending, timeout=30)
            heartbeat.cancel()
            watchdog.cancel()
            await self.nc.publish(
                p.gone_subject(self.prefix),
                p.encode(p.WorkerGone(worker_id=s.worker_id, sku_id=s.sku_id)),
            )
            await self.nc.drain()
            await self.backend.close()
            gc.unfreeze()

    def stop(self) -> None:
        self._stopping.set()

    async def _announce(self) -> None:
        assert self.nc is not None
        s = self.settings
        msg = p.WorkerAnnounce(
            worker_id=s.worker_id,
            sku_id=s.sku_id,
            model=s.model,
            backend=self.backend.name,
            capacity=self.backend.capacity,
            max_context=self.backend.max_context,
            direct=True,
        )
        await self.nc.publish(p.announce_subject(self.prefix), p.encode(msg))
        await self._heartbeat()

    async def _heartbeat(self) -> None:
        assert self.nc is not None
        load = self.backend.load()
        beat = p.WorkerHeartbeat(
            worker_id=self.settings.worker_id,
            sku_id=self.settings.sku_id,
            running=load.running,
            waiting=load.waiting,
            kv_pressure=load.kv_pressure,
            ts=time.time(),
        )
        await self.nc.publish(
            p.heartbeat_subject(self.prefix, self.settings.sku_id), p.encode(beat)
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            with contextlib.suppress(
                Exception
            ):  # a reconnecting client buffers; never stop beating
                await self._heartbeat()

    async def _on_discover(self, msg: Msg) -> None:
        await self._announce()

    async def _on_request(self, msg: Msg) -> None:
        try:
            request = p.decode_request(msg.data)
        except Exception:
            log.exception("undecodable request on %s", msg.subject)
            return
        task = asyncio.create_task(self._serve(request))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = p.decode_cancel(msg.data)
        gen = self._in_flight.get(cancel.request_id)
        if gen is None:
            now = time.monotonic()
            self._early_cancels[cancel.request_id] = now
            for rid, t in list(self._early_cancels.items()):
                if now - t > 60:
                    del self._early_cancels[rid]
            return
        gen.cancel()

    async def _on_lease(self, msg: Msg) -> None:
        self._leases[msg.subject] = time.monotonic()

    async def _watch_gateways(self) -> None:
        """Stops the requests whose gateway went silent: it died, or lost NATS, and nobody
        would receive what is generated. What was generated is still recorded (the waste)."""
        silent_s = self.settings.gateway_silent_s
        while True:
            await asyncio.sleep(min(0.5, silent_s / 4))
            now = time.monotonic()
            for rid, (lease, state) in list(self._leased.items()):
                if now - self._leases.get(lease, now) > silent_s and rid in self._in_flight:
                    log.warning("the gateway of %s went silent; stopping it", rid)
                    state.gateway_lost = True
                    self._in_flight[rid].cancel()
            for lease, heard in list(self._leases.items()):
                if now - heard > 60 and all(lease != sub for sub, _ in self._leased.values()):
                    del self._leases[lease]

    async def _serve(self, request: p.GenerateRequest) -> None:
        """One request, start to metered finish. Never raises."""
        assert self.nc is not None
        nc, rid, reply = self.nc, request.request_id, request.reply_to
        started_at = datetime.now(UTC)
        t0 = time.monotonic()
        admitted_lag = max(0.0, time.time() - request.admitted_at)
        state = _Generation()
        await nc.publish(
            reply, p.encode(p.Accepted(request_id=rid, worker_id=self.settings.worker_id))
        )

        gen = asyncio.create_task(self._generate(request, state))
        self._in_flight[rid] = gen
        if request.gateway_id:
            lease = p.gateway_lease_subject(self.prefix, request.gateway_id)
            self._leases.setdefault(lease, time.monotonic())  # its clock starts now
            self._leased[rid] = (lease, state)
        if self._early_cancels.pop(rid, None) is not None:
            gen.cancel()
        try:
            await asyncio.wait({gen})
        finally:
            del self._in_flight[rid]
            self._leased.pop(rid, None)
        if gen.cancelled():
            state.finish_reason = "cancelled"
        elif (exc := gen.exception()) is not None:
            if isinstance(exc, InvalidRequest):
                await nc.publish(
                    reply,
                    p.encode(
                        p.Rejected(
                            request_id=rid, message=exc.message, param=exc.param, code=exc.code
                        )
                    ),
                )
                return
            log.error("request %s failed", rid, exc_info=exc)
            state.finish_reason, state.error = "error", f"{type(exc).__name__}: {exc}"
        elif state.finish_reason is None:
            state.finish_reason, state.error = "error", "the backend ended without a finish reason"

        e2e = time.monotonic() - t0 + admitted_lag
        event = WorkerGenerated(
            request_id=rid,
            tenant_id=request.tenant_id,
            key_id=request.key_id,
            sku_id=request.sku_id,
            model=self.settings.model or request.model,
            worker_id=self.settings.worker_id,
            prompt_tokens=state.prompt_tokens,
            cached_tokens=state.cached_tokens,
            completion_tokens=state.completion_tokens,
            # the bill knows no "tool_calls": the model stopped by itself
            finish_reason="stop" if state.finish_reason == "tool_calls" else state.finish_reason,
            gateway_lost=state.gateway_lost,
            gateway_id=request.gateway_id,
            ttft_ms=None
            if state.first_token_at is None
            else (state.first_token_at - t0 + admitted_lag) * 1000,
            e2e_ms=e2e * 1000,
            started_at=started_at,
            finished_at=datetime.now(UTC),
        )
        # In flight while Finished goes out; awaited below, so a drain still waits for the ack.
        usage = asyncio.create_task(self._usage.publish_until_acked(event))
        finished = p.Finished(
            request_id=rid,
            seq=state.seq,
            prompt_tokens=state.prompt_tokens,
            cached_tokens=state.cached_tokens,
            completion_tokens=state.completion_tokens,
            finish_reason=state.finish_reason,
            error=state.error,
            finish_reasons=[state.finish_reasons[i] for i in sorted(state.finish_reasons)],
        )
        with contextlib.suppress(Exception):
            await nc.publish(reply, p.encode(finished))
        await usage

    async def _generate(self, request: p.GenerateRequest, state: _Generation) -> None:
        assert self.nc is not None
        nc, rid, reply = self.nc, request.request_id, request.reply_to
        if request.body_object is not None:  # too large for one message: the object store
            request = await self._bodies.take(request)
        async for progress in self.backend.generate(request):
            if state.first_token_at is None and progress.completion_tokens > 0:
                state.first_token_at = time.monotonic()
            state.prompt_tokens = progress.prompt_tokens
            state.cached_tokens = progress.cached_tokens
            state.completion_tokens = progress.completion_tokens
            chunk = p.TokenChunk(
                request_id=rid,
                seq=state.seq,
                text=progress.text,
                completion_tokens=progress.completion_tokens,
                prompt_tokens=progress.prompt_tokens,
                cached_tokens=progress.cached_tokens,
                index=progress.index,
                logprobs=progress.logprobs,
                tool_calls=progress.tool_calls,
                finish_reason=progress.finish_reason,
            )
            state.seq += 1
            await nc.publish(reply, p.encode(chunk))
            if progress.finish_reason is not None:  # one choice done; the request when all are
                state.finish_reasons[progress.index] = progress.finish_reason
                if len(state.finish_reasons) >= request.num_choices:
                    state.finish_reason = state.finish_reasons.get(0, progress.finish_reason)
                    return


@dataclass
class _Generation:
    seq: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: p.FinishReason | None = None
    error: str | None = None
    gateway_lost: bool = False  # stopped because its gateway went silent
    finish_reasons: dict[int, p.FinishReason] = field(default_factory=dict)  # by choice


def use_gpu(
    settings: WorkerSettings, gpu: int, environ: MutableMapping[str, str]
) -> WorkerSettings:
    """Pins this worker process to the `gpu`-th visible GPU: CUDA_VISIBLE_DEVICES names that
    one GPU alone (an index into an existing CUDA_VISIBLE_DEVICES, else the host's GPU
    number), so the backend's device is `cuda:0`, and the worker id ends `-gpu{N}`. Run one
    such process per GPU of a host. Must run before the backend first touches CUDA."""
    if gpu < 0:
        raise SystemExit(f"--gpu {gpu}: a GPU number is 0 or more")
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if gpu >= len(ids):
            raise SystemExit(f"--gpu {gpu}: CUDA_VISIBLE_DEVICES={visible} shows {len(ids)}")
        environ["CUDA_VISIBLE_DEVICES"] = ids[gpu]
    else:
        environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    config = dict(settings.backend_config)
    if settings.backend == "torch_runtime":
        device = str(config.get("device", "cuda"))
        if not device.startswith("cuda"):
            raise SystemExit(f"--gpu {gpu} with device {device!r}: drop one of them")
        config["device"] = "cuda:0"  # the only GPU the process sees
    return dataclasses.replace(
        settings, backend_config=config, worker_id=f"{settings.worker_id}-gpu{gpu}"
    )


def _parse_args(
    argv: list[str] | None, environ: MutableMapping[str, str] = os.environ
) -> WorkerSettings:
    base = WorkerSettings()
    ap = argparse.ArgumentParser(
        prog="tokenmill worker", description="Serve one SKU from one backend over NATS."
    )
    ap.add_argument("--nats-url", default=base.nats_url)
    ap.add_argument("--prefix", default=base.stream_prefix, help="stream/subject prefix")
    ap.add_argument("--sku-id", default=base.sku_id)
    ap.add_argument("--model", default=base.model)
    ap.add_argument(
        "--backend", default=base.backend, choices=["torch_runtime", "openai_proxy", "fixed_rate"]
    )
    ap.add_argument("--config", default=None, help="backend keyword config as JSON")
    ap.add_argument("--worker-id", default=base.worker_id)
    ap.add_argument("--heartbeat-s", type=float, default=base.heartbeat_s)
    ap.add_argument("--drain-s", type=float, default=base.drain_s)
    ap.add_argument(
        "--gpu",
        type=int,
        default=None,
        help="serve on this visible GPU alone (one worker process per GPU)",
    )
    a = ap.parse_args(argv)
    settings = WorkerSettings(
        nats_url=a.nats_url,
        stream_prefix=a.prefix,
        sku_id=a.sku_id,
        model=a.model,
        backend=a.backend,
        backend_config=json.loads(a.config) if a.config else base.backend_config,
        worker_id=a.worker_id,
        heartbeat_s=a.heartbeat_s,
        drain_s=a.drain_s,
    )
    return settings if a.gpu is None else use_gpu(settings, a.gpu, environ)


async def serve(settings: WorkerSettings) -> None:
    worker = Worker(settings, make_backend(settings.backend, settings.backend_config))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, worker.stop)
    await worker.run()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("TOKENMILL_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(_parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
