"""Fresh-device predictions (issue 12): the fast paths answer byte for byte what the plain paths answer.

Four shortcuts serve a prediction on a device x precision no memo holds: onnxruntime runs each distinct
feature row once (:func:`app.predictor.onnx_model._run_distinct`) through the model's GPU head alone when every
row is a GPU row (:func:`app.predictor.onnx_model._head_branch`), the roofline fallback estimates each
distinct row once (:meth:`app.predictor.registry.CompositePredictor._fallback_groups`), and a training
footprint replays its layout's walk in numpy (:class:`app.core.memory._Walk`). The reference here switches
all four off (every feature row run through the whole graph, every fallback row estimated, the set-by-set walk
:func:`app.core.memory._walk_sets`) and compares the JSON of whole responses, summary and per-layer, on a
ResNet-50 (the onnx wheel's light model), a transformer-like JSON graph and BERT-base, over devices of
several vendors and generations, three precisions and both modes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from app.config import REPO_ROOT
from app.core import memory
from app.core.analysis import GraphAnalysis, analyze
from app.core.hardware import HardwareSpec
from app.core.ir import Layer, Tensor
from app.core.precision import Precision, PrecisionNotSupported, check_precision
from app.core.vocab import SoftwareStack
from app.graphs import service as graphs
from app.graphs.importer import canonical_json
from app.graphs.service import build_graph
from app.hardware.catalog import load_catalog
from app.predictions import service
from app.predictions.schemas import PredictionCreate
from app.predictor import onnx_model
from app.predictor.registry import CompositePredictor, load_predictor
from app.predictor.table import Setting
from tests.helpers import light_model

DEVICES = ("a100-sxm4-40gb", "h100-sxm", "v100-sxm2-16gb", "mi250x", "l4", "rtx-4090")
PRECISIONS = (Precision.FP32, Precision.FP16, Precision.BF16)

BLOCK = [{"op": "layernorm"}, {"op": "multihead_attention", "num_heads": 4}, {"op": "layernorm"},
         {"op": "linear", "out_features": 1024}, {"op": "gelu"}, {"op": "linear", "out_features": 256},
         {"op": "dropout"}]
TRANSFORMER = {"name": "fresh-transformer", "input_shape": [64, 256],
               "layers": [*BLOCK * 6, {"op": "linear", "out_features": 1000}]}


def _analysis(name: str) -> GraphAnalysis:
    if name == "resnet50":
        graph = build_graph(light_model("resnet50"), "onnx", batch_size=16)
    elif name == "transformer":
        graph = build_graph(canonical_json(TRANSFORMER), "json", batch_size=16)
    else:
        from tests.core.real_models import exported

        graph = build_graph(exported(name).onnx_bytes, "onnx", batch_size=8, dims={"seq": 64})
    return analyze(graph, software_stack=SoftwareStack.PYTORCH_EAGER)


@pytest.fixture(scope="module")
def predictor() -> CompositePredictor:
    return load_predictor(REPO_ROOT / "models")


class _SetWalk:
    """The reference footprint: the set-by-set walk in place of the compiled one."""

    def __init__(self, layout: memory.Layout, layers: Sequence[Layer], outputs: Sequence[Tensor]) -> None:
        self.layout, self.layers, self.outputs = layout, layers, outputs

    def footprint(self, scale: float, *, runtime: memory.DeviceRuntime, states: int,
                  precision: str) -> memory.MemoryFootprint:
        return memory._walk_sets(self.layers, self.outputs, self.layout, scale, runtime=runtime, states=states,
                                 precision=precision, activation_checkpointing=False)


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch, predictor: CompositePredictor) -> Callable[[], Iterator[None]]:
    """A context in which every shortcut is off (see the module docstring)."""
    from contextlib import contextmanager

    @contextmanager
    def off() -> Iterator[None]:
        with monkeypatch.context() as m:
            m.setattr(predictor.learned, "distinct_rows", False)
            m.setattr(predictor.learned, "_branch", None)
            m.setattr(CompositePredictor, "_fallback_groups",
                      lambda self, table, reasons, s: np.arange(len(table), dtype=np.intp))
            m.setattr(memory, "_compile_walk", _SetWalk)
            yield

    return off


def _responses(analysis: GraphAnalysis, predictor: CompositePredictor, requests: Sequence[PredictionCreate],
               devices: Sequence[HardwareSpec]) -> list[str]:
    """The JSON of each request on a fresh binding (nothing memoised: its own table, layouts and estimates)."""
    bound = graphs.BoundGraph(key=None, analysis=analysis, graph_id=None, nbytes=0)
    return [service.estimate(analysis, hw, predictor, request=r, graph_id=None, bound=bound).model_dump_json()
            for r, hw in zip(requests, devices, strict=True)]


@pytest.mark.parametrize("model", ["resnet50", "transformer", pytest.param("bert", marks=pytest.mark.slow)])
def test_fresh_device_predictions_equal_the_plain_paths(model: str, predictor: CompositePredictor,
                                                        plain: Any) -> None:
    analysis = _analysis(model)
    catalog = load_catalog()
    requests, devices = [], []
    for hw_id in DEVICES:
        hw = catalog[hw_id]
        for precision in PRECISIONS:
            try:
                check_precision(hw, precision)
            except PrecisionNotSupported:
                continue
            for mode, detail in (("training", "summary"), ("training", "layers"), ("inference", "layers")):
                requests.append(PredictionCreate.model_validate({
                    "graph": {"name": "x", "input_shape": [1], "layers": [{"op": "relu"}]},  # not read by estimate
                    "hardware_id": hw_id, "batch_size": analysis.graph.batch_size, "mode": mode,
                    "precision": precision.value, "detail": detail}))
                devices.append(hw)
    fast = _responses(analysis, predictor, requests, devices)
    with plain():
        reference = _responses(analysis, predictor, requests, devices)
    assert len(fast) >= 30
    for f, r, req in zip(fast, reference, requests, strict=True):
        assert f == r, (req.hardware_id, req.precision, req.mode, req.detail)


def test_distinct_rows_are_run_once_and_answer_what_every_row_answers(predictor: CompositePredictor) -> None:
    learned = predictor.learned
    analysis = _analysis("transformer")
    bound = graphs.BoundGraph(key=None, analysis=analysis, graph_id=None, nbytes=0)
    catalog = load_catalog()
    feats = []
    for hw_id in ("a100-sxm4-40gb", "mi250x"):
        table = bound.table(catalog[hw_id])
        rows, _ = predictor._route(table, "gpu")
        s = Setting(catalog[hw_id], "training", "adam", Precision.FP16)
        feats.append(learned._prepare(table, rows, s).selected)
    x = np.concatenate(feats)
    counted: list[int] = []

    def run(rows: np.ndarray) -> np.ndarray:
        counted.append(len(rows))
        return learned._run(rows)

    assert learned.distinct_rows  # this machine's onnxruntime computes whole row blocks row by row
    for m in range(len(x) - 7, len(x) + 1):  # every remainder of the row block
        counted.clear()
        got = onnx_model._run_distinct(run, np.ascontiguousarray(x[:m]))
        assert got.tobytes() == learned._run(np.ascontiguousarray(x[:m])).tobytes()
        assert counted == [counted[0]] and counted[0] < m / 2  # one run, over far fewer rows


def test_distinct_rows_only_with_one_onnxruntime_thread() -> None:
    """With several intra-op threads MLAS shares a run's rows among them by its length, so the distinct-row run
    would not reproduce a large run bit for bit (the small runs of the load-time check do not show it)."""
    assert load_predictor(REPO_ROOT / "models", threads=1).learned.distinct_rows
    assert not load_predictor(REPO_ROOT / "models", threads=2).learned.distinct_rows


def test_a_run_that_depends_on_its_neighbours_is_detected() -> None:
    rng = np.random.default_rng(0)
    assert onnx_model._distinct_run_reproduces(lambda x: x[:, :3] * 2.0, 8, rng)
    assert not onnx_model._distinct_run_reproduces(lambda x: x[:, :3] + float(len(x)), 8, rng)


@pytest.mark.parametrize("model", ["resnet50", "transformer"])
def test_the_compiled_footprint_walk_equals_the_set_walk(model: str) -> None:
    analysis = _analysis(model)
    layers, outputs = analysis.graph.layers, analysis.graph.outputs
    catalog = load_catalog()
    n = 0
    for hw in [*(catalog[d] for d in DEVICES), None]:  # None: a CPU
        for precision in ("fp32", "fp16", "bf16"):
            layout = memory.memory_layout(analysis, precision=precision, hardware=hw)
            for optimizer in ("sgd", "momentum", "adam"):
                states = memory.OPTIMIZERS[optimizer][1]
                for batch in (1, 7, 16, 300, 65536):
                    got = memory.footprint(analysis, mode="training", optimizer=optimizer, precision=precision,
                                           hardware=hw, batch_size=batch, layout=layout)
                    ref = memory._walk_sets(layers, outputs, layout, batch / analysis.graph.batch_size,
                                            runtime=memory.runtime_for(hw), states=states, precision=precision,
                                            activation_checkpointing=False)
                    assert got == ref, (hw and hw.id, precision, optimizer, batch)
                    n += 1
    assert n == 7 * 3 * 3 * 5


@pytest.mark.parametrize("model", ["resnet50", "transformer"])
def test_costs_at_a_precision_are_computed_once_per_twin_and_equal_each_rows_own(model: str) -> None:
    from app.core.precision import cost_at_precision

    analysis = _analysis(model)
    table = graphs.BoundGraph(key=None, analysis=analysis, graph_id=None, nbytes=0).table(load_catalog()[DEVICES[0]])
    assert len(set(table.twins())) < len(table) / 2  # repeated blocks
    for precision in (*PRECISIONS, Precision.TF32, Precision.FP32_STRICT):
        got = table.rescaled(precision).costs
        for layer, cost, at in zip(table.layers, table.costs, got, strict=True):
            own = cost_at_precision(layer, cost, precision)
            assert at == own and (at is cost) == (own is cost), (layer.name, precision)
