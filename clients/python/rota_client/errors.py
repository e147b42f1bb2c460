"""What a call can fail with: one small hierarchy under RotaError.

Each refusal of the cluster maps to one class by its gRPC code; the stable
reason code (`rota-reason-code`) and the field at fault (`rota-field`) that
a replica attaches travel with it, so programs need not parse messages.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc

#: Response metadata naming the request field a refusal is about.
FIELD_METADATA = "rota-field"
#: Response metadata with the refusal's stable code (e.g. "invalid").
REASON_CODE_METADATA = "rota-reason-code"
#: Response metadata of a request refused by its caller's limits: ms to wait.
RETRY_AFTER_METADATA = "retry-after-ms"


class RotaError(Exception):
    """Any failure of a rota call.

    `code` is the gRPC status code of the answer (None for a failure found
    before anything was sent), `message` the replica's message,
    `reason_code` its stable code and `field` the request field at fault,
    where the replica named them.
    """

    #: How the error is named when no answer gave it a code.
    label = "error"

    def __init__(
        self,
        message: str,
        *,
        code: Optional[grpc.StatusCode] = None,
        reason_code: Optional[str] = None,
        field: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason_code = reason_code
        self.field = field

    def __str__(self) -> str:
        name = self.code.name.lower().replace("_", " ") if self.code is not None else self.label
        return f"{name}: {self.message}"


class ConfigError(RotaError, ValueError):
    """The client was set up wrongly (endpoints, credentials): nothing was sent."""

    label = "bad configuration"


class InvalidArgument(RotaError, ValueError):
    """Bad input; `field` names it (e.g. "spec.replicas")."""

    label = "invalid argument"


class NotFound(RotaError, LookupError):
    """An unknown job (or rank, for logs)."""


class AlreadyExists(RotaError):
    """A request id reused with a different spec."""


class Unauthenticated(RotaError):
    """No certificate or token, or one the cluster does not take."""


class PermissionDenied(RotaError):
    """The caller's role does not allow it."""


class ResourceExhausted(RotaError):
    """Over the caller's limits past the deadline, or a full cluster."""


class FailedPrecondition(RotaError):
    """The cluster cannot do it in its current state."""


class Unavailable(RotaError):
    """No replica could serve the call within the deadline.

    `attempts` and `elapsed_ms` say how hard the client tried; `message`
    and `code` are those of the last answer.
    """

    def __init__(self, message: str, *, attempts: int = 0, elapsed_ms: int = 0, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.attempts = attempts
        self.elapsed_ms = elapsed_ms


_BY_CODE: Dict[grpc.StatusCode, Type[RotaError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


def trailing(error: grpc.RpcError, key: str) -> Optional[str]:
    """A value of the answer's trailing metadata (where replicas put theirs)."""
    metadata = getattr(error, "trailing_metadata", None)
    pairs = metadata() if callable(metadata) else None
    for name, value in pairs or ():
        if name == key:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def status_code(error: grpc.RpcError) -> grpc.StatusCode:
    code = getattr(error, "code", None)
    value = code() if callable(code) else None
    return value if isinstance(value, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def status_message(error: grpc.RpcError) -> str:
    details = getattr(error, "details", None)
    text = details() if callable(details) else None
    return text or str(error)


def field_of(message: str) -> Optional[str]:
    """The field a message starts with ("spec.replicas: must be ..."), if any."""
    head, sep, _ = message.partition(": ")
    if sep and 0 < len(head) <= 64 and all(c.islower() or c.isdigit() or c in "._-" for c in head) and head.isascii():
        return head
    return None


def from_rpc_error(error: grpc.RpcError) -> RotaError:
    """The RotaError of a refused call."""
    code = status_code(error)
    message = status_message(error)
    field = trailing(error, FIELD_METADATA)
    if field is None and code == grpc.StatusCode.INVALID_ARGUMENT:
        field = field_of(message)
    kind = _BY_CODE.get(code, RotaError)
    return kind(message, code=code, reason_code=trailing(error, REASON_CODE_METADATA), field=field)


class EventsCompacted(RotaError):
    """The events after the index asked for are no longer kept (they were
    folded into a snapshot or pushed out of the bounded ring). Read the
    current state, then watch from `current_index`."""

    label = "events compacted"

    def __init__(self, message: str, *, oldest_index: int, current_index: int) -> None:
        super().__init__(message, reason_code="compacted", field="since_index")
        self.oldest_index = oldest_index
        self.current_index = current_index
