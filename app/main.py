"""Application factory: ``create_app(settings)`` builds everything in the lifespan (STYLE.md §5).

Nothing is built at import time: the engine, the session factory, the seeded hardware catalog and the
predictor are created when the app starts and released when it stops, so one process can hold several
apps (the tests do). Run it with ``layercast serve`` or ``uvicorn --factory app.main:create_app``.

Errors (STYLE.md §6) are rendered as one problem document, whatever raised them::

    {"error": {"code": "<machine-readable>", "message": "<human-readable>", "detail": {...}}}

* :class:`app.errors.LayercastError` → its own status and code;
* request validation failures → 422 ``validation_error`` with ``detail.errors``;
* Starlette/FastAPI HTTP errors (unknown route, wrong method, ...) → their status, code from the status;
* anything else → 500 ``internal_error``, logged with its traceback, which never reaches the client,
  sent with ``Connection: close`` so a keep-alive client reconnects instead of reading a reset.

Every request runs under :class:`RequestGuard`: a URL with NUL or a line break in its path or a NUL in its
query is 400 ``bad_request``; the import limits of the settings are made active
(:func:`app.core.limits.use_limits`), SQLite transactions of GET/HEAD/OPTIONS begin deferred and all
others ``BEGIN IMMEDIATE`` (:data:`app.db.write_intent`), and a JSON body is read whole (up to
``max_json_bytes``, else 413) and its nesting measured (over ``max_json_depth``: 422
``limit_exceeded``) before anything parses it; a body that is not UTF-8/16/32 text or holds an integer literal
over Python's 4,300-digit limit is 422 ``validation_error`` (``json_invalid``), as any other malformed JSON
body is (FastAPI answers those two with a 400): :func:`app.core.limits.json_text_problem`.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import (
    AUTH_ERRORS,
    BOOTSTRAP_OWNER,
    RateLimiter,
    active_key_count,
    authorize,
    required_scope,
    sends_key,
)
from app.auth import Scope as AccessScope
from app.config import Settings, is_loopback
from app.core.limits import Limits, json_bytes_depth_over, json_text_problem, use_limits
from app.db import DATABASE_DOWN, database_is_down, make_engine, make_sessionmaker, write_intent
from app.deps import refuse_unknown_query
from app.errors import (
    LayercastError,
    LimitExceeded,
    MalformedJson,
    PayloadTooLarge,
    clean_validation_errors,
    validation_message,
)
from app.migrate import ensure_sqlite_dir
from app.observability import RequestContext
from app.predictors.service import PredictorUnavailable
from app.schemas import ErrorResponse

logger = logging.getLogger("layercast")

#: Routers included by :func:`create_app`, as ``(module, attribute)``; every one but the probes
#: (:data:`OPEN_ROUTERS`) runs :func:`app.auth.authorize` (key, scope, rate limit) before its routes.
OPEN_ROUTERS: tuple[tuple[str, str], ...] = (("app.observability", "router"),)
#: Routers whose query string :func:`app.deps.refuse_unknown_query` does not check: the page reads its own
#: and refuses unknown names itself; the probes and metrics take none and answer whatever a prober appends.
#: Every other route refuses a query name it does not declare.
_OWN_QUERY_CHECK = frozenset({"app.web.router", "app.observability"})
ROUTERS: tuple[tuple[str, str], ...] = (
    *OPEN_ROUTERS,
    ("app.web.router", "router"),
    ("app.hardware.router", "router"),
    ("app.graphs.router", "router"),
    ("app.predictions.router", "router"),
    ("app.measurements.router", "router"),
    ("app.estimates.router", "router"),
    ("app.predictors.router", "router"),
)

_HTTP_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_entity",
    429: "too_many_requests",
}


def service_version() -> str:
    """Installed version of the ``layercast`` distribution (``"0+unknown"`` when not installed)."""
    try:
        return package_version("layercast")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


class ProblemResponse(JSONResponse):
    """JSON response of an error: ASCII-escaped, so a lone surrogate echoed from the request (a field
    name, a path segment) is written as ``\\ud800`` instead of failing to encode as UTF-8 (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":"), default=str).encode("ascii")


def problem(status_code: int, code: str, message: str, detail: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    """A problem-document response (the one error shape of the API)."""
    body = {"error": {"code": code, "message": message, "detail": detail or {}}}
    return ProblemResponse(body, status_code=status_code, headers=headers)


# --------------------------------------------------------------------------------------------- errors


async def _handle_layercast_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LayercastError)
    return ProblemResponse(exc.to_problem(), status_code=exc.status_code)


