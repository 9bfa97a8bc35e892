"""One settings object (STYLE.md §5). Read from the environment (prefix ``LAYERCAST_``) or passed in."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from limits import parse_many
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.auth import Scope, parse_scopes
from app.core.limits import DEFAULT_LIMITS, Limits

REPO_ROOT = Path(__file__).resolve().parent.parent

#: ``Host`` names of a loopback-bound server (the default allow-list, :meth:`Settings.host_allow_list`).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
#: Shortest accepted ``LAYERCAST_ADMIN_KEY``: 32 characters of ``secrets.token_urlsafe`` carry 192 bits
#: (stored keys carry 256, :func:`app.auth.create_key`), out of reach of guessing within any rate limit.
MIN_ADMIN_KEY_LENGTH = 32
#: Scopes of requests without a key when ``open_scopes`` is unset, on a loopback bind and on any other.
LOOPBACK_OPEN_SCOPES = "read,graphs"
EXPOSED_OPEN_SCOPES = "read"


def is_loopback(host: str) -> bool:
    """Whether the bind address ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Service configuration.

    ``database_url``: SQLAlchemy URL; default an SQLite file under ``./var``.
    ``models_dir``: folder of predictor artifacts (ONNX + metadata JSON); default the shipped ``models/``.
    ``artifact_store``: directory of registered predictor artifacts that every replica can read (a shared
    volume); default ``models_dir``. ``admin_key``: a bootstrap key with the ``admin`` scope (:mod:`app.auth`:
    promote, rollback, retrain, hardware and graphs of any owner), for deployments that cannot run
    ``layercast keys create`` first, at least :data:`MIN_ADMIN_KEY_LENGTH` characters (a ``ValueError``
    naming the variable otherwise); unset = only stored API keys are accepted. ``predictor_poll_s``: how
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
    ``import_worker_at_start``: start the process that imports ONNX uploads over 8 MiB
    (:mod:`app.graphs.importer`) with the app, so that the first large upload does not wait for its ~0.6 s
    start and its ~90 MB resident are a fixed cost of the server, not of an upload; false = on the first large upload.

    Access control (:mod:`app.auth`): ``open_scopes``, the scopes of requests without an API key
    (comma-separated; ``admin`` is refused); unset = ``read,graphs`` when ``host`` is a loopback address
    (a laptop: the README's upload-and-predict commands need no key), else ``read`` only (a server reachable
    from a network: anonymous uploads would fill its database; see :attr:`open_scope_set`); ``rate_limit``,
    each key's or anonymous client address's budget in the ``limits`` notation (``100/second``; empty = none).
    ``allowed_hosts``: accepted ``Host`` headers, comma-separated (Starlette ``TrustedHostMiddleware``:
    a DNS-rebinding page names its own host); unset = the loopback names when ``host`` is a loopback
    address, else any. ``cors_origins``: origins allowed to call the API from a browser script,
    comma-separated (default none: no cross-origin access). ``db_retry_after_s``: the ``Retry-After``
    of a 503 ``database_unavailable``.
    ``gc_thresholds``: the cyclic garbage collector's three thresholds while the app runs (:func:`gc.set_threshold`,
    restored when it stops), comma-separated; empty = Python's own (700, 10, 10). The default's first generation
    collects every 20,000 net container allocations instead of 700, so most short-lived objects of a request die
    by reference counting before a collection promotes them, and the old generations (the analysis cache, the
    memos) are scanned far less often. Measured in process (``benchmarks/README.md``): 1,000 job estimates after
    the prediction benchmarks of ``benchmarks/perf.py`` spent 177 ms in the collector (one full collection) with
    Python's thresholds, 20-21 ms with these, p99 199 -> 90-101 ms; fresh predictions the same within noise, the
    longest single collection 10-17 ms (50,000: 30-48 ms, Python's own: 20-23 ms, full collections).
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
    import_worker_at_start: bool = True
    open_scopes: str | None = None
    rate_limit: str = "100/second"
    allowed_hosts: str | None = None
    cors_origins: str = ""
    db_retry_after_s: int = Field(default=5, ge=1)
    gc_thresholds: str = "20000,10,10"

    @field_validator("open_scopes")
    @classmethod
    def _no_open_admin(cls, value: str | None) -> str | None:
        if value is not None and Scope.ADMIN in parse_scopes(value):
            raise ValueError("open_scopes must not include 'admin': admin actions always need a key")
        return value

    @field_validator("admin_key")
    @classmethod
    def _long_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_ADMIN_KEY_LENGTH:
            raise ValueError(f"LAYERCAST_ADMIN_KEY must be at least {MIN_ADMIN_KEY_LENGTH} characters (it is an "
                             "admin credential; e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        return value

    @field_validator("rate_limit")
    @classmethod
    def _valid_rate_limit(cls, value: str) -> str:
        if value.strip():
            parse_many(value)  # ValueError on bad notation
        return value

    @field_validator("gc_thresholds")
    @classmethod
    def _valid_gc_thresholds(cls, value: str) -> str:
        if value.strip():
            parts = [p.strip() for p in value.split(",")]
            if (len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts)
                    or not all(1 <= int(p) <= 2**31 - 1 for p in parts)):
                raise ValueError(f"LAYERCAST_GC_THRESHOLDS must be three integers from 1 to 2147483647 "
                                 f"(gc.set_threshold), e.g. 20000,10,10; or empty for Python's own: got {value!r}")
        return value

    @property
    def gc_threshold_values(self) -> tuple[int, int, int] | None:
        """``gc_thresholds`` parsed; ``None`` when empty (Python's own thresholds are left alone)."""
        if not self.gc_thresholds.strip():
            return None
        a, b, c = (int(p) for p in self.gc_thresholds.split(","))
        return a, b, c

    @property
    def open_scope_set(self) -> frozenset[Scope]:
        """``open_scopes`` parsed; unset: :data:`LOOPBACK_OPEN_SCOPES` on a loopback bind, else
        :data:`EXPOSED_OPEN_SCOPES` (the same rule as :meth:`host_allow_list`)."""
        if self.open_scopes is not None:
            return parse_scopes(self.open_scopes)
        return parse_scopes(LOOPBACK_OPEN_SCOPES if is_loopback(self.host) else EXPOSED_OPEN_SCOPES)

    def host_allow_list(self) -> list[str]:
        """The ``Host`` names the API answers (see ``allowed_hosts``)."""
        if self.allowed_hosts is not None:
            return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
        if is_loopback(self.host):
            return list(LOOPBACK_NAMES)
        return ["*"]

    def cors_origin_list(self) -> list[str]:
        """``cors_origins`` as a list."""
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

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
