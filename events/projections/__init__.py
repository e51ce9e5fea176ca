"""Projections: durable JetStream consumers that keep the Postgres read models, each batch
committed together with its stream position. Rebuildable from the log at any time."""

from __future__ import annotations

from events.projections.read_models import ReadModelsProjection
from events.projections.runner import (
    Entry,
    Projection,
    ProjectionLocked,
    Projector,
    committed_positions,
    ensure_schema,
)
from events.projections.usage_ledger import UsageLedgerProjection


def all_projections() -> list[Projection]:
    # Billing's finalized invoices are a read model of the control stream too (imported here,
    # not at the top: pricing builds on this package).
    from pricing.store import InvoicesProjection

    return [ReadModelsProjection(), UsageLedgerProjection(), InvoicesProjection()]


__all__ = [
    "Entry",
    "Projection",
    "ProjectionLocked",
    "Projector",
    "ReadModelsProjection",
    "UsageLedgerProjection",
    "all_projections",
    "committed_positions",
    "ensure_schema",
]
