"""The admin API (/admin/v1): tenants, API keys, SKUs, price plans."""
