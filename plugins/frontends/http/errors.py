"""What server.py and completions.py both need, so that neither imports the other: exceptions
mapped to OpenAI error responses, and response ids. A leaf: it imports neither of them.

`as_api_error`: input errors (`ApiError`, `InvalidRequestError`) 400 or their own status, a dead
engine 503, anything else 500 (logged); `request_failed`: the exception of a request the engine
ended with an error (a 400 naming the field when it was the request's fault); `error_response`:
the JSON body ``{"error": {"message", "type", "param", "code"}}`` at that status;
`new_id`: ``KIND-<32 hex>``.
"""

from __future__ import annotations

import logging
import uuid

from starlette.responses import JSONResponse

from pagebatch.errors import EngineDeadError, InvalidRequestError
from pagebatch.request import RequestOutput

from .protocol import ApiError

logger = logging.getLogger(__name__)


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def as_api_error(e: BaseException) -> ApiError:
    """Map an exception to its HTTP error: input errors 400, a dead engine 503, else 500."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), param=getattr(e, "param", None), code=type(e).__name__)
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), type="service_unavailable", code="engine_dead")
    logger.exception("request failed")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error")


def request_failed(out: RequestOutput) -> Exception:
    """The error to answer for ``out``, a request that failed in the engine (``out.error``
    set): ApiError 400 whose param is ``out.error_param`` when the request was at fault (a
    constraint that cannot be compiled or can no longer be met), else a RuntimeError (a 500)."""
    if out.error_param is not None:
        return ApiError(400, out.error, param=out.error_param)
    return RuntimeError(f"the request failed in the engine: {out.error}")


def new_id(kind: str) -> str:
    """A response id, e.g. ``new_id("cmpl")`` -> ``"cmpl-<uuid4 hex>"``."""
    return f"{kind}-{uuid.uuid4().hex}"
