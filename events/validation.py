"""The one check every event passes before it is appended: the log must hold only what every
reader can apply. A string with a NUL (Postgres text and jsonb refuse it) or a lone surrogate
(not encodable as UTF-8), an integer outside 64 bits (a bigint column, msgspec's int range) or
a non-finite float (JSON has none) would be accepted by the log and then fail its projection
on every replay, so it is refused here, naming the field."""

from __future__ import annotations

import math
from typing import Any

import msgspec

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class InvalidEvent(ValueError):
    """`field` is a dotted path into the event (`labels.team`, `runtime_config.a[2]`)."""

    def __init__(self, field: str, reason: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.reason = reason
        self.detail = detail


def validate_event(event: msgspec.Struct) -> None:
    """Raise InvalidEvent for the first field no reader could store."""
    for f in msgspec.structs.fields(event):
        _check(getattr(event, f.name), f.encode_name)


def _string_problem(value: str) -> str | None:
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


def _check(value: Any, path: str) -> None:
    if isinstance(value, str):
        problem = _string_problem(value)
        if problem:
            raise InvalidEvent(path, "invalid_string", f"{path} {problem}")
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise InvalidEvent(
                path, "out_of_range", f"{path} must be between {INT64_MIN} and {INT64_MAX}"
            )
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidEvent(path, "out_of_range", f"{path} must be a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            key_text = str(key)
            problem = _string_problem(key_text)
            if problem:
                raise InvalidEvent(path, "invalid_string", f"a key of {path} {problem}")
            _check(item, f"{path}.{key_text}")
    elif isinstance(value, list | tuple | set | frozenset):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]")
    elif isinstance(value, msgspec.Struct):
        for f in msgspec.structs.fields(value):
            _check(getattr(value, f.name), f"{path}.{f.encode_name}")
