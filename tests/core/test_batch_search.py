"""``largest_batch_that_fits``: the secant search on the (piecewise) affine peak answers what a bisection over
:func:`app.core.memory.footprint` answers, with a handful of footprint evaluations, on real graphs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import app.core.memory as memory
from app.core.analysis import GraphAnalysis, analyze
from app.core.hardware import HardwareSpec
from app.core.vocab import SoftwareStack
from app.graphs.service import build_graph
from app.hardware.catalog import load_catalog
from tests.helpers import light_model

# (mode, optimizer, precision, activation checkpointing)
SETTINGS = [("training", "adam", "fp32", False), ("training", "sgd", "fp16", True),
            ("inference", "sgd", "bf16", False), ("training", "adamw", "bf16", False),
            ("training", "momentum", "fp32", True)]
DEVICES = ["k40", "v100-sxm2-16gb", "a10", "a100-sxm4-80gb", "h200", "mi250x"]


def bisection(analysis: GraphAnalysis, *, memory_bytes: float, max_batch: int = 1 << 20, **kw: Any) -> int:
    """The reference: doubling then bisection over exact footprints (the search this module replaced)."""

    def ok(b: int) -> bool:
        return memory.fits(memory.footprint(analysis, batch_size=b, **kw), memory_bytes)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_batch and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@pytest.fixture(scope="module", params=["resnet50", "bert", "gpt2"])
def graph(request: pytest.FixtureRequest) -> GraphAnalysis:
    if request.param == "resnet50":
        g = build_graph(light_model("resnet50"), "onnx", batch_size=8)
    else:
        from tests.core.real_models import exported

        e = exported(request.param)
        g = build_graph(e.onnx_bytes, "onnx", batch_size=4, dims={"seq": 64})
    return analyze(g, software_stack=SoftwareStack.PYTORCH_EAGER)


@pytest.fixture(scope="module")
def resnet() -> GraphAnalysis:
    g = build_graph(light_model("resnet50"), "onnx", batch_size=8)
    return analyze(g, software_stack=SoftwareStack.PYTORCH_EAGER)


def _cases() -> Iterator[tuple[HardwareSpec, tuple[str, str, str, bool]]]:
    catalog = load_catalog()
    for d in DEVICES:
        for s in SETTINGS:
            yield catalog[d], s


def test_same_answer_as_bisection_with_few_footprints(graph: GraphAnalysis,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    exact = memory.footprint
    calls = [0]

    def counted(*a: Any, **k: Any) -> memory.MemoryFootprint:
        calls[0] += 1
        return exact(*a, **k)

    worst = 0
    for hw, (mode, opt, prec, ckpt) in _cases():
        kw = {"mode": mode, "optimizer": opt, "precision": prec, "hardware": hw, "activation_checkpointing": ckpt}
        want = bisection(graph, memory_bytes=hw.memory_bytes, **kw)
        monkeypatch.setattr(memory, "footprint", counted)
        calls[0] = 0
        got = memory.largest_batch_that_fits(graph, memory_bytes=hw.memory_bytes, **kw)
        monkeypatch.setattr(memory, "footprint", exact)
        assert got == want, (hw.id, kw)
        assert want > 0
        worst = max(worst, calls[0])
    assert worst <= 12  # a bisection up to these batches takes 14-30


@pytest.mark.parametrize("memory_bytes", [1e3, 3e8, 5e8, 2e9, 1e15])
@pytest.mark.parametrize("max_batch", [1, 7, 1 << 20])
def test_edges_nothing_fits_and_the_cap(memory_bytes: float, max_batch: int, resnet: GraphAnalysis) -> None:
    a = resnet
    kw = {"mode": "training", "optimizer": "adam", "precision": "fp32", "hardware": None}
    want = bisection(a, memory_bytes=memory_bytes, max_batch=max_batch, **kw)
    assert memory.largest_batch_that_fits(a, memory_bytes=memory_bytes, max_batch=max_batch, **kw) == want
    if memory_bytes == 1e3:
        assert want == 0
    if memory_bytes == 1e15:
        assert want == max_batch
