"""Graphs are stored without weights, external data is never read, uploads stream, graphs can be deleted."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy import create_engine, pool, text
from sqlalchemy.orm import Session

from app.config import Settings
from app.core.analysis import analyze
from app.core.onnx_import import import_onnx
from app.graphs.models import StoredGraph
from app.main import create_app
from app.migrate import upgrade
from tests.security.test_auth import _make_key

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_bytes()  # read here, before any test audits opened paths
VOCAB, HIDDEN, FFN = 1000, 256, 1024


def _gpt_like(*, tied_copy: bool = True, seed: int = 0) -> onnx.ModelProto:
    """A GPT-2-shaped toy: token embedding, one MLP block, an LM head that is the transposed embedding
    table stored as a separate initializer (what torch.onnx.export's constant folding of the tied
    ``lm_head`` produces). About 3.1 MB of float32 weights."""
    rng = np.random.default_rng(seed)
    wte = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    inits = [
        numpy_helper.from_array(wte, "transformer.wte.weight"),
        numpy_helper.from_array(rng.standard_normal((HIDDEN, FFN)).astype(np.float32), "mlp.c_fc.weight"),
        numpy_helper.from_array(np.zeros(FFN, dtype=np.float32), "mlp.c_fc.bias"),
        numpy_helper.from_array(rng.standard_normal((FFN, HIDDEN)).astype(np.float32), "mlp.c_proj.weight"),
        numpy_helper.from_array(
            wte.T.copy() if tied_copy else rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32),
            "onnx::MatMul_99",
        ),
    ]
    nodes = [
        helper.make_node("Gather", ["transformer.wte.weight", "input_ids"], ["h0"], name="wte"),
        helper.make_node("MatMul", ["h0", "mlp.c_fc.weight"], ["h1"], name="fc"),
        helper.make_node("Add", ["h1", "mlp.c_fc.bias"], ["h2"], name="fc_bias"),
        helper.make_node("Relu", ["h2"], ["h3"], name="act"),
        helper.make_node("MatMul", ["h3", "mlp.c_proj.weight"], ["h4"], name="proj"),
        helper.make_node("MatMul", ["h4", "onnx::MatMul_99"], ["l0"], name="lm_head"),
        helper.make_node("Softmax", ["l0"], ["probs"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "gpt-like",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", "seq", VOCAB])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")


EXPECTED_PARAMS = VOCAB * HIDDEN + HIDDEN * FFN + FFN + FFN * HIDDEN  # the LM head is the tied embedding


def _post(client: TestClient, content: bytes, headers: dict[str, str] | None = None, **params) -> object:
    return client.post(
        "/v1/graphs", content=content, headers={"content-type": "application/octet-stream", **(headers or {})},
        params=params,
    )


def _stored(session: Session, gid: str) -> StoredGraph:
    session.expire_all()
    row = session.get(StoredGraph, gid)
    assert row is not None
    return row


def test_weights_are_stripped_and_the_numbers_do_not_change(client: TestClient, session: Session) -> None:
    model = _gpt_like()
    original = model.SerializeToString()
    direct = analyze(import_onnx(original, batch_size=2, dims={"seq": 16}))  # the importer, weights present
    assert direct.params == EXPECTED_PARAMS

    r = _post(client, original, batch_size=2, dims="seq=16")
    assert r.status_code == 201, r.text
    body = r.json()
    storage = body["storage"]
    assert body["size_bytes"] == len(original)
    assert storage["weights_stored"] is False
    assert storage["stored_bytes"] < len(original) / 100
    # every tensor over 65536 elements lost its data, the tied copy included; the 1024-element bias
    # is kept (shape-sized)
    assert storage["stripped_weight_bytes"] == 4 * (2 * VOCAB * HIDDEN + 2 * HIDDEN * FFN)
    assert body["summary"]["params"] == direct.params
    assert body["summary"]["forward_macs"] == direct.forward_macs

    row = _stored(session, body["id"])
    assert len(row.content) == storage["stored_bytes"]
    assert row.structure_sha256 == storage["structure_sha256"]
    stored_model = onnx.load_model_from_string(row.content)
    inits = {t.name: t for t in stored_model.graph.initializer}
    assert list(inits["mlp.c_fc.weight"].dims) == [HIDDEN, FFN]
    assert inits["mlp.c_fc.weight"].data_type == TensorProto.FLOAT
    assert not inits["mlp.c_fc.weight"].HasField("raw_data")
    assert "onnx::MatMul_99" not in inits  # the tied copy became a Transpose of the embedding table

    layers = client.get(f"/v1/graphs/{body['id']}/layers", params={"batch_size": 8, "dims": "seq=16"}).json()
    at8 = analyze(import_onnx(original, batch_size=8, dims={"seq": 16}))
    assert layers["summary"]["params"] == at8.params
    assert layers["summary"]["forward_macs"] == at8.forward_macs == 4 * direct.forward_macs
    lm = next(layer for layer in layers["layers"] if layer["name"] == "lm_head")
    assert lm["forward_macs"] == 8 * 16 * HIDDEN * VOCAB


def test_untied_weights_are_not_merged(client: TestClient) -> None:
    r = _post(client, _gpt_like(tied_copy=False).SerializeToString(), dims="seq=4")
    assert r.status_code == 201, r.text
    assert r.json()["summary"]["params"] == EXPECTED_PARAMS + HIDDEN * VOCAB


def test_same_architecture_other_weights_is_another_graph_with_the_same_structure(client: TestClient) -> None:
    """Only the weight-sized tensors differ (the bias, kept as a shape-sized constant, is zero in both)."""
    a = _post(client, _gpt_like(seed=1).SerializeToString(), dims="seq=4").json()
    b = _post(client, _gpt_like(seed=2).SerializeToString(), dims="seq=4").json()
    assert a["id"] != b["id"]
    assert a["storage"]["structure_sha256"] == b["storage"]["structure_sha256"]


def test_external_data_model_uploaded_alone_imports_from_declared_dims(
    client: TestClient, tmp_path: Path
) -> None:
    path = tmp_path / "gpt.onnx"
    onnx.save_model(_gpt_like(), str(path), save_as_external_data=True, location="gpt.weights")
    assert (tmp_path / "gpt.weights").stat().st_size > 3_000_000
    small = path.read_bytes()
    assert len(small) < 10_000
    (tmp_path / "gpt.weights").unlink()  # the server could not read it even if it tried
    r = _post(client, small, batch_size=2, dims="seq=16")
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["summary"]["params"] == EXPECTED_PARAMS + HIDDEN * VOCAB  # no values: the tie is unknowable
    assert body["summary"]["unsupported"] == []
    assert body["storage"]["stripped_weight_bytes"] >= 4 * (VOCAB * HIDDEN + 2 * HIDDEN * FFN)


class _OpenWatch:
    """Kernel-level record of every open or read of one file (Linux inotify ``IN_OPEN | IN_ACCESS``),
    by any code in any language: onnx reads external data in C++, past Python's audit hooks."""

    def __init__(self, path: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, "inotify unavailable"
        assert self.libc.inotify_add_watch(self.fd, str(path).encode(), 0x20 | 0x01) >= 0, path

    def touched(self) -> bool:
        try:
            return bool(os.read(self.fd, 4096))
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.fd)


