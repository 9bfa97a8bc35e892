"""The learned predictor runs a batch of GPU rows through the model's GPU head alone (issue 12, fresh settings).

The exported model computes both heads on every row and ends in ``Where(is_cpu > 0.5, cpu, gpu)``;
:func:`app.predictor.onnx_model._head_branch` cuts the else-branch out as a session of its own. These tests pin
that the shipped model gets one, that it answers GPU rows of real graphs with the whole graph's bytes, that a
run holding any CPU row still goes through the whole graph, and that a model of another shape gets none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from app.config import REPO_ROOT
from app.core.analysis import analyze
from app.core.precision import Precision
from app.core.vocab import SoftwareStack
from app.graphs.service import build_graph
from app.hardware.catalog import load_catalog
from app.predictor import onnx_model
from app.predictor.registry import CompositePredictor, load_predictor
from app.predictor.table import LayerTable, Setting
from tests.helpers import light_model


@pytest.fixture(scope="module")
def predictor() -> CompositePredictor:
    return load_predictor(REPO_ROOT / "models")


def _features(predictor: CompositePredictor, kind: str) -> np.ndarray:
    """The learned rows' model inputs of the onnx wheel's ResNet-50 on every catalog GPU (``kind="gpu"``) or on
    the CPUs of the model's training data (``"cpu"``)."""
    graph = build_graph(light_model("resnet50"), "onnx", batch_size=16)
    analysis = analyze(graph, software_stack=SoftwareStack.PYTORCH_EAGER, hardware_kind=kind)
    pairs = analysis.step_layers(False)
    devices = ([h for h in load_catalog().values() if h.kind == kind] if kind == "gpu"
               else list(predictor.learned._cpu_specs.values()))
    table = LayerTable([p[0] for p in pairs], [p[1] for p in pairs], reference=devices[0])
    learned = predictor.learned
    rows = predictor._route(table, kind)[0]
    return np.concatenate([learned._prepare(table, rows, Setting(h, "training", "adam", Precision.FP32)).selected
                           for h in devices])


def test_shipped_model_has_a_gpu_branch(predictor: CompositePredictor) -> None:
    branch = predictor.learned._branch
    assert branch is not None
    assert branch.column == predictor.learned.feature_names.index("is_cpu")
    assert branch.threshold == 0.5
    assert len(onnx.load(str(REPO_ROOT / "models" / f"{predictor.version}.onnx")).graph.node) > 500


def test_gpu_rows_answer_the_whole_graphs_bytes(predictor: CompositePredictor,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    learned = predictor.learned
    x = _features(predictor, "gpu")
    assert not (x[:, learned._branch.column] > 0.5).any()
    for m in (1, 3, 4, 7, 44, len(x)):  # remainders of ORT_ROW_BLOCK and the catalog's every GPU at once
        run = np.ascontiguousarray(x[:m])
        assert learned._run(run).tobytes() == learned._session.run(None, {learned._input: run})[0].tobytes()
    calls = []
    real = learned._branch.session.run
    monkeypatch.setattr(learned._branch.session, "run", lambda *a: calls.append(1) or real(*a), raising=False)
    learned._run(np.ascontiguousarray(x[:5]))
    assert calls == [1]  # the GPU head alone answered


def test_a_cpu_row_runs_the_whole_graph(predictor: CompositePredictor) -> None:
    learned = predictor.learned
    x = np.ascontiguousarray(np.concatenate([_features(predictor, "gpu")[:6], _features(predictor, "cpu")[:2]]))
    assert (x[:, learned._branch.column] > 0.5).any()
    out = learned._run(x)
    assert out.tobytes() == learned._session.run(None, {learned._input: x})[0].tobytes()
    # the CPU rows' answer is the CPU head's: the GPU head alone would answer them otherwise
    gpu_only = learned._branch.session.run(None, {learned._input: x})[0]
    assert out[6:].tobytes() != gpu_only[6:].tobytes()


def test_a_model_without_the_where_gets_no_branch(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["features"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "relu.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert onnx_model._head_branch(path, ort.SessionOptions(), session, 4, np.random.default_rng(0)) is None


def test_a_head_that_cannot_be_cut_out_leaves_the_whole_graph_running(monkeypatch: pytest.MonkeyPatch,
                                                                       predictor: CompositePredictor) -> None:
    """The cut is an optimisation: when building it fails (onnxruntime refusing the pruned graph), the predictor
    still loads and answers with the whole graph, the same bytes."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("pruned graph refused")

    monkeypatch.setattr(onnx_model, "_head_branch", broken)
    whole = load_predictor(REPO_ROOT / "models")
    assert whole.learned._branch is None and predictor.learned._branch is not None
    x = _features(predictor, "gpu")[:50]
    assert whole.learned._run(x).tobytes() == predictor.learned._run(x).tobytes()

