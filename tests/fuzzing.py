"""schemathesis over this service's OpenAPI operations against a running server: every operation asked for, in the
positive and negative generation modes, with the checks that matter (no 5xx, the documented status codes and
content types, responses that match their schema). One loop for every fuzz test (tests/reliability)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def fuzz(url: str, labels: set[str] | None, headers: dict, examples: int,
         on_response: Callable | None = None) -> tuple[int, dict[str, set[int]], dict[tuple, str]]:
    """Run `examples` cases per operation and mode; `labels`: e.g. {"POST /v1/responses"} (None: every operation).
    `on_response(response)` may assert more per response. Returns (cases, statuses per operation, failures)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance, not_a_server_error, response_schema_conformance, status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if labels is None or op.label in labels]
    assert labels is None or {op.label for op in ops} == labels, [op.label for op in ops]
    failures: dict[tuple, str] = {}
    statuses: dict[str, set[int]] = {}
    n_cases = 0
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal n_cases
                n_cases += 1
                response = case.call(base_url=url, headers=headers, timeout=60)
                statuses.setdefault(op.label, set()).add(response.status_code)
                try:
                    case.validate_response(response, checks=checks)
                    if on_response is not None:
                        on_response(response)
                except BaseException as e:  # noqa: BLE001 - collected, reported together by the caller
                    failures.setdefault((op.label, mode.value), str(e)[:1500])

            try:
                run()
            except Exception as e:  # an operation with nothing to generate in this mode
                if type(e).__name__ != "Unsatisfiable":
                    raise
    return n_cases, statuses, failures


def report(failures: dict) -> str:
    return "\n\n".join(f"{k}: {v}" for k, v in failures.items())
