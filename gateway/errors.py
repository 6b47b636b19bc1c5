"""OpenAI-style errors: every failure the gateway answers has the body

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

`APIError` is raised anywhere in request handling; the app's error middleware turns it
(and aiohttp's own HTTP errors, and any unexpected exception) into that body. Bad input
is always a 4xx with a message that says what was wrong; only a fault of the server
itself is a 5xx.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

_encoder = msgspec.json.Encoder()

# http status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """A request ends with this status and OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "api_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=_encoder.encode(self.body()),
            content_type="application/json",
        )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def require(cond: bool, message: str, param: str | None) -> None:
    """A 400 naming param unless cond holds."""
    if not cond:
        raise bad_request(message, param=param)


def from_request_failed(code: str, message: str, http_status: int) -> APIError:
    """The HTTP error for a `RequestFailed` from the engine."""
    status = http_status if 400 <= http_status <= 599 else 500
    return APIError(status, message, code=code)
