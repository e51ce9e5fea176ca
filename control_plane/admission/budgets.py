"""Budgets shared by gateway replicas through NATS JetStream KV, leased in chunks.

One KV key per budget (a tenant's or key's RPM in one minute, TPM in one minute, token or
spend quota in one period, open streams) holds what each replica has *leased* from it:

    {"holders": {replica_id: [held, heartbeat, usage_seq]}}

The pool is `limit - settled - sum(held of live holders)` (settled usage comes from the usage
stream and is zero for rate windows and stream slots). A replica grows its lease with one
compare-and-set on the key's revision, so two replicas never lease the same unit; admission
then draws on the local lease with no I/O at all (the hot path is dictionary arithmetic).
Leases are sized to a fraction of what is left (`chunk`), so they shrink as the budget runs
out and little can be stranded on an idle replica; unused lease goes back after
`idle_return_s`. Invariant: what a replica uses locally never exceeds what the KV records
for it (grow: write KV, then raise locally; shrink: lower locally, then write KV), so the
sum of use over all replicas never exceeds the limit — except for the one request a quota
lets overdraw the last remainder (its reservation bounds the overspend).

A holder's entry lives until `heartbeat + ttl`; a crashed replica's lease is therefore
counted (conservatively) until then and dropped after, never leaked. `usage_seq` is the
usage-stream position the holder had applied when it wrote: a reader behind it waits to
catch up, so usage that moved from a holder's lease into the settled sums is never missed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from events.nats_cluster import ensure_key_value

Clock = Callable[[], float]


class Holding(msgspec.Struct, array_like=True):
    held: int
    heartbeat: float
    usage_seq: int = 0


class BudgetDoc(msgspec.Struct):
    holders: dict[str, Holding] = {}


_encode = msgspec.json.Encoder().encode
_decode_doc = msgspec.json.Decoder(BudgetDoc).decode


@dataclass(frozen=True)
class BudgetSpec:
    """What a budget counts and how it is shared."""

    kv_key: str
    limit: int
    # a quota may let the one request that crosses the line through (bounded overspend);
    # rate windows and stream slots never
    overdraft: bool
    holder_ttl_s: float
    window_end: float | None = None  # rate windows and quota periods end; stream slots do not


class SharedBudget:
    def __init__(
        self,
        store: BudgetStore,
        spec: BudgetSpec,
        settled: Callable[[], int],
    ) -> None:
        self.store, self.spec, self.settled = store, spec, settled
        self.limit = spec.limit
        self.held = 0  # leased to this replica (never above what KV records for it)
        self.in_use = 0  # reserved by this replica's requests
        self.others = 0  # other replicas' leases when last seen
        self.last_take = 0.0
        self._recorded = 0  # what KV records for this replica
        self._recorded_at = 0.0
        self._lock = asyncio.Lock()
        self._refilling = False

    # -- the hot path (no I/O) -----------------------------------------------------------

    @property
    def slack(self) -> int:
        return self.held - self.in_use

    def remaining(self) -> int:
        """This replica's best estimate of what is left of the budget everywhere."""
        return max(0, self.limit - self.settled() - self.others - self.in_use)

    def try_take(self, units: int) -> bool:
        if self.slack < units:
            return False
        self.in_use += units
        self.last_take = self.store.clock()
        if self.slack < self._chunk(self.limit) // 2 and not self._refilling:
            self._refilling = True
            self.store.spawn(self._refill())
        return True

    def give_back(self, units: int) -> None:
        self.in_use = max(0, self.in_use - units)

    def settle_out(self, units: int) -> None:
        """Units in use became settled usage (the usage stream has them): they leave the
        lease too, since the settled sums now count them."""
        units = min(units, self.in_use)
        self.in_use -= units
        self.held -= units

    def set_limit(self, limit: int) -> None:
        """A changed limit applies now: the lease is cut to what is in use, so the next
        request leases again against the new limit."""
        if limit != self.limit:
            self.limit = limit
            self.held = min(self.held, self.in_use)

    # -- leasing (one NATS round trip per compare-and-set) ---------------------------------

    async def take(self, units: int, may_overdraw: int | None = None) -> bool:
        """Take `units`, leasing as needed. An overdraft budget lets the one request that
        crosses the line overdraw; `may_overdraw` caps by how much (None: any amount)."""
        for _ in range(4):
            if self.try_take(units):
                return True
            async with self._lock:
                if self.slack >= units:
                    continue
                if not await self._grow(units - self.slack, True, may_overdraw):
                    return False
        return False

    async def _refill(self) -> None:
        try:
            async with self._lock:
                await self._grow(0, for_request=False)
        finally:
            self._refilling = False

    def _chunk(self, available: int) -> int:
        """Lease size: a share of what is left, at most `lease_fraction` of the limit."""
        cap = max(1, int(self.limit * self.store.lease_fraction))
        return max(0, min(cap, available // 8))

    async def _grow(self, short: int, for_request: bool, may_overdraw: int | None = None) -> bool:
        """Lease `short` more units (plus a chunk when the pool allows), by compare-and-set."""
        for _ in range(16):
            doc, revision = await self.store.read(self.spec.kv_key)
            now = self.store.clock()
            others = {
                replica: h
                for replica, h in doc.holders.items()
                if replica != self.store.replica_id and h.heartbeat + self.spec.holder_ttl_s > now
            }
            newest_seq = max((h.usage_seq for h in others.values()), default=0)
            if not await self.store.usage_caught_up(newest_seq):
                return False
            self.others = sum(h.held for h in others.values())
            available = self.limit - self.settled() - self.others - self.held
            if available >= short and (short or available > 0):
                grant = short + self._chunk(available - short)
            elif (
                for_request
                and self.spec.overdraft
                and available > 0
                and (may_overdraw is None or short - available <= may_overdraw)
            ):
                grant = short  # the one request that may cross the line
            else:
                return False
            if grant <= 0:
                return True
            recorded = self.held + grant
            others[self.store.replica_id] = Holding(recorded, now, self.store.usage_seq())
            if await self.store.write(self.spec.kv_key, BudgetDoc(others), revision):
                self.held += grant
                self._recorded, self._recorded_at = recorded, now
                return True
        return False

    async def sync(self) -> None:
        """Hand back a lease idle for `idle_return_s`, and refresh the heartbeat of one that
        is in use before other replicas would take this one for crashed."""
        now = self.store.clock()
        idle = now - self.last_take >= self.store.idle_return_s
        if idle and self.held > self.in_use:
            self.held = self.in_use  # lower locally first: never use what KV may not record
        stale = self.held and now - self._recorded_at > self.spec.holder_ttl_s / 3
        if self.held == self._recorded and not stale:
            return
        async with self._lock:
            for _ in range(16):
                doc, revision = await self.store.read(self.spec.kv_key)
                holders = dict(doc.holders)
                if self.held:
                    holders[self.store.replica_id] = Holding(self.held, now, self.store.usage_seq())
                else:
                    holders.pop(self.store.replica_id, None)
                if await self.store.write(self.spec.kv_key, BudgetDoc(holders), revision):
                    self._recorded, self._recorded_at = self.held, now
                    return

    @property
    def expired(self) -> bool:
        end = self.spec.window_end
        return end is not None and self.store.clock() > end + 5 and not self.in_use


def budget_bucket_configs(prefix: str, replicas: int) -> dict[str, KeyValueConfig]:
    """The buckets of shared budgets: "r" rate windows, "h" quotas and stream slots."""
    return {
        # Rate windows last a minute: their keys may age out. Quotas and slots persist.
        "r": KeyValueConfig(bucket=f"{prefix}_GOV_RATE", history=1, ttl=300, replicas=replicas),
        "h": KeyValueConfig(bucket=f"{prefix}_GOV_HOLD", history=1, replicas=replicas),
    }


class BudgetStore:
    """The budgets of one replica, their KV buckets, and the loop that keeps them synced."""

    def __init__(
        self,
        js: JetStreamContext,
        prefix: str,
        replica_id: str,
        *,
        clock: Clock = time.time,
        lease_fraction: float = 0.02,
        idle_return_s: float = 1.0,
        usage_seq: Callable[[], int] = lambda: 0,
        wait_usage: Callable[[int, float], Awaitable[bool]] | None = None,
        replicas: int = 1,
    ) -> None:
        self.js, self.prefix, self.replica_id, self.clock = js, prefix, replica_id, clock
        self.replicas = replicas
        self.lease_fraction, self.idle_return_s = lease_fraction, idle_return_s
        self.usage_seq, self._wait_usage = usage_seq, wait_usage
        self.budgets: dict[str, SharedBudget] = {}
        self._kv: dict[str, KeyValue] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def bucket_configs(self) -> dict[str, KeyValueConfig]:
        """The KV buckets, with the install's replica count (TOKENMILL_STREAM_REPLICAS)."""
        return budget_bucket_configs(self.prefix, self.replicas)

    async def open(self) -> None:
        for kind, config in self.bucket_configs().items():
            self._kv[kind] = await ensure_key_value(self.js, config)

    def budget(self, spec: BudgetSpec, settled: Callable[[], int]) -> SharedBudget:
        found = self.budgets.get(spec.kv_key)
        if found is None:
            found = self.budgets[spec.kv_key] = SharedBudget(self, spec, settled)
        found.set_limit(spec.limit)
        return found

    def _bucket(self, key: str) -> KeyValue:
        return self._kv["r" if key.startswith("r.") else "h"]

    async def read(self, key: str) -> tuple[BudgetDoc, int]:
        try:
            entry = await self._bucket(key).get(key)
        except KeyNotFoundError:  # absent or deleted: an empty pool, created on first write
            return BudgetDoc(), 0
        return _decode_doc(entry.value or b"{}"), entry.revision or 0

    async def write(self, key: str, doc: BudgetDoc, revision: int) -> bool:
        kv = self._bucket(key)
        try:
            if revision:
                await kv.update(key, _encode(doc), last=revision)
            else:
                await kv.create(key, _encode(doc))
        except KeyWrongLastSequenceError:  # another replica wrote first: read again
            return False
        return True

    async def usage_caught_up(self, seq: int) -> bool:
        if self._wait_usage is None or self.usage_seq() >= seq:
            return True
        return await self._wait_usage(seq, 0.25)

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def sync_all(self) -> None:
        for key, budget in list(self.budgets.items()):
            await budget.sync()
            if budget.expired and not budget.held:
                self.budgets.pop(key, None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
