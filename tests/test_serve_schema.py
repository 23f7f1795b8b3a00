"""Property-based: schemathesis reads the OpenAPI schema the server publishes and drives every endpoint
with generated requests, ones the schema allows and ones it does not. Every response has a status the
schema documents, in the shape it documents (errors in OpenAI's), a request outside the schema is
refused with a 4xx, no request is a fault, and after each the server is alive with every row free. A
short run in the default tier, a longer one in the slow tier; skipped without schemathesis (the `test`
extra)."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")

import httpx2 as httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from test_serve_api import wait_for  # noqa: E402
from test_serve_limits import export, free, start  # noqa: E402, F401  (export: the fixture)

CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def served(export):  # noqa: F811
    engine, background = start(export)
    with background as url:
        yield engine, background.server.config.app, url.removesuffix("/v1")


def drive(served, examples: int, derandomize: bool = False) -> Counter:
    """`examples` generated requests; `derandomize`: the same ones every run (a short run that must reach
    every endpoint cannot leave that to chance)."""
    engine, app, base = served
    schema = schemathesis.openapi.from_dict(app.openapi())
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    seen = Counter()

    @given(case=cases)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
    )
    def one(case):
        response = case.call(base_url=base, timeout=60)
        case.validate_response(response, checks=CHECKS)
        assert response.status_code < 500, response.text  # a documented 500 is still a fault
        wait_for(lambda: free(engine))
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        seen[case.method, case.path, response.status_code] += 1

    one()
    return seen


def test_generated_requests_get_documented_answers_and_leave_the_server_whole(served):
    seen = drive(served, 20, derandomize=True)
    assert {path for _, path, _ in seen} == {"/health", "/v1/models", "/v1/completions", "/v1/chat/completions"}


@pytest.mark.slow  # hundreds of requests, many of them decoding
def test_generated_requests_get_documented_answers_at_length(served):
    seen = drive(served, 600)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert seen["POST", path, 200] and seen["POST", path, 400], seen
