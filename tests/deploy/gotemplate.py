"""A renderer for the subset of Helm's Go templates that deploy/helm/tokenmill uses, so the
chart renders in the test suite without the helm binary. Anything outside the subset is an
error (never rendered wrongly in silence), so a template that grows beyond it fails here
first:

    {{ .Values.a.b }} {{ .Release.Name }} {{ .Chart.Name }}  (a missing value is an error)
    {{ X | quote }}  {{ toYaml X | nindent N }}  {{ include "name" . | nindent N }}
    {{ required "message" X }}  {{ not X }}
    {{ if X }} ... {{ else }} ... {{ end }}   {{ define "name" }} ... {{ end }}
    {{- and -}} trim the whitespace before / after, as in Go.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.DOTALL)


class TemplateError(Exception):
    pass


@dataclass
class _If:
    cond: str
    then: list[Any] = field(default_factory=list)
    otherwise: list[Any] = field(default_factory=list)


def _tokens(source: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", s) pairs, with Go's {{- -}} whitespace trimming applied."""
    out: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(source):
        text = source[pos : m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        out.append(("text", text))
        action = m.group(2).strip()
        if not (action.startswith("/*") and action.endswith("*/")):
            out.append(("action", action))
        trim_next, pos = bool(m.group(3)), m.end()
    text = source[pos:]
    out.append(("text", text.lstrip() if trim_next else text))
    return out


class Chart:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.chart = yaml.safe_load((root / "Chart.yaml").read_text())
        self.defaults = yaml.safe_load((root / "values.yaml").read_text())
        self.defines: dict[str, list[Any]] = {}
        self.templates: dict[str, list[Any]] = {}
        for path in sorted((root / "templates").iterdir()):
            nodes = self._parse(_tokens(path.read_text()), path.name)
            if path.suffix in (".yaml", ".yml"):
                self.templates[path.name] = nodes

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self, tokens: list[tuple[str, str]], where: str) -> list[Any]:
        root: list[Any] = []
        stack: list[tuple[str, Any, list[Any]]] = [("root", None, root)]
        for kind, value in tokens:
            body = stack[-1][2]
            if kind == "text":
                if value:
                    body.append(value)
                continue
            word, _, rest = value.partition(" ")
            if word == "if":
                node = _If(rest.strip())
                body.append(node)
                stack.append(("if", node, node.then))
            elif word == "else":
                top, node, _ = stack.pop()
                if top != "if" or rest:
                    raise TemplateError(f"{where}: unsupported {{{{ {value} }}}}")
                stack.append(("else", node, node.otherwise))
            elif word == "define":
                name = json.loads(rest.strip())
                nodes: list[Any] = []
                self.defines[name] = nodes
                stack.append(("define", name, nodes))
            elif word == "end":
                if len(stack) == 1:
                    raise TemplateError(f"{where}: {{{{ end }}}} without a block")
                stack.pop()
            elif word in ("range", "with", "template", "block", "tpl") or ":=" in value:
                raise TemplateError(f"{where}: {{{{ {value} }}}} is outside the supported subset")
            else:
                body.append(("pipe", value))
        if len(stack) != 1:
            raise TemplateError(f"{where}: unclosed {stack[-1][0]}")
        return root

    # -- rendering -------------------------------------------------------------------------

    def render(self, values: dict[str, Any] | None = None, release: str = "tm") -> dict[str, str]:
        """Each template's output, with `values` merged over values.yaml (as `--set`)."""
        ctx = {
            "Values": _merge(self.defaults, values or {}),
            "Release": {"Name": release, "Namespace": "default", "Service": "Helm"},
            "Chart": {
                "Name": self.chart["name"],
                "Version": self.chart["version"],
                "AppVersion": self.chart["appVersion"],
            },
        }
        return {name: self._run(nodes, ctx) for name, nodes in self.templates.items()}

    def _run(self, nodes: list[Any], dot: Any) -> str:
        out: list[str] = []
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
            elif isinstance(node, _If):
                branch = node.then if _truthy(self._pipe(node.cond, dot)) else node.otherwise
                out.append(self._run(branch, dot))
            else:
                out.append(_show(self._pipe(node[1], dot)))
        return "".join(out)

    def _pipe(self, pipeline: str, dot: Any) -> Any:
        value: Any = _UNSET
        for stage in pipeline.split("|"):
            head, *rest = shlex.split(stage.strip(), posix=False)
            if _is_operand(head):
                if rest or value is not _UNSET:
                    raise TemplateError(f"{pipeline!r}: an operand takes no arguments")
                value = self._arg(head, dot)
                continue
            args = [self._arg(w, dot) for w in rest]
            if value is not _UNSET:
                args.append(value)  # a pipeline passes its value as the last argument
            value = self._call(head, args, dot)
        return value

    def _arg(self, word: str, dot: Any) -> Any:
        if word.startswith('"'):
            return json.loads(word)
        if re.fullmatch(r"-?\d+", word):
            return int(word)
        if word in ("true", "false"):
            return word == "true"
        if word == ".":
            return dot
        if word.startswith("."):
            value = dot
            for part in word[1:].split("."):
                if not isinstance(value, dict) or part not in value:
                    raise TemplateError(f"{word}: no such value")
                value = value[part]
            return value
        raise TemplateError(f"{word!r}: not a literal or a value")

    def _call(self, name: str, args: list[Any], dot: Any) -> Any:
        if name == "quote":
            (x,) = args
            return json.dumps(_show(x))
        if name == "toYaml":
            (x,) = args
            return yaml.safe_dump(x, default_flow_style=False, sort_keys=True).rstrip("\n")
        if name == "nindent":
            n, text = args
            return "\n" + "\n".join(" " * n + line if line else line for line in text.split("\n"))
        if name == "required":
            message, x = args
            if x in (None, ""):
                raise TemplateError(f"required: {message}")
            return x
        if name == "not":
            (x,) = args
            return not _truthy(x)
        if name == "include":
            template, arg = args
            if template not in self.defines:
                raise TemplateError(f"include {template!r}: not defined")
            return self._run(self.defines[template], arg)
        raise TemplateError(f"function {name!r} is outside the supported subset")


_UNSET = object()


def _is_operand(word: str) -> bool:
    return word.startswith((".", '"')) or re.fullmatch(r"-?\d+|true|false", word) is not None


def _truthy(x: Any) -> bool:
    return x not in (None, False, 0, "") and not (isinstance(x, dict | list) and not x)


def _show(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if x is None:
        raise TemplateError("a nil value rendered")
    if isinstance(x, dict | list):
        raise TemplateError("a map or list rendered without toYaml")
    return str(x)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
