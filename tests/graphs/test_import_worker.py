"""Large ONNX uploads are imported in the worker process (app.graphs.importer): same answers as in-process,
errors with their own type, code and detail, a dead worker is a 503 and replaced, duplicates are never parsed."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from onnx import numpy_helper

from app.core.limits import Limits
from app.errors import GraphTooLarge, ImportWorkerFailed
from app.graphs import service
from app.graphs.importer import WORKER_MIN_BYTES, ImportWorkers, prepare_graph
from app.graphs.spool import Spool
from tests.graphs.test_storage import _gpt_like, _post


def _large_model() -> bytes:
    """The GPT-like toy with 12 MiB of unused weights: over :data:`WORKER_MIN_BYTES`."""
    model = _gpt_like()
    model.graph.initializer.append(numpy_helper.from_array(np.ones((3, 1024, 1024), np.float32), "unused.buffer"))
    content = model.SerializeToString()
    assert len(content) > WORKER_MIN_BYTES
    return content


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the uploads the server imported in its own process (:func:`service.prepare_graph` calls)."""
    calls: list[int] = []
    real = service.prepare_graph

    def spy(content: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(content, bytes):
            calls.append(len(content))
        else:
            at = content.tell()
            calls.append(content.seek(0, 2) - at)
            content.seek(at)
        return real(content, *args, **kwargs)

    monkeypatch.setattr(service, "prepare_graph", spy)
    return calls


def test_a_large_upload_is_imported_in_the_worker_process_with_the_in_process_answer(
    client: TestClient, in_process: list[int]
) -> None:
    content = _large_model()
    expected = prepare_graph(content, "onnx", name="", batch_size=2, dims={"seq": 4})
    r = _post(client, content, batch_size=2, dims="seq=4")
    assert r.status_code == 201, r.text
    assert in_process == []  # not parsed by the server
    body = r.json()
    assert body["id"] == hashlib.sha256(content).hexdigest()  # hashed in batches while it streamed
    assert body["size_bytes"] == len(content)
    assert body["summary"] == expected.summary and body["summary"]["batch_size"] == 2
    assert body["storage"]["structure_sha256"] == hashlib.sha256(expected.stored).hexdigest()
    assert body["storage"]["stripped_weight_bytes"] == expected.stripped_bytes
    # a small upload is still imported in-process (its parse is short)
    small = _gpt_like(seed=1).SerializeToString()
    assert _post(client, small, dims="seq=4").status_code == 201
    assert in_process == [len(small)]


def test_large_streamed_and_multipart_uploads_go_to_the_worker(client: TestClient, in_process: list[int]) -> None:
    """Without a Content-Length (not started ahead) and as a multipart part (copied to a named spool)."""
    content = _large_model()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(content), 300_001):
            yield content[i:i + 300_001]

    r = client.post("/v1/graphs", content=chunks(), params={"dims": "seq=4"},
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    other = _gpt_like(seed=2)
    other.graph.initializer.append(numpy_helper.from_array(np.zeros((3, 1024, 1024), np.float32), "unused"))
    part = other.SerializeToString()
    r2 = client.post("/v1/graphs", files={"file": ("big.onnx", part)}, params={"dims": "seq=4"})
    assert r2.status_code == 201, r2.text
    assert r2.json()["id"] == hashlib.sha256(part).hexdigest() and r2.json()["name"] == "big.onnx"
    assert in_process == []


def test_a_duplicate_large_upload_is_not_parsed(client: TestClient, in_process: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    content = _large_model()
    assert _post(client, content, dims="seq=4").status_code == 201
    sent: list[str] = []
    workers: ImportWorkers = client.app.state.import_workers  # type: ignore[attr-defined]
    real = workers.prepare
    monkeypatch.setattr(workers, "prepare", lambda path, **kw: sent.append(path) or real(path, **kw))
    again = _post(client, content, dims="seq=4")
    assert again.status_code == 200 and again.json()["id"] == hashlib.sha256(content).hexdigest()
    assert sent == [] and in_process == []


def test_errors_from_the_worker_keep_their_code_and_detail_and_store_nothing(client: TestClient) -> None:
    garbage = _post(client, b"\x0f" * (WORKER_MIN_BYTES + 1))
    assert garbage.status_code == 422 and garbage.json()["error"]["code"] == "invalid_graph", garbage.text
    typo = _post(client, _large_model(), dims="seq=4,sqe=8")
    assert typo.status_code == 422, typo.text
    assert typo.json()["error"]["code"] == "unknown_dimension"
    assert typo.json()["error"]["detail"]["unknown_dims"] == ["sqe"]
    unbound = _post(client, _large_model())
    assert unbound.status_code == 422 and unbound.json()["error"]["code"] == "unbound_dimension"
    assert client.get("/v1/graphs").json()["count"] == 0


def test_the_worker_imports_under_the_callers_limits(tmp_path: Path) -> None:
    path = tmp_path / "big.onnx"
    path.write_bytes(_large_model())
    workers = ImportWorkers()
    try:
        with pytest.raises(GraphTooLarge) as info:
            workers.prepare(str(path), name="", batch_size=1, dims={"seq": 4}, limits=Limits(max_nodes=3))
        assert info.value.status_code == 413 and info.value.code == "graph_too_large"
        assert info.value.detail["max"] == 3 and info.value.detail["value"] > 3
        ok = workers.prepare(str(path), name="", batch_size=1, dims={"seq": 4}, limits=Limits())
        assert ok.size == path.stat().st_size and ok.summary["layer_count"] > 3
    finally:
        workers.close()


def test_a_worker_that_dies_is_a_503_and_the_next_import_gets_a_new_one(tmp_path: Path, client: TestClient) -> None:
    path = tmp_path / "big.onnx"
    path.write_bytes(_large_model())
    workers = ImportWorkers()
    try:
        workers._submit(os._exit, 3)  # the process ends while this import waits for it
        with pytest.raises(ImportWorkerFailed) as info:
            workers.prepare(str(path), name="", batch_size=1, dims={"seq": 4}, limits=Limits())
        assert info.value.status_code == 503 and info.value.code == "import_worker_failed"
        assert workers.prepare(str(path), name="", batch_size=1, dims={"seq": 4}, limits=Limits()).summary
    finally:
        workers.close()
    # through the API: the worker dies during the upload's import (queued behind a 2 s task, then the exit)
    app_workers: ImportWorkers = client.app.state.import_workers  # type: ignore[attr-defined]
    app_workers._submit(time.sleep, 2)
    app_workers._submit(os._exit, 3)
    r = _post(client, path.read_bytes(), dims="seq=4")
    assert r.status_code == 503 and r.json()["error"]["code"] == "import_worker_failed", r.text
    assert client.get("/v1/graphs").json()["count"] == 0
    # the app's worker died between two uploads; the next upload is imported by a new one
    died = app_workers._submit(os._exit, 3)
    with pytest.raises(BrokenProcessPool):
        died.result()
    r = _post(client, path.read_bytes(), dims="seq=4")
    assert r.status_code == 201, r.text


def test_the_worker_starts_with_the_app_when_configured(settings: Any) -> None:
    from app.main import create_app
    from app.migrate import upgrade

    upgrade(settings.database_url)
    with TestClient(create_app(settings.model_copy(update={"import_worker_at_start": True}))) as client:
        workers: ImportWorkers = client.app.state.import_workers  # type: ignore[attr-defined]
        assert workers._pool is not None  # spawned at start-up, before any upload
        assert _post(client, _large_model(), dims="seq=4").status_code == 201
    assert workers._pool is None  # stopped with the app
    with TestClient(create_app(settings)) as client:  # the suite's default (conftest): on the first large upload
        assert client.app.state.import_workers._pool is None  # type: ignore[attr-defined]


def test_the_worker_ends_when_its_server_is_killed() -> None:
    """A server killed without its shutdown (SIGKILL, os._exit) does not leave its worker running."""
    import subprocess
    import sys

    import psutil

    code = ("import os; from app.graphs.importer import ImportWorkers, _warm; w = ImportWorkers(); "
            "w._submit(_warm).result(); print(*w._pool._processes, flush=True); os._exit(0)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert server.stdout is not None
    (pid,) = map(int, server.stdout.readline().split())  # the worker keeps the pipe open: not read to its end
    assert server.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        psutil.Process(pid).kill()
        pytest.fail("the import worker outlived its server by 10 s")


def test_the_spool_file_is_removed_after_success_and_error(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    spools = tmp_path / "spools"
    spools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))
    created: list[str] = []
    real = tempfile.NamedTemporaryFile

    def spy(*args: Any, **kwargs: Any) -> Any:
        f = real(*args, **kwargs)
        created.append(f.name)
        return f

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", spy)
    closed: list[bool] = []
    real_close = Spool.close

    async def close(self: Spool) -> None:
        await real_close(self)
        closed.append(self.path is not None and not Path(self.path).exists())

    monkeypatch.setattr(Spool, "close", close)
    assert _post(client, _large_model(), dims="seq=4").status_code == 201  # removed after the response
    assert _post(client, b"\x0f" * (WORKER_MIN_BYTES + 1)).status_code == 422  # removed before the error
    assert closed == [True, True]  # closed by the request (the success's after its response), not left to the GC
    assert len(created) == 2 and all(Path(c).parent == spools for c in created)
    assert list(spools.iterdir()) == []


def test_an_import_queued_behind_another_is_bounded_by_the_import_deadline(tmp_path: Path) -> None:
    """One process imports one upload at a time: the wait in its queue counts against ``import_timeout_s``, so
    an upload queued behind a long import is refused with 422 ``import_seconds`` in about that time, not after
    the one before it finishes."""
    from app.errors import LimitExceeded

    path = tmp_path / "big.onnx"
    path.write_bytes(_large_model())
    workers = ImportWorkers()
    try:
        workers.prepare(str(path), name="", batch_size=1, dims={"seq": 4}, limits=Limits())  # started and warm
        workers._submit(time.sleep, 4)
        t0 = time.monotonic()
        with pytest.raises(LimitExceeded) as info:
            workers.prepare(str(path), name="", batch_size=1, dims={"seq": 4}, limits=Limits(import_timeout_s=0.5))
        waited = time.monotonic() - t0
        assert info.value.code == "limit_exceeded" and info.value.detail["limit"] == "import_seconds"
        assert waited < 3.0, waited  # the sleep ahead of it takes 4 s
    finally:
        workers.close()


def test_a_worker_that_cannot_start_is_a_503_and_the_app_still_serves(settings: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No process can be spawned (no /dev/shm, a process limit): a large upload is a 503 import_worker_failed
    naming the cause, not a 500; with the worker configured to start with the app, the app starts anyway."""
    from app.graphs import importer
    from app.main import create_app
    from app.migrate import upgrade

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(importer, "ProcessPoolExecutor", refuse)
    upgrade(settings.database_url)
    with TestClient(create_app(settings.model_copy(update={"import_worker_at_start": True}))) as client:
        assert client.get("/healthz").status_code == 200
        r = _post(client, _large_model(), dims="seq=4")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "import_worker_failed" and error["detail"]["reason"] == "OSError"
        assert client.get("/v1/graphs").json()["count"] == 0
