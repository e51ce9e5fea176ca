"""A request's way in: the OpenAI-compatible data plane (`dataplane/`: /v1, dispatch to workers,
the gateway that bills what it delivered), admission (`admission/`: API keys, the governance
view, quotas and limits), the admin API (`admin/`) and the operations view (`observability/`)."""
