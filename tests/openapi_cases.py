"""An API against its own OpenAPI document (schemathesis), shared by the admin API's and /v1's
suites: the generated cases of each operation, valid and invalid, and what failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

# What an API promises: no 5xx, and only what its document says (status, content type, body).
# The stateful and data-acceptance checks are left out: a generated write is often a
# legitimate 4xx (unknown tenant, stale If-Match), which those would count as failures.
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
]


def operations(base_url: str, auth: dict[str, str], path_regex: str) -> list[Any]:
    """The operations of the document served at `base_url` whose paths match `path_regex`."""
    config = schemathesis.Config.from_dict({"seed": 20261201, "headers": auth})
    schema = schemathesis.openapi.from_url(base_url + "/schema/openapi.json", config=config)
    return [result.ok() for result in schema.include(path_regex=path_regex).get_all_operations()]


def _cases(
    operation: Any,
    mode: GenerationMode,
    max_examples: int,
    auth: dict[str, str],
    prepare: Callable[[Any], None] | None,
) -> Any:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=max_examples,
        derandomize=True,  # the same cases on every run
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # report the case as found
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        if prepare is not None:
            prepare(case)
        case.call_and_validate(headers=auth, checks=CHECKS, timeout=30)

    return run


def failures(
    operations: list[Any],
    modes: list[GenerationMode],
    max_examples: int,
    auth: dict[str, str],
    prepare_valid: Callable[[Any], None] | None = None,
) -> list[str]:
    """Run each operation's generated cases in each mode (`prepare_valid` edits a valid case
    before it is sent); the failures, one text per operation and mode."""
    found = []
    for operation in operations:
        for mode in modes:
            prepare = prepare_valid if mode == GenerationMode.POSITIVE else None
            run = _cases(operation, mode, max_examples, auth, prepare)
            try:
                run()
            except Unsatisfiable:
                # No invalid request exists (no body, only free-form path parameters).
                assert mode == GenerationMode.NEGATIVE, operation.label
            except (Exception, BaseExceptionGroup) as e:  # schemathesis groups its failures
                found.append(f"{operation.label} ({mode}): {e}")
    return found


def assert_conforms(failed: list[str]) -> None:
    """No operation failed; else every failure, one text per operation."""
    assert not failed, "\n\n".join(failed)
