"""Price plans, invoices, chargeback/showback exports and capacity projections."""
