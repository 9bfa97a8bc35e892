"""``layercast serve --workers N``: N uvicorn worker processes on one SQLite file answer requests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.cli import _build_parser as build_parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _workers(pid: int) -> list[psutil.Process]:
    """uvicorn's worker processes (multiprocessing spawns; its resource tracker excluded)."""
    return [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]


def test_workers_must_be_positive() -> None:
    assert build_parser().parse_args(["serve", "--workers", "3"]).workers == 3
    assert build_parser().parse_args(["serve"]).workers == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--workers", "0"])


def test_serve_with_two_workers_answers_from_two_processes(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "LAYERCAST_DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())", "serve", "--host",
         "127.0.0.1", "--port", str(port), "--workers", "2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready and len(_workers(proc.pid)) >= 2:
                break
            time.sleep(0.5)
        assert ready, proc.stderr.read().decode() if proc.poll() is not None and proc.stderr else "not ready"
        workers = _workers(proc.pid)
        assert len(workers) == 2
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            codes = [client.get("/v1/hardware").status_code for _ in range(10)]
        assert codes == [200] * 10
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
