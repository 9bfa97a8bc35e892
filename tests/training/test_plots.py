"""The images next to the reports (loss curve, predicted vs measured per device) and the progress bars of
the long commands."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from app.training.plots import error_plots, loss_curve  # noqa: E402
from tests.helpers import REPO  # noqa: E402

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


def test_import_shows_a_progress_bar_with_eta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from app.measurements.cli import main

    monkeypatch.setenv("LAYERCAST_PROGRESS", "1")
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert main(["profiler", "--data-dir", str(REPO / "data" / "seed"), "--database-url", url,
                 "--hardware-id", "local", "--limit", "20"]) == 0
    captured = capsys.readouterr()
    # tqdm's bar: "import profiler: 100%|...| 1.2M/1.2M [00:01<00:00, ...]" (elapsed<remaining is the ETA)
    assert re.search(r"import profiler: 100%\|.*\| [0-9.]+[kM]?/[0-9.]+[kM]?B? \[\d\d:\d\d<\d\d:\d\d", captured.err)
    assert "import profiler" not in captured.out  # stdout keeps only the report
    monkeypatch.setenv("LAYERCAST_PROGRESS", "0")
    assert main(["profiler", "--data-dir", str(REPO / "data" / "seed"), "--database-url", url,
                 "--hardware-id", "local", "--limit", "20"]) == 0
    assert "import profiler:" not in capsys.readouterr().err
