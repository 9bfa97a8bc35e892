"""The callers' docs (``docs/callers/*.md``) run as written: every fenced ``python`` and ``sh`` block of a
page runs, in order and each in a fresh process, against the app served by uvicorn on a free port
(``$LAYERCAST_URL``), in a folder with the models the pages name. ``sh exit=N`` blocks must exit ``N``.

The server runs with the shipped access defaults (anonymous requests get ``read,graphs``; the suite's
conftest widening is undone), and ``$LAYERCAST_API_KEY`` holds a key made with ``layercast keys create``,
as a user would: the pages' writes of measurements and hardware work only because they send it."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from app.auth import Scope
from app.config import Settings
from app.main import create_app
from app.migrate import upgrade
from tests.estimates.models import mlp_onnx
from tests.helpers import REPO, light_model, serve
from tests.security.test_auth import SHIPPED_DEFAULTS, _make_key

DOCS = REPO / "docs" / "callers"
CALLERS = ("ci-pipeline", "comparing-hardware", "scheduler", "nas-loop", "adding-a-gpu")
_BLOCK = re.compile(r"^```(python|sh)([^\n]*)\n(.*?)^```", flags=re.S | re.M)


def blocks(page: Path) -> list[tuple[str, int, str]]:
    """``(language, expected exit status, code)`` of each runnable block of ``page``."""
    out = []
    for lang, info, code in _BLOCK.findall(page.read_text()):
        exit_status = re.search(r"exit=(\d+)", info)
        out.append((lang, int(exit_status.group(1)) if exit_status else 0, code))
    return out


def test_every_caller_has_a_page_with_examples() -> None:
    pages = {p.stem for p in DOCS.glob("*.md")} - {"README"}
    assert pages == set(CALLERS)
    index = (DOCS / "README.md").read_text()
    for name in CALLERS:
        assert f"({name}.md)" in index
        assert len(blocks(DOCS / f"{name}.md")) >= 2, name


def _workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    work = tmp_path / "work"
    (work / "bin").mkdir(parents=True)
    (work / "model.onnx").write_bytes(light_model("resnet50"))
    (work / "baseline.onnx").write_bytes(mlp_onnx(512))
    (work / "candidate.onnx").write_bytes(mlp_onnx(8192))
    shim = work / "bin" / "layercast"  # `layercast` of this checkout, whatever is installed
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m app.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    path = os.pathsep.join([str(work / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "LAYERCAST_MODELS_DIR": str(REPO / "models"),
           "LAYERCAST_PROGRESS": "0"}
    return work, env


@pytest.mark.parametrize("name", CALLERS)
def test_page_examples_run(name: str, settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work, env = _workdir(tmp_path)
    upgrade(settings.database_url)
    env["LAYERCAST_API_KEY"] = _make_key(settings.database_url, name, "read", "graphs", "measurements", "hardware",
                                         capsys=capsys)
    shipped = settings.model_copy(update={**SHIPPED_DEFAULTS, "open_scopes": None, "allowed_hosts": None})
    assert shipped.open_scope_set == {Scope.READ, Scope.GRAPHS}  # the default of a loopback bind
    with serve(create_app(shipped)) as url:
        env["LAYERCAST_URL"] = url
        for i, (lang, expected, code) in enumerate(blocks(DOCS / f"{name}.md")):
            cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
            done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == expected, (
                f"{name}.md block {i + 1} ({lang}) exited {done.returncode}, expected {expected}:\n{code}\n"
                f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
            assert done.stdout.strip(), f"{name}.md block {i + 1} printed nothing"