def _pointing_at(location: str) -> bytes:
    """The toy model with its embedding table declared as external data at ``location``."""
    model = _gpt_like(tied_copy=False)
    table = model.graph.initializer[0]
    table.ClearField("raw_data")
    table.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(4 * VOCAB * HIDDEN))):
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    return model.SerializeToString()


@pytest.mark.parametrize(
    ("location", "cwd", "target"),
    [
        ("README.md", REPO, REPO / "README.md"),
        ("../README.md", REPO / "tests", REPO / "README.md"),
        (str(REPO / "README.md"), REPO, REPO / "README.md"),
        ("../../../../../../../../etc/passwd", REPO, Path("/etc/passwd")),
        ("/proc/self/environ", REPO, None),  # procfs: no inotify; the content checks below still apply
    ],
)
def test_external_data_paths_are_never_opened(
    client: TestClient,
    session: Session,
    monkeypatch: pytest.MonkeyPatch,
    location: str,
    cwd: Path,
    target: Path | None,
) -> None:
    monkeypatch.chdir(cwd)
    content = _pointing_at(location)
    watch = _OpenWatch(target) if target is not None and target.exists() else None
    try:
        r = _post(client, content, dims="seq=4")
        assert r.status_code == 201, r.text
        layers = client.get(f"/v1/graphs/{r.json()['id']}/layers", params={"dims": "seq=4"})
        assert layers.status_code == 200
        if watch is not None:
            assert not watch.touched(), f"{target} was opened or read"
    finally:
        if watch is not None:
            watch.close()
    assert r.json()["summary"]["params"] == EXPECTED_PARAMS + HIDDEN * VOCAB
    row = _stored(session, r.json()["id"])
    for blob in (row.content, r.content, layers.content):
        assert README[:64] not in blob
    assert location.encode() not in row.content  # the reference itself is not kept


