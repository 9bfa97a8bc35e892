"""Access control (issue 11 item 3): API keys with scopes, owners, the shipped defaults, rate limits, the
host allow-list, cross-site writes, CORS and ``Allow`` on 405.

The suite's conftest opens every non-admin scope to requests without a key; the apps here are built
with the shipped defaults passed explicitly (``open_scopes="read,graphs"``), so these tests see what a
fresh install does.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from app.auth import POLICY, Scope, active_key_count, required_scope, revoke_key, sends_key
from app.cli import main as cli_main
from app.config import REPO_ROOT, Settings
from app.db import make_engine, make_sessionmaker
from app.main import create_app, module_routes
from app.migrate import upgrade
from tests.security.test_hostile_inputs import HARDWARE, MEASUREMENT, batch, json_graph, prediction

GPU: dict[str, Any] = {**HARDWARE, "boost_clock_mhz": 1500, "l2_cache_bytes": 4 * 2**20}
SHIPPED_DEFAULTS: dict[str, Any] = {"open_scopes": "read,graphs", "rate_limit": "100/second"}


def _make_key(url: str, name: str, *scopes: str, capsys: pytest.CaptureFixture[str]) -> str:
    """A key made through the CLI, as an operator would."""
    argv = ["keys", "--database-url", url, "create", name]
    for scope in scopes:
        argv += ["--scope", scope]
    assert cli_main(argv) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def db_url(settings: Settings) -> str:
    """This test's migrated database (SQLite, or PostgreSQL under ``LAYERCAST_TEST_BACKEND=postgresql``)."""
    upgrade(settings.database_url)
    return settings.database_url


def _client(db_url: str, **overrides: Any) -> TestClient:
    settings = Settings(database_url=db_url, models_dir=REPO_ROOT / "models", allowed_hosts="testserver",
                        **{**SHIPPED_DEFAULTS, **overrides})
    return TestClient(create_app(settings))


@pytest.fixture
def keys(db_url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    return {
        "measure": _make_key(db_url, "profiler", "measurements", capsys=capsys),
        "hw_a": _make_key(db_url, "team-a", "hardware", "graphs", capsys=capsys),
        "hw_b": _make_key(db_url, "team-b", "hardware", "graphs", capsys=capsys),
        "reader": _make_key(db_url, "dashboard", "read", capsys=capsys),
        "admin": _make_key(db_url, "ops", "admin", capsys=capsys),
    }


@pytest.fixture
def client(db_url: str, keys: dict[str, str]) -> Iterator[TestClient]:
    with _client(db_url) as c:
        yield c


def test_defaults_keep_reads_and_uploads_open_and_close_everything_else(client: TestClient) -> None:
    """Out of the box: the README's upload-and-predict works without a key; measurements, hardware and
    admin actions answer 401 ``auth_required`` naming the scope, with ``WWW-Authenticate``."""
    assert client.post("/v1/graphs", json=json_graph(name="open")).status_code == 201
    assert client.post("/v1/predictions", json=prediction()).status_code == 200
    assert client.get("/v1/hardware").status_code == 200
    refused = [
        ("POST", "/v1/measurements", batch(MEASUREMENT), "measurements"),
        ("POST", "/v1/hardware", GPU, "hardware"),
        ("POST", "/v1/predictors/retrain", None, "admin"),
        ("POST", "/v1/predictors/layer-time-mlp-3/promote", None, "admin"),
    ]
    for method, path, body, scope in refused:
        r = client.request(method, path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "auth_required" and r.json()["error"]["detail"]["scope"] == scope
        assert r.headers["www-authenticate"] == "Bearer"


def test_admin_can_never_be_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="admin"):
        Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", open_scopes="read,admin")


def test_scoped_keys(client: TestClient, keys: dict[str, str], db_url: str) -> None:
    r = client.post("/v1/measurements", json=batch(MEASUREMENT), headers=_bearer(keys["measure"]))
    assert r.status_code == 201, r.text
    key_id = keys["measure"].split("_")[1]
    stored = client.get("/v1/measurements", params={"source": "scheduler"}).json()["items"]
    assert [m["submitter"] for m in stored] == [key_id]  # measurements carry their submitter
    # X-API-Key works as well as a bearer token
    r = client.post("/v1/measurements", json=batch(MEASUREMENT), headers={"X-API-Key": keys["measure"]})
    assert r.status_code == 201
    # a key without the scope: 403, not 401
    r = client.post("/v1/hardware", json=GPU, headers=_bearer(keys["measure"]))
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = client.post("/v1/measurements", json=batch(MEASUREMENT), headers=_bearer(keys["reader"]))
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    # a key never allows less than no key: the profiler's key still reads and predicts
    assert client.get("/v1/hardware", headers=_bearer(keys["measure"])).status_code == 200
    assert client.post("/v1/predictions", json=prediction(), headers=_bearer(keys["measure"])).status_code == 200
    # admin implies every scope
    assert client.post("/v1/measurements", json=batch(MEASUREMENT), headers=_bearer(keys["admin"])).status_code == 201


def test_job_actuals_carry_their_submitter(client: TestClient, keys: dict[str, str]) -> None:
    """A scheduler's actuals are measurements like any other: the key that reported them is recorded (the
    README's "Owners"), so an operator can tell whose reports calibrate the estimates."""
    graph_id = client.post("/v1/graphs", json=json_graph(name="sched")).json()["id"]
    job = {"graph_id": graph_id, "hardware_id": "a100-sxm4-40gb", "batch_size": 8, "dataset_size": 800,
           "epochs": 1}
    predicted_s = client.post("/v1/job-estimates", json={"jobs": [job]}).json()["estimates"][0]["p50_s"]
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [{**job, "measured_s": 1.2 * predicted_s}]},
                    headers=_bearer(keys["measure"]))
    assert r.status_code == 201 and r.json()["recorded"] == 1, r.text
    stored = client.get("/v1/measurements", params={"source": "scheduler", "granularity": "job"}).json()["items"]
    assert [m["submitter"] for m in stored] == [keys["measure"].split("_")[1]]


