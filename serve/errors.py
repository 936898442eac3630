"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, and the api_server's
mapping of what goes wrong onto it: 400 for a bad field (named in ``param``: a response format's
too, down to the schema keyword xgrammar or the JSON Schema meta-schema refused) or a prompt or
``max_tokens`` that does not fit (``context_length_exceeded``), 401, 404, 503, else 500."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from lmd.errors import PromptTooLongError
from lmd.guided import ResponseFormatError


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: 'invalid_request_error', 401: 'authentication_error', 404: 'not_found_error',
                              503: 'service_unavailable'}.get(status, 'server_error')

    def body(self) -> dict:
        return {'error': {'message': self.message, 'type': self.type, 'param': self.param,
                          'code': self.code or str(self.status)}}


def error_response(e: APIError) -> JSONResponse:
    headers = {'WWW-Authenticate': 'Bearer'} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def as_api_error(e: BaseException, prompt_param: str | None = None) -> APIError:
    """``e`` as the HTTP error it means; ``prompt_param`` names the field whose prompt was too long."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):  # the engines' one length check (lmd.engine.SessionTable)
        return APIError(400, e.detail, param=prompt_param, code='context_length_exceeded')
    if isinstance(e, ResponseFormatError):  # a schema or regex xgrammar cannot compile (lmd.guided)
        return APIError(400, str(e), param=e.param)
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f'{type(e).__name__}: {e}')
