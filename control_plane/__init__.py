"""tokenmill control plane: admin API, OpenAI-compatible data plane, CLI."""
