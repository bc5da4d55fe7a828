"""Exceptions raised by the tenants package, one per way a caller can go wrong."""


class TenantError(Exception):
    """Base of the tenant store's errors."""


class TenantNameError(TenantError, ValueError):
    """A tenant name that does not match the allowed pattern."""


class TenantIdError(TenantError, ValueError):
    """A tenant id that is not one the store could have minted."""


class TenantExists(TenantError):
    """create() on a name that is taken."""


class TenantNotFound(TenantError, LookupError):
    """An operation that needs the tenant to exist found none."""


class TenantConcurrentChange(TenantError):
    """The tenant was deleted or recreated under the same name again and again
    while an operation kept retrying against it."""


class CredentialError(TenantError, ValueError):
    """Adapter-source credentials a client sent that cannot be kept; `field` names the bad one."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class QuotaError(ValueError):
    """A quota dict with an unknown field or a bad value; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"quota field {field!r}: {message}")
        self.field = field


class QuotaExceeded(Exception):
    """A rate or concurrency limit refused this request now; it may succeed later.

    The HTTP layer answers 429 with `Retry-After: retry_after_seconds`.
    """

    def __init__(self, message: str, retry_after_seconds: int, limit_name: str) -> None:
        super().__init__(message)
        assert retry_after_seconds >= 1
        self.message = message
        self.retry_after_seconds = retry_after_seconds
        self.limit_name = limit_name


class RequestTooLarge(ValueError):
    """A single request that exceeds a per-request maximum and so can never succeed.

    Unlike QuotaExceeded, retrying does not help: the HTTP layer answers 400.
    """

    def __init__(self, message: str, limit_name: str) -> None:
        super().__init__(message)
        self.message = message
        self.limit_name = limit_name
