"""The analysis cache: hits never read the stored blob, the budget is bytes, the estimate is honest."""

from __future__ import annotations

import gc
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from app.core.analysis import analyze
from app.core.vocab import SoftwareStack
from app.graphs.service import (
    LAYOUT_BYTES_PER_LAYER,
    AnalysisCache,
    BoundGraph,
    analysis_bytes,
    analysis_cache,
    build_graph,
)
from tests.helpers import light_model


def _upload(client: TestClient, name: str) -> str:
    r = client.post("/v1/graphs", files={"file": (f"{name}.onnx", light_model(name), "application/octet-stream")})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def test_a_hit_never_reads_the_stored_content(client: TestClient) -> None:
    """After the first prediction, the stored blob is overwritten with garbage: the cached binding still
    answers (same numbers), and only once the cache is dropped is the blob re-read (and now refused)."""
    analysis_cache.clear()
    gid = _upload(client, "squeezenet")
    body = {"graph_id": gid, "hardware_id": "a100-sxm4-40gb", "batch_size": 16}
    first = client.post("/v1/predictions", json=body)
    assert first.status_code == 200, first.text
    with client.app.state.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("UPDATE graphs SET content = :c WHERE id = :i"), {"c": b"\x00garbage", "i": gid})
    again = client.post("/v1/predictions", json=body)
    assert again.status_code == 200 and again.json()["iteration"] == first.json()["iteration"]
    analysis_cache.clear()
    assert client.post("/v1/predictions", json=body).status_code == 422


def test_summary_detail_has_the_same_totals_without_rows(client: TestClient) -> None:
    gid = _upload(client, "squeezenet")
    body = {"graph_id": gid, "hardware_id": "t4", "batch_size": 8, "dataset_size": 10_000, "epochs": 2}
    full = client.post("/v1/predictions", json=body).json()
    summary = client.post("/v1/predictions", json={**body, "detail": "summary"}).json()
    assert summary["layers"] == [] and len(full["layers"]) > 10
    for key in ("iteration", "epoch", "job", "memory", "totals", "methods", "warnings"):
        assert summary[key] == full[key], key


def _entry(key: str, nbytes: int) -> BoundGraph:
    a = analyze(build_graph(light_model("squeezenet"), "onnx", batch_size=1))
    return BoundGraph(key=key, analysis=a, graph_id=None, nbytes=nbytes)


def test_budget_is_bytes_least_recently_used_first_out() -> None:
    cache = AnalysisCache(budget_bytes=1000)
    for k in "abc":
        cache.put(_entry(k, 400))
    assert len(cache) == 2 and cache.nbytes == 800 and cache.get("a") is None  # a evicted
    assert cache.get("b") is not None  # b is now the most recent
    cache.put(_entry("d", 400))
    assert cache.get("c") is None and cache.get("b") is not None and cache.get("d") is not None
    big = cache.put(_entry("huge", 5000))  # larger than the budget: answered, never kept
    assert big.key == "huge" and cache.get("huge") is None and cache.nbytes <= 1000


@pytest.mark.parametrize("name", ["resnet50", "densenet121", "inception_v2"])
def test_byte_estimate_is_within_a_factor_two_of_traced_memory(name: str) -> None:
    content = light_model(name)
    analyze(build_graph(content, "onnx", batch_size=2), software_stack=SoftwareStack.PYTORCH_EAGER)  # warm imports
    gc.collect()
    tracemalloc.start()
    try:
        a = analyze(build_graph(content, "onnx", batch_size=4), software_stack=SoftwareStack.PYTORCH_EAGER)
        gc.collect()
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.5 <= analysis_bytes(a) / traced <= 2.0, (analysis_bytes(a), traced)


@pytest.mark.parametrize("name", ["resnet50", "densenet121", "inception_v2"])
def test_layout_byte_estimate_counts_the_compiled_walk(name: str) -> None:
    """What a memoised training layout is charged (``LAYOUT_BYTES_PER_LAYER`` per layer) is within 15 % below /
    20 % above what it holds once a footprint has compiled its numpy walk onto it (``Layout.walk``, ~10 % of it:
    the layout alone would be charged too little)."""
    from app.core import memory
    from app.hardware.catalog import load_catalog

    hw = load_catalog()["a100-sxm4-40gb"]
    a = analyze(build_graph(light_model(name), "onnx", batch_size=4), software_stack=SoftwareStack.PYTORCH_EAGER)
    memory.footprint(a, mode="training", optimizer="adam", precision="fp32", hardware=hw)  # warm imports
    gc.collect()
    tracemalloc.start()
    try:
        layout = memory.memory_layout(a, precision="fp32", hardware=hw)
        memory.footprint(a, mode="training", optimizer="adam", precision="fp32", hardware=hw, layout=layout)
        gc.collect()
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert layout.walk is not None
    charged = LAYOUT_BYTES_PER_LAYER * len(a.graph.layers)
    assert 0.85 <= charged / traced <= 1.2, (charged, traced)


