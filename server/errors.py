"""The server edge of tiercache/status.py: every exception a handler raises becomes one status code here."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from tiercache import status
from tiercache.errors import TierCacheError

logger = logging.getLogger(__name__)


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status code of `exc` (tiercache/status.py) and its message."""
    code = status.to_code(exc)
    if isinstance(exc, TierCacheError):
        message = str(exc)
    else:
        # Never leak internals to a (possibly hostile) caller; the log has the traceback.
        message = f"internal error ({type(exc).__name__}); see the daemon log"
    context.set_trailing_metadata(((status.ERROR_CLASS_KEY, type(exc).__name__),))
    context.abort(grpc.StatusCode[code], message)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _report(method: str, exc: BaseException) -> None:
    if isinstance(exc, TierCacheError):
        logger.debug("%s: %s: %s", method, type(exc).__name__, exc)
    else:
        logger.exception("%s failed unexpectedly", method)


def translated(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (unary or streaming) so that exceptions become status codes."""
    name = method.__name__
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def streaming(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - this is the one place that maps them all
                _report(name, exc)
                abort(context, exc)
        return streaming

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - as above: every exception becomes its status code
            _report(name, exc)
            abort(context, exc)
    return unary
