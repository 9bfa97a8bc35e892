"""schemathesis over the whole OpenAPI document (issue 11 item 7): every operation, a bounded number of
generated requests each (valid ones and invalid ones), none may answer 5xx, answer a status its
operation does not document, or send a body that breaks its own response schema.

Three configurations: the suite's widened scopes (conftest: every non-admin scope open, most requests reach
the routes' own code), the shipped defaults (``read,graphs`` open: writes answer 401, which must be
documented), and the shipped defaults with the bootstrap admin key sent on every request (admin routes
get past 401: retrain, promote, rollback and other owners' rows). The last two run fewer examples.

The operations are driven one by one through hypothesis here rather than by schemathesis' pytest plugin
(``schema.parametrize``), whose lazy sub-tests do not run under pytest 9; one test names every failing
operation at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.config import REPO_ROOT, Settings
from app.main import create_app
from app.migrate import upgrade

#: Generated requests per operation and mode, per configuration (about 30 operations x 2 modes).
EXAMPLES = {"widened": 15, "shipped": 4, "admin": 4}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ADMIN_KEY = "schemathesis-admin-key-0123456789abcdef"
#: Settings per configuration (``rate_limit`` off everywhere: 429s would hide the routes behind them).
CONFIGS: dict[str, dict[str, Any]] = {
    "widened": {"rate_limit": ""},
    "shipped": {"rate_limit": "", "open_scopes": "read,graphs"},
    "admin": {"rate_limit": "", "open_scopes": "read,graphs", "admin_key": ADMIN_KEY},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def api_schema(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('schemathesis')) / 'st.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url, models_dir=REPO_ROOT / "models", **CONFIGS[request.param]))
    with TestClient(app):  # runs the lifespan: catalog seeded, predictor loaded, for every call below
        yield request.param, schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_operation_answers_5xx_or_breaks_its_schema(api_schema: Any, mode: schemathesis.GenerationMode) -> None:
    config, schema = api_schema
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if config == "admin" else None
    failures: dict[str, str] = {}
    nothing_to_negate: list[str] = []
    statuses: dict[str, set[int]] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES[config], deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        def run(case: schemathesis.Case) -> None:
            answer = case.call_and_validate(headers=headers, checks=CHECKS)
            statuses.setdefault(case.operation.label, set()).add(answer.status_code)

        try:
            run()
        except Unsatisfiable:  # negative mode, an operation with no constrained input (GET /healthz, a free id)
            assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
            nothing_to_negate.append(operation.label)
        except Exception as exc:  # noqa: BLE001 - collected, reported together below
            failures[operation.label] = str(exc)[:1500]
    assert failures == {}, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    assert len(operations) - len(nothing_to_negate) >= 15  # most operations were really exercised
    if mode is schemathesis.GenerationMode.POSITIVE:
        admin_ops = {label: codes for label, codes in statuses.items() if label.startswith("POST /v1/predictors/")}
        assert len(admin_ops) == 3, admin_ops  # retrain, promote, rollback
        if config == "shipped":  # the defaults really guard the admin routes and the measurement writes
            assert all(codes == {401} for codes in admin_ops.values()), admin_ops
            assert statuses["POST /v1/measurements"] == {401}
        if config == "admin":  # the admin key gets past authentication to the routes' own answers
            assert all(codes - {401} for codes in admin_ops.values()), admin_ops