def test_importing_the_api_imports_neither_torch_nor_alembic_nor_onnx() -> None:
    """Importing the API package (and building the app) imports none of them: onnx is imported by the lifespan
    before the app is ready, torch and alembic never."""
    code = ("import sys, app.main; app.main.create_app(); "
            "print('torch' in sys.modules, 'alembic' in sys.modules, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


def test_the_installed_ml_dtypes_is_below_0_7() -> None:
    """``import onnx`` imports ml_dtypes; 0.7.0's extension took 0.55 s to load (GIL held, numpy 2.3 and 2.4),
    0.5.4 and 0.6.0 4 ms, so pyproject.toml pins ``<0.7``: the lifespan's onnx import is then ~0.07 s of the
    start-up (issue 12, benchmarks/README.md)."""
    from importlib.metadata import version

    major, minor = (int(p) for p in version("ml_dtypes").split(".")[:2])
    assert (major, minor) < (0, 7), version("ml_dtypes")


def test_the_app_imports_onnx_before_it_is_ready(tmp_path: Path) -> None:
    """The first ONNX upload must not stall every concurrent request while onnx imports (GIL held): the
    lifespan imports it, so a started app has it and an imported one does not."""
    code = ("import sys; from fastapi.testclient import TestClient; from app.config import Settings; "
            "from app.main import create_app; "
            f"app = create_app(Settings(database_url='sqlite:///{tmp_path}/s.db'), run_migrations=True); "
            "before = 'onnx' in sys.modules\n"
            "with TestClient(app): print(before, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_a_binding_that_fails_is_not_imported_again(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """unbound_dimension is a property of the content and the binding: the second request gets the same
    422 from the cache, without a second import; another binding of the same graph is imported."""
    from app.graphs import service

    analysis_cache.clear()
    r = client.post("/v1/graphs", content=_symbolic_seq_model(), params={"dims": "seq=4"},
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    gid = r.json()["id"]
    imports: list[int] = []
    real = service.build_graph
    monkeypatch.setattr(service, "build_graph", lambda *a, **k: imports.append(1) or real(*a, **k))
    body = {"graph_id": gid, "hardware_id": "t4", "batch_size": 8}
    first, second = client.post("/v1/predictions", json=body), client.post("/v1/predictions", json=body)
    assert first.status_code == second.status_code == 422
    assert first.json() == second.json() and first.json()["error"]["code"] == "unbound_dimension"
    assert len(imports) == 1
    assert client.post("/v1/predictions", json={**body, "dims": {"seq": 4}}).status_code == 200
    assert len(imports) == 2


def _symbolic_seq_model() -> bytes:
    """A MatMul over ``(batch, seq, 64)`` with a 64x64 weight: ``seq`` must be bound."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 64])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_memoised_results_count_against_the_budget() -> None:
    """What an entry memoises with its size (the memory layouts) grows the entry: the cache evicts the least
    recently used entries to stay within its budget."""
    budget = analysis_cache.budget_bytes
    analysis_cache.clear(budget_bytes=1000)
    try:
        a, b = analysis_cache.put(_entry("a", 300)), analysis_cache.put(_entry("b", 300))
        assert b.memo("k", lambda: 1, nbytes=200) == 1 and analysis_cache.nbytes == 800 and b.nbytes == 500
        assert b.memo("k", lambda: 2, nbytes=200) == 1 and analysis_cache.nbytes == 800  # built once, counted once
        b.memo("k2", lambda: 3, nbytes=300)
        assert analysis_cache.get("a") is None and analysis_cache.nbytes == 800  # a evicted, b (800) kept
        assert analysis_cache.get("b") is b
        assert a.memo("x", lambda: 4, nbytes=10) == 4 and analysis_cache.nbytes == 800  # not cached: not counted
    finally:
        analysis_cache.clear(budget_bytes=budget)


def test_the_layer_table_and_its_precisions_count_against_the_budget() -> None:
    """An entry's layer table (built on first prediction) and each precision's rescaled columns and costs
    (built on first use of that precision) grow the entry by what they hold; without it a cache of tables
    would outgrow its byte budget unseen."""
    from app.hardware.catalog import load_catalog

    content = light_model("resnet50")
    a = analyze(build_graph(content, "onnx", batch_size=4), software_stack=SoftwareStack.PYTORCH_EAGER)
    budget = analysis_cache.budget_bytes
    analysis_cache.clear(budget_bytes=2**30)
    try:
        entry = analysis_cache.put(BoundGraph(key="t", analysis=a, graph_id=None, nbytes=analysis_bytes(a)))
        before = entry.nbytes
        table = entry.table(load_catalog()["a100-sxm4-40gb"])
        assert entry.nbytes == before + table.nbytes and table.nbytes > 0
        grown = entry.nbytes
        gc.collect()
        tracemalloc.start()
        try:
            table.rescaled("fp16")
            traced, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        added = table.nbytes - (grown - before)
        assert entry.nbytes == grown + added == analysis_cache.nbytes
        assert 0.5 <= added / traced <= 2.0, (added, traced)  # the estimate is about what it holds
        table.rescaled("fp16")  # already built: not counted again
        assert entry.nbytes == grown + added
    finally:
        analysis_cache.clear(budget_bytes=budget)


def test_an_evicted_entry_with_its_table_is_freed_without_the_garbage_collector() -> None:
    """The table's growth callback holds its entry weakly: an evicted entry (and the table it built) is freed
    when its last reference goes, not whenever the cyclic garbage collector runs."""
    import weakref

    from app.hardware.catalog import load_catalog

    budget = analysis_cache.budget_bytes
    analysis_cache.clear(budget_bytes=2**30)
    gc.disable()
    try:
        entry = analysis_cache.put(_entry("e", 100))
        entry.table(load_catalog()["a100-sxm4-40gb"]).rescaled("bf16")
        gone, table_gone = weakref.ref(entry), weakref.ref(entry.table(load_catalog()["a100-sxm4-40gb"]))
        del entry
        analysis_cache.clear()
        assert gone() is None and table_gone() is None
    finally:
        gc.enable()
        analysis_cache.clear(budget_bytes=budget)

