"""Typed failures of a fetch, each with the HTTP status it answers (the API maps them as they are)."""
from __future__ import annotations


class SourceError(Exception):
    """`status`: 400 refused reference, 403 not allowed by the operator, 404 missing object,
    413 too large, 502 the source failed or is unreachable, 504 it timed out."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        assert status in (400, 403, 404, 413, 502, 504), status
        self.status = status
        self.message = message
        self.code = code


def refused(message: str) -> SourceError:
    return SourceError(403, message, "source_not_allowed")


def too_large(what: str, size: int, cap: int) -> SourceError:
    return SourceError(413, f"{what} is {size} bytes, over the limit of {cap} bytes", "source_too_large")
