"""FastAPI dependencies declared once as ``Annotated`` aliases (STYLE.md §4).

Everything comes from ``request.app.state``, filled by the lifespan of :func:`app.main.create_app`:
``settings``, ``sessionmaker``, ``predictors`` (the hot-swapping predictor holder).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session, sessionmaker

from app.config import Settings
from app.db import end_session
from app.errors import InvalidRequest

T = TypeVar("T")


async def get_settings(request: Request) -> Settings:
    """The app's :class:`Settings`. (The cheap dependencies are ``async def``: FastAPI runs a plain ``def``
    dependency in its thread pool, one hop to a worker thread and back per dependency and request.)"""
    return request.app.state.settings


#: ``Session.info`` key set once :func:`in_worker` has ended the session (committed or rolled back, and closed).
_ENDED = "layercast.ended"


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for this request: commits on success, rolls back on error (STYLE.md §3).

    Made on the event loop (a session connects at its first statement, which runs in the route's worker
    thread, not here); the commit or rollback and the close run in the thread pool, shielded from cancellation
    so that a client that goes away never leaves a connection checked out. One hop to a worker thread per
    request instead of two (a plain generator dependency enters and exits in the pool); none when the route
    ended the session in its own worker-thread call (:func:`in_worker`)."""
    session = request.app.state.sessionmaker()

    def ended() -> bool:  # by in_worker, and not used again since (that would have begun a new transaction)
        return bool(session.info.get(_ENDED)) and not session.in_transaction()

    try:
        yield session
    except BaseException:
        if not ended():
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(end_session, session, commit=False)
        raise
    if not ended():
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(end_session, session, commit=True)


async def in_worker(session: Session, work: Callable[[], T]) -> T:
    """``work()`` in the thread pool, then the request's ``session`` ended in that same call: committed when
    ``work`` returns (its result is returned; a failed commit raises, so it is never answered 200), rolled back
    when it raises (re-raised). For an ``async def`` route whose work is blocking: one hop to a worker thread
    and back per request, where a plain ``def`` route with :data:`SessionDep` takes three (the route; FastAPI's
    validation of a sync route's return value, which it runs in the pool too; the session's commit). The
    response is then validated and serialised on the event loop, so ``work`` returns what needs no session
    (pydantic models, not ORM rows). The call runs to its end even when the client goes away meanwhile (the
    thread is not interrupted), and then commits: for routes whose work may be kept whatever the client does
    (the read-only prediction routes), not for one whose writes must be undone when the request is cancelled.
    A session used again after this call begins a new transaction, which :func:`get_session` then ends as
    usual."""

    def call() -> T:
        try:
            out = work()
        except BaseException:
            session.info[_ENDED] = True
            end_session(session, commit=False)
            raise
        session.info[_ENDED] = True
        end_session(session, commit=True)
        return out

    return await run_in_threadpool(call)


async def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    """The app's session factory, for work that outlives the request's session (a streamed export)."""
    return request.app.state.sessionmaker


async def get_predictor(request: Request) -> Any:
    """The production predictor, taken once at the start of the request so that one request never mixes
    versions (:class:`app.predictors.service.PredictorHolder`: re-read every ``predictor_poll_s``)."""
    return request.app.state.predictors.current()


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameter names (aliases) a route's dependency tree declares."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def refuse_unknown_query(request: Request) -> None:
    """Raises :class:`InvalidRequest` (422 ``invalid_request``, ``detail.unknown`` and ``detail.allowed``)
    when the query string names a parameter the matched route does not declare: a typo such as
    ``GET /v1/graphs/{id}/layers?batchsize=64`` was ignored and answered at the default batch size 1; and
    :func:`refuse_repeated_query`."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    # kept on the route itself: a module-level cache keyed by id(route) would hand a later app's route, built at
    # a freed route's address, the old route's names
    allowed: frozenset[str] | None = getattr(route, "_layercast_query_names", None)
    if allowed is None:
        allowed = frozenset(_query_names(route.dependant))
        route._layercast_query_names = allowed  # type: ignore[attr-defined]
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise InvalidRequest(
            f"unknown query parameter(s) {', '.join(repr(u) for u in unknown)}; this route takes "
            f"{', '.join(sorted(allowed)) or 'none'}", detail={"unknown": unknown, "allowed": sorted(allowed)})
    refuse_repeated_query(request)


def repeated_names(names: list[str]) -> list[str]:
    """The names given more than once in ``names`` (query parameters or form fields, one per value), sorted."""
    return sorted({name for name in names if names.count(name) > 1})


def refuse_repeated_query(request: Request) -> None:
    """Raises :class:`InvalidRequest` (422 ``invalid_request``, ``detail.repeated``) when a query parameter is
    given more than once: every parameter of the API and the page is one value, and
    ``?batch_size=4&batch_size=64`` silently used the last."""
    repeated = repeated_names([name for name, _ in request.query_params.multi_items()])
    if repeated:
        raise InvalidRequest(f"query parameter(s) {', '.join(repr(r) for r in repeated)} given more than once; "
                             "give each once", detail={"repeated": repeated})


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": commit before the response is sent, so a failed commit is never answered 200
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
PredictorDep = Annotated[Any, Depends(get_predictor)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_sessionmaker)]
