"""Progress bars with ETA of the long commands (tqdm on stderr; forced on or off by LAYERCAST_PROGRESS)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from tests.helpers import REPO

#: tqdm's "<elapsed><<remaining>" field: the remaining time is the ETA.
ETA = r"\[\d\d:\d\d<\d\d:\d\d"


def test_import_shows_a_progress_bar_with_eta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from app.measurements.cli import main

    monkeypatch.setenv("LAYERCAST_PROGRESS", "1")
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert main(["profiler", "--data-dir", str(REPO / "data" / "seed"), "--database-url", url,
                 "--limit", "20"]) == 0
    captured = capsys.readouterr()
    # tqdm's bar: "import profiler: 100%|...| 1.2M/1.2M [00:01<00:00, ...]" (elapsed<remaining is the ETA)
    assert re.search(r"import profiler: 100%\|.*\| [0-9.]+[kM]?/[0-9.]+[kM]?B? " + ETA, captured.err)
    assert "import profiler" not in captured.out  # stdout keeps only the report
    monkeypatch.setenv("LAYERCAST_PROGRESS", "0")
    assert main(["profiler", "--data-dir", str(REPO / "data" / "seed"), "--database-url", url,
                 "--limit", "20"]) == 0
    assert "import profiler:" not in capsys.readouterr().err


def test_profile_progress_is_a_bar_with_eta_or_log_lines(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from app.profiler.run import Progress

    monkeypatch.setenv("LAYERCAST_PROGRESS", "1")
    bar = Progress(3)
    for status in ("ok", "error", "ok"):
        bar.update(status=status, label="conv/fp32")
    bar.close()
    err = capsys.readouterr().err
    assert re.search(r"profile: 100%\|.*\| 3/3 " + ETA, err) and "ok 2 err 1" in err
    monkeypatch.setenv("LAYERCAST_PROGRESS", "0")  # a log file: plain lines (the first, every 15 s, the last)
    log = io.StringIO()
    lines = Progress(2, stream=log)
    lines.update(status="ok", label="conv/fp32")
    lines.update(status="skipped", label="conv/fp32")
    last = log.getvalue().splitlines()[-1]
    assert last.startswith("[     2/2] 100.0%  ok 1  err 0  skipped 1") and "eta" in last