def _is_json_type(content_type: str) -> bool:
    """Whether a ``Content-Type`` media type (parameters stripped, lower case) is JSON (``application/json``
    or ``application/<x>+json``), the types FastAPI parses a JSON body from."""
    return content_type == "application/json" or (content_type.startswith("application/")
                                                  and content_type.endswith("+json"))


async def _handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 ``validation_error`` listing the errors, or 422 ``invalid_request`` naming the content type when the
    whole JSON body was refused because it came under a non-JSON ``Content-Type`` (FastAPI then does not parse
    it: ``curl -d`` without ``-H 'content-type: application/json'`` sends form encoding)."""
    assert isinstance(exc, RequestValidationError)
    errors = clean_validation_errors(exc.errors())
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and not _is_json_type(ctype) and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return problem(422, "invalid_request",
                       f"unsupported content type {ctype!r}: this route takes a JSON body (application/json)",
                       {"content_type": ctype})
    return problem(422, "validation_error", validation_message("request validation failed", errors), {"errors": errors})


async def _handle_layercast_error_with_headers(request: Request, exc: Exception) -> JSONResponse:
    """:class:`app.auth.RateLimited` carries ``Retry-After``; 401s name the scheme (RFC 6750)."""
    response = await _handle_layercast_error(request, exc)
    assert isinstance(exc, LayercastError)
    if exc.status_code == 429 and "retry_after_s" in exc.detail:
        response.headers["Retry-After"] = str(exc.detail["retry_after_s"])
    elif exc.status_code == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def module_routes() -> list[APIRoute]:
    """Every route of :data:`ROUTERS` (full paths: the routers' prefixes included). FastAPI 0.16x keeps
    included routers as opaque branches of ``app.routes``, so this reads the routers themselves."""
    routes: list[APIRoute] = []
    for module_name, attribute in ROUTERS:
        router = getattr(importlib.import_module(module_name), attribute)
        routes.extend(r for r in router.routes if isinstance(r, APIRoute))
    return routes


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app accepts at this path: Starlette's own ``Allow`` names only the
    first route whose path matched (``GET`` of ``/v1/graphs/{graph_id}``, not its ``DELETE``)."""
    methods: set[str] = set()
    path = request.scope.get("path", "")
    route: Route
    for route in request.app.state.route_table:
        if route.path_regex.match(path):
            methods |= set(route.methods or ())
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


async def _handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "client_error" if exc.status_code < 500 else "server_error")
    message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    detail: dict[str, Any] = exc.detail if isinstance(exc.detail, dict) else {}
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
        detail = {**detail, "allow": headers["Allow"].split(", ")}
    return problem(exc.status_code, code, message, detail, headers=headers or None)


