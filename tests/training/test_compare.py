"""The quick leave-one-GPU-out comparison scores each variant on held-out chips' validation rows only."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from app.hardware.catalog import load_catalog  # noqa: E402
from app.training.compare import VARIANTS, score_variant  # noqa: E402
from app.training.dataset import load_from_database  # noqa: E402
from app.training.train import DEFAULTS, gpu_group, splits  # noqa: E402
from tests.helpers import SHARED_DATA  # noqa: E402

needs_data = pytest.mark.skipif(not (SHARED_DATA / "justus2018").is_dir(), reason="no Justus data")


def test_variants_are_subsets_of_the_feature_schema() -> None:
    from app.core.features import FEATURE_NAMES

    for name, (names, _) in VARIANTS.items():
        assert set(names) <= set(FEATURE_NAMES) and "log_floor_ms" in names and "is_train" in names, name
    from app.training.compare import ABSOLUTE_HW
    from app.training.train import MEMBER_FEATURES, MODEL_FEATURES, V3_FEATURES

    assert VARIANTS["v3"][0] == V3_FEATURES  # v3's features, the datasheet-aware member of the shipped mix
    assert VARIANTS["mixed_ensemble"] == (MODEL_FEATURES, {"balance": "source", "member_features": MEMBER_FEATURES})
    for member in MEMBER_FEATURES:
        assert set(member) <= set(MODEL_FEATURES)
    assert not set(ABSOLUTE_HW) & set(MEMBER_FEATURES[1])  # the device-blind member
    assert set(ABSOLUTE_HW) <= set(VARIANTS["v3"][0])  # v3 reads the datasheet figures themselves
    assert not set(ABSOLUTE_HW) & set(VARIANTS["v4"][0])  # v4 reads them only as per-SM, per-cycle ratios


@needs_data
def test_score_variant_holds_out_each_chip_and_scores_validation_rows(justus_db: str) -> None:
    d = load_from_database(justus_db, sources=("justus2018",), sample_per_file=60, seed=0)
    tr, va, _ = splits(d, None, seed=0)
    recipe = {**DEFAULTS, **VARIANTS["v4"][1], "epochs": 1, "hidden": 8, "depth": 1}
    res = score_variant(tr, va, names=VARIANTS["v4"][0], recipe=recipe, seed=0, log=lambda s: None)
    chips = set(gpu_group(va.gpu, load_catalog()).tolist())
    assert set(res["by_gpu"]) == chips and len(chips) >= 2  # one fold per chip with validation rows
    assert set(res["by_source"]) == {"justus"}
    assert res["score"] == pytest.approx(np.mean(list(res["by_source"].values())), abs=0.01)
    assert all(np.isfinite(v) and v > 0 for v in res["by_gpu"].values())
