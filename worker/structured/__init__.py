"""Structured output: grammar-constrained decoding (see `worker.structured.grammar`)."""

from worker.structured.grammar import (
    GrammarError,
    Grammars,
    GrammarSpec,
    GrammarState,
    apply_masks,
    response_format_grammar,
    tool_call_tag,
    tool_calls_grammar,
)

__all__ = [
    "GrammarError",
    "GrammarSpec",
    "GrammarState",
    "Grammars",
    "apply_masks",
    "response_format_grammar",
    "tool_call_tag",
    "tool_calls_grammar",
]
