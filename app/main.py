"""Application factory: ``create_app(settings)`` builds everything in the lifespan (STYLE.md §5).

Nothing is built at import time: the engine, the session factory, the seeded hardware catalog and the
predictor are created when the app starts and released when it stops, so one process can hold several
apps (the tests do). Run it with ``layercast serve`` or ``uvicorn --factory app.main:create_app``.

Errors (STYLE.md §6) are rendered as one problem document, whatever raised them::

    {"error": {"code": "<machine-readable>", "message": "<human-readable>", "detail": {...}}}

* :class:`app.errors.LayercastError` → its own status and code;
* request validation failures → 422 ``validation_error`` with ``detail.errors``;
* Starlette/FastAPI HTTP errors (unknown route, wrong method, ...) → their status, code from the status;
* anything else → 500 ``internal_error``, logged with its traceback, which never reaches the client.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings
from app.db import make_engine, make_sessionmaker
from app.errors import LayercastError, PayloadTooLarge
from app.migrate import ensure_sqlite_dir
from app.observability import RequestContext

logger = logging.getLogger("layercast")

#: Routers included by :func:`create_app`, as ``(module, attribute)``.
ROUTERS: tuple[tuple[str, str], ...] = (
    ("app.observability", "router"),
    ("app.hardware.router", "router"),
    ("app.graphs.router", "router"),
    ("app.predictions.router", "router"),
    ("app.measurements.router", "router"),
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


def problem(status_code: int, code: str, message: str, detail: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    """A problem-document response (the one error shape of the API)."""
    body = {"error": {"code": code, "message": message, "detail": detail or {}}}
    return JSONResponse(body, status_code=status_code, headers=headers)


# --------------------------------------------------------------------------------------------- errors


def _clean_validation_errors(errors: Any) -> list[dict[str, Any]]:
    """Pydantic errors made JSON-safe: ``type``, ``loc``, ``msg`` and a stringified ``ctx``.

    The offending ``input`` is left out on purpose: it can be a whole uploaded model (binary, large).
    """
    cleaned: list[dict[str, Any]] = []
    for err in errors:
        item: dict[str, Any] = {
            "type": str(err.get("type", "")),
            "loc": [p if isinstance(p, int) else str(p) for p in err.get("loc", ())],
            "msg": str(err.get("msg", "")),
        }
        if isinstance(err.get("ctx"), dict):
            item["ctx"] = {
                str(k): v if isinstance(v, (int, float, bool, str)) or v is None else str(v)
                for k, v in err["ctx"].items()
            }
        cleaned.append(item)
    return cleaned


async def _handle_layercast_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LayercastError)
    return JSONResponse(exc.to_problem(), status_code=exc.status_code)


async def _handle_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = _clean_validation_errors(exc.errors())
    first = errors[0] if errors else None
    message = "request validation failed"
    if first:
        message += f": {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return problem(422, "validation_error", message, {"errors": errors})


async def _handle_http_exception(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "client_error" if exc.status_code < 500 else "server_error")
    message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    detail: dict[str, Any] = exc.detail if isinstance(exc.detail, dict) else {}
    return problem(exc.status_code, code, message, detail, headers=getattr(exc, "headers", None))


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem(500, "internal_error", "internal server error; the error has been logged")


# ---------------------------------------------------------------------------------------- size guard


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
            await JSONResponse(err.to_problem(), status_code=err.status_code)(scope, receive, send)
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


# ------------------------------------------------------------------------------------------ lifespan


def _seed_catalog(app: FastAPI) -> None:
    """Insert/refresh the built-in hardware catalog in one committed session."""
    from app.hardware.service import seed_builtin

    with app.state.sessionmaker.begin() as session:
        seed_builtin(session)


def _load_predictor(settings: Settings) -> Any:
    """The active predictor from ``settings.models_dir``; raises ``FileNotFoundError`` without one."""
    from app.predictor.registry import load_predictor

    return load_predictor(settings.models_dir)


def _make_lifespan(settings: Settings, run_migrations: bool) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ensure_sqlite_dir(settings.database_url)
        if run_migrations:
            from app.migrate import upgrade

            upgrade(settings.database_url)
        engine = make_engine(settings.database_url)
        app.state.settings = settings
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.predictor = None
        try:
            if settings.seed_catalog:
                _seed_catalog(app)
            app.state.predictor = _load_predictor(settings)
            logger.info(
                "layercast %s ready (database %s, predictor %s)",
                service_version(), engine.url.render_as_string(hide_password=True),
                getattr(app.state.predictor, "version", None),
            )
            yield
        finally:
            engine.dispose()

    return lifespan


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
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_upload_bytes)
    app.add_middleware(RequestContext)  # added last = outermost: ids and timing cover the size guard too

    app.add_exception_handler(LayercastError, _handle_layercast_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(Exception, _handle_unexpected)

    for module_name, attribute in ROUTERS:
        app.include_router(getattr(importlib.import_module(module_name), attribute))
    return app
