"""The endpoint's refusal of a request (its own module: the request checks and the tool checks both raise it)."""

from __future__ import annotations


class RequestError(Exception):
    """A request the endpoint refuses: ``status`` (400 unless said) and a message naming the field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param
