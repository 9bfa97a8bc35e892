"""One settings object (STYLE.md §5). Read from the environment (prefix ``LAYERCAST_``) or passed in."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Service configuration.

    ``database_url``: SQLAlchemy URL; default an SQLite file under ``./var``.
    ``models_dir``: folder of predictor artifacts (ONNX + metadata JSON); default the shipped ``models/``.
    ``artifact_store``: directory of registered predictor artifacts that every replica can read (a shared
    volume); default ``models_dir``. ``admin_key``: the key of the admin routes (promote, rollback, retrain
    requests); unset = those routes answer 403 ``admin_key_not_configured``. ``predictor_poll_s``: how
    often (s) a running API re-reads the production version from the database (0 = on every request): the
    bound on how long a promotion takes to be served.
    ``max_upload_bytes``: largest accepted request body, 2 GiB by default (GPT-2 XL-sized ONNX files
    with their weights; uploads are streamed to disk, and weights are not stored).
    """

    model_config = SettingsConfigDict(env_prefix="LAYERCAST_", extra="ignore")

    database_url: str = f"sqlite:///{REPO_ROOT / 'var' / 'layercast.db'}"
    models_dir: Path = REPO_ROOT / "models"
    artifact_store: Path | None = None
    admin_key: SecretStr | None = None
    predictor_poll_s: float = Field(default=5.0, ge=0)
    max_upload_bytes: int = 2 * 1024**3
    host: str = "127.0.0.1"
    port: int = 8000
    seed_catalog: bool = True
    log_level: str = "info"

    @property
    def artifact_store_dir(self) -> Path:
        """The artifact store: ``artifact_store``, else ``models_dir``."""
        return self.artifact_store or self.models_dir
