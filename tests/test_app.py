"""The app skeleton: health check, the one error shape, no import-time state."""

from __future__ import annotations

import sys

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app.config import Settings
from app.errors import HardwareNotFound
from app.main import create_app
from app.migrate import database_revisions, script_heads, upgrade


def _assert_problem(body: dict, code: str) -> None:  # type: ignore[type-arg]
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["detail"], dict)


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert isinstance(body["version"], str) and body["version"]
    assert "predictor_version" in body


def test_state_is_set(client: TestClient) -> None:
    state = client.app.state  # type: ignore[attr-defined]
    assert isinstance(state.settings, Settings)
    assert state.sessionmaker is not None


def test_unknown_route_is_json_404(client: TestClient) -> None:
    response = client.get("/no/such/route")
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("application/json")
    _assert_problem(response.json(), "not_found")


def test_wrong_method_is_json_405(client: TestClient) -> None:
    response = client.delete("/healthz")
    assert response.status_code == 405
    _assert_problem(response.json(), "method_not_allowed")


class _Payload(BaseModel):
    n: int


def _add_test_routes(app: FastAPI) -> None:
    @app.post("/_test/echo")
    def echo(payload: _Payload) -> dict[str, int]:
        return {"n": payload.n}

    @app.get("/_test/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    @app.get("/_test/domain")
    def domain() -> None:
        raise HardwareNotFound("no hardware 'h999'", detail={"hardware_id": "h999"})


def test_validation_error_shape(app: FastAPI) -> None:
    _add_test_routes(app)
    with TestClient(app) as client:
        response = client.post("/_test/echo", json={"n": "not a number"})
    assert response.status_code == 422
    body = response.json()
    _assert_problem(body, "validation_error")
    errors = body["error"]["detail"]["errors"]
    assert errors and errors[0]["loc"] == ["body", "n"]
    assert "input" not in errors[0]


def test_invalid_json_is_422(app: FastAPI) -> None:
    _add_test_routes(app)
    with TestClient(app) as client:
        response = client.post(
            "/_test/echo", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert response.status_code == 422
    _assert_problem(response.json(), "validation_error")


def test_domain_error_renders_its_status_and_code(app: FastAPI) -> None:
    _add_test_routes(app)
    with TestClient(app) as client:
        response = client.get("/_test/domain")
    assert response.status_code == 404
    body = response.json()
    _assert_problem(body, "hardware_not_found")
    assert body["error"]["detail"] == {"hardware_id": "h999"}


def test_unexpected_error_is_500_without_traceback(app: FastAPI) -> None:
    _add_test_routes(app)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/_test/boom")
    assert response.status_code == 500
    _assert_problem(response.json(), "internal_error")
    assert "secret internal detail" not in response.text
    assert "Traceback" not in response.text


def test_payload_too_large(settings: Settings) -> None:
    upgrade(settings.database_url)
    app = create_app(settings.model_copy(update={"max_upload_bytes": 100}))
    _add_test_routes(app)
    with TestClient(app) as client:
        json_type = {"content-type": "application/json"}
        declared = client.post("/_test/echo", content=b"x" * 1000, headers=json_type)

        def chunks():  # type: ignore[no-untyped-def]  # no Content-Length: counted while streaming
            for _ in range(10):
                yield b" " * 50

        streamed = client.post("/_test/echo", content=chunks(), headers=json_type)
        small = client.post("/_test/echo", json={"n": 1})
    assert declared.status_code == 413
    _assert_problem(declared.json(), "payload_too_large")
    assert streamed.status_code == 413
    _assert_problem(streamed.json(), "payload_too_large")
    assert small.status_code == 200


def test_create_app_twice(settings: Settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    other = settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'other.db'}"})
    upgrade(settings.database_url)
    upgrade(other.database_url)
    first, second = create_app(settings), create_app(other)
    assert first is not second
    with TestClient(first) as c1, TestClient(second) as c2:
        assert c1.get("/healthz").status_code == 200
        assert c2.get("/healthz").status_code == 200
        assert c1.app.state.engine is not c2.app.state.engine  # type: ignore[attr-defined]


def test_run_migrations_at_startup(settings: Settings, empty_database_url: str) -> None:
    """``run_migrations=True`` migrates an empty database (of the suite's backend) to head at startup."""
    assert database_revisions(empty_database_url) == frozenset()
    app = create_app(settings.model_copy(update={"database_url": empty_database_url}), run_migrations=True)
    with TestClient(app) as client:
        assert client.get("/readyz").json()["database"] == "ok"
    assert database_revisions(empty_database_url) == script_heads()


def test_api_does_not_import_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Serving never imports torch (DESIGN.md): starting the app and answering a request must not."""
    import os
    import subprocess

    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from app.main import create_app\n"
        "with TestClient(create_app(run_migrations=True)) as c:\n"
        "    assert c.get('/healthz').status_code == 200\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "LAYERCAST_DATABASE_URL": f"sqlite:///{tmp_path / 'notorch.db'}"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_startup_objects_are_frozen_out_of_the_collector_while_serving(settings: Settings) -> None:
    """What start-up built sits in the collector's permanent generation while the app serves (a full
    collection then scans only what requests built: no 80-100 ms pause in a request), and is unfrozen when
    the app stops."""
    import gc

    upgrade(settings.database_url)
    gc.unfreeze()
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # modules, the ORM, onnx, the predictor
    assert gc.get_freeze_count() == 0


def test_the_collector_runs_at_the_configured_thresholds_while_serving_and_at_pythons_after(
        settings: Settings) -> None:
    """``LAYERCAST_GC_THRESHOLDS`` holds while the app serves (the default's first generation is 20,000, not
    Python's 700) and the process's own thresholds come back when it stops; empty leaves Python's alone."""
    import gc

    upgrade(settings.database_url)
    before = gc.get_threshold()
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        assert gc.get_threshold() == (20_000, 10, 10)
    assert gc.get_threshold() == before
    with TestClient(create_app(settings.model_copy(update={"gc_thresholds": "9000,5,5"}))):
        assert gc.get_threshold() == (9000, 5, 5)
    with TestClient(create_app(settings.model_copy(update={"gc_thresholds": ""}))):
        assert gc.get_threshold() == before
    assert gc.get_threshold() == before


@pytest.mark.parametrize("value", ["50000,20", "0,10,10", "a,b,c", "1,2,3,4", "-5,1,1", "20000,0,0",
                                   "99999999999,1,1", "\u00b2,1,1", "\u0661\u0660,1,1"])
def test_malformed_gc_thresholds_are_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="LAYERCAST_GC_THRESHOLDS"):
        Settings(gc_thresholds=value)


def test_unknown_query_parameter_is_refused_on_api_routes(client: TestClient) -> None:
    """A misspelt query name (``batchsize`` for ``batch_size``) is a 422 naming it, not silently the default."""
    graph = client.post("/v1/graphs", json={"input_shape": [8], "layers": [{"op": "linear", "out_features": 4}]})
    assert graph.status_code == 201
    layers = f"/v1/graphs/{graph.json()['id']}/layers"
    assert client.get(layers, params={"batch_size": 3}).json()["batch_size"] == 3
    for path, params in [(layers, {"batchsize": 3}), ("/v1/graphs", {"limt": 5}),
                         ("/v1/hardware", {"vendor": "NVIDIA"}), ("/v1/measurements", {"hardware": "p100"})]:
        response = client.get(path, params=params)
        assert response.status_code == 422, (path, response.text)
        _assert_problem(response.json(), "invalid_request")
        assert response.json()["error"]["detail"]["unknown"] == list(params)
    posted = client.post("/v1/graphs", params={"batchsize": 2},
                         json={"input_shape": [8], "layers": [{"op": "relu"}]})
    assert posted.status_code == 422 and posted.json()["error"]["detail"]["unknown"] == ["batchsize"]
    assert client.get("/healthz", params={"probe": 1}).status_code == 200


def test_a_repeated_query_parameter_is_refused_on_api_routes(client: TestClient) -> None:
    """``?batch_size=4&batch_size=64`` silently answered for the last value."""
    graph = client.post("/v1/graphs", json={"input_shape": [8], "layers": [{"op": "linear", "out_features": 4}]})
    layers = f"/v1/graphs/{graph.json()['id']}/layers"
    response = client.get(f"{layers}?batch_size=4&batch_size=64")
    assert response.status_code == 422, response.text
    _assert_problem(response.json(), "invalid_request")
    assert response.json()["error"]["detail"] == {"repeated": ["batch_size"]}
    assert client.get(f"{layers}?batch_size=4&dims=").status_code == 200


def test_a_json_body_sent_under_another_content_type_names_the_content_type(client: TestClient) -> None:
    """``curl -d '{...}'`` without ``-H 'content-type: application/json'`` sends form encoding: the body was
    answered "body: Input should be a valid dictionary", as if the JSON were wrong. It is a 422
    ``invalid_request`` naming the content type, as ``POST /v1/graphs`` answers one it does not take."""
    body = b'{"graph": {"input_shape": [4], "layers": [{"op": "relu"}]}, "hardware_id": "t4", "batch_size": 2}'
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "text/plain; charset=utf-8"):
        response = client.post("/v1/predictions", content=body, headers={"content-type": ctype})
        assert response.status_code == 422, response.text
        _assert_problem(response.json(), "invalid_request")
        assert "application/json" in response.json()["error"]["message"]
        assert response.json()["error"]["detail"]["content_type"] == ctype.split(";")[0]
    for headers in ({"content-type": "application/json"}, {"content-type": "application/json; charset=utf-8"}):
        assert client.post("/v1/predictions", content=body, headers=headers).status_code == 200
    wrong = client.post("/v1/predictions", content=b"[1]", headers={"content-type": "application/json"})
    _assert_problem(wrong.json(), "validation_error")  # JSON that is not an object stays a validation error


def test_head_is_served_wherever_get_is(client: TestClient) -> None:
    """Every 405 lists HEAD in ``Allow`` beside GET (RFC 9110: a server supporting GET supports HEAD), yet
    HEAD itself answered 405 everywhere, ``/healthz`` included (uptime checkers probe with HEAD). It is GET's
    status and headers without the body now."""
    for path, status in (("/healthz", 200), ("/v1/hardware", 200), ("/v1/graphs/nope", 404)):
        got, head = client.get(path), client.head(path)
        assert head.status_code == got.status_code == status, (path, head.text)
        assert head.content == b""
        assert head.headers["content-length"] == got.headers["content-length"]
        assert head.headers["content-type"] == got.headers["content-type"]
    post_only = client.head("/v1/predictions")
    assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"
