"""The open-reservations gauges on /metrics: governance's quota reservations that admission
made and the usage stream has not settled yet, per SKU, read periodically (reading is a walk
over the open ones; nothing on the request path)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from control_plane.observability.feed import SkuNames, sku_label
from tokenmill.settings import GatewaySettings

REPORT_EVERY_S = GatewaySettings().reservations_every_s


class OpenReservations(Protocol):
    def open_reservations(self) -> dict[str, tuple[int, int]]:
        """Per SKU id: (reservations, tokens they hold)."""
        ...


class ReservationGauges(Protocol):
    def set_open_reservations(self, sku: str, count: int, tokens: int | None = None) -> None: ...


class ReservationsReporter:
    def __init__(
        self, admission: OpenReservations, metrics: ReservationGauges, names: SkuNames
    ) -> None:
        self.admission, self.metrics, self.names = admission, metrics, names
        self._reported: set[str] = set()

    def report(self) -> None:
        """Sets every SKU's gauges; a SKU whose reservations all settled goes back to 0."""
        current = {
            sku_label(self.names, sku_id): held
            for sku_id, held in self.admission.open_reservations().items()
        }
        for sku in self._reported - current.keys():
            self.metrics.set_open_reservations(sku, 0, 0)
        for sku, (count, tokens) in current.items():
            self.metrics.set_open_reservations(sku, count, tokens)
        self._reported = set(current)

    async def run(self, every_s: float = REPORT_EVERY_S) -> None:
        while True:
            self.report()
            await asyncio.sleep(every_s)