def test_the_watch_sees_a_read(tmp_path: Path) -> None:
    """The detector above is not vacuous: onnx's own external-data loader trips it."""
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    model = onnx.load_model_from_string(_pointing_at("w.bin"))
    table = model.graph.initializer[0]
    table.dims[:] = [16]
    for entry in table.external_data:
        if entry.key == "length":
            entry.value = "64"
    watch = _OpenWatch(tmp_path / "w.bin")
    try:
        assert not watch.touched()
        numpy_helper.to_array(table, base_dir=str(tmp_path))
        assert watch.touched()
    finally:
        watch.close()


def test_streamed_body_over_the_limit_is_413(settings: Settings) -> None:
    upgrade(settings.database_url)
    app = create_app(settings.model_copy(update={"max_upload_bytes": 1_000_000}))
    with TestClient(app) as client:

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while streaming
            for _ in range(20):
                yield b"\0" * 100_000

        r = client.post("/v1/graphs", content=chunks(), headers={"content-type": "application/octet-stream"})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"


def test_default_upload_limit_is_2_gib() -> None:
    assert Settings.model_fields["max_upload_bytes"].default == 2 * 1024**3


def test_upload_larger_than_the_in_memory_spool(client: TestClient) -> None:
    """12 MB of weights: spooled to disk by the router, stored in a few hundred bytes."""
    model = _gpt_like()
    big = np.ones((3, 1024, 1024), dtype=np.float32)
    model.graph.initializer.append(numpy_helper.from_array(big, "unused.buffer"))
    content = model.SerializeToString()
    assert len(content) > 12 * 2**20
    for upload in (
        lambda: _post(client, content, dims="seq=4"),
        lambda: client.post("/v1/graphs", files={"file": ("big.onnx", content)}, params={"dims": "seq=4"}),
    ):
        r = upload()
        assert r.status_code in (200, 201), r.text
        assert r.json()["storage"]["stored_bytes"] < 10_000
        assert r.json()["size_bytes"] == len(content)


