"""Access control: API keys with scopes, the per-route scope policy, ownership checks, rate limits.

Keys. A key is ``lck_<id>_<secret>`` (:func:`create_key`): ``id`` (16 hex characters) is public and is
what rows record as their owner; the database keeps only the SHA-256 of the whole key
(``api_keys.key_sha256``), compared with :func:`hmac.compare_digest` (constant time). A plain hash is
enough because the secret is 256 random bits (``secrets.token_urlsafe(32)``): no dictionary to attack,
so a slow password hash (bcrypt, argon2) would buy nothing and cost a few ms per request. Revoked keys
(``revoked_at`` set) are refused. Keys are managed with ``layercast keys create|list|revoke``.
``LAYERCAST_ADMIN_KEY`` (:attr:`app.config.Settings.admin_key`), when set, is also accepted as a key
with the ``admin`` scope and owner ``admin``: the bootstrap credential of a container deployment.

Clients send the key as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.

Scopes (:class:`Scope`): ``read`` (every GET and the prediction POSTs: nothing is stored),
``graphs`` (upload, delete own graphs), ``measurements`` (report measurements and job actuals),
``hardware`` (add custom devices, update/delete own ones), ``admin`` (all of them, other owners' rows,
retrain, promote, rollback). :data:`POLICY` maps every writing route to its scope; a writing route
missing from it needs ``admin`` (fail closed), and a test checks that every route of the app is listed.

Requests without a key get :attr:`app.config.Settings.open_scopes` (default ``read,graphs`` on a loopback
bind, ``read`` on any other: the README's upload-and-predict commands work out of the box on a laptop,
while measurements, hardware and every admin action need a key, and a server reachable from a network
takes no anonymous uploads; ``admin`` can never be open). The choice of the default is "safe by default,
useful by default": reading and costing a model cannot change what the service tells anyone else,
while a measurement or a device spec does (they feed retraining and every comparison).

Errors: 401 ``auth_required`` (no key, the route needs a scope the anonymous caller lacks; with
``WWW-Authenticate: Bearer``), 401 ``api_key_invalid`` (unknown, malformed or revoked key), 403
``insufficient_scope``, 403 ``not_owner``, 429 ``rate_limited`` (with ``Retry-After``).

Rate limits (:class:`RateLimiter`, the ``limits`` library's moving window in process memory): one
budget per key id, or per client address for anonymous requests, and one more per client address for
the requests presenting a key, counted before the key is looked up (so a flood of invalid keys is limited
too; the keys used from one address share it); ``Settings.rate_limit`` (e.g. ``100/second``, empty = none).
Each API process counts on its own.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from limits import RateLimitItem, parse_many
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from sqlalchemy import JSON, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from app.db import Base, utcnow, write_intent
from app.errors import LayercastError, NotFoundError
from app.schemas import check_name

logger = logging.getLogger("layercast")

KEY_PREFIX = "lck"
#: Owner recorded for rows written with the bootstrap ``LAYERCAST_ADMIN_KEY``.
BOOTSTRAP_OWNER = "admin"


class Scope(StrEnum):
    """What a key may do (module doc)."""

    READ = "read"
    GRAPHS = "graphs"
    MEASUREMENTS = "measurements"
    HARDWARE = "hardware"
    ADMIN = "admin"


#: Scope required by each route that is not a plain read: ``(method, route path template)``.
POLICY: dict[tuple[str, str], Scope] = {
    ("POST", "/v1/graphs"): Scope.GRAPHS,
    ("DELETE", "/v1/graphs/{graph_id}"): Scope.GRAPHS,
    ("POST", "/ui/graphs"): Scope.GRAPHS,
    ("POST", "/v1/hardware"): Scope.HARDWARE,
    ("PUT", "/v1/hardware/{hardware_id}"): Scope.HARDWARE,
    ("DELETE", "/v1/hardware/{hardware_id}"): Scope.HARDWARE,
    ("POST", "/v1/measurements"): Scope.MEASUREMENTS,
    ("POST", "/v1/job-estimates/actuals"): Scope.MEASUREMENTS,
    # predictions store nothing: they are reads with a body
    ("POST", "/v1/predictions"): Scope.READ,
    ("POST", "/v1/predictions/batch"): Scope.READ,
    ("POST", "/v1/job-estimates"): Scope.READ,
    ("POST", "/v1/comparisons"): Scope.READ,
    ("POST", "/v1/predictors/retrain"): Scope.ADMIN,
    ("POST", "/v1/predictors/{version}/promote"): Scope.ADMIN,
    ("POST", "/v1/predictors/{version}/rollback"): Scope.ADMIN,
}

_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def required_scope(method: str, route_path: str) -> Scope:
    """The scope a request needs: ``read`` for GET/HEAD/OPTIONS, :data:`POLICY` for the rest, ``admin``
    for a writing route the policy does not list (fail closed)."""
    if method in _READ_METHODS:
        return Scope.READ
    return POLICY.get((method, route_path), Scope.ADMIN)


def parse_scopes(raw: str | Iterable[str]) -> frozenset[Scope]:
    """Scopes from ``"read,graphs"`` or an iterable of names; ``ValueError`` names an unknown one."""
    names = raw.split(",") if isinstance(raw, str) else list(raw)
    out: set[Scope] = set()
    for name in (n.strip() for n in names):
        if not name:
            continue
        try:
            out.add(Scope(name))
        except ValueError:
            raise ValueError(f"unknown scope {name!r}; scopes are {', '.join(s.value for s in Scope)}") from None
    return frozenset(out)


# --------------------------------------------------------------------------------------------- errors


class AuthRequired(LayercastError):
    status_code = 401
    code = "auth_required"


class ApiKeyInvalid(LayercastError):
    status_code = 401
    code = "api_key_invalid"


class InsufficientScope(LayercastError):
    status_code = 403
    code = "insufficient_scope"


class NotOwner(LayercastError):
    status_code = 403
    code = "not_owner"


class RateLimited(LayercastError):
    status_code = 429
    code = "rate_limited"


class ApiKeyNotFound(NotFoundError):
    code = "api_key_not_found"


# ------------------------------------------------------------------------------------------------ keys


class ApiKey(Base):
    """One API key: public ``id``, a ``name`` for people, its ``scopes`` (list of :class:`Scope` values),
    the hex SHA-256 of the whole key, and ``revoked_at`` once revoked (rows are kept: owners stay named)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    key_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(nullable=True)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


