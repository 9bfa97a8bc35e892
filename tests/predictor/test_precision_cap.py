"""A tensor-core answer is never above the strict-fp32 answer of the same layer (issue 8: precision dominance).

The learned model predicts GEMMs under TF32 and autocast fp16/bf16 directly (Vidur's fp16 rows showed it GEMMs on
tensor cores); alone it answered 14-17 % of single conv/linear layers under tf32 slower than strict fp32 on the
A10, L4, H100 and H200, up to 3.4x. The served forward, less autocast's weight cast, is capped by the strict-fp32
forward of the same layer on the same device and stack.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.core.costs import layer_cost
from app.core.ir import Layer
from app.core.json_import import import_json
from app.core.precision import Precision, autocast_cast_bytes, check_precision
from app.core.vocab import SoftwareStack
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeQuery
from app.predictor.registry import load_predictor
from app.predictor.roofline import KERNEL_FLOOR_MS_BY_STACK, autocast_weight_cast_ms

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
CAP_NOTE = "capped at its fp32-strict prediction"


def _linears() -> list[Layer]:
    """Single ``nn.Linear`` layers K -> N at batch 1-4096 (the grid of scripts/monotonicity_check.py)."""
    out = []
    for b in (1, 8, 64, 512, 4096):
        for k in (256, 1024, 4096):
            for n in (256, 1024, 4096):
                out.extend(import_json({"input_shape": [k], "layers": [{"op": "linear", "out_features": n}]},
                                       batch_size=b).layers)
    return out


@pytest.fixture(scope="module")
def predictor():  # type: ignore[no-untyped-def]
    return load_predictor(MODELS_DIR)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_tensor_core_forward_never_above_strict_fp32(predictor, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Every catalog GPU x TF32/fp16/bf16 it supports x 45 linear layers: served forward less the autocast
    cast, backward and total less the cast <= the strict-fp32 ones (float tolerance), and the cap binds somewhere
    with its note."""
    layers = _linears()
    capped = 0
    gpus = [hw for hw in load_catalog().values() if hw.kind == "gpu"]
    opt = "adamw" if mode == "training" else "none"
    for hw in gpus:

        def q(p: Precision, la: Layer, hw=hw) -> LayerTimeQuery:  # type: ignore[no-untyped-def]
            return LayerTimeQuery(la, layer_cost(la), hw, mode, opt, p)

        strict = predictor.estimate([q(Precision.FP32_STRICT, la) for la in layers])
        for p in (Precision.TF32, Precision.FP16, Precision.BF16):
            try:
                check_precision(hw, p)
            except Exception:
                continue
            got = predictor.estimate([q(p, la) for la in layers])
            cast_bytes = np.asarray([autocast_cast_bytes(la, p.value, training=mode == "training") for la in layers],
                                    dtype=np.float64)
            cast = autocast_weight_cast_ms(cast_bytes, precision=p.value, hardware=hw,
                                           stack=SoftwareStack.PYTORCH_EAGER,
                                           kernel_ms=KERNEL_FLOOR_MS_BY_STACK[SoftwareStack.PYTORCH_EAGER])
            for la, e, ref, c in zip(layers, got, strict, cast, strict=True):
                # 1e-6: onnxruntime's last bits depend on where a row falls in a run (ORT_ROW_BLOCK)
                assert e.forward_ms - c <= ref.forward_ms * (1 + 1e-6), (hw.id, p.value, la.name)
                assert e.backward_ms <= ref.backward_ms * (1 + 1e-6), (hw.id, p.value, la.name)
                assert e.total_ms - c <= ref.total_ms * (1 + 1e-6), (hw.id, p.value, la.name)
                assert e.total_ms_p10 <= e.total_ms <= e.total_ms_p90
                if any(n.startswith(CAP_NOTE) for n in e.notes):
                    capped += 1
                    assert e.out_of_distribution
    assert capped > 0  # the shipped model needs the cap (else this test shows nothing)


def test_the_cap_is_a_min_over_the_models_own_answer(predictor, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """H100 tf32 and A100 fp16 linear layers, training and inference, against the same predictor with the cap
    switched off: rows without the note answer exactly the uncapped figures (to onnxruntime's row-block last
    bits), rows with it answer less, never more, and not every row is capped."""
    import dataclasses

    from app.predictor import onnx_model

    cat = load_catalog()
    layers = _linears()
    settings = [(cat["h100-sxm"], Precision.TF32, "training", "adamw"), (cat["a100-sxm4-40gb"], Precision.FP16,
                                                                       "inference", "none")]

    def answers() -> list[list]:  # type: ignore[type-arg]
        return [predictor.estimate([LayerTimeQuery(la, layer_cost(la), hw, mode, opt, prec) for la in layers])
                for hw, prec, mode, opt in settings]

    capped = answers()
    prepare = onnx_model.LearnedPredictor._prepare

    def uncapped_prepare(self, table, idx, s):  # type: ignore[no-untyped-def]
        p = prepare(self, table, idx, s)
        none = np.zeros(len(p.idx), dtype=bool)
        return dataclasses.replace(p, cap=none, cap_raw=p.cap_raw[:0], features=p.selected,  # no capped rows
                                   cap_forward_floor_ms=np.zeros(0), cap_backward_floor_ms=np.zeros(0))

    monkeypatch.setattr(onnx_model.LearnedPredictor, "_prepare", uncapped_prepare)
    free = answers()
    n_capped = n_free = 0
    for got, base in zip(capped, free, strict=True):
        for e, u in zip(got, base, strict=True):
            assert not any(n.startswith(CAP_NOTE) for n in u.notes)
            if any(n.startswith(CAP_NOTE) for n in e.notes):
                n_capped += 1
                assert e.total_ms < u.total_ms and e.forward_ms <= u.forward_ms * (1 + 1e-6)
            else:
                n_free += 1
                for a, b in ((e.forward_ms, u.forward_ms), (e.backward_ms, u.backward_ms),
                             (e.total_ms_p10, u.total_ms_p10), (e.total_ms_p90, u.total_ms_p90)):
                    assert a == pytest.approx(b, rel=1e-6)
    assert n_capped > 0 and n_free > 0
