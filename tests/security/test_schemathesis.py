"""schemathesis over the whole OpenAPI document (issue 11 item 7): every operation, a bounded number of
generated requests each (valid ones and invalid ones), none may answer 5xx, answer a status its
operation does not document, or send a body that breaks its own response schema.

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

#: Generated requests per operation and mode (about 30 operations x 2 modes: ~900 requests in all).
EXAMPLES = 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Any:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('schemathesis')) / 'st.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url, models_dir=REPO_ROOT / "models"))
    with TestClient(app):  # runs the lifespan: catalog seeded, predictor loaded, for every call below
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_operation_answers_5xx_or_breaks_its_schema(api_schema: Any, mode: schemathesis.GenerationMode) -> None:
    failures: dict[str, str] = {}
    nothing_to_negate: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 20

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS)

        try:
            run()
        except Unsatisfiable:  # negative mode, an operation with no constrained input (GET /healthz, a free id)
            assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
            nothing_to_negate.append(operation.label)
        except Exception as exc:  # noqa: BLE001 - collected, reported together below
            failures[operation.label] = str(exc)[:1500]
    assert failures == {}, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    assert len(operations) - len(nothing_to_negate) >= 15  # most operations were really exercised