#: Longest key name (the ``api_keys.name`` column).
MAX_KEY_NAME = 200


def create_key(session: Session, *, name: str, scopes: Iterable[str]) -> tuple[ApiKey, str]:
    """Store a new key with ``scopes`` and return ``(row, key)``; the key itself is shown only now.
    Raises ``ValueError`` for an unknown scope or no scope, and for a ``name`` that is blank, longer than
    :data:`MAX_KEY_NAME` characters or holds control characters (:func:`app.schemas.check_name`: NUL is
    refused by PostgreSQL's text, and a blank name cannot be told apart in ``keys list``). Flushes."""
    if not name.strip():
        raise ValueError("a key needs a name (who or what uses it, e.g. ci-pipeline)")
    if len(name) > MAX_KEY_NAME:
        raise ValueError(f"a key name has at most {MAX_KEY_NAME} characters, got {len(name)}")
    check_name(name)
    parsed = parse_scopes(scopes)
    if not parsed:
        raise ValueError("a key needs at least one scope")
    key_id = secrets.token_hex(8)
    key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
    row = ApiKey(id=key_id, name=name, scopes=sorted(s.value for s in parsed), key_sha256=_digest(key))
    session.add(row)
    session.flush()
    return row, key


def revoke_key(session: Session, *, key_id: str) -> ApiKey:
    """Mark ``key_id`` revoked (idempotent); raises :class:`ApiKeyNotFound` (404). Flushes."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise ApiKeyNotFound(f"no API key with id {key_id!r}", detail={"key_id": key_id})
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
    return row


def list_keys(session: Session) -> Sequence[ApiKey]:
    """Every key, oldest first (revoked ones included)."""
    return session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)).all()


def active_key_count(session: Session) -> int:
    """Keys not revoked."""
    return session.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))) or 0


# ------------------------------------------------------------------------------------------ principals


@dataclass(frozen=True)
class Principal:
    """Who is asking: ``key_id`` (None for an anonymous request) and the scopes granted."""

    key_id: str | None
    scopes: frozenset[Scope]

    def has(self, scope: Scope) -> bool:
        """Whether this principal may act with ``scope`` (``admin`` implies every scope)."""
        return Scope.ADMIN in self.scopes or scope in self.scopes

    @property
    def is_admin(self) -> bool:
        return Scope.ADMIN in self.scopes


def authenticate(session: Session, key: str, *, bootstrap_key: str | None) -> Principal:
    """The principal of ``key``: the bootstrap admin key, or a stored key that is not revoked.
    Raises :class:`ApiKeyInvalid` (401) otherwise; the comparison is constant-time either way."""
    # digests of equal length: compare_digest would otherwise leak the bootstrap key's length
    if bootstrap_key and hmac.compare_digest(_digest(key), _digest(bootstrap_key)):
        return Principal(BOOTSTRAP_OWNER, frozenset({Scope.ADMIN}))
    parts = key.split("_", 2)  # the secret (urlsafe base64) may itself hold "_"
    row = session.get(ApiKey, parts[1]) if len(parts) == 3 and parts[0] == KEY_PREFIX and len(parts[1]) == 16 else None
    expected = row.key_sha256 if row is not None else "0" * 64
    if not hmac.compare_digest(_digest(key), expected) or row is None:
        raise ApiKeyInvalid("unknown or malformed API key")
    if row.revoked_at is not None:
        raise ApiKeyInvalid("this API key was revoked", detail={"key_id": row.id})
    return Principal(row.id, parse_scopes(row.scopes))


def presented_key(request: Request) -> str | None:
    """The key sent with ``request`` (``Authorization: Bearer`` or ``X-API-Key``), or None."""
    header = request.headers.get("authorization")
    if header is not None and header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return request.headers.get("x-api-key", "").strip() or None


def sends_key(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether raw ASGI ``headers`` carry an API key header with a non-empty key (used by the cross-site
    check of :mod:`app.main`: a browser never adds one to a cross-site simple request). The same rule as
    :func:`presented_key`: an empty ``X-API-Key`` or a bare ``Bearer`` is no key, and does not pass."""
    for name, value in headers:
        lower = name.lower()
        if (lower == b"x-api-key" and value.strip()) or (
            lower == b"authorization" and value[:7].lower() == b"bearer " and value[7:].strip()
        ):
            return True
    return False


