"""Errors raised in the trainer."""

from __future__ import annotations


class DataServerError(RuntimeError):
    """A sample, a server or the client itself failed; the message says which and why.

    ``index`` and ``file`` name the sample when one is to blame.
    """

    def __init__(self, message: str, index: int | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.file = file


class ServerUnreachable(DataServerError):
    """A server did not answer within the client's ``timeout``."""


class NotAuthorized(DataServerError):
    """A CURVE-secured server refused this client's key."""
