"""Errors the service layer raises; the API maps each to an HTTP status with the message as JSON."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """Base class: `message` is written for a person and says what to do."""

    status_code = 400

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidInput(ServiceError, ValueError):
    status_code = 422


class NotFound(ServiceError, LookupError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class PayloadTooLarge(ServiceError):
    status_code = 413


class Unavailable(ServiceError):
    status_code = 503