async def _handle_database_down(request: Request, exc: Exception) -> JSONResponse:
    if not database_is_down(exc):
        return await _handle_unexpected(request, exc)
    logger.error("database unavailable on %s %s: %s", request.method, request.url.path,
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    retry = request.app.state.settings.db_retry_after_s
    return problem(503, "database_unavailable",
                   f"the database is unavailable; retry in {retry} s (predictions with inline graphs and "
                   "hardware keep working)", {"retry_after_s": retry}, headers={"Retry-After": str(retry)})


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem(500, "internal_error", "internal server error; the error has been logged",
                   headers={"Connection": "close"})


# ---------------------------------------------------------------------------------------- size guard


class HeadAsGet:
    """Answer ``HEAD`` as ``GET`` without the body (RFC 9110 9.3.2): FastAPI routes list GET only, so HEAD was
    a 405 while every 405's ``Allow`` names HEAD beside GET. The request runs as GET (same status, headers and
    ``Content-Length``); the body is dropped before it is sent. A path with no GET still answers 405."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)


class BodySizeLimit:
    """ASGI middleware rejecting request bodies over ``max_bytes`` with 413 ``payload_too_large``.

    A declared ``Content-Length`` over the limit is answered before the body is read; a streamed body is
    counted as it arrives and reading it fails with a 413 as soon as it crosses the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            err = PayloadTooLarge(
                f"request body of {int(declared)} bytes exceeds the limit of {self.max_bytes} bytes",
                detail={"limit_bytes": self.max_bytes, "size_bytes": int(declared)},
            )
            await ProblemResponse(err.to_problem(), status_code=err.status_code)(scope, receive, send)
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(  # FastAPI re-raises HTTPException from body parsing
                        413, f"request body exceeds the limit of {self.max_bytes} bytes"
                    )
            return message

        await self.app(scope, counting_receive, send)


def _is_json(content_type: str) -> bool:
    """FastAPI parses a body as JSON for ``application/json``, ``application/*+json`` and no type."""
    main = content_type.split(";")[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


class RequestGuard:
    """ASGI middleware: per-request limits and write intent, and bounds on JSON bodies (module doc).

    ``raw_paths``: POST paths whose untyped body is a raw upload (ONNX bytes), not JSON.
    """

    def __init__(self, app: ASGIApp, limits: Limits, max_json_bytes: int, raw_paths: frozenset[str]) -> None:
        self.app = app
        self.limits = limits
        self.max_json_bytes = max_json_bytes
        self.raw_paths = raw_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        if any(c in scope.get("path", "") for c in "\x00\r\n") or b"%00" in scope.get("query_string", b""):
            # PostgreSQL refuses NUL in text: a path or query parameter holding one would be a 500
            bad = LayercastError("the URL contains a NUL or line-break character")
            await ProblemResponse(bad.to_problem(), status_code=400)(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type", b"").decode("latin-1")
        # the prediction POSTs store nothing: their SQLite transactions begin deferred like GETs'
        token = write_intent.set(required_scope(method, scope.get("path", "")) is not AccessScope.READ)
        try:
            with use_limits(self.limits):
                if method in ("GET", "HEAD", "OPTIONS", "DELETE") or not (
                    _is_json(ctype) or (not ctype and scope.get("path") not in self.raw_paths)
                ):
                    await self.app(scope, receive, send)
                    return
                body, error = await self._read_json_body(receive, raw=scope.get("path") in self.raw_paths)
                if error is not None:
                    await ProblemResponse(error.to_problem(), status_code=error.status_code)(scope, receive, send)
                    return
                replayed = False

                async def replay() -> Message:
                    nonlocal replayed
                    if replayed:
                        return await receive()
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}

                await self.app(scope, replay, send)
        finally:
            write_intent.reset(token)

    async def _read_json_body(self, receive: Receive, *, raw: bool) -> tuple[bytes, LayercastError | None]:
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await receive()
            except HTTPException as exc:  # BodySizeLimit's own bound crossed first
                return b"", PayloadTooLarge(str(exc.detail), detail={"limit": "upload_bytes", "value": size})
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_json_bytes:
                return b"", PayloadTooLarge(
                    f"JSON body exceeds the limit of {self.max_json_bytes} bytes",
                    detail={"limit": "json_bytes", "value": size, "max": self.max_json_bytes},
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        most = self.limits.max_json_depth
        depth = (await run_in_threadpool(json_bytes_depth_over, body, most) if size > 1 << 20
                 else json_bytes_depth_over(body, most))
        if depth is not None:
            return body, LimitExceeded("json_depth", depth, self.limits.max_json_depth,
                                       f"JSON body nests {depth} deep; the limit is {self.limits.max_json_depth}")
        if not raw:  # a graph upload parses its own body (any malformed JSON there is 422 invalid_graph)
            problem = await run_in_threadpool(json_text_problem, body) if size > 1 << 20 else json_text_problem(body)
            if problem is not None:
                return body, MalformedJson(problem[1], offset=problem[0])
        return body, None


class SQLiteWriteSlot:
    """ASGI middleware: on SQLite, one writing request at a time per process (``app.state.write_lock``,
    an ``asyncio.Lock`` made by the lifespan; absent on PostgreSQL, whose writers lock rows, not the file).

    Why: a writing request takes SQLite's one write lock at its first statement (``BEGIN IMMEDIATE``) and
    releases it at the commit, which FastAPI runs after the endpoint in another worker-thread call (unless the
    route commits in its own call, :func:`app.deps.in_worker`; the writing routes do not). When
    every worker thread is taken by requests waiting (busy timeout) for that same lock, the commit gets no
    thread until their timeouts expire: the load test saw 64 % of requests fail with "database is
    locked" at 100 concurrent clients. Queued here, on the event loop, waiting writers hold no thread
    and no connection. The slot is taken once the request body has been received in full (so a slow
    upload does not hold it while it streams), or at once for a request without a body, and released when
    the response is sent (the commit is before it). Which requests write: :data:`app.db.write_intent`.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = getattr(getattr(scope.get("app"), "state", None), "write_lock", None)
        if scope["type"] != "http" or lock is None or not write_intent.get():
            await self.app(scope, receive, send)
            return
        held = False

        async def take() -> None:
            nonlocal held
            if not held:
                await lock.acquire()
                held = True

        async def receive_then_take() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                await take()
            return message

        headers = dict(scope.get("headers") or [])
        try:
            if headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers:
                await take()
            await self.app(scope, receive_then_take, send)
        finally:
            if held:
                lock.release()


# --------------------------------------------------------------------------------- hosts, cross-site


class HostAllowList:
    """ASGI middleware: Starlette's :class:`TrustedHostMiddleware` (``Host`` parsing and ``*.domain``
    patterns), with its plain-text refusal replaced by a 400 ``host_not_allowed`` problem document.
    Against DNS rebinding: a page on ``evil.example`` whose name now resolves to 127.0.0.1 still sends
    ``Host: evil.example``."""

    _PASSED = "layercast.host_allowed"

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self._check = TrustedHostMiddleware(self._accepted, allowed_hosts=allowed_hosts, www_redirect=False)

    async def _accepted(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[self._PASSED] = True
        await self.app(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = False

        async def refuse(message: Message) -> None:
            nonlocal refused
            if refused or scope.get(self._PASSED):
                if not refused:
                    await send(message)
                return
            refused = True  # TrustedHostMiddleware's own 400: send ours instead, drop its body
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            err = LayercastError(f"Host {host!r} is not served here (LAYERCAST_ALLOWED_HOSTS)",
                                 detail={"host": host, "allowed_hosts": self.allowed_hosts})
            err.code = "host_not_allowed"
            await ProblemResponse(err.to_problem(), status_code=400)(scope, receive, send)

        await self._check(scope, receive, refuse)


class CrossSiteGuard:
    """ASGI middleware refusing cross-site writes (CSRF) with 403 ``cross_site_request``.

    A request with a method other than GET/HEAD/OPTIONS and no API key header is refused when its
    ``Origin`` is present and is neither this server's own origin (same scheme-less host and port as the
    ``Host`` header) nor one of ``allowed_origins`` (the CORS list), or, without ``Origin``, when
    ``Sec-Fetch-Site`` says ``cross-site`` or ``same-site`` (another port of localhost is same-site).
    Browsers send ``Origin`` with every cross-origin POST, including the "simple" form and multipart ones
    that need no CORS preflight, and can never add an ``Authorization`` or ``X-API-Key`` header to
    those, so a request with a key is not a forged one. Clients that are not browsers send neither
    header and pass.
    """

    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers") or []
        if not sends_key(raw):
            headers = dict(raw)
            origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/").lower()
            site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
            host = headers.get(b"host", b"").decode("latin-1").lower()
            same = origin.split("://", 1)[-1] == host if origin and origin != "null" else False
            if (origin and not same and origin not in self.allowed_origins) or (
                not origin and site in ("cross-site", "same-site")
            ):
                err = LayercastError(
                    "cross-site write refused: send an API key header, or list the origin in LAYERCAST_CORS_ORIGINS",
                    detail={"origin": origin or None, "sec_fetch_site": site or None},
                )
                err.code = "cross_site_request"
                await ProblemResponse(err.to_problem(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------ lifespan


def _seed_catalog(app: FastAPI) -> None:
    """Insert/refresh the built-in hardware catalog in one committed session."""
    from app.hardware.service import seed_builtin

    with app.state.sessionmaker.begin() as session:
        seed_builtin(session)


def _predictor_holder(app: FastAPI, settings: Settings) -> Any:
    """Register the shipped ``models_dir/CURRENT`` artifact as production when the registry is empty, then
    a :class:`app.predictors.service.PredictorHolder` on the production version (loaded now: raises
    ``FileNotFoundError`` without one). A replica that loses the seeding race to another one just reads."""
    from sqlalchemy.exc import IntegrityError

    from app.predictors.service import PredictorHolder, seed_from_models_dir

    try:
        with app.state.sessionmaker.begin() as session:
            seed_from_models_dir(session, settings.models_dir, settings.artifact_store_dir)
    except IntegrityError:
        logger.info("another process seeded the predictor registry first")
    holder = PredictorHolder(app.state.sessionmaker, settings.artifact_store_dir, poll_s=settings.predictor_poll_s)
    holder.current()
    return holder


def _freeze_startup_objects() -> None:
    """Collect, then move every object start-up built (modules, the ORM, onnx, the predictor: ~150,000) into
    the collector's permanent generation (:func:`gc.freeze`): they live as long as the process, and a full
    (generation-2) collection no longer scans them. Measured on the 2-core VM with ResNet-50, BERT and GPT-2
    stored: a full collection during a request took 80-98 ms before (the p99 outliers of fresh predictions in
    ``benchmarks/perf.py``), 6-7 ms after. The lifespan's exit unfreezes them."""
    gc.collect()
    gc.freeze()


def _make_lifespan(settings: Settings, run_migrations: bool) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        python_thresholds = gc.get_threshold()  # restored when this app stops (settings.gc_thresholds)
        ensure_sqlite_dir(settings.database_url)
        if run_migrations:
            from app.migrate import upgrade

            upgrade(settings.database_url)
        engine = make_engine(settings.database_url, pool_size=settings.db_pool_size)
        app.state.settings = settings
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.predictors = None
        app.state.rate_limiter = RateLimiter(settings.rate_limit)
        app.state.write_lock = asyncio.Lock() if engine.dialect.name == "sqlite" else None
        from app.graphs.importer import ImportWorkers
        from app.graphs.service import analysis_cache

        analysis_cache.budget_bytes = settings.analysis_cache_bytes
        app.state.import_workers = ImportWorkers()  # ONNX uploads over 8 MiB are imported there
        try:
            if settings.seed_catalog:
                _seed_catalog(app)
            _log_access_policy(app, settings)
            # imported before ready, else the first ONNX upload stalls every concurrent request while it loads
            # (GIL held): ~0.07 s with ml_dtypes < 0.7, 0.6 s with 0.7.0's extension (pyproject.toml pins it)
            importlib.import_module("onnx")
            try:
                app.state.predictors = _predictor_holder(app, settings)
            except PredictorUnavailable as exc:
                logger.critical("%s", exc)
                raise
            if settings.import_worker_at_start:
                try:  # not waited for: it starts (imports onnx) while the app serves
                    app.state.import_workers.start()
                except LayercastError as exc:  # an optimisation only: large uploads then answer its 503
                    logger.error("%s", exc.message)
            logger.info(
                "layercast %s ready (database %s, predictor %s, polled every %s s)",
                service_version(), engine.url.render_as_string(hide_password=True),
                app.state.predictors.loaded.version, settings.predictor_poll_s,
            )
            _freeze_startup_objects()
            thresholds = settings.gc_threshold_values
            if thresholds is not None:
                gc.set_threshold(*thresholds)
            yield
        finally:
            gc.set_threshold(*python_thresholds)
            gc.unfreeze()  # what start-up froze is collectable again once this app is gone (tests build many)
            # waits for an import in progress: off the event loop, which still finishes other responses
            await run_in_threadpool(app.state.import_workers.close)
            engine.dispose()

    return lifespan


#: What each scope lets a caller do, for the start-up line (:func:`_log_access_policy`).
_SCOPE_ACTIONS: dict[AccessScope, str] = {
    AccessScope.GRAPHS: "graph uploads", AccessScope.MEASUREMENTS: "measurements",
    AccessScope.HARDWARE: "hardware changes", AccessScope.ADMIN: "admin actions",
}


def _refused_without_key(open_scopes: frozenset[AccessScope]) -> str:
    """The actions a caller without a key cannot take under ``open_scopes`` (``admin`` is never open)."""
    refused = [action for scope, action in _SCOPE_ACTIONS.items() if scope not in open_scopes]
    return (", ".join(refused[:-1]) + " and " + refused[-1]) if len(refused) > 1 else refused[0]


def _log_access_policy(app: FastAPI, settings: Settings) -> None:
    """One startup line saying who may do what, and how to create the first key when none exists."""
    with app.state.sessionmaker() as session:
        keys = active_key_count(session)
    open_scopes = ",".join(sorted(s.value for s in settings.open_scope_set)) or "none"
    admin = f"{keys} active API key(s)"
    if settings.admin_key is not None:
        admin += f" + the {BOOTSTRAP_OWNER} key LAYERCAST_ADMIN_KEY"
    logger.info("access: requests without a key may use scopes [%s]; %s; hosts %s; rate limit %s",
                open_scopes, admin, ",".join(settings.host_allow_list()), settings.rate_limit or "none")
    if not keys and settings.admin_key is None:
        logger.warning("no API key exists: %s are refused until you create one: `layercast keys create NAME --scope "
                       "admin`", _refused_without_key(settings.open_scope_set))
    if not is_loopback(settings.host) and "*" in settings.host_allow_list():
        logger.warning("serving on %s with any Host header accepted: set LAYERCAST_ALLOWED_HOSTS", settings.host)


# ------------------------------------------------------------------------------------------- factory


def create_app(settings: Settings | None = None, *, run_migrations: bool = False) -> FastAPI:
    """Build the FastAPI app. ``settings`` default to the environment (``LAYERCAST_*``).

    ``run_migrations=True`` applies ``alembic upgrade head`` at startup; ``layercast serve`` instead
    migrates once before starting uvicorn, and tests migrate their own database first.
    """
    settings = settings or Settings()
    app = FastAPI(
        title="layercast",
        version=service_version(),
        summary="Predicts what a deep neural network costs on given hardware before it runs.",
        lifespan=_make_lifespan(settings, run_migrations),
    )
    app.add_middleware(SQLiteWriteSlot)  # innermost: sees the JSON body RequestGuard replays in one piece
    app.add_middleware(
        RequestGuard, limits=settings.limits(), max_json_bytes=settings.max_json_bytes,
        raw_paths=frozenset({"/v1/graphs"}),
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_upload_bytes)
    app.add_middleware(CrossSiteGuard, allowed_origins=settings.cors_origin_list())
    if settings.cors_origin_list():
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origin_list(),
                           allow_methods=["GET", "POST", "PUT", "DELETE"],
                           allow_headers=["Authorization", "X-API-Key", "Content-Type", "Idempotency-Key"])
    app.add_middleware(HostAllowList, allowed_hosts=settings.host_allow_list())
    app.add_middleware(HeadAsGet)  # inside RequestContext: the access log still says HEAD
    app.add_middleware(RequestContext)  # added last = outermost: ids and timing cover the guards too

    app.add_exception_handler(LayercastError, _handle_layercast_error_with_headers)
    for db_error in DATABASE_DOWN:
        app.add_exception_handler(db_error, _handle_database_down)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(Exception, _handle_unexpected)

    for module_name, attribute in ROUTERS:
        guard = [] if (module_name, attribute) in OPEN_ROUTERS else [Depends(authorize)]
        if module_name not in _OWN_QUERY_CHECK:
            guard.append(Depends(refuse_unknown_query))
        app.include_router(getattr(importlib.import_module(module_name), attribute), dependencies=guard)
    app.state.route_table = [*module_routes(), *(r for r in app.routes if isinstance(r, Route))]
    _document_common_errors(app)
    return app