def test_delete_graph(client: TestClient, settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    owner = {"Authorization": f"Bearer {_make_key(settings.database_url, 'owner', 'graphs', capsys=capsys)}"}
    gid = _post(client, _gpt_like().SerializeToString(), headers=owner, dims="seq=4").json()["id"]
    assert client.delete(f"/v1/graphs/{gid}", headers=owner).status_code == 204
    missing = client.get(f"/v1/graphs/{gid}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "graph_not_found"
    again = client.delete(f"/v1/graphs/{gid}", headers=owner)
    assert again.status_code == 404
    assert again.json()["error"] == {
        "code": "graph_not_found", "message": f"no graph with id '{gid}'", "detail": {"graph_id": gid}
    }
    assert client.get("/v1/graphs").json()["count"] == 0


def test_a_graph_deleted_and_uploaded_again_under_another_name_is_answered_with_the_new_name(
    client: TestClient, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """The id is the content's sha256, so a re-upload after a delete has the same id: the cached analysis of
    the deleted graph (which carries its name) goes with the delete, and only that graph's entries."""
    from app.graphs.service import analysis_cache

    owner = {"Authorization": f"Bearer {_make_key(settings.database_url, 'owner', 'graphs', capsys=capsys)}"}
    analysis_cache.clear()
    content = _gpt_like().SerializeToString()
    gid = _post(client, content, headers=owner, dims="seq=4", name="old-name").json()["id"]
    other = _post(client, _gpt_like(seed=1).SerializeToString(), headers=owner, dims="seq=4").json()["id"]
    body = {"hardware_id": "t4", "batch_size": 2, "dims": {"seq": 4}}
    for g in (gid, other):
        assert client.post("/v1/predictions", json={**body, "graph_id": g}).status_code == 200
    assert client.post("/v1/predictions", json={**body, "graph_id": gid}).json()["graph_name"] == "old-name"
    kept = len(analysis_cache)
    assert client.delete(f"/v1/graphs/{gid}", headers=owner).status_code == 204
    assert len(analysis_cache) == kept - 1  # the other graph's binding stays
    again = _post(client, content, headers=owner, dims="seq=4", name="new-name")
    assert again.status_code == 201 and again.json()["id"] == gid
    r = client.post("/v1/predictions", json={**body, "graph_id": gid})
    assert r.status_code == 200 and r.json()["graph_name"] == "new-name"


def test_migration_keeps_old_rows_and_says_their_weights_are_stored(sqlite_url: str) -> None:
    upgrade(sqlite_url, "0002")
    engine = create_engine(sqlite_url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO graphs (id, name, source_format, size_bytes, content, summary, created_at) "
                    "VALUES ('a', 'old', 'onnx', 1234, x'00', '{}', '2026-11-30 10:00:00')"
                )
            )
        upgrade(sqlite_url)
        with Session(engine) as s:
            row = s.get(StoredGraph, "a")
            assert row is not None
            assert (row.weights_stored, row.stored_bytes, row.stripped_weight_bytes) == (True, 1234, 0)
            assert row.structure_sha256 is None
            assert row.created_at.tzinfo is not None and row.created_at.utcoffset().total_seconds() == 0
    finally:
        engine.dispose()


def test_an_analysis_cached_while_a_delete_is_uncommitted_goes_with_the_commit(client: TestClient) -> None:
    """A prediction that read the row before the delete committed may cache its analysis in between: the
    commit drops it again; a rolled-back delete keeps what is cached."""
    from app.auth import Principal, Scope
    from app.graphs import service
    from app.graphs.service import BoundGraph, analysis_cache

    gid = _post(client, _gpt_like().SerializeToString(), dims="seq=4").json()["id"]
    admin = Principal(key_id=None, scopes=frozenset({Scope.ADMIN}))
    factory = client.app.state.sessionmaker  # type: ignore[attr-defined]
    key = ("id", gid, 1, (), None, None)
    analysis = analyze(import_onnx(_gpt_like().SerializeToString(), dims={"seq": 4}))
    for commit in (False, True):
        analysis_cache.clear()
        with factory() as session:
            service.delete_graph(session, graph_id=gid, principal=admin)
            analysis_cache.put(BoundGraph(key=key, analysis=analysis, graph_id=gid, nbytes=1))  # in between
            assert len(analysis_cache) == 1
            session.commit() if commit else session.rollback()
        assert len(analysis_cache) == (0 if commit else 1)
