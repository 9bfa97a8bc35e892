"""What a new user sees: re-uploads say what they did, unknown ``dims`` are named, timestamps are aware."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.db import make_engine, make_sessionmaker
from app.graphs.models import StoredGraph
from app.migrate import upgrade
from tests.graphs.test_storage import _gpt_like, _post
from tests.helpers import light_model


def test_reupload_with_other_name_and_batch_says_what_it_did(client: TestClient) -> None:
    content = _gpt_like().SerializeToString()
    first = _post(client, content, name="gpt-a", batch_size=2, dims="seq=8")
    assert first.status_code == 201
    (bound,) = first.json()["notices"]  # a new upload's dims bind its summary only, and it says so
    assert "dims=seq=8 bound" in bound and "summary only" in bound
    again = _post(client, content, name="gpt-b", batch_size=4, dims="seq=8")
    assert again.status_code == 200
    body = again.json()
    assert body["id"] == first.json()["id"]
    assert body["name"] == "gpt-a"
    assert body["summary"]["batch_size"] == 2
    assert len(body["notices"]) == 2
    assert "keeps its original name" in body["notices"][0] and "'gpt-b'" in body["notices"][0]
    assert "batch_size=2" in body["notices"][1] and "batch_size=4" in body["notices"][1]
    assert client.get(f"/v1/graphs/{body['id']}").json()["name"] == "gpt-a"
    same = _post(client, content, name="gpt-a", batch_size=2, dims="seq=8")
    assert same.status_code == 200 and same.json()["notices"] == []


def test_unknown_dims_key_is_a_422_that_names_it(client: TestClient) -> None:
    content = _gpt_like().SerializeToString()
    r = _post(client, content, dims="seq=8,sequence_length=8")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "unknown_dimension"
    assert err["detail"] == {"unknown_dims": ["sequence_length"], "graph_dims": ["batch", "seq"]}
    assert "'sequence_length'" in err["message"]
    assert client.get("/v1/graphs").json()["count"] == 0  # nothing stored

    gid = _post(client, content, dims="seq=8").json()["id"]
    layers = client.get(f"/v1/graphs/{gid}/layers", params={"dims": "seq=8,typo=3"})
    assert layers.status_code == 422 and layers.json()["error"]["detail"]["unknown_dims"] == ["typo"]
    pred = client.post(
        "/v1/predictions", json={"graph_id": gid, "hardware_id": "local", "batch_size": 1, "dims": {"seq": 8, "sek": 8}}
    )
    assert pred.status_code == 422 and pred.json()["error"]["code"] == "unknown_dimension"
    # a graph with no symbolic dimension (fixed-shape model zoo export) has none to bind
    fixed = _post(client, light_model("squeezenet"), dims="seq=8")
    assert fixed.status_code == 422 and fixed.json()["error"]["detail"]["graph_dims"] == []


def test_dims_query_binding_a_name_twice_or_below_one_is_a_422(client: TestClient) -> None:
    """``dims=seq=8,seq=9`` silently took 9; ``dims=seq=0`` was an ``unbound_dimension`` though it was bound."""
    gid = _post(client, _gpt_like().SerializeToString(), dims="seq=8").json()["id"]
    assert client.get(f"/v1/graphs/{gid}/layers", params={"dims": "seq=9"}).status_code == 200
    for dims, detail in [("seq=8,seq=9", {"repeated": "seq"}), ("seq=0", {"dimension": "seq"}),
                         ("seq=-3", {"dimension": "seq"})]:
        for r in (client.get(f"/v1/graphs/{gid}/layers", params={"dims": dims}),
                  _post(client, _gpt_like().SerializeToString(), dims=dims)):
            assert r.status_code == 422, (dims, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and err["detail"] == {"dims": dims, **detail}, (dims, err)
            assert "'seq'" in err["message"]


def test_created_at_is_timezone_aware_in_the_api(client: TestClient) -> None:
    body = _post(client, _gpt_like().SerializeToString(), dims="seq=8").json()
    created = datetime.fromisoformat(body["created_at"])
    assert created.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - created) < timedelta(minutes=5)


def test_sqlite_round_trip_returns_aware_utc(sqlite_url: str) -> None:
    """SQLite stores datetimes as text without an offset; the column type stores UTC and reads it
    back aware, so a value written with another offset keeps its instant."""
    upgrade(sqlite_url)
    factory = make_sessionmaker(make_engine(sqlite_url))
    plus_two = datetime(2026, 12, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    with factory() as session:
        session.add(
            StoredGraph(id="t" * 64, name="t", source_format="json", size_bytes=1, content=b"{}", summary={},
                        created_at=plus_two)
        )
        session.commit()
    with factory() as fresh:
        row = fresh.get(StoredGraph, "t" * 64)
        assert row is not None
        assert row.created_at.tzinfo is not None
        assert row.created_at == plus_two
        assert row.created_at.utcoffset() == timedelta(0) and row.created_at.hour == 10


def test_naive_values_are_taken_as_utc(session: Session) -> None:
    session.add(
        StoredGraph(id="n" * 64, name="n", source_format="json", size_bytes=1, content=b"{}", summary={},
                    created_at=datetime(2026, 12, 1, 9, 30))
    )
    session.flush()
    session.expire_all()
    row = session.get(StoredGraph, "n" * 64)
    assert row is not None and row.created_at == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