#: Statuses any route can answer, whatever its own ``responses=`` say: 400 (a body that cannot be
#: parsed: broken multipart; a ``Host`` not allowed), 403 (a cross-site write), 413 (a body over
#: ``max_upload_bytes``/``max_json_bytes``), 422 (validation, ``limit_exceeded``), 503 (the database is
#: unavailable), 500 (``internal_error``, with ``Connection: close``); guarded routes add
#: :data:`app.auth.AUTH_ERRORS`.
_COMMON_ERRORS: dict[str, str] = {
    "400": "bad_request: the body cannot be parsed; host_not_allowed",
    "413": "payload_too_large: body over max_upload_bytes or max_json_bytes",
    "422": "validation_error or limit_exceeded (json_depth...)",
    "503": "database_unavailable (Retry-After)",
    "500": "internal_error (never caused by input; sent with Connection: close)",
}


def _document_common_errors(app: FastAPI) -> None:
    """Make the OpenAPI document list, on every operation, the error statuses the middleware and the
    handlers of this module can answer (413 only where the operation takes a body, the access-control
    ones on guarded routes, 403 ``cross_site_request`` on writes)."""
    build = app.openapi
    open_paths = {
        getattr(route, "path", None)
        for module_name, attribute in OPEN_ROUTERS
        for route in getattr(importlib.import_module(module_name), attribute).routes
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                common = dict(_COMMON_ERRORS)
                if path not in open_paths:
                    common.update(AUTH_ERRORS)
                if method.upper() not in ("GET", "HEAD", "OPTIONS"):
                    common["403"] = common.get("403", "") + ", cross_site_request"
                for status_code, description in common.items():
                    takes_input = "requestBody" in operation or operation.get("parameters")
                    if (status_code == "413" and "requestBody" not in operation) or (
                        status_code == "422" and not takes_input
                    ):
                        continue
                    if status_code not in responses:
                        responses[status_code] = {"description": description.lstrip(", "), "content": ref}
        schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(
            "ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