@pytest.mark.parametrize("bad", ["wrong", "lck_0000000000000000_nope", "lck_zz_x", "", "lck__", "lck_" + "f" * 500])
def test_unknown_or_malformed_keys_are_401(client: TestClient, keys: dict[str, str], bad: str) -> None:
    real = keys["measure"]
    for key in (bad, real[:-1] + ("A" if real[-1] != "A" else "B")):  # also: right id, wrong secret
        r = client.post("/v1/measurements", json=batch(MEASUREMENT), headers={"X-API-Key": key} if key else {})
        assert r.status_code == 401, (key, r.text)
        assert r.json()["error"]["code"] == ("auth_required" if not key else "api_key_invalid")


def test_keys_are_stored_hashed_and_revocation_is_immediate(
    client: TestClient, keys: dict[str, str], db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, key_sha256, name, scopes FROM api_keys")).all()
    engine.dispose()
    stored = " ".join(str(v) for row in rows for v in row)
    for key in keys.values():
        assert key not in stored and key.split("_", 2)[2] not in stored
        assert hashlib.sha256(key.encode()).hexdigest() in stored
    key_id = keys["measure"].split("_")[1]
    assert cli_main(["keys", "--database-url", db_url, "revoke", key_id]) == 0
    r = client.post("/v1/measurements", json=batch(MEASUREMENT), headers=_bearer(keys["measure"]))
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_invalid"
    assert cli_main(["keys", "--database-url", db_url, "list"]) == 0
    listed = capsys.readouterr().out
    assert key_id in listed and keys["measure"] not in listed
    assert cli_main(["keys", "--database-url", db_url, "revoke", "0" * 16]) == 2


def test_custom_hardware_belongs_to_its_key(client: TestClient, keys: dict[str, str]) -> None:
    a, b, admin = _bearer(keys["hw_a"]), _bearer(keys["hw_b"]), _bearer(keys["admin"])
    created = client.post("/v1/hardware", json=GPU, headers=a)
    assert created.status_code == 201 and created.json()["owner"] == keys["hw_a"].split("_")[1]
    # catalog ids and another key's id cannot be squatted
    for body in ({**GPU, "id": "a100-sxm4-40gb"}, {**GPU, "id": "local"}, GPU):
        r = client.post("/v1/hardware", json=body, headers=b)
        assert r.status_code == 409 and r.json()["error"]["code"] == "hardware_exists"
    changed = {**GPU, "name": "My GPU rev 2"}
    r = client.put("/v1/hardware/my-gpu", json=changed, headers=b)
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_owner"
    assert client.delete("/v1/hardware/my-gpu", headers=b).status_code == 403
    r = client.put("/v1/hardware/my-gpu", json=changed, headers=a)
    assert r.status_code == 200 and r.json()["name"] == "My GPU rev 2"
    assert client.get("/v1/hardware/my-gpu").json()["name"] == "My GPU rev 2"
    r = client.put("/v1/hardware/my-gpu", json={**changed, "id": "other"}, headers=a)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    for method in ("PUT", "DELETE"):
        r = client.request(method, "/v1/hardware/a100-sxm4-40gb", json=changed if method == "PUT" else None,
                           headers=admin)
        assert r.status_code in (403, 422), r.text
        if method == "DELETE":
            assert r.json()["error"]["code"] == "builtin_hardware"
    r = client.put("/v1/hardware/a100-sxm4-40gb", json={**changed, "id": "a100-sxm4-40gb"}, headers=admin)
    assert r.status_code == 403 and r.json()["error"]["code"] == "builtin_hardware"
    # measurements on it freeze the spec: what they mean must not change under them
    measured = {**MEASUREMENT, "hardware_id": "my-gpu"}
    assert client.post("/v1/measurements", json=batch(measured), headers=_bearer(keys["measure"])).status_code == 201
    r = client.delete("/v1/hardware/my-gpu", headers=admin)
    assert r.status_code == 409 and r.json()["error"]["code"] == "hardware_in_use"
    assert client.get("/v1/hardware/my-gpu").status_code == 200


def test_admin_deletes_any_custom_hardware(client: TestClient, keys: dict[str, str]) -> None:
    assert client.post("/v1/hardware", json=GPU, headers=_bearer(keys["hw_a"])).status_code == 201
    assert client.delete("/v1/hardware/my-gpu", headers=_bearer(keys["admin"])).status_code == 204
    assert client.get("/v1/hardware/my-gpu").status_code == 404


def test_graphs_belong_to_their_first_uploader(client: TestClient, keys: dict[str, str]) -> None:
    a, b = _bearer(keys["hw_a"]), _bearer(keys["hw_b"])
    gid = client.post("/v1/graphs", json=json_graph(name="mine"), headers=a).json()["id"]
    again = client.post("/v1/graphs", json=json_graph(name="mine"), headers=b)  # same content: not re-owned
    assert again.status_code == 200 and again.json()["owner"] == keys["hw_a"].split("_")[1]
    r = client.delete(f"/v1/graphs/{gid}", headers=b)
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_owner"
    assert client.delete(f"/v1/graphs/{gid}").status_code == 403  # anonymous cannot either
    assert client.delete(f"/v1/graphs/{gid}", headers=a).status_code == 204
    # an anonymous upload has no owner: only an admin may delete it (anyone could, otherwise)
    anon = client.post("/v1/graphs", json=json_graph(name="shared")).json()
    assert anon["owner"] is None
    for who in ({}, a):
        r = client.delete(f"/v1/graphs/{anon['id']}", headers=who)
        assert r.status_code == 403 and r.json()["error"]["code"] == "not_owner", r.text
    assert client.delete(f"/v1/graphs/{anon['id']}", headers=_bearer(keys["admin"])).status_code == 204


def test_open_scopes_default_to_read_only_on_a_non_loopback_bind(db_url: str) -> None:
    base = {"database_url": db_url, "models_dir": REPO_ROOT / "models", "rate_limit": "", "open_scopes": None}
    assert Settings(**base, host="127.0.0.1").open_scope_set == {Scope.READ, Scope.GRAPHS}
    assert Settings(**base, host="::1").open_scope_set == {Scope.READ, Scope.GRAPHS}
    exposed = Settings(**base, host="0.0.0.0")  # the Dockerfile's bind
    assert exposed.open_scope_set == {Scope.READ}
    widened = Settings(**{**base, "open_scopes": "read,graphs"}, host="0.0.0.0")
    assert widened.open_scope_set == {Scope.READ, Scope.GRAPHS}
    with TestClient(create_app(exposed.model_copy(update={"allowed_hosts": "testserver"}))) as client:
        r = client.post("/v1/graphs", json=json_graph(name="anon"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "auth_required"
        assert client.post("/v1/predictions", json=prediction()).status_code == 200


def test_every_writing_route_is_in_the_policy() -> None:
    """A new writing route must be placed in :data:`app.auth.POLICY` on purpose (unlisted ones need
    admin, which is safe but probably not meant); and the policy names no route that does not exist."""
    writes = {(m, r.path) for r in module_routes() for m in r.methods or () if m not in ("GET", "HEAD", "OPTIONS")}
    assert writes == set(POLICY)
    assert required_scope("PATCH", "/v1/anything-new") is Scope.ADMIN
    assert required_scope("GET", "/v1/anything") is Scope.READ


def test_openapi_documents_the_auth_errors(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for status in ("401", "403", "429", "503"):
        assert status in paths["/v1/measurements"]["post"]["responses"]
    assert "401" not in paths["/healthz"]["get"]["responses"]


def test_rate_limit_per_key_and_per_address(db_url: str, keys: dict[str, str]) -> None:
    with _client(db_url, rate_limit="3/minute") as c:
        codes = [c.get("/v1/hardware").status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = c.get("/v1/hardware")
        assert r.json()["error"]["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 1
        # a key has its own budget, apart from its address's anonymous one
        assert c.get("/v1/hardware", headers=_bearer(keys["reader"])).status_code == 200
        assert c.get("/healthz").status_code == 200  # probes are never limited


def test_invalid_keys_are_rate_limited_before_they_are_checked(db_url: str) -> None:
    with _client(db_url, rate_limit="3/minute") as c:
        codes = [c.get("/v1/hardware", headers=_bearer(f"lck_{i:016x}_guess")).status_code for i in range(5)]
        assert codes == [401, 401, 401, 429, 429]
        assert c.get("/v1/hardware").status_code == 200  # the anonymous budget of the address is apart


def test_hosts_outside_the_allow_list_are_refused(db_url: str) -> None:
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends its own Host."""
    settings = Settings(database_url=db_url, models_dir=REPO_ROOT / "models", allowed_hosts=None, host="127.0.0.1")
    assert settings.host_allow_list() == ["localhost", "127.0.0.1", "::1", "[::1]"]
    assert Settings(database_url=db_url, allowed_hosts=None, host="0.0.0.0").host_allow_list() == ["*"]
    with TestClient(create_app(settings), base_url="http://localhost:8000") as c:
        assert c.get("/v1/hardware").status_code == 200
        assert c.get("/v1/hardware", headers={"Host": "127.0.0.1:8000"}).status_code == 200
        r = c.get("/v1/hardware", headers={"Host": "evil.example:8000"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"


def _onnx_form() -> dict[str, Any]:
    from tests.helpers import light_model

    return {"files": {"file": ("m.onnx", light_model("squeezenet"), "application/octet-stream")}}


def test_cross_site_simple_posts_are_refused(client: TestClient, keys: dict[str, str]) -> None:
    """A page on another site can make a browser send a multipart or form POST without a CORS
    preflight; it can never add a key header."""
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site"}, {"Origin": "http://testserver:9999"}):  # fmt: skip
        r = client.post("/v1/graphs", headers=headers, **_onnx_form())
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", headers
        r = client.post("/ui/graphs", headers=headers, **_onnx_form())
        assert r.status_code == 403, headers
    # the page itself (same origin) and non-browser clients (no Origin) pass
    assert client.post("/v1/graphs", headers={"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"},
                       **_onnx_form()).status_code in (200, 201)
    assert client.post("/ui/graphs", headers={"Origin": "http://testserver"}, follow_redirects=False,
                       **_onnx_form()).status_code == 303
    # a request carrying a key is not a forged one
    r = client.post("/v1/graphs", headers={"Origin": "http://evil.example", **_bearer(keys["hw_a"])}, **_onnx_form())
    assert r.status_code in (200, 201)


def test_an_empty_key_header_is_no_key_for_the_cross_site_check(client: TestClient) -> None:
    for empty in ({"X-API-Key": ""}, {"X-API-Key": "  "}, {"Authorization": "Bearer "}, {"Authorization": "Bearer  "}):
        assert sends_key([(k.lower().encode(), v.encode()) for k, v in empty.items()]) is False, empty
        r = client.post("/v1/graphs", headers={"Origin": "http://evil.example", **empty}, **_onnx_form())
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", empty
    assert sends_key([(b"x-api-key", b"lck_x")]) and sends_key([(b"authorization", b"Bearer lck_x")])


def test_cors_is_closed_by_default_and_opens_per_origin(db_url: str, client: TestClient) -> None:
    r = client.options("/v1/hardware", headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
    with _client(db_url, cors_origins="http://ui.example") as c:
        pre = c.options("/v1/measurements", headers={"Origin": "http://ui.example",
                                                     "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
        other = c.options("/v1/hardware", headers={"Origin": "http://evil.example",
                                                   "Access-Control-Request-Method": "GET"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        # the listed origin may write without the cross-site refusal (it still needs a key for it)
        r = c.post("/v1/graphs", json=json_graph(name="cors"), headers={"Origin": "http://ui.example"})
        assert r.status_code == 201


def test_405_names_every_method_of_the_path(client: TestClient) -> None:
    gid = client.post("/v1/graphs", json=json_graph(name="allow")).json()["id"]
    r = client.patch(f"/v1/graphs/{gid}")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}
    r = client.delete("/v1/hardware")
    assert set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}
    r = client.put("/v1/hardware/x")
    assert r.status_code != 405  # PUT exists there
    r = client.post("/v1/hardware/x")
    assert set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "PUT", "DELETE"}


@pytest.mark.parametrize(("open_scopes", "refused"), [
    ("read,graphs", "measurements, hardware changes and admin actions are refused"),
    ("read,graphs,measurements,hardware", "no API key exists: admin actions are refused"),
    ("read", "graph uploads, measurements, hardware changes and admin actions are refused"),
])  # fmt: skip
def test_the_first_start_says_what_the_open_scopes_really_refuse(
    db_url: str, open_scopes: str, refused: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="layercast"), _client(db_url, open_scopes=open_scopes):
        pass
    warnings = [r.getMessage() for r in caplog.records if "no API key exists" in r.getMessage()]
    assert len(warnings) == 1 and refused in warnings[0], warnings


def test_the_bootstrap_admin_key_is_long_and_compared_as_a_digest(db_url: str) -> None:
    with pytest.raises(ValueError, match="LAYERCAST_ADMIN_KEY must be at least 32 characters"):
        Settings(database_url=db_url, admin_key="short-admin-key")
    key = "b" * 32
    with _client(db_url, admin_key=key) as c:
        assert c.post("/v1/predictors/retrain", headers=_bearer(key)).status_code == 202
        for wrong in ("b" * 31, "b" * 33, "c" + key[1:]):  # near misses of every length
            r = c.post("/v1/predictors/retrain", headers=_bearer(wrong))
            assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_invalid", wrong


def test_active_key_count_counts_in_the_database(db_url: str, keys: dict[str, str]) -> None:
    engine = make_engine(db_url, pool_size=1)
    try:
        with make_sessionmaker(engine).begin() as session:
            assert active_key_count(session) == len(keys)
            revoke_key(session, key_id=keys["admin"].split("_")[1])
            assert active_key_count(session) == len(keys) - 1
    finally:
        engine.dispose()
