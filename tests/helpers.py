"""Shared test helpers (paths to shared data and to the onnx wheel's model-zoo graphs)."""

from __future__ import annotations

from pathlib import Path

import onnx

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()
LIGHT_MODELS = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def light_model(name: str) -> bytes:
    """Bytes of ``light_<name>.onnx`` shipped inside the onnx wheel."""
    return (LIGHT_MODELS / f"light_{name}.onnx").read_bytes()


def import_measurements(database_url: str, dataset: str, *args: str) -> None:
    """``layercast import <dataset> --database-url URL *args`` (migrates and seeds first); raises on failure."""
    from app.measurements.cli import main

    code = main([dataset, "--database-url", database_url, *args])
    if code != 0:
        raise RuntimeError(f"layercast import {dataset} {' '.join(args)} failed with exit code {code}")
