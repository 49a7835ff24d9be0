"""OpenAI-shaped error bodies, and the handlers that turn every failure into one.

A client must never see a stack trace or an HTML page: validation errors, unknown routes and
unexpected exceptions all answer ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error a client caused or must handle; rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "api_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status, error.message, error.param, error.code),
        status_code=error.status,
        headers=error.headers,
    )


# Pydantic names the member of a union it tried ("str", "list[constrained-int]") in an
# error's location, and the model class it expected in the message: neither is a field
# the client sent, so both are left out.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]-]")
_CLASS_NAME = re.compile(r" or instance of \w+")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    context = first.get("ctx") or {}
    if "param" in context:  # a model validator's error: its message names the field
        return f"{first.get('msg')}{more}", str(context["param"])
    loc = [
        str(part)
        for part in first.get("loc", ())
        if part != "body" and not (isinstance(part, str) and _UNION_TAG.search(part))
    ]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    message = _CLASS_NAME.sub("", str(first.get("msg", "invalid value")))
    message = message.removeprefix("Value error, ")
    return f"{where}{message}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed requests with 400, not FastAPI's 422.
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return JSONResponse(
            error_body(exc.status_code, message),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)
