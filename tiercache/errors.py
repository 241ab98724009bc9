"""The one exception hierarchy of tiercache; the server maps it to gRPC status codes in one table."""


class TierCacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class InvalidArgument(TierCacheError, ValueError):
    """The caller sent something malformed: wrong key length, bad shape, unknown field."""


class NotFound(TierCacheError, KeyError):
    """The named block, namespace or tier does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "not found"


class CorruptBlock(TierCacheError):
    """A stored or transmitted block failed its checksum, size or format checks."""


class CapacityExceeded(TierCacheError):
    """A tier or the whole store is full of pinned or in-use data: backpressure, retry later."""


class QuotaExceeded(CapacityExceeded):
    """A tenant's byte quota would be exceeded."""


class Unauthenticated(TierCacheError):
    """No valid credentials were presented."""


class PermissionDenied(TierCacheError):
    """The caller is authenticated but may not do this."""


class Unavailable(TierCacheError):
    """The daemon cannot be reached or is shutting down."""


class DeadlineExceeded(TierCacheError):
    """The call did not finish within its deadline."""


class Unimplemented(TierCacheError):
    """The daemon does not know this rpc: it is older than the caller."""


class AlreadyRunning(TierCacheError):
    """Another daemon already owns this socket or data directory."""
