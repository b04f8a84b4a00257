"""Reading rows by id: the 32-bit id range every backend shares, and the NotFound a missing id raises."""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import Field
from sqlalchemy.orm import Session

from engine.messages import Word
from studio.services.errors import NotFound
from studio.services.messages import SERVICES, at_field

# Ids (and steps) are 32-bit integer columns on SQLite and PostgreSQL alike; a larger number would reach
# the driver as an overflow error, so every id taken from outside is bounded by this.
MAX_ID = 2**31 - 1
# An id field of a request body (pydantic); path and query parameters use `studio.api.deps.ID`.
RowId = Annotated[int, Field(ge=1, le=MAX_ID)]

Row = TypeVar("Row")


def get_or_404(session: Session, model: type[Row], row_id: int, what: str, field: str | None = None) -> Row:
    """The `model` row with this id, or NotFound ("[<field>: ]<what> <id> does not exist") for a missing or
    absurd id; ``what`` is a word of ours (run, dataset, ...), shown in the reader's language."""
    row = session.get(model, row_id) if 1 <= row_id <= MAX_ID else None
    if row is None:
        raise NotFound(at_field(field, SERVICES("not_found", what=Word(what), id=row_id)))
    return row
