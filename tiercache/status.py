"""THE table between tiercache.errors classes and gRPC status code names, used by server and client alike."""

from __future__ import annotations

from tiercache import errors

# (exception class, gRPC status code name). Code names are grpc.StatusCode member names, kept as
# strings so that the core needs no grpc import. A code shared by two classes maps back to the
# first one listed (the more general), and the trailing metadata ERROR_CLASS_KEY refines it.
# The base class comes last: to_code takes the first class the exception is an instance of.
ERROR_CODES: tuple[tuple[type[errors.TierCacheError], str], ...] = (
    (errors.CapacityExceeded, "RESOURCE_EXHAUSTED"),
    (errors.QuotaExceeded, "RESOURCE_EXHAUSTED"),
    (errors.InvalidArgument, "INVALID_ARGUMENT"),
    (errors.NotFound, "NOT_FOUND"),
    (errors.CorruptBlock, "DATA_LOSS"),
    (errors.Unauthenticated, "UNAUTHENTICATED"),
    (errors.PermissionDenied, "PERMISSION_DENIED"),
    (errors.Unavailable, "UNAVAILABLE"),
    (errors.DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (errors.AlreadyRunning, "ALREADY_EXISTS"),
    (errors.TierCacheError, "INTERNAL"),
)
# Codes that gRPC itself produces, with no tiercache class behind them.
_TRANSPORT_CODES: dict[str, type[errors.TierCacheError]] = {
    "CANCELLED": errors.Unavailable,
    "UNKNOWN": errors.TierCacheError,
    "UNIMPLEMENTED": errors.Unimplemented,
    "ABORTED": errors.Unavailable,
    "FAILED_PRECONDITION": errors.TierCacheError,
    "OUT_OF_RANGE": errors.InvalidArgument,
}
# Trailing metadata naming the exact exception class (e.g. QuotaExceeded behind RESOURCE_EXHAUSTED).
ERROR_CLASS_KEY = "tiercache-error"

_BY_NAME: dict[str, type[errors.TierCacheError]] = {cls.__name__: cls for cls, _ in ERROR_CODES}
_BY_CODE: dict[str, type[errors.TierCacheError]] = {
    **_TRANSPORT_CODES, **{code: cls for cls, code in reversed(ERROR_CODES)},  # reversed: first listed wins
}


def to_code(exc: BaseException) -> str:
    """The status code name for an exception; INTERNAL for anything not in the table."""
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return "INTERNAL"


def from_code(code: str, class_name: str | None = None) -> type[errors.TierCacheError]:
    """The exception class for a status code name, refined by the class the server named if it
    agrees with the code (a server cannot make the client raise a class the code does not allow)."""
    general = _BY_CODE.get(code, errors.TierCacheError)
    named = _BY_NAME.get(class_name or "")
    if named is not None and issubclass(named, general):
        return named
    return general
