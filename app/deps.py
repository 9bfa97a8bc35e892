"""FastAPI dependencies declared once as ``Annotated`` aliases (STYLE.md §4).

Everything comes from ``request.app.state``, filled by the lifespan of :func:`app.main.create_app`:
``settings``, ``sessionmaker``, ``predictors`` (the hot-swapping predictor holder).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from app.config import Settings
from app.db import session_scope


def get_settings(request: Request) -> Settings:
    """The app's :class:`Settings`."""
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """A session for this request: commits on success, rolls back on error (STYLE.md §3)."""
    yield from session_scope(request.app.state.sessionmaker)


def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    """The app's session factory, for work that outlives the request's session (a streamed export)."""
    return request.app.state.sessionmaker


def get_predictor(request: Request) -> Any:
    """The production predictor, taken once at the start of the request so that one request never mixes
    versions (:class:`app.predictors.service.PredictorHolder`: re-read every ``predictor_poll_s``)."""
    return request.app.state.predictors.current()


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": commit before the response is sent, so a failed commit is never answered 200
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
PredictorDep = Annotated[Any, Depends(get_predictor)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_sessionmaker)]
