"""``layercast profile --upload``: a finished campaign's rows reach the service through the API, a rerun
stores nothing twice, the stored rows are ones the trainer rebuilds, and a refused batch is reported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.client import Client, LayercastAPIError
from app.config import Settings
from app.main import create_app
from app.measurements.importers import SOURCE_PROFILER_UPLOAD
from app.measurements.profiler_rows import iter_profiler_layers
from app.migrate import upgrade
from app.profiler import upload
from app.training.dataset import load_training_rows
from tests.security.test_auth import _make_key

torch = pytest.importorskip("torch")
from app.profiler import run  # noqa: E402

ARGS = ["--n-configs", "3", "--families", "activation,linear", "--max-train-ms", "0.5", "--warmup", "1", "--reps",
        "3", "--max-seconds", "0.3", "--precision", "fp32"]  # fmt: skip


@pytest.fixture
def api(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    """The upload's HTTP client, pointed at the test app."""
    monkeypatch.setattr(upload, "http_client", lambda server, **_: Client(http=TestClient(client.app)))
    yield Client(http=client)


def _uploaded(api: Client) -> int:
    return api.list_measurements(source=SOURCE_PROFILER_UPLOAD, limit=1).total


def test_upload_after_the_campaign_and_again(api: Client, tmp_path: Path, session: object,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "layers_cpu.jsonl"
    assert run.main(["--out", str(out), *ARGS, "--upload", "http://test", "--hardware-id", "local"]) == 0
    expected = sum(1 for _ in iter_profiler_layers(out, hardware_id="local"))
    assert expected >= 9 and _uploaded(api) == expected  # forward, train_step, backward... per row
    assert f"{expected} measurements stored" in capsys.readouterr().err

    report = upload.upload_shard(out, client=api, hardware_id="local", chunk=4, log=lambda s: None)
    assert report.stored == expected  # other chunk boundaries: other keys, stored again...
    again = upload.upload_shard(out, client=api, hardware_id="local", chunk=4, log=lambda s: None)
    assert (again.stored, again.replayed) == (0, expected)  # ...but the same upload twice stores once
    assert _uploaded(api) == 2 * expected

    rows = load_training_rows(session, sources=(SOURCE_PROFILER_UPLOAD,))  # type: ignore[arg-type]
    assert len(rows) > 0 and set(rows.gpu) == {"local"} and rows.layers


def test_refused_upload_exits_1_and_an_unfinished_campaign_is_not_uploaded(
    api: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "layers_cpu.jsonl"
    assert run.main(["--out", str(out), *ARGS, "--upload", "http://test", "--hardware-id", "no-such-device"]) == 1
    assert "invalid_measurements" in capsys.readouterr().err and _uploaded(api) == 0
    with pytest.raises(LayercastAPIError) as err:
        upload.upload_shard(out, client=api, hardware_id="no-such-device", log=lambda s: None)
    assert err.value.detail["errors"][0] == {"index": 0, "code": "hardware_not_found", "field": "hardware_id",
                                             "message": "unknown hardware id 'no-such-device': register it first"}

    more = tmp_path / "layers_more.jsonl"
    assert run.main(["--out", str(more), *ARGS, "--limit", "1", "--upload", "http://test", "--hardware-id",
                     "local"]) == 0  # fmt: skip
    assert "not uploading" in capsys.readouterr().err and _uploaded(api) == 0
    with pytest.raises(SystemExit, match="hardware-id"):
        run.main(["--out", str(more), *ARGS, "--upload", "http://test"])


def test_upload_sends_its_api_key_to_a_server_with_the_shipped_scopes(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert upload.http_client("http://x", api_key="lck_k").http.headers["authorization"] == "Bearer lck_k"
    upgrade(settings.database_url)
    key = _make_key(settings.database_url, "profiler", "measurements", capsys=capsys)
    shipped = settings.model_copy(update={"open_scopes": "read,graphs", "allowed_hosts": "testserver"})
    with TestClient(create_app(shipped)) as server:
        def keyed(server_url: str, *, api_key: str | None = None, **_: object) -> Client:
            return Client(http=TestClient(server.app), api_key=api_key)

        monkeypatch.setattr(upload, "http_client", keyed)
        monkeypatch.delenv("LAYERCAST_API_KEY", raising=False)
        out = tmp_path / "layers_cpu.jsonl"
        argv = ["--out", str(out), *ARGS, "--upload", "http://test", "--hardware-id", "local"]
        assert run.main(argv) == 1  # no key: measurements are not an open scope
        assert "auth_required" in capsys.readouterr().err
        assert run.main([*argv, "--api-key", key]) == 0
        assert _uploaded(Client(http=server)) > 0
