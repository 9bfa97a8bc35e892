"""The vectorised layer table equals the scalar definitions it replaces, row by row, on real graphs.

Every serving path (single, batch, job estimates, comparisons) featurises, floors and clamps layers through
:mod:`app.predictor.table`; training featurises through :func:`app.core.features.raw_matrix`. These tests pin
that both give the same numbers (exact equality, float64) on ResNet-50 and BERT-base for every catalog device,
precision, mode, optimizer and stack, so the one feature function stays one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from app.config import REPO_ROOT
from app.core.analysis import GraphAnalysis, analyze
from app.core.features import FeatureInput, raw_matrix
from app.core.precision import (
    Precision,
    PrecisionNotSupported,
    check_precision,
    cost_at_precision,
    floors_by_pass_ms,
    op_precision,
)
from app.core.vocab import SoftwareStack
from app.graphs.service import build_graph
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery
from app.predictor.registry import load_predictor
from app.predictor.table import LayerTable, Setting, floors_for, op_peaks, raw_for, roofline_for
from tests.helpers import light_model

STACKS = (SoftwareStack.PYTORCH_EAGER, SoftwareStack.TF1_SESSION, SoftwareStack.PYTORCH_CUDA_GRAPH)


@pytest.fixture(scope="module")
def resnet() -> GraphAnalysis:
    graph = build_graph(light_model("resnet50"), "onnx", batch_size=8)
    return analyze(graph, software_stack=SoftwareStack.PYTORCH_EAGER)


@pytest.fixture(scope="module")
def bert() -> GraphAnalysis:
    from tests.core.real_models import exported

    e = exported("bert")
    return analyze(build_graph(e.onnx_bytes, "onnx", batch_size=4, dims={"seq": 64}),
                   software_stack=SoftwareStack.PYTORCH_EAGER)


def _table(a: GraphAnalysis) -> LayerTable:
    pairs = [(la, c) for la, c in zip(a.graph.layers, a.costs, strict=True) if c.supported]
    return LayerTable([p[0] for p in pairs], [p[1] for p in pairs], reference=load_catalog()["a100-sxm4-40gb"])


def _settings():  # noqa: ANN202 - (hardware, precision) pairs the device supports
    for hw in load_catalog().values():
        for p in Precision:
            try:
                yield hw, check_precision(hw, p)
            except PrecisionNotSupported:
                continue


@pytest.mark.parametrize("graph", ["resnet", "bert"])
def test_raw_features_equal_the_training_feature_function(graph: str, request: pytest.FixtureRequest) -> None:
    table = _table(request.getfixturevalue(graph))
    checked = 0
    for hw, p in _settings():
        for pass_, opt in (("forward", "none"), ("train_step", "adam"), ("train_step", "nesterov")):
            stack = STACKS[checked % len(STACKS)].value
            want = raw_matrix([FeatureInput(la, c, hw, pass_, opt, str(p), stack)
                               for la, c in zip(table.layers, table.costs, strict=True)])
            got = raw_for(table, hw, pass_=pass_, optimizer=opt, precision=str(p), stack=stack)
            np.testing.assert_array_equal(got, want, err_msg=f"{hw.id} {p} {pass_} {opt}")
            checked += 1
    assert checked > 100


def test_floors_peaks_and_roofline_equal_the_scalar_definitions(resnet: GraphAnalysis) -> None:
    table = _table(resnet)
    for hw, p in _settings():
        peaks = op_peaks(table, hw, p)
        assert peaks.tolist() == [op_precision(hw, p, la.kind).peak_flops_per_s for la in table.layers]
        floors = floors_for(table, hw, p, "adam")
        for training in (True, False):
            want = [floors_by_pass_ms(la, c, hw, p, training=training, optimizer="adam")
                    for la, c in zip(table.layers, table.costs, strict=True)]
            got = np.stack(floors.by_pass(training=training), axis=1)
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"{hw.id} {p} {training}")
        roof = roofline_for(table, hw, p, training=True)
        for i, (la, c) in enumerate(zip(table.layers, table.costs, strict=True)):
            r = cost_at_precision(la, c, p)
            assert roof.flops[i] == c.forward_flops + c.backward_flops
            assert roof.nbytes[i] == r.forward_bytes + r.backward_bytes


def same(a: list[LayerTimeEstimate], b: list[LayerTimeEstimate]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.method, x.notes, x.out_of_distribution, x.floor_clamped) == (
            y.method, y.notes, y.out_of_distribution, y.floor_clamped)
        assert [x.forward_ms, x.backward_ms, x.update_ms, x.total_ms_p10, x.total_ms_p90] == pytest.approx(
            [y.forward_ms, y.backward_ms, y.update_ms, y.total_ms_p10, y.total_ms_p90], rel=1e-6)


def test_estimate_tables_equals_per_query_estimates_in_any_grouping(resnet: GraphAnalysis) -> None:
    """One table for the whole graph, or the queries in mixed order over two devices: the same answers."""
    predictor = load_predictor(REPO_ROOT / "models")
    table = _table(resnet)
    cat = load_catalog()
    a100, t4 = cat["a100-sxm4-40gb"], cat["t4"]
    s1 = Setting(a100, "training", "adam", Precision.BF16)
    s2 = Setting(t4, "inference", "none", Precision.FP32)
    whole = predictor.estimate_tables([(table, np.arange(len(table)), s1), (table, np.arange(len(table)), s2)])
    queries = [LayerTimeQuery(la, c, s.hardware, s.mode, s.optimizer, s.precision)
               for la, c in zip(table.layers, table.costs, strict=True) for s in (s1, s2)]
    mixed = predictor.estimate(queries)
    # onnxruntime's float32 kernels may round the same row differently in batches of another size: equal to
    # 1e-6, every note and method identical
    same(mixed[0::2], whole[0].to_list())
    same(mixed[1::2], whole[1].to_list())
    assert {e.method for e in mixed} == {"learned", "roofline"}
    # a subset of rows answers exactly those rows
    idx = np.arange(0, len(table), 7)
    (part,) = predictor.estimate_tables([(table, idx, s1)])
    same(part.to_list(), [whole[0].to_list()[i] for i in idx.tolist()])


def test_unseen_cpu_and_seen_cpu_take_the_stored_spec_only_when_identical() -> None:
    """A CPU equal in identity to a training CPU is featurised with the stored spec (no 'not in the training
    data' note); another CPU is not."""
    predictor = load_predictor(REPO_ROOT / "models")
    cpus = list(predictor.learned._cpu_specs.values())
    if not cpus:
        pytest.fail("the shipped predictor lists no training CPU")
    seen = cpus[0]
    other = dataclasses.replace(seen, name="another cpu", id="other-cpu")
    a = analyze(build_graph(light_model("resnet50"), "onnx", batch_size=2),
                software_stack=SoftwareStack.PYTORCH_EAGER)
    table = _table(a)
    e_seen, e_other = predictor.estimate_tables([
        (table, np.arange(len(table)), Setting(seen, "inference", "none", Precision.FP32)),
        (table, np.arange(len(table)), Setting(other, "inference", "none", Precision.FP32))])
    assert not any("not in the training data" in n for ns in e_seen.notes for n in ns)
    learned = [ns for ns, m in zip(e_other.notes, e_other.method, strict=True) if m == "learned"]
    assert learned and all(any("not in the training data" in n for n in ns) for ns in learned)
