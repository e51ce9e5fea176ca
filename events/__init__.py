"""Event types, JetStream streams and Postgres projections: the log is the source of truth."""
