"""The images next to the reports: the loss curve and predicted vs measured per device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from app.training.plots import error_plots, loss_curve  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == PNG
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_loss_curve_is_a_png_and_refuses_no_data(tmp_path: Path) -> None:
    path = loss_curve(tmp_path / "loss.png", {"gpu 1": [1.0, 0.5, 0.3], "cpu 1": [0.8, 0.4]}, title="t")
    assert _size(path) == (700, 450)
    with pytest.raises(ValueError, match="no loss"):
        loss_curve(tmp_path / "none.png", {"gpu 1": []}, title="t")


def test_error_plots_have_one_panel_per_device(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    measured = rng.lognormal(0, 1, 300)
    hardware = np.array(["p100", "v100-sxm2-16gb", "a100-sxm4-40gb", "t4", "cpu"] * 60)
    path = error_plots(tmp_path / "errors.png", hardware=hardware, measured_ms=measured,
                       predicted_ms=measured * rng.lognormal(0, 0.1, 300), title="t")
    assert _size(path) == (4 * 320, int(2 * 300 + 40))  # 5 devices: a 4 x 2 grid
    with pytest.raises(ValueError, match="equal length"):
        error_plots(tmp_path / "bad.png", hardware=hardware[:3], measured_ms=measured, predicted_ms=measured,
                    title="t")
