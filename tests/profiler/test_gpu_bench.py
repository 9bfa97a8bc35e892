"""The GPU measurement session (app.profiler.gpu_bench): its --smoke run on CPU goes through the real
importer into the measurement database and out again as training rows; the full session is well formed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from app.core.ir import OpKind
from app.core.json_import import import_json
from app.profiler import gpu_bench
from app.profiler.sampler import FAMILY_KIND, sample_configs
from tests.helpers import import_measurements

pytest.importorskip("torch")


def test_smoke_run_is_imported_with_its_context_and_read_back_as_training_rows(tmp_path: Path) -> None:
    from app.measurements.models import Measurement
    from app.training.dataset import iterations_from_database, load_from_database

    out = tmp_path / "bench"
    assert gpu_bench.main(["--smoke", "--out-dir", str(out), "--tag", "smoke"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["e2e_smoke.jsonl", "layers_smoke.jsonl"]
    url = f"sqlite:///{tmp_path / 'm.db'}"
    import_measurements(url, "profiler", "--data-dir", str(out), "--hardware-id", "local")
    with Session(create_engine(url)) as s:
        rows = s.scalars(select(Measurement).where(Measurement.source == "profiler")).all()
    by = Counter((r.granularity, r.precision) for r in rows)
    assert by[("layer", "fp32")] > 0 and by[("layer", "bf16")] > 0
    assert by[("iteration", "fp32")] > 0 and by[("iteration", "bf16")] > 0
    assert not any(r.precision == "tf32" for r in rows)  # TF32 has no CPU meaning: the smoke run skips it
    for r in rows:
        assert r.software_stack == "pytorch-eager" and r.time_ms_median > 0
        assert r.context["granularity"] == r.granularity and r.context["framework"] == "torch"
        assert r.context["device_name"] and r.context["framework_version"]
        assert "matmul_allow_tf32" in r.context["precision_flags"]
    # the same path retraining reads: layers rebuilt from their configs, iterations with their graphs
    train = load_from_database(url, sources=("profiler",))
    assert len(train) > 0 and set(train.precision) == {"fp32", "bf16"}
    iters = iterations_from_database(url)
    assert {it["precision"] for it in iters} == {"fp32", "bf16"}
    # a rerun skips what is done
    before = [p.read_text() for p in sorted(out.iterdir())]
    assert gpu_bench.main(["--smoke", "--out-dir", str(out), "--tag", "smoke"]) == 0
    assert [p.read_text() for p in sorted(out.iterdir())] == before


def test_full_session_plan_covers_the_kernel_families_and_six_models() -> None:
    kinds = {FAMILY_KIND[f] for f in gpu_bench.KERNEL_FAMILIES}
    assert {OpKind.GEMM, OpKind.MATMUL, OpKind.CONV, OpKind.NORM, OpKind.BATCHNORM, OpKind.ACTIVATION,
            OpKind.SOFTMAX} <= kinds and "attention" in gpu_bench.KERNEL_FAMILIES
    configs = sample_configs(1000, seed=1, families=gpu_bench.KERNEL_FAMILIES, max_train_ms=1500.0)
    assert len(configs) == 1000 and len({c.config_id for c in configs}) == 1000
    assert len(configs) * len(gpu_bench.PRECISIONS) == 3000
    assert set(Counter(c.family for c in configs)) == set(gpu_bench.KERNEL_FAMILIES)
    assert len(gpu_bench.MODELS) == 6 and len({m.name for m in gpu_bench.MODELS}) == 6
    for m in gpu_bench.MODELS:
        for b in m.batches:
            assert import_json(m.config["doc"], batch_size=b).layers  # the graph layercast predicts


def test_precision_mode_sets_and_restores_the_tf32_flags() -> None:
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with gpu_bench.precision_mode("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    with gpu_bench.precision_mode("fp32"):  # PyTorch's defaults
        assert not torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
    with pytest.raises(ValueError), gpu_bench.precision_mode("fp8"):
        pass


def test_a_cuda_run_without_a_gpu_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_bench.main(["--out-dir", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())
