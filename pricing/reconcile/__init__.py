"""Reconciliation: does what was billed equal what was served?

- `metering`: the three records of each request (worker generated, gateway delivered, ledger
  billed) compared request by request; `tokenmill reconcile`.
- `billing`: the ledger against the invoices, and each finalized invoice rebuilt; embeds the
  metering report. The scheduler's reconcile job runs both (`pricing.jobs`).
"""

from pricing.reconcile.billing import (
    BillingCheck,
    RebuildCheck,
    ReconciliationReport,
    check_billing,
    check_rebuild,
)
from pricing.reconcile.metering import GatewayLost, Mismatch, Report, main, reconcile

__all__ = [
    "BillingCheck",
    "GatewayLost",
    "Mismatch",
    "RebuildCheck",
    "ReconciliationReport",
    "Report",
    "check_billing",
    "check_rebuild",
    "main",
    "reconcile",
]
