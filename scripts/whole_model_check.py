"""Predicted whole-model training throughput next to published figures (docs/physics_and_fusion.md).

Usage: ``PYTHONPATH=. python scripts/whole_model_check.py [--bert]`` (ResNet-50 ~10 s; ``--bert`` exports
BERT-base from its ``transformers`` config, ~1 min, and needs the ``train`` extra).

ResNet-50: the light model-zoo ResNet-50 of the onnx wheel at batch 256, SGD with momentum, against the
figures of ``tests/predictions/test_published_throughput.py`` (the committed check, band 0.6x-1.6x).
BERT-base: ``transformers`` BertModel (tests/core/real_models.py) at sequence 384, batch 32, AdamW, against
Lambda's ``bert_base_squad`` column (``pytorch/pytorch-train-throughput-{fp16,fp32}.csv``, NGC PyTorch 22.10,
2023, commit 0551cb70ffdc155dc4cb2c10dddebb65651c3883; SQuAD fine-tuning, sequences/s; "fp32" is TF32 on
Ampere and newer), the committed check's ``BERT_PUBLISHED`` (same band).
``--inference``: ResNet-50 inference latency against DeepLearningExamples' published "Latency Avg" (V100 16GB
and T4, FP32 and AMP, batch 1 / 8 / 64 / 256; :data:`INFERENCE_PUBLISHED_MS`). Not a committed check: the
launch-bound batch sizes fall outside the band (docs/physics_and_fusion.md says why).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from app.estimates.cli import JobParams, OfflineBackend
from tests.helpers import light_model
from tests.predictions.test_published_throughput import (
    BERT_JOB,
    BERT_PUBLISHED,
    MODELS_DIR,
    PUBLISHED,
    RESNET_JOB,
    predicted_samples_per_s,
)

# ResNet-50 v1.5 inference latency, ms per batch (DeepLearningExamples, the README and commit of the training
# figures, "Inference performance results", pytorch-21.03 NGC container, "Latency Avg"): 1x V100 16GB (DGX-1)
# and T4, FP32 and mixed precision (AMP, autocast fp16).
INFERENCE_PUBLISHED_MS: dict[tuple[str, str], dict[int, float]] = {
    ("v100-sxm2-16gb", "fp32"): {1: 10.37, 8: 11.5, 64: 55.4, 256: 214.48},
    ("v100-sxm2-16gb", "fp16"): {1: 12.78, 8: 13.65, 64: 23.18, 256: 84.14},
    ("t4", "fp32"): {1: 10.7, 8: 22.41, 64: 152.73, 256: 635.98},
    ("t4", "fp16"): {1: 12.96, 8: 12.82, 64: 57.41, 256: 225.95},
}


def inference_rows(model: Path) -> list[str]:
    """One markdown row per (device, precision, batch) of :data:`INFERENCE_PUBLISHED_MS`: predicted ms per batch
    (offline path, shipped predictor, PyTorch eager), published ms and the ratio."""
    backend = OfflineBackend(MODELS_DIR)
    out = []
    for (hw, precision), table in INFERENCE_PUBLISHED_MS.items():
        for batch, published in table.items():
            pred = backend.predict(model, hw, JobParams(mode="inference", precision=precision, batch_size=batch))
            ms = float(pred["iteration"]["time_ms"])
            out.append(f"| {hw} | {precision} | {batch} | {ms:.2f} | {published:.2f} | {ms / published:.2f}x |")
    return out


def rows(model: Path, table: dict[tuple[str, str], dict[str, float]], job: dict[str, object]) -> list[str]:
    out = []
    for (hw, prec), sps in predicted_samples_per_s(model, table, job).items():
        cells = ", ".join(f"{src} {v:.0f} ({sps / v:.2f}x)" for src, v in table[(hw, prec)].items())
        out.append(f"| {model.stem} | {hw} | {prec} | {sps:.0f} | {cells} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bert", action="store_true")
    p.add_argument("--inference", action="store_true", help="ResNet-50 inference latency instead")
    args = p.parse_args(argv)
    if args.inference:
        with tempfile.TemporaryDirectory() as d:
            r50 = Path(d) / "resnet50.onnx"
            r50.write_bytes(light_model("resnet50"))
            print("\n".join(["| hardware | precision | batch | predicted ms | published ms | ratio |",
                             "|---|---|---|---|---|---|", *inference_rows(r50)]))
        return 0
    lines = ["| model | hardware | precision | predicted /s | published (ratio) |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        r50 = Path(d) / "resnet50.onnx"
        r50.write_bytes(light_model("resnet50"))
        lines += rows(r50, PUBLISHED, RESNET_JOB)
        if args.bert:
            from tests.core.real_models import exported

            bert = Path(d) / "bert_base.onnx"
            bert.write_bytes(exported("bert").onnx_bytes)
            lines += rows(bert, BERT_PUBLISHED, BERT_JOB)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
