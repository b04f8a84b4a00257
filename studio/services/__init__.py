"""Service layer: plain functions taking a SQLAlchemy Session first, shared by the REST API and the UI."""

from studio.services.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge, ServiceError

__all__ = ["Conflict", "InvalidInput", "NotFound", "PayloadTooLarge", "ServiceError"]
