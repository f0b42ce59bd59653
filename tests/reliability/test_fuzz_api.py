"""Fuzz the HTTP API with schemathesis: every operation in /openapi.json, generated inputs (valid
and invalid), and every response checked — no 5xx, and status, content type and body conform to
the documented responses (capd/api.py declares a response shape for each endpoint)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from capd.api import create_app
from capd.settings import Settings
from tests.reliability.harness import FULL, fleet_tap, sized
from tests.taputil import local_client

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency (pip install -e '.[dev]')")

pytestmark = pytest.mark.reliability


# The operations, from the spec itself (building the app starts nothing; only its lifespan would).
SPEC = create_app(Settings(model="hash", taps=())).openapi()
OPERATIONS = [(method.upper(), path, mode) for path, methods in SPEC["paths"].items() for method, op in methods.items()
              for mode in ("positive", "negative") if mode == "positive" or "parameters" in op or "requestBody" in op]


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from schemathesis.python.asgi import shutdown_lifespans

    root = tmp_path_factory.mktemp("fuzz")
    # host: the name schemathesis's client addresses the app by (a daemon without a token answers
    # only to its own names, capd/origin.py)
    app = create_app(Settings(model="hash", taps=(fleet_tap(root),), data_dir=root / "data", max_active=3,
                              pinned=("fs-read",), host="testserver"), watch=False, warm_in_background=False)
    # schemathesis starts the app's lifespan once (the service warms up before the first request)
    # and keeps it for every generated case; shut it down here so the service closes.
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    shutdown_lifespans()


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS, ids=[f"{m} {p} {g}" for m, p, g in OPERATIONS])
def test_every_endpoint_conforms(api_schema: Any, method: str, path: str, mode: str) -> None:
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @given(case=strategy)
    @settings(max_examples=sized(25, 400), deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=not FULL, database=None)
    def run(case: Any) -> None:
        case.call_and_validate()

    run()


def test_the_schema_documents_every_response(tmp_path: Path) -> None:
    """Without declared response shapes the fuzzer checks nothing: make sure they stay declared."""
    app = create_app(Settings(model="hash", taps=(), data_dir=tmp_path), watch=False, warm_in_background=False)
    with local_client(app) as client:
        spec = client.get("/openapi.json").json()
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            responses = operation["responses"]
            ok = responses["200"]["content"]
            if path != "/metrics":
                assert "$ref" in ok["application/json"]["schema"], (method, path)
            assert responses["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")
            assert "422" not in responses, (method, path)  # capd's errors are {error, detail}, not FastAPI's
