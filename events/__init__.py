"""The log, the source of truth: event contracts, their validation, the JetStream store, the usage
publisher and the Postgres projections."""