# -------------------------------------------------------------------------------------------- limiting


class RateLimiter:
    """Per-identity request budget: ``limit`` in the ``limits`` notation (``"100/second"``,
    ``"6000/minute;100/second"``); empty = unlimited. Moving window, in process memory."""

    def __init__(self, limit: str) -> None:
        self.items: list[RateLimitItem] = parse_many(limit) if limit.strip() else []
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def hit(self, identity: str) -> None:
        """Count one request of ``identity``; raises :class:`RateLimited` (429) when over a budget."""
        for item in self.items:
            if not self._limiter.hit(item, identity):
                reset_at, _remaining = self._limiter.get_window_stats(item, identity)
                retry_after = max(1, math.ceil(reset_at - time.time()))
                raise RateLimited(
                    f"rate limit of {item} exceeded; retry in {retry_after} s",
                    detail={"limit": str(item), "retry_after_s": retry_after},
                )


# ------------------------------------------------------------------------------------------ dependency


def get_principal(request: Request) -> Principal:
    """The principal of this request, computed once (cached on ``request.state``): anonymous with the open
    scopes, or a key's with its scopes plus the open ones. Raises :class:`ApiKeyInvalid` (401)."""
    cached = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    settings = request.app.state.settings
    key = presented_key(request)
    if key is None:
        principal = Principal(None, settings.open_scope_set)
    else:
        bootstrap = settings.admin_key.get_secret_value() if settings.admin_key is not None else None
        token = write_intent.set(False)  # a read: never queue behind SQLite's write lock for it
        try:
            with request.app.state.sessionmaker() as session:
                keyed = authenticate(session, key, bootstrap_key=bootstrap)
        finally:
            write_intent.reset(token)
        # a key never allows less than no key: a `measurements` key still reads and predicts
        principal = Principal(keyed.key_id, keyed.scopes | settings.open_scope_set)
    request.state.principal = principal
    return principal


async def authorize(request: Request) -> Principal:
    """Router dependency: the principal, after the rate limit and the scope the route needs
    (:func:`required_scope`). Raises :class:`RateLimited`, :class:`AuthRequired`,
    :class:`ApiKeyInvalid`, :class:`InsufficientScope`.

    On the event loop: only a presented key's lookup reads the database, and it runs in the thread pool
    (an anonymous request no longer pays a hop to a worker thread and back for this dependency)."""
    client = request.client.host if request.client is not None else "unknown"
    limiter: RateLimiter = request.app.state.rate_limiter
    if getattr(request.state, "principal", None) is None and presented_key(request) is not None:
        # counted before the key is looked up: a flood of invalid keys is limited like any other
        # (its own budget per address, apart from the anonymous one)
        limiter.hit(f"key-attempts:ip:{client}")
        await run_in_threadpool(get_principal, request)  # the key's lookup; cached on request.state
    principal = get_principal(request)
    limiter.hit(principal.key_id or f"ip:{client}")
    route = request.scope.get("route")
    needed = required_scope(request.method, str(getattr(route, "path", request.url.path)))
    if not principal.has(needed):
        if principal.key_id is None:
            raise AuthRequired(
                f"this action needs an API key with scope '{needed.value}' "
                "(Authorization: Bearer <key>; create one with `layercast keys create`)",
                detail={"scope": needed.value},
            )
        raise InsufficientScope(
            f"API key {principal.key_id} lacks scope '{needed.value}'",
            detail={"scope": needed.value, "key_id": principal.key_id},
        )
    return principal


def check_owner(principal: Principal, owner: str | None, *, what: str, ident: str) -> None:
    """Raise :class:`NotOwner` (403) unless ``principal`` may change a row owned by ``owner``: the
    owner itself or an admin. A row without an owner (stored anonymously or before owners were recorded)
    is changed by admins only: an anonymous caller could otherwise delete what every other one stored."""
    if principal.is_admin or (owner is not None and principal.key_id == owner):
        return
    if owner is None:
        raise NotOwner(f"{what} {ident!r} has no owner: only an admin key may change it",
                       detail={"id": ident, "owner": None})
    raise NotOwner(f"{what} {ident!r} belongs to another key", detail={"id": ident, "owner": owner})


PrincipalDep = Annotated[Principal, Depends(authorize)]

#: Statuses :func:`authorize` answers, documented on every guarded operation by :mod:`app.main`.
AUTH_ERRORS: dict[str, str] = {
    "401": "auth_required (no key) or api_key_invalid (unknown, malformed or revoked key)",
    "403": "insufficient_scope, not_owner",
    "429": "rate_limited (Retry-After says when to retry)",
}
