"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status."""

from __future__ import annotations

import json
from http import HTTPStatus

from starlette.responses import Response

# Named like the exceptions the openai SDK raises for each status.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """Raised anywhere in a handler; the app turns it into the error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> Response:
    # json.dumps escapes non-ASCII, so a message quoting bad input (a lone surrogate in a
    # model name, say) always encodes; Starlette's JSONResponse would fail on it with a 500.
    return Response(json.dumps(error_body(status, message, param)), status_code=status,
                    media_type="application/json")


def sse_error(status: int, message: str) -> str:
    """An error after a stream has started: the status line is gone, so it is an event."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"
