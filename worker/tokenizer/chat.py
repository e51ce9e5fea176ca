"""Chat templates: the Jinja templates shipped with models (tokenizer_config.json,
chat_template.jinja, GGUF `tokenizer.chat_template`), rendered the way transformers does.

Tools: a template that knows them (Qwen3.5/3.6's, Hermes-style ones: it reads `tools`) gets
them as transformers passes them, `[{"type": "function", "function": {...}}]`, with assistant
`tool_calls` (arguments as objects) and role "tool" messages in the history. A template that
does not (SmolLM2's) gets the same conversation written out the way Qwen's template writes it:
the tools in the system message between `<tools>` tags with the `<tool_call>` instructions,
calls as `<tool_call>` spans in the assistant's text and tool results as user turns of
`<tool_response>` spans, so every model sees the format `worker.tokenizer.tool_calls` parses.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tool_call_text(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def _arguments(value: Any) -> Any:
    """OpenAI carries arguments as JSON text; templates index them as objects."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    out["tool_calls"] = [
        {
            "id": c.get("id"),
            "type": "function",
            "function": {
                "name": (c.get("function") or c)["name"],
                "arguments": _arguments((c.get("function") or c).get("arguments", {})),
            },
        }
        for c in calls
    ]
    return out


def inline_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as text (Qwen's layout), for a
    template that only knows system/user/assistant messages with string content."""
    out: list[dict[str, Any]] = []
    if tools:
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        block = TOOLS_PREAMBLE + lines + TOOLS_INSTRUCTIONS
        if messages and messages[0].get("role") == "system":
            first, messages = messages[0], messages[1:]
            block = f"{first.get('content') or ''}\n\n{block}"
        out.append({"role": "system", "content": block})
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            spans = [
                tool_call_text(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join(([content] if content else []) + spans)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_turn": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_turn", None)
    return out


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        # Whether the template renders tools itself (it reads the `tools` variable).
        self.knows_tools = re.search(r"\btools\b", source) is not None
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        messages = [_normalize(m) for m in messages]
        uses_tools = tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and not self.knows_tools:
            messages, tools = inline_tools(messages, tools), None
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )
