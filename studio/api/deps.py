"""FastAPI dependencies: the app's settings and one database session per request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from studio.config import Settings
from studio.db import session_factory
from studio.services.store import MAX_ID


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    # Async so FastAPI does not spend a threadpool hop on it: making a Session does no I/O; the route
    # (a sync def, in the threadpool) is the only code that uses it.
    session = session_factory(request.app.state.settings)()
    try:
        yield session
    finally:
        # Closing a session that holds a connection rolls its transaction back: a round trip to the
        # database, which on the event loop would hold up every request in flight until the database
        # answers (with a remote PostgreSQL, a network round trip per request). A session that never
        # touched the database has nothing to send and closes here.
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
# Bounding ids turns absurd ones into a 422 instead of a driver error.
ID = Annotated[int, Path(ge=1, le=MAX_ID)]
QueryID = Annotated[int, Query(ge=1, le=MAX_ID)]
