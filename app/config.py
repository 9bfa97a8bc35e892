"""One settings object (STYLE.md §5). Read from the environment (prefix ``LAYERCAST_``) or passed in."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Service configuration.

    ``database_url``: SQLAlchemy URL; default an SQLite file under ``./var``.
    ``models_dir``: folder of predictor artifacts (ONNX + metadata JSON); default the shipped ``models/``.
    ``max_upload_bytes``: largest accepted request body, 2 GiB by default (GPT-2 XL-sized ONNX files
    with their weights; uploads are streamed to disk, and weights are not stored).
    ``log_format``: ``json`` (one object per line, with the request id) or ``text``, for ``layercast serve``.
    """

    model_config = SettingsConfigDict(env_prefix="LAYERCAST_", extra="ignore")

    database_url: str = f"sqlite:///{REPO_ROOT / 'var' / 'layercast.db'}"
    models_dir: Path = REPO_ROOT / "models"
    max_upload_bytes: int = 2 * 1024**3
    host: str = "127.0.0.1"
    port: int = 8000
    seed_catalog: bool = True
    log_level: str = "info"
    log_format: Literal["json", "text"] = "json"
