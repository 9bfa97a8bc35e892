"""Predicted whole-model training throughput next to published figures (docs/physics_and_fusion.md).

Usage: ``PYTHONPATH=. python scripts/whole_model_check.py [--bert]`` (ResNet-50 ~10 s; ``--bert`` exports
BERT-base from its ``transformers`` config, ~1 min, and needs the ``train`` extra).

ResNet-50: the light model-zoo ResNet-50 of the onnx wheel at batch 256, SGD with momentum, against the
figures of ``tests/predictions/test_published_throughput.py`` (the committed check, band 0.6x-1.6x).
BERT-base: ``transformers`` BertModel (tests/core/real_models.py) at sequence 384, batch 32, AdamW, against
Lambda's ``bert_base_squad`` column (``pytorch/pytorch-train-throughput-{fp16,fp32}.csv``, NGC PyTorch 22.10,
2023, commit 0551cb70ffdc155dc4cb2c10dddebb65651c3883; SQuAD fine-tuning, sequences/s; "fp32" is TF32 on
Ampere and newer), the committed check's ``BERT_PUBLISHED`` (same band).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.helpers import light_model
from tests.predictions.test_published_throughput import (
    BERT_JOB,
    BERT_PUBLISHED,
    PUBLISHED,
    RESNET_JOB,
    predicted_samples_per_s,
)


def rows(model: Path, table: dict[tuple[str, str], dict[str, float]], job: dict[str, object]) -> list[str]:
    out = []
    for (hw, prec), sps in predicted_samples_per_s(model, table, job).items():
        cells = ", ".join(f"{src} {v:.0f} ({sps / v:.2f}x)" for src, v in table[(hw, prec)].items())
        out.append(f"| {model.stem} | {hw} | {prec} | {sps:.0f} | {cells} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bert", action="store_true")
    args = p.parse_args(argv)
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
