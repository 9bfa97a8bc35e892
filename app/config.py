"""One settings object (STYLE.md §5). Read from the environment (prefix ``LAYERCAST_``) or passed in."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.limits import DEFAULT_LIMITS, Limits

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
    ``log_format``: ``json`` (one object per line, with the request id) or ``text``, for ``layercast serve``.
    ``max_json_bytes``: largest JSON request body (32 MiB: a 100k-layer JSON graph is ~1.5 MB).
    ``max_nodes``, ``max_rank``, ``max_dim``, ``max_tensor_elements``, ``max_subgraph_depth``,
    ``max_json_depth``, ``import_timeout_s``: import bounds (:class:`app.core.limits.Limits`, where the
    defaults are explained). ``db_pool_size``: database connections, one per worker thread (anyio's
    default thread limiter runs 40 sync routes at once). ``analysis_cache_bytes``: byte budget of the
    per-process cache of analysed graph bindings (:class:`app.graphs.service.AnalysisCache`; 0 disables it).
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
    log_format: Literal["json", "text"] = "json"
    max_json_bytes: int = 32 * 1024**2
    max_nodes: int = DEFAULT_LIMITS.max_nodes
    max_rank: int = DEFAULT_LIMITS.max_rank
    max_dim: int = DEFAULT_LIMITS.max_dim
    max_tensor_elements: int = DEFAULT_LIMITS.max_tensor_elements
    max_subgraph_depth: int = DEFAULT_LIMITS.max_subgraph_depth
    max_json_depth: int = DEFAULT_LIMITS.max_json_depth
    import_timeout_s: float = DEFAULT_LIMITS.import_timeout_s
    db_pool_size: int = 40
    analysis_cache_bytes: int = Field(default=512 * 2**20, ge=0)

    def limits(self) -> Limits:
        """The import bounds these settings configure."""
        return Limits(
            max_nodes=self.max_nodes, max_rank=self.max_rank, max_dim=self.max_dim,
            max_tensor_elements=self.max_tensor_elements, max_subgraph_depth=self.max_subgraph_depth,
            max_json_depth=self.max_json_depth, import_timeout_s=self.import_timeout_s,
        )

    @property
    def artifact_store_dir(self) -> Path:
        """The artifact store: ``artifact_store``, else ``models_dir``."""
        return self.artifact_store or self.models_dir
