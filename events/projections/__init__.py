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
from tokenmill.modules import installed_modules

# Packages above this one that keep read models of their own, by module name: each defines
# `tokenmill_projections() -> list[Projection]` (billing's finalized invoices). Named, not
# imported, so that events imports nothing of the packages built on it, as the app's
# extensions are (control_plane.app.EXTENSION_MODULES).
PROJECTION_MODULES = ("pricing.store",)


def all_projections() -> list[Projection]:
    found: list[Projection] = [ReadModelsProjection(), UsageLedgerProjection()]
    for module in installed_modules(PROJECTION_MODULES):
        found.extend(module.tokenmill_projections())
    return found


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
